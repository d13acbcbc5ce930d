"""``split``'s NaN masters: a NaN master shows a NaN weight, on every path (2026-12-07).

``split`` keeps a float32 master as its bf16 weight (the top half rounded to nearest by the
low half, ties kept) and the low 16 bits. Rounded as a number, a NaN master's top half
showed a number: ``0x7FFF`` or ``0xFFFF`` rounded up carried into the sign bit, a zero
(CUDA's canonical NaN ``0x7FFFFFFF`` gave -0.0), and ``0x7F80`` or ``0xFF80`` kept (the
payload in the low half only) was an infinity; the model computed with those where the
optimizer held a NaN. A NaN master's weight is now its top half made quiet (a NaN), which
decodes to a NaN.

The reference is independent of the encoding's integer arithmetic: the nearest of the two
bf16 neighbours by float64 distances (exact here: each distance is a difference of values
within 2**24 of each other's spacing), ties to the one nearer zero, NaN for a NaN master.
"""

from __future__ import annotations

import pytest
import torch

import collage
from collage.optim import get_strategy, native
from collage.optim.rounding import split_decode, split_encode
from collage.optim.rules import AdamWRule
from collage.optim.triton import launch as launches

BF16 = torch.bfloat16
LOWS = (0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF)


def _floats(bits32: torch.Tensor) -> torch.Tensor:
    return bits32.to(torch.int32).view(torch.float32)


def _masters() -> torch.Tensor:
    """Every top half with each of LOWS below it: every sign, exponent and bf16 mantissa,
    below, at and above the tie."""
    top = torch.arange(1 << 16, dtype=torch.int64)
    low = torch.tensor(LOWS, dtype=torch.int64)
    words = (top[:, None] << 16 | low[None, :]).reshape(-1)
    return _floats(torch.where(words >= 1 << 31, words - (1 << 32), words))


def _nearest_bf16(master: torch.Tensor) -> torch.Tensor:
    """The bf16 nearest ``master`` (float32, not NaN), ties to the neighbour nearer zero,
    from float64 distances to its two neighbours; beyond the largest finite bf16 the
    upper neighbour is 2**128 (infinity's place), so values past the midpoint round to inf."""
    m = master.double()
    toward_zero = master.view(torch.int32) & ~0xFFFF
    lower = _floats(toward_zero).double()  # truncated: the neighbour nearer zero
    # bf16's spacing: 2**(e - 8) for |x| in [2**(e-1), 2**e) (8 significant bits),
    # 2**-133 below 2**-126 (subnormals)
    exponent = torch.frexp(torch.where(lower == 0, 1.0, lower)).exponent
    spacing = torch.where(lower.abs() < 2.0 ** -126, 2.0 ** -133,
                          torch.ldexp(torch.ones_like(m), exponent - 8))
    upper = lower + torch.sign(m) * spacing
    up = (upper - m).abs() < (m - lower).abs()
    nearest = torch.where(up, upper, lower)
    nearest = torch.where(m.isinf(), m, nearest)
    return nearest.to(torch.float32)  # 2**128 -> inf; exact otherwise (a bf16 value)


def test_split_encode_is_the_nearest_bf16_and_a_nan_for_a_nan_master():
    masters = _masters()
    weight, low = split_encode(masters)
    nan = masters.isnan()
    assert bool(weight[nan].isnan().all()), "a NaN master showed a number (the carry)"
    want = _nearest_bf16(masters[~nan])
    got = weight[~nan].float()
    same = (got.view(torch.int32) == want.view(torch.int32))
    assert bool(same.all()), f"{int((~same).sum())} masters rounded wrongly"
    back = split_decode(weight, low)
    assert bool(back[nan].isnan().all())  # a NaN, its payload not kept
    assert torch.equal(back[~nan].view(torch.int32), masters[~nan].view(torch.int32))


# ------------------------------------------------------------------ every path's step

#: (weight word, low bits) stored, and the NaN master they decode to
NAN_STATES = ((0x8000, 0xFFFF),   # 0x7FFFFFFF: CUDA's canonical NaN
              (0x0000, 0xFFFF),   # 0xFFFFFFFF
              (0x8000, 0x8001))   # 0x7FFF8001
N = 70  # a vector block and a tail on every backend
SPOTS = (3, 40, 66)


def _split_param():
    """A split weight and its state with a NaN master at SPOTS, numbers elsewhere."""
    p = torch.nn.Parameter(torch.linspace(-2, 2, N).to(BF16))
    state: dict = {}
    get_strategy("split").init_state(AdamWRule(), p, state)
    words = p.detach().view(torch.int16)
    for spot, (weight, low) in zip(SPOTS, NAN_STATES):
        words[spot] = weight - (1 << 16) if weight >= 1 << 15 else weight
        state["weight_low_bits"][spot] = low - (1 << 16) if low >= 1 << 15 else low
    return p, state


def _check(p: torch.Tensor, state: dict) -> None:
    master = split_decode(p.detach(), state["weight_low_bits"])
    spots = list(SPOTS)
    assert bool(master[spots].isnan().all())
    assert bool(p.detach()[spots].isnan().all()), p.detach()[spots]
    others = torch.ones(N, dtype=torch.bool)
    others[spots] = False
    assert bool(p.detach()[others].isfinite().all())


@pytest.mark.parametrize("flags", [{"foreach": True}, {"foreach": False},
                                   {"reference": True}, {}],
                         ids=["foreach", "per_tensor", "reference", "default"])
def test_every_path_steps_a_nan_master_to_a_nan_weight(flags):
    p, state = _split_param()
    opt = collage.AdamW([p], lr=1e-2, strategy="split", nonfinite="ignore", **flags)
    opt.state[p].update(state)
    opt.state[p]["step"] = torch.tensor(0.0)
    p.grad = torch.linspace(-1, 1, N).to(BF16)
    opt.step()
    _check(p, opt.state[p])


def test_every_native_backend_steps_a_nan_master_to_a_nan_weight(kernel_lib):
    """The default build and each other backend this CPU runs (scalar, 8 and 4 lanes)."""
    rule = AdamWRule()
    coeffs = rule.coefficients({"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8,
                                "weight_decay": 0.1}, 1)
    p, state = _split_param()
    grad = torch.linspace(-1, 1, N).to(BF16)
    row = native.row_tensors(rule, get_strategy("split"), p.detach(), grad, state)
    native.adamw(get_strategy("split"), coeffs, [(row, 0, 0, 0)], lib=kernel_lib)
    _check(p, state)


@pytest.mark.triton
@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.skipif(launches.triton is None, reason="Triton is not installed")
def test_the_triton_kernel_steps_a_nan_master_to_a_nan_weight():
    p, state = _split_param()
    opt = collage.AdamW([p], lr=1e-2, strategy="split", nonfinite="ignore", fused="triton")
    opt.state[p].update(state)
    opt.state[p]["step"] = torch.tensor(0.0)
    p.grad = torch.linspace(-1, 1, N).to(BF16)
    opt.step()
    assert opt.last_paths == {0: "triton"}
    _check(p, opt.state[p])
