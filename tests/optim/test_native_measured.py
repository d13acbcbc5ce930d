"""The native measured step (``native.adamw(..., sums=...)``, ``collage_adamw_measured``).

Two properties, for every strategy the native kernels cover:

* **the step is the unmeasured native step, bit for bit** (weights and every state), so
  measuring never changes training;
* **the sums are those of tracked.py's CPU kernel**: the same float32 intended update
  ``d``, the same float32 changes ``e`` (TwoSum for a pair) and ``ev`` with exact zero
  tests. The reference here runs that kernel's operations eagerly (``kernels.fast_step``
  with ``intended_dtype=float32`` and ``metrics.component_change``, with the correctly
  rounded square root of ``test_native.IEEESqrtAdamW``, so its step is the native one bit for
  bit) and sums the very same float32 values **in float64**. Counts must then be equal
  exactly and every sum within ``SUM_BOUND * sum |x * y|`` (the native kernel's float32
  partial sums; ``update_sums_blocked`` states the bound).

Cases are data: adversarial values (zeros of both signs, subnormals, huge weights, and
inf/nan), zero gradients, updates below half an ulp (``e == 0`` exactly), weight decay or
none, maximize with the other lerp formula, a GradScaler scale, float32 gradients for bf16
weights, sizes with vector tails and several 256-element blocks; threads and the other
build. At the optimizer level: several groups, named parameters, the analytic values of
``edq`` and ``imprecision`` where updates cannot reach a bf16 weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

import collage
from collage.metrics import FIELDS, UpdateStats, component_change
from collage.metrics.stats import BLOCK
from collage.optim import get_strategy, kernels, native
from collage.optim.draws import counter_uniform, stochastic_key
from collage.optim.native import build
from collage.optim.native import calls as native_calls

from .test_native import RULE, STRATEGIES, _assert_same_bits, _nan_master, _values
from .test_native import calls  # noqa: F401 (the fixture: native.adamw's calls, measured or not)

pytestmark = pytest.mark.skipif(
    build._compiler() is None, reason="no C compiler: the native kernels cannot be built")

#: float32 rounding unit
U = 2.0**-24
#: test_measured_cpu.SUM_BOUND: a sum's error relative to the sum of its absolute terms
#: (at most BLOCK float32 roundings per term in the portable build, 16 in the AVX-512 one)
SUM_BOUND = (BLOCK + 8) * U
#: the float sums (the others are counts)
SUMS = ("dot_ed", "dd", "ee", "dot_evd", "evev", "cc")
#: tails of every kind, several 256-element blocks and a partial one (4099 = 16 * 256 + 3)
SIZES = (1, 15, 16, 17, 33, 255, 256, 257, 1000, 4099)


@dataclass(frozen=True)
class Case:
    """One configuration of a direct kernel call."""

    name: str
    group: dict = field(default_factory=dict)
    scale: float | None = None
    data: str = "hard"  # hard: adversarial finite values; nonfinite: also inf/nan; smooth
    grad: str = "bf16"  # the gradients' dtype for bf16 weights
    grad_size: float = 1e-3  # gradient magnitude; 0: all-zero gradients

    def __str__(self) -> str:
        return self.name


CASES = (
    Case("decay", {"lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.1}),
    Case("no_decay_fp32_grads", {"lr": 3e-3, "betas": (0.9, 0.99), "weight_decay": 0.0},
         grad="fp32"),
    Case("lerp_ge_half_maximize", {"lr": 1.0, "betas": (0.3, 0.5), "weight_decay": 0.01,
                                   "maximize": True}),
    Case("grad_scaler", {"lr": 1e-3, "weight_decay": 0.1, "eps": 1e-6}, scale=65536.0),
    Case("below_half_ulp", {"lr": 1e-7, "weight_decay": 0.0}, data="smooth"),
    Case("zero_grads_decay", {"lr": 1e-3, "weight_decay": 0.5}, grad_size=0.0),
    Case("nonfinite", {"lr": 1e-2, "weight_decay": 0.1}, data="nonfinite"),
    # eps = 0: the unused lanes of a tail step zeros into 0 / 0 = nan; they must not count
    Case("eps_zero_tails", {"lr": 1e-3, "weight_decay": 0.1, "eps": 0.0}, data="smooth"),
)


def _coeffs(case: Case, step: int = 2) -> dict:
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
             **{k: v for k, v in case.group.items() if k != "maximize"}}
    return RULE.coefficients(group, step)


def _tensors(strategy: str, case: Case, n: int, seed: int) -> tuple:
    """(weight, gradient, state) of one tensor; moments nonzero (as after a few steps)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if strategy == "fp32" else torch.bfloat16
    if case.data == "smooth":  # |w| in [0.5, 2): a bf16 half ulp is >= 2**-10
        sign = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
        w = (torch.rand(n, generator=gen) * 1.5 + 0.5) * sign
        g = torch.randn(n, generator=gen) * case.grad_size
    else:
        w = _values(n, gen, case.data, 1.0)
        g = _values(n, gen, case.data, case.grad_size)
    weight = w.to(dtype)
    grad = g.to(torch.float32 if case.grad == "fp32" else dtype)
    state: dict = {}
    get_strategy(strategy).init_state(RULE, weight, state)
    for key in ("exp_avg", "exp_avg_sq"):
        value = torch.randn(n, generator=gen).abs() * (case.grad_size or 1e-3)
        state[key].copy_(value.square() if key == "exp_avg_sq" else value)
    if "weight_lo" in state or "compensation" in state:  # a nonzero, normalised low part
        extra = "weight_lo" if "weight_lo" in state else "compensation"
        state[extra].copy_((weight.float() * torch.rand(n, generator=gen) * 2**-9).bfloat16())
    return weight, grad, state


def _copy(weight, grad, state) -> tuple:
    return weight.clone(), grad.clone(), {k: v.clone() for k, v in state.items()}


def _reference(strategy: str, case: Case, weight, grad, state, keys: tuple[int, int],
               coeffs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``weight``/``state`` with tracked.py's CPU kernel operations, eagerly (``coeffs``:
    default those of ``case``); returns (the float64 sums of its float32 values, layout
    FIELDS; sum |x * y| per field)."""
    st = get_strategy(strategy)
    g = grad.float()
    if case.scale is not None:
        g = g / torch.tensor(case.scale)
    if case.group.get("maximize"):
        g = -g
    draws = None
    if strategy == "stochastic":
        seeds = torch.tensor([keys[0], keys[1], 0], dtype=torch.int32)
        draws = counter_uniform(weight.numel(), seeds)
    before = [t.float().clone() for t in st.represented_parts(weight, state)]
    visible_before = weight.float().clone()
    d = kernels.fast_step(RULE, st, weight, g, state, coeffs or _coeffs(case), draws, True,
                          intended_dtype=torch.float32)
    after = [t.float() for t in st.represented_parts(weight, state)]
    e, stuck = component_change(before, after)
    # fp32, bf16, stochastic: the visible weight is the represented one, ev == e
    ev, stuck_visible = component_change([visible_before], [weight.float()])
    comp = st.compensation_of(state)
    c = comp.float() if comp is not None else torch.zeros_like(d)
    d, e, ev, c = (t.double() for t in (d, e, ev, c))
    moving = d != 0
    terms = {"dot_ed": e * d, "dd": d * d, "ee": e * e, "dot_evd": ev * d, "evev": ev * ev,
             "cc": c * c}
    sums = {k: t.sum() for k, t in terms.items()}
    sums.update(n_nonzero=moving.sum(), n_stuck=(moving & stuck).sum(),
                n_stuck_visible=(moving & stuck_visible).sum(),
                n_compensation=comp.numel() if comp is not None else 0,
                n_elements=d.numel())
    absolute = torch.tensor([float(terms[k].abs().sum()) if k in terms else 0.0
                             for k in FIELDS], dtype=torch.float64)
    return torch.tensor([float(sums[k]) for k in FIELDS], dtype=torch.float64), absolute


def _assert_sums(got: torch.Tensor, want: torch.Tensor, absolute: torch.Tensor, what: str,
                 bound: float = SUM_BOUND) -> None:
    for i, name in enumerate(FIELDS):
        a, b = float(got[i]), float(want[i])
        if name not in SUMS:
            assert a == b, f"{what} {name}: {a} != {b} (counts are exact)"
        elif math.isnan(b) or math.isinf(b):
            assert a == b or (math.isnan(a) and math.isnan(b)), f"{what} {name}: {a} vs {b}"
        elif math.isinf(a) and float(absolute[i]) >= 2.0**127:
            continue  # terms of weights near 1e30: float32 partial sums overflow (tracked too)
        else:
            assert abs(a - b) <= bound * float(absolute[i]), \
                f"{what} {name}: {a} vs {b} (bound {bound * float(absolute[i])})"


def _rows(strategy: str, case: Case, seed: int) -> list[tuple]:
    return [_tensors(strategy, case, n, seed + i) for i, n in enumerate(SIZES)]


KEYS = (-123456, 987654)


def _native(strategy, case, tensors, measured: bool, threads: int = 1, lib=None):
    st = get_strategy(strategy)
    rows = [(native.row_tensors(RULE, st, w, g, s), 0, *KEYS) for w, g, s in tensors]
    sums = torch.full((len(rows), len(FIELDS)), float("nan"), dtype=torch.float64) \
        if measured else None
    native.adamw(st, _coeffs(case), rows, scale=case.scale,
                 maximize=bool(case.group.get("maximize")), threads=threads, sums=sums,
                 lib=lib)
    return sums


def _assert_same_step(strategy, got, want, what) -> None:
    for (wa, _, sa), (wb, _, sb) in zip(got, want):
        nan = _nan_master(strategy, wa, sa, wb, sb)
        _assert_same_bits(wa, wb, f"{what} weight", nan)
        for key in sa:
            if key != "step":
                _assert_same_bits(sa[key], sb[key], f"{what} {key}",
                                  nan if key == "weight_low_bits" else None)


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_measured_step_is_the_step_and_sums_are_tracked_kernels(strategy, case) -> None:
    """Direct calls on tensors of every tail length: the measured call writes the bits of
    the unmeasured one (and of the tracked-kernel operations); its sums have the reference's
    counts exactly and its sums within SUM_BOUND."""
    measured = _rows(strategy, case, seed=10)
    plain = [_copy(*t) for t in measured]
    reference = [_copy(*t) for t in measured]
    sums = _native(strategy, case, measured, True)
    _native(strategy, case, plain, False)
    _assert_same_step(strategy, measured, plain, "measured vs unmeasured")
    for i, (w, g, s) in enumerate(reference):
        want, absolute = _reference(strategy, case, w, g, s, KEYS)
        _assert_sums(sums[i], want, absolute, f"tensor {i} ({SIZES[i]} elements)")
    _assert_same_step(strategy, measured, reference, "native vs tracked-kernel operations")
    if case.name == "below_half_ulp" and strategy == "bf16":
        total = sums.sum(0)
        assert total[FIELDS.index("n_stuck")] == total[FIELDS.index("n_nonzero")] > 0
        assert total[FIELDS.index("dot_ed")] == 0.0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_threads_give_the_same_step_and_sums(strategy, monkeypatch) -> None:
    """3 threads (tensors cut between threads, every 64 elements): the same bits, the same
    counts, sums within the bound."""
    monkeypatch.setattr(native_calls, "_MIN_CHUNK", 64)
    case = CASES[0]
    one = _rows(strategy, case, seed=20)
    three, reference = [_copy(*t) for t in one], [_copy(*t) for t in one]
    sums = {"one": _native(strategy, case, one, True),
            "three": _native(strategy, case, three, True, threads=3)}
    _assert_same_step(strategy, three, one, "3 threads vs 1")
    for i, (w, g, s) in enumerate(reference):
        want, absolute = _reference(strategy, case, w, g, s, KEYS)
        for name, got in sums.items():
            _assert_sums(got[i], want, absolute, f"{name}: tensor {i}")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_other_backends_give_the_same_step_and_sums(strategy, backend_lib) -> None:
    """Every other backend this CPU runs (conftest.OTHER_BACKENDS: the scalar build's
    256-element float32 blocks, the vector source's lanes at 8 and 4): the default build's
    step bits, the reference's counts, sums within the bound."""
    case = CASES[0]
    default = _rows(strategy, case, seed=20)
    other, reference = [_copy(*t) for t in default], [_copy(*t) for t in default]
    sums = {"default": _native(strategy, case, default, True),
            "other": _native(strategy, case, other, True, lib=backend_lib)}
    _assert_same_step(strategy, other, default, "other backend vs default")
    for i, (w, g, s) in enumerate(reference):
        want, absolute = _reference(strategy, case, w, g, s, KEYS)
        for name, got in sums.items():
            _assert_sums(got[i], want, absolute, f"{name}: tensor {i}")


#: above 3 x the C side's 65,536-element minimum per thread; the cuts fall inside tensors
OPENMP_SIZES = (70001, 1, 65600, 33, 100003)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_openmp_threads_give_the_same_step(strategy) -> None:
    """Unmeasured calls of an OpenMP build split the rows in C (3 threads: cuts inside
    tensors, moved to multiples of 64 elements): the bits of one thread, stochastic's draws
    included (each is keyed by its element's index in its tensor)."""
    lib = native.load()
    if lib is None or not lib.collage_native_openmp():
        pytest.skip("the native library was built without OpenMP")
    case = CASES[0]
    one = [_tensors(strategy, case, n, 40 + i) for i, n in enumerate(OPENMP_SIZES)]
    three = [_copy(*t) for t in one]
    _native(strategy, case, one, False, threads=1)
    _native(strategy, case, three, False, threads=3)
    _assert_same_step(strategy, three, one, "3 OpenMP threads vs 1")


def test_openmp_build_shares_torchs_runtime() -> None:
    """Where torch runs on GNU OpenMP, the library binds to torch's libgomp (one runtime,
    one set of threads), as native.info() reports."""
    lib = native.load()
    if lib is None or not lib.collage_native_openmp():
        pytest.skip("the native library was built without OpenMP")
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch does not use OpenMP")
    with open("/proc/self/maps") as handle:
        gomp = {line.split()[-1] for line in handle if "libgomp" in line}
    if len(gomp) != 1 or "torch" not in next(iter(gomp)):
        pytest.skip(f"torch's OpenMP runtime is not a libgomp in torch/lib: {gomp}")
    assert native.info()["openmp"] == "torch"


# ---------------------------------------------------------------------------------------
# the optimizer: groups, names, GradScaler, the default path
# ---------------------------------------------------------------------------------------


def _model(strategy: str, seed: int) -> list[tuple[str, torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if strategy == "fp32" else torch.bfloat16
    return [(f"p{i}", torch.nn.Parameter((torch.randn(n, generator=gen) * 0.02).to(dtype)))
            for i, n in enumerate((1000, 17, 4099, 256, 0))]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_optimizer_reports_the_reference_metrics(strategy, calls) -> None:
    """Two groups (weight decay in one, maximize in the other), named parameters (keys
    ``edq/p0``), an empty tensor, a GradScaler scale in one step: update_stats equal the
    reference built from the same per-tensor sums, counts exact; the weights are the
    unmeasured optimizer's bit for bit."""
    named = _model(strategy, 0)
    twin = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in named]
    groups = lambda ps: [{"params": ps[:3], "weight_decay": 0.1},  # noqa: E731
                         {"params": ps[3:], "lr": 3e-3, "maximize": True}]
    opt = collage.AdamW(groups(named), lr=1e-3, strategy=strategy, track_updates=True,
                        fused=True)
    plain = collage.AdamW(groups(twin), lr=1e-3, strategy=strategy, fused=True)
    gen = torch.Generator().manual_seed(1)
    positions = opt._parameter_positions()
    for step in range(3):
        want = UpdateStats()
        scale = 1024.0 if step == 1 else None
        for index, group in enumerate(opt.param_groups):
            for name, p, q in zip(group["param_names"], group["params"],
                                  plain.param_groups[index]["params"]):
                g = (torch.randn(p.shape, generator=gen) * 1e-3 * (scale or 1.0)).to(p.dtype)
                p.grad, q.grad = g, g.clone()
                if not opt.state[p]:
                    get_strategy(strategy).init_state(opt.rule, p, opt.state[p])
                ref_w, ref_g, ref_s = _copy(p.detach(), g, opt.state[p])
                ref_s["step"] += 1
                case = Case("opt", {"lr": group["lr"], "betas": group["betas"],
                                    "eps": group["eps"], "weight_decay": group["weight_decay"],
                                    "maximize": group["maximize"]}, scale=scale)
                step_value = int(ref_s["step"])
                sums, _ = _reference(strategy, case, ref_w, ref_g, ref_s,
                                     stochastic_key(opt.seed, positions[id(p)], step_value),
                                     RULE.coefficients(case.group, step_value))
                want.add_sums(("", f"group{index}", name), sums)  # optimizer._gather's keys
        if scale is not None:
            opt.grad_scale = plain.grad_scale = torch.tensor(scale)
        opt.step()
        plain.step()
        opt.grad_scale = plain.grad_scale = None
        expected = want.to_dict()
        got = opt.update_stats
        assert got.keys() == expected.keys() and "edq/p0" in got
        for key, value in expected.items():
            name = key.split("/")[0]
            if name.startswith("imprecision"):
                assert got[key] == value or (math.isnan(value) and math.isnan(got[key])), key
            elif math.isnan(value):
                assert math.isnan(got[key]), key
            else:
                assert math.isclose(got[key], value, rel_tol=SUM_BOUND, abs_tol=1e-30), key
        for (_, p), (_, q) in zip(named, twin):
            _assert_same_bits(p.detach(), q.detach(), f"step {step} weight")
    assert set(opt.last_paths.values()) == {"native"} and set(calls) == {strategy}


@pytest.mark.parametrize("strategy", ("bf16", "light", "plus", "mixed", "split"))
def test_analytic_values_when_updates_cannot_reach_a_bf16_weight(strategy, calls) -> None:
    """Weights in [0.5, 2) (a bf16 half ulp >= 2**-10) and Adam steps of about lr = 2**-17:
    nothing reaches the bf16 weight. bf16 loses every update (imprecision 1, edq 0
    exactly); the strategies with a wider represented value keep them (edq within 1e-3 of
    1) while the visible weight stays put. The default path (fused=None) measures
    natively. (Adam's first step is +-lr for every element: lr = 1e-5, 83.9 float32 ulps of
    a weight in [1, 2), lands as 84 ulps everywhere, a true edq of 1.0014 for mixed.)"""
    gen = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(((torch.rand(n, generator=gen) * 1.5 + 0.5)
                                  * (torch.randint(0, 2, (n,), generator=gen) * 2 - 1))
                                 .bfloat16()) for n in (4099, 300)]
    opt = collage.AdamW(params, lr=2.0**-17, weight_decay=0.0, strategy=strategy,
                        track_updates=True)
    for _ in range(3):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).bfloat16()
        opt.step()
        stats = opt.update_stats
        if strategy == "bf16":
            assert stats["imprecision"] == 1.0 and stats["edq"] == 0.0
        else:
            assert abs(stats["edq"] - 1.0) < 1e-3 and stats["imprecision"] < 1e-2
            assert stats["imprecision_visible"] > 0.99 and abs(stats["edq_visible"]) < 1e-2
    assert calls == [strategy] * 3
