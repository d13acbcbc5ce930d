"""``plus`` (Collage-plus): Collage-light's weight, and the rule's slow EMA (Adam's second
moment, Lion's momentum) as an MCF pair with beta split as ``bf16(beta) + residual``."""

from __future__ import annotations

from .light import Light


class Plus(Light):
    name = "plus"
    summary = "Collage-light plus the second moment as an MCF with beta2 split (Collage-plus)"
    order = 6
    mcf_slow_states = True
    native_code = 6


STRATEGY = Plus()
