"""User-facing errors and notes: the CLI prints an error's message (no traceback) and exits non-zero; a note is
said on stderr and the work goes on."""


class TensileUserError(Exception):
    """Bad input from a user: the message names the field and the fix."""


def print_user_error(exc: TensileUserError) -> int:
    """One line on stderr, never wrapped (a file path must stay copyable); the exit status for bad input."""
    from rich.console import Console

    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {exc}", highlight=False)
    return 2


def print_note(text: str) -> None:
    """What a result rests on (an uncalibrated latency model), on stderr: apart from the output, which may be JSON."""
    from rich.console import Console

    Console(stderr=True).print(f"[yellow]note:[/] {text}", highlight=False)
