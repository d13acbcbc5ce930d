"""Multi-component floats (MCF): exact error-free transformations on tensors.

A value is kept as an unevaluated sum ``hi + lo`` of low-precision floats. The primitives
here are generic over the component dtype (bfloat16, float16, float8_e4m3fn, float8_e5m2,
float32) and are exact where their docstrings say so; ``docs/mcf.md`` has the proofs and the
precision and range table.
"""

from .eft import (
    checks_enabled,
    combine,
    debug_checks,
    fast_two_sum,
    grow,
    mul,
    split,
    two_prod,
    two_sum,
)
from .formats import COMPONENT_DTYPES, FormatInfo, format_info, round_to, ulp

__all__ = [
    "COMPONENT_DTYPES",
    "FormatInfo",
    "checks_enabled",
    "combine",
    "debug_checks",
    "fast_two_sum",
    "format_info",
    "grow",
    "mul",
    "round_to",
    "split",
    "two_prod",
    "two_sum",
    "ulp",
]
