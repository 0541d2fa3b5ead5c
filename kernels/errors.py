"""The user-facing error (engine.errors re-exports it): defined at the bottom so that the knob
declarations in kernels can raise it without importing the engine."""


class MoetuneError(Exception):
    """A user-facing error: printed as one line, no traceback."""
