"""The numbers the kernels branch on, as Triton constexprs: ``layout.py``'s column indices,
dtype and rule codes, and the landings' codes (the strategies' ``native_code``)."""

from __future__ import annotations

import torch
import triton.language as tl

from .. import layout

# Triton reads globals only as constexprs: layout.py's numbers, wrapped
F32: tl.constexpr = tl.constexpr(layout.KINDS[torch.float32])
BF16: tl.constexpr = tl.constexpr(layout.KINDS[torch.bfloat16])
F16: tl.constexpr = tl.constexpr(layout.KINDS[torch.float16])
ADAMW: tl.constexpr = tl.constexpr(layout.RULE_CODES["adamw"])
SGD: tl.constexpr = tl.constexpr(layout.RULE_CODES["sgd"])
LION: tl.constexpr = tl.constexpr(layout.RULE_CODES["lion"])
# landings: the strategies' ``native_code`` (the C kernels' numbers, ``native/native.h``)
L_FP32: tl.constexpr = tl.constexpr(0)
L_MIXED: tl.constexpr = tl.constexpr(1)
L_BF16: tl.constexpr = tl.constexpr(2)
L_KAHAN: tl.constexpr = tl.constexpr(3)
L_STOCHASTIC: tl.constexpr = tl.constexpr(4)
L_LIGHT: tl.constexpr = tl.constexpr(5)
L_PLUS: tl.constexpr = tl.constexpr(6)
L_SPLIT: tl.constexpr = tl.constexpr(7)
NCOL: tl.constexpr = tl.constexpr(layout.NCOL)
C_PARAM: tl.constexpr = tl.constexpr(layout.C_PARAM)
C_EXTRA: tl.constexpr = tl.constexpr(layout.C_EXTRA)
C_STATE: tl.constexpr = tl.constexpr(layout.C_STATE)
C_NUMEL: tl.constexpr = tl.constexpr(layout.C_NUMEL)
C_INDEX: tl.constexpr = tl.constexpr(layout.C_INDEX)
C_MIX: tl.constexpr = tl.constexpr(layout.C_MIX)
C_STEP: tl.constexpr = tl.constexpr(layout.C_STEP)
NCOEF: tl.constexpr = tl.constexpr(layout.NCOEF)
