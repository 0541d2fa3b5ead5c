"""User-facing errors (the class lives in kernels.errors, below the engine and the kernels' knobs)."""
from kernels.errors import MoetuneError  # noqa: F401
