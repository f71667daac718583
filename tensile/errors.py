"""User-facing errors: the CLI prints their message (no traceback) and exits non-zero."""


class TensileUserError(Exception):
    """Bad input from a user: the message names the field and the fix."""


def print_user_error(exc: TensileUserError) -> int:
    """One line on stderr, never wrapped (a file path must stay copyable); the exit status for bad input."""
    from rich.console import Console

    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {exc}", highlight=False)
    return 2
