"""The Triton kernels' interface: the launch table's columns, the dtype and rule codes, and
the order of the per-step coefficients. Plain Python (no Triton): ``launch.py`` builds
what the ``kernels`` package reads (``kernels/codes.py``), both from these numbers.
"""

from __future__ import annotations

import torch

__all__ = ["NCOL", "C_GRAD", "C_PARAM", "C_EXTRA", "C_STATE", "MAX_STATES", "C_NUMEL",
           "C_INDEX", "C_MIX", "C_STEP", "NCOEF", "KINDS", "RULE_CODES", "COEFFICIENTS",
           "LANDINGS", "ARGUMENT_TYPES"]

# One int64 row per tensor in the launch table:
#
#   | grad | param | extra | state 0 | state 1 | state 2 | numel | index | mix | step |
#
# grad: unused (the gradients' addresses are a separate vector, refreshed each step);
# param, extra (a second weight component: compensation, lo, master, low bits; else 0),
# the rule's states in component order (a pair's lo right after its hi): addresses;
# numel: elements of this (local) tensor; index: the whole tensor's index of its first
# element (draws); mix: draws.mix_state(MIX_START, seed, position) as int64 bits; step: the
# address of the float32 step counter (capturable steps).
NCOL = 10
C_GRAD, C_PARAM, C_EXTRA, C_STATE = 0, 1, 2, 3
MAX_STATES = 3  # AdamW under plus or split: m, v, v_lo
C_NUMEL, C_INDEX, C_MIX, C_STEP = 6, 7, 8, 9

#: coefficients per row in the capturable table (the most any rule passes)
NCOEF = 8

#: column dtype codes (``kernels.codes.F32``, ``BF16``, ``F16``); split's int16 low bits are
#: read as raw bits (code 3)
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int16: 3}

#: the rules the kernels compute (``kernels.codes.ADAMW``, ``SGD``, ``LION``), by ``Rule.name``
RULE_CODES = {"adamw": 0, "sgd": 1, "lion": 2}

#: the coefficients each rule's kernel reads (``Rule.coefficients`` keys), in order
COEFFICIENTS = {
    "adamw": ("one_minus_beta1", "beta2", "one_minus_beta2", "bias_correction2_sqrt", "eps",
              "step_size", "decay", "lr_wd"),
    "sgd": ("weight_decay", "momentum", "one_minus_dampening", "lr", "first_step"),
    "lion": ("one_minus_beta1", "one_minus_beta2", "lr", "decay", "lr_wd"),
}

#: the landings the kernels compute, by the strategies' ``native_code`` (fp32, mixed,
#: bf16, kahan, stochastic, light, plus, split: ``kernels.codes.L_*``)
LANDINGS = frozenset(range(8))

#: the Triton types of ``kernels.multi_tensor_step``'s runtime (not constexpr) arguments, for
#: compiling a variant without launching it (``benchmarks/gpu_model.py``)
ARGUMENT_TYPES = {
    "table": "*i64", "grads": "*i64", "blocks": "*i32", "coefs": "*fp32", "scale": "*fp32",
    "found": "*fp32", **{f"k{j}": "fp32" for j in range(NCOEF)}, "step": "i32",
    "tiles": "i32", "whole": "i32",
}
