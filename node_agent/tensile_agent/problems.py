"""The agent's refusals: an HTTP status, a code a client can act on, and the detail with the fix."""

from __future__ import annotations


class Problem(Exception):
    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail
