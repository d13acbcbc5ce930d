"""The Triton kernels' arithmetic on CPU, through Triton's interpreter, against exact
references: the fused multiply-add, the division by a per-row constant, stochastic
rounding to bf16 over every bf16 spacing, and the per-mode copies of the kernel modules.
The optimizer's steps through the same kernels are ``test_triton.py``'s."""

from __future__ import annotations

import sys

import pytest
import torch

from collage.optim import rounding
from collage.optim.triton import launch as launches

from ._division import DIVISORS, SIGNIFICANDS, special_dividends, worst_reciprocals

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("triton_interpreter")]

needs_triton = pytest.mark.skipif(launches.triton is None, reason="Triton is not installed")


@needs_triton
def test_fma_is_correctly_rounded_in_the_interpreter():
    """The interpreter's ``tl.fma`` rounds twice; ``kernels.arithmetic._fma_emulated`` must
    give torch's fused multiply-add (``addcmul``) bit for bit, cancellations and tiny
    results included."""
    module = launches.kernel_module(True)
    g = torch.Generator().manual_seed(0)
    n = 4096
    a = torch.randn(n, generator=g)
    b = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g))
    c = torch.randn(n, generator=g)
    c[: n // 2] = -(a * b)[: n // 2] * (1 + torch.randn(n // 2, generator=g) * 2.0**-20)
    c[n // 2: n // 2 + 64] = 2.0**-140  # subnormal neighbourhood
    out = torch.empty(n)
    module.fma_probe[(n // 256,)](a, b, c, out, n, EMULATE_FMA=True, BLOCK=256)
    assert torch.equal(out.view(torch.int32), torch.addcmul(c, a, b).view(torch.int32))


def _div_by_row(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``x / c`` elementwise as the kernels divide by a row's constant (AdamW's ``sqrt(v) /
    c3``: ``kernels.arithmetic._div_by_row``, the reciprocal of each ``c``), interpreted."""
    module = launches.kernel_module(True)
    out = torch.empty_like(x)
    block = 1 << 16  # one interpreted program per 65,536 elements (its cost is per program)
    module.div_by_row_probe[(-(-x.numel() // block),)](x, c, out, x.numel(), EMULATE_FMA=True,
                                                       BLOCK=block)
    return out


def _assert_ieee_quotient(x: torch.Tensor, c: torch.Tensor) -> None:
    got = _div_by_row(x, c)
    want = x / c  # IEEE, correctly rounded
    differ = (got.view(torch.int32) != want.view(torch.int32)).nonzero().flatten()
    assert differ.numel() == 0, [(float(x[i]), float(c[i])) for i in differ[:5]]


@needs_triton
# the correction of an infinite dividend is inf - inf, computed by numpy in the interpreter
# and then discarded by the select that passes inf and NaN through
@pytest.mark.filterwarnings("ignore:invalid value encountered in add:RuntimeWarning")
def test_the_division_by_a_row_constant_is_the_ieee_quotient():
    """The C kernels' divisors (``_division.py``: the worst-rounded reciprocals, the
    all-ones and 1 + ulp significands, bias corrections of real runs), moved into (0, 1]
    where AdamW's ``c3`` lies and down to ``2**-20`` (a power of two: the same significand
    problem), each with every 64th dividend significand (a different 64th each), and the
    worst-rounded reciprocal with every 8th: bit for bit IEEE (the C kernels' test tries
    every significand of every divisor on the same operations). Then the dividends passed
    through (+0 keeps its sign, -0 too, inf, NaN with its payload) and the extreme square
    roots."""
    xs, cs = [], []
    for k, b in enumerate(DIVISORS):
        x = SIGNIFICANDS[k % 64::64]
        xs.append(x)
        cs.append(torch.full_like(x, b * (0.5 if k % 2 else 2.0**-20)))
    _assert_ieee_quotient(torch.cat(xs), torch.cat(cs))
    worst = worst_reciprocals(1)[0] * 0.5
    x = SIGNIFICANDS[::8].contiguous()
    _assert_ieee_quotient(x, torch.full_like(x, worst))
    special = special_dividends()
    for b in (1.0, 0.03162277, 0.5, 0.7071068, 0.9995, 2.0**-26):
        _assert_ieee_quotient(special, torch.full_like(special, b))


@needs_triton
def test_each_mode_executes_its_own_copy_of_every_kernel_module():
    """``launch.kernel_module`` executes the ``kernels`` package once per mode: every module
    of a mode's copy, and every ``@jit`` function it holds (its own and those it imports
    from its siblings), is decorated in that mode. A helper shared between the copies would
    run compiled code in the interpreter, or interpreted code on a GPU."""
    from triton.runtime.interpreter import InterpretedFunction  # noqa: PLC0415 - optional
    from triton.runtime.jit import JITFunction  # noqa: PLC0415

    expected = {"codes", "arithmetic", "columns", "draws", "rules", "landings", "step",
                "check"}
    for interpret, kind in ((True, InterpretedFunction), (False, JITFunction)):
        package = launches.kernel_module(interpret)
        modules = {name.rpartition(".")[2]: module for name, module in sys.modules.items()
                   if name.startswith(package.__name__ + ".")}
        assert set(modules) == expected
        kernels = [value for module in (package, *modules.values())
                   for value in vars(module).values()
                   if isinstance(value, (InterpretedFunction, JITFunction))]
        assert len(kernels) > 40
        assert all(isinstance(k, kind) for k in kernels), interpret
    assert launches.kernel_module(True) is not launches.kernel_module(False)


def _hard_stochastic_inputs() -> torch.Tensor:
    """float32 values over every bf16 spacing (2**-133 ... 2**120): random significands at
    every exponent, the subnormals, values a hair either side of bf16 values and of
    midpoints, the largest finite values (whose upward neighbour is inf), zeros, inf, nan."""
    g = torch.Generator().manual_seed(3)
    exponents = torch.arange(-149, 128, dtype=torch.float32).repeat_interleave(16)
    values = (1 + torch.rand(exponents.numel(), generator=g)) * torch.exp2(exponents)
    bf = torch.randint(0, 0x7F80, (2048,), generator=g, dtype=torch.int32) << 16
    near = torch.cat([bf + 1, bf - 1, bf + 0x8000, bf + 0x7FFF, bf | 0x1]).view(torch.float32)
    special = torch.tensor([0.0, -0.0, 3.4028235e38, -3.4028235e38, 3.39e38, 1e-45, -1e-45,
                            2.0**-133, 2.0**-126, float("inf"), float("-inf"), float("nan")])
    x = torch.cat([values, near, special])
    return torch.cat([x, -x])


@needs_triton
def test_stochastic_rounding_on_the_integer_view_is_the_reference_on_the_draws_grid():
    """The step rounds from the top 16 bits of its 24-bit draws on the integer view alone
    (``kernels.draws._stochastic_bf16_draw16``): for every draw on the 2**-24 grid (the
    step's, ``draws.counter_uniform``) it must be ``rounding._stochastic_round_bf16`` bit
    for bit: draws at 0, the largest, random ones, and at, one grid step under and over
    the probability and its complement (both exact multiples of 2**-16 of the spacing),
    and each with low bits that the top 16 do not see."""
    module = launches.kernel_module(True)
    x = _hard_stochastic_inputs()
    low = x.view(torch.int32).to(torch.int64) & 0xFFFF
    g = torch.Generator().manual_seed(5)
    tops = [torch.zeros_like(low), torch.full_like(low, 0xFFFF),
            torch.randint(0, 0x10000, x.shape, generator=g)]
    for k in (low, 0x10000 - low):
        tops += [k, k - 1, k + 1]
    for top in tops:
        for rest in (0, 0xFF, torch.randint(0, 0x100, x.shape, generator=g)):
            u = (top.clamp(0, 0xFFFF) << 8) | rest
            draw = (u.double() * 2.0**-24).float()
            out = torch.empty(x.shape, dtype=torch.int16)
            # one interpreted program per 4,096 elements (its cost is per program)
            module.stochastic_draw16_probe[(-(-x.numel() // 4096),)](
                x, draw, out, x.numel(), BLOCK=4096)
            expected = rounding._stochastic_round_bf16(x, draw).view(torch.int16)
            assert torch.equal(out, expected)
