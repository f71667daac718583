"""User-facing errors: the CLI prints their message (no traceback) and exits non-zero."""


class TensileUserError(Exception):
    """Bad input from a user: the message names the field and the fix."""
