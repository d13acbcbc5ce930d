"""torch-collage: pure low-precision training without fp32 master weights."""

__version__ = "0.1.0"

from . import mcf  # noqa: E402

__all__ = ["__version__", "mcf"]
