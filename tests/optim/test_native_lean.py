"""The AVX2 and NEON builds' lean chunks (``lean_vector.h``): a chunk of blocks steps in its
lean forms (bf16 rounding without its NaN lane, no guard on the root) only where every
value it reads is finite and below 2**63, and the test reads each stream on its own. So one
infinity or NaN in any one stream, every other value of the row ordinary, must send its
chunk to the exact code: the foreach kernel's bits, NaN patterns included. (The suites of
``test_native.py`` put special values in every stream at once, where a test that skipped
one stream still sees another; these fail for each stream the test skips.)

On builds without lean chunks (AVX-512, the portable loop) the same bits hold: the cases
run everywhere.
"""

from __future__ import annotations

import pytest
import torch

import collage
from collage.optim import get_strategy, native
from collage.optim.native import build

from .test_native import (RULE, Case, _assert_same_bits, _clone_state, _nan_master,
                          _reference_step, calls)  # noqa: F401 (calls: a fixture)

pytestmark = pytest.mark.skipif(
    build._compiler() is None, reason="no C compiler: the native kernels cannot be built")

#: the strategies with bf16 weights and states (the lean chunks' pair layout)
PAIRED = ("bf16", "kahan", "stochastic", "light", "plus", "split")
#: 4 chunks of 16 blocks of 16 elements (AVX2; 8 chunks at the 128-bit width)
N = 1024
#: where the special values go: the second and third AVX2 chunks (the first and last stay
#: lean, so a row is stepped by both codes)
SPOTS = {300: float("inf"), 700: float("nan")}
CASE = Case("lean", {"lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.1}, data="lean")


def _streams(strategy: str) -> list[str]:
    """What the lean test reads, by the name this test pokes it under"""
    streams = ["weight", "grad", "exp_avg", "exp_avg_sq"]
    if strategy in ("kahan", "light", "plus"):
        streams.append("extra")  # kahan's compensation, light's and plus's lo
    if strategy in ("plus", "split"):
        streams.append("exp_avg_sq_lo")
    return streams


@pytest.mark.parametrize("strategy,stream", [(s, t) for s in PAIRED for t in _streams(s)])
def test_one_special_value_in_one_stream_takes_the_exact_code(strategy: str, stream: str,
                                                              calls) -> None:
    gen = torch.Generator().manual_seed(11)
    param = torch.nn.Parameter(torch.randn(N, generator=gen).to(torch.bfloat16))
    opt = collage.AdamW([param], strategy=strategy, nonfinite="ignore", **CASE.group)
    param.grad = (torch.randn(N, generator=gen) * 1e-2).to(torch.bfloat16)
    opt.step()
    state = opt.state[param]
    grad = (torch.randn(N, generator=gen) * 1e-2).to(torch.bfloat16)
    if stream == "extra":
        stream = native.row_layout(RULE, get_strategy(strategy))[3][0]
    poked = {"weight": param.data, "grad": grad}.get(stream, state.get(stream))
    for spot, value in SPOTS.items():
        poked[spot] = value
    shadow, shadow_state = param.detach().clone(), _clone_state(state)
    param.grad = grad
    opt.step()
    _reference_step(opt, CASE, strategy, param, shadow, grad, shadow_state)
    nan_master = _nan_master(strategy, param.detach(), state, shadow, shadow_state)
    _assert_same_bits(param.detach(), shadow, f"{stream}: weight", nan_master)
    for key, value in shadow_state.items():
        if key != "step":
            _assert_same_bits(state[key], value, f"{stream}: {key}",
                              nan_master if key == "weight_low_bits" else None)
    assert calls == [strategy] * 2  # both steps were the native kernels'
