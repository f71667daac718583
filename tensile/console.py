"""What the command lines (`tensile`, the agent's and the operator's) say on stderr, apart from their output, which
may be JSON: an error's one line, or a note a result rests on. Kept out of tensile.errors, which the hook imports in
the user's image, where rich may be missing."""

from __future__ import annotations

from tensile.errors import TensileUserError


def print_user_error(exc: TensileUserError) -> int:
    """One line on stderr, never wrapped (a file path must stay copyable); the exit status for bad input."""
    from rich.console import Console

    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {exc}", highlight=False)
    return 2


def print_note(text: str) -> None:
    """What a result rests on (an uncalibrated latency model), on stderr: apart from the output, which may be JSON."""
    from rich.console import Console

    Console(stderr=True).print(f"[yellow]note:[/] {text}", highlight=False)
