"""User-facing errors."""


class MoetuneError(Exception):
    """A user-facing error: printed as one line, no traceback."""
