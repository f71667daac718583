"""The tables of the user docs, read as tests compare them with what the code prints."""

from __future__ import annotations

from pathlib import Path


def documented_keys(intro: str) -> set[str]:
    """The keys in the first column of the table after `intro` in docs/local-mode.md."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "local-mode.md").read_text()
    table = text[text.index(intro):].split("\n\n")[1]
    keys: set[str] = set()
    for line in table.splitlines()[2:]:
        keys.update(k.strip("` ") for k in line.split("|")[1].split(","))
    return keys
