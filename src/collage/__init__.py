"""torch-collage: pure low-precision training without fp32 master weights.

``collage.AdamW(model.parameters(), strategy="plus")`` trains a bf16 model with Collage-plus;
see ``docs/strategies.md`` for the strategies and ``collage.mcf`` for the arithmetic.
"""

__version__ = "0.1.0"

from . import mcf  # noqa: E402
from .optim import (  # noqa: E402
    SGD,
    STRATEGIES,
    AdamW,
    Autopilot,
    Lion,
    consolidate,
    load_full_precision,
)

__all__ = [
    "SGD",
    "STRATEGIES",
    "AdamW",
    "Autopilot",
    "Lion",
    "__version__",
    "consolidate",
    "load_full_precision",
    "mcf",
]
