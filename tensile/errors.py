"""User-facing errors: the message names the field and the fix; the command line prints it without a traceback
(tensile.console) and exits non-zero."""


class TensileUserError(Exception):
    """Bad input from a user: the message names the field and the fix."""
