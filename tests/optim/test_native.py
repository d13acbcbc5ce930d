"""The native CPU kernels (``collage.optim.native``): bit for bit the foreach kernel.

The foreach path's float32 kernel (``kernels.fast_step``) is the specification. Its one
operation the C kernels do not reproduce is torch's CPU ``sqrt`` (MKL's, which is not
correctly rounded for every input on every CPU); the reference here is that kernel with a
correctly rounded square root (:class:`IEEESqrtAdamW`), and the native kernels must equal it
bit for bit, NaN bit patterns and signed zeros included, on adversarial inputs: zeros of
both signs, subnormal-range gradients and moments, inf/nan gradients and weights, huge and
tiny weights, tails shorter than a vector, both lerp formulas, maximize, a GradScaler scale,
weight decay or none, float32 gradients for bf16 weights. ``stochastic`` is compared with
the in-kernel draws of the inductor fused path (``fused.counter_uniform`` keyed by
``fused.stochastic_seeds``), computed eagerly. Against the unmodified foreach path, the
bounds of ``test_float64_agreement.test_foreach_and_fused_agree_per_step`` apply.

Also: the portable scalar build and the AVX-512 build without AVX512-BF16 equal the default
build; threads split work without changing a bit; a new learning rate every step compiles
nothing; no compiler means one warning and the foreach path; the cache is reused.
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass, field

import pytest
import torch

import collage
from collage.optim import compiled, get_strategy, kernels, native
from collage.optim.draws import counter_uniform, draw_key
from collage.optim.native import build
from collage.optim.native import calls as native_calls
from collage.optim.native import plan as native_plan
from collage.optim.rules import AdamWRule
from collage.optim.strategies import all_strategies

from ._common import bits

pytestmark = pytest.mark.skipif(
    build._compiler() is None, reason="no C compiler: the native kernels cannot be built")

#: the strategies with a native code, in code order
STRATEGIES = tuple(s.name for s in sorted(all_strategies(), key=lambda s: s.native_code or 0)
                   if s.native_code is not None)


class IEEESqrtAdamW(AdamWRule):
    """``rules.AdamW.fast`` with a correctly rounded square root (float64 sqrt of a float32,
    rounded once to float32: exact, since float64 carries more than 2 * 24 + 2 bits)."""

    def fast(self, weight, grad, states, c):
        exp_avg, exp_avg_sq = states["exp_avg"], states["exp_avg_sq"]
        exp_avg.lerp_(grad, c["one_minus_beta1"])
        exp_avg_sq.mul_(c["beta2"]).addcmul_(grad * c["one_minus_beta2"], grad)
        root = exp_avg_sq.double().sqrt().float()
        denom = (root / c["bias_correction2_sqrt"]).add_(c["eps"])
        return c["decay"], (exp_avg * -c["step_size"]) / denom, None


RULE = IEEESqrtAdamW()


@dataclass(frozen=True)
class Case:
    """One optimizer configuration and the kind of data it steps."""

    name: str
    group: dict = field(default_factory=dict)
    scale: float | None = None
    data: str = "hard"  # "hard": adversarial values; "nonfinite": also inf/nan

    def __str__(self) -> str:
        return self.name


CASES = (
    Case("default", {"lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.1}),
    Case("no_decay", {"lr": 3e-3, "betas": (0.9, 0.99), "weight_decay": 0.0}),
    Case("lerp_ge_half_maximize", {"lr": 1.0, "betas": (0.3, 0.5), "weight_decay": 0.01,
                                   "maximize": True}),
    Case("grad_scaler", {"lr": 1e-3, "weight_decay": 0.1, "eps": 1e-6}, scale=65536.0),
    Case("nonfinite", {"lr": 1e-2, "weight_decay": 0.1}, data="nonfinite"),
    # beta2 = 0: the bias correction's square root is 1.0f from the first step (as late in
    # any run), where the kernels skip the division by it
    Case("bias_correction_one", {"lr": 1e-2, "betas": (0.9, 0.0), "weight_decay": 0.1},
         data="nonfinite"),
    # finite values below 2**63 only: the AVX2 and NEON builds step them in lean blocks
    # (step_vector.h: no NaN blends), both lerp formulas, with and without the division
    Case("lean", {"lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.1}, data="lean"),
    Case("lean_lerp_ge_half_maximize", {"lr": 0.1, "betas": (0.3, 0.5), "weight_decay": 0.01,
                                        "maximize": True}, data="lean"),
    Case("lean_bias_correction_one", {"lr": 1e-2, "betas": (0.9, 0.0)}, data="lean"),
    # lr = 0 (a linear warm-up's first step): the step size and the decay are -0.0 and
    # 1.0, so a zero weight keeps the sign IEEE gives it (-0 + -0 = -0); a vector broadcast
    # written as 0 + x made the -0.0 step size +0.0 (found by audit, 2026-12-07)
    Case("lr_zero", {"lr": 0.0, "betas": (0.9, 0.999), "weight_decay": 0.1}),
    Case("lean_lr_zero", {"lr": 0.0, "betas": (0.9, 0.999), "weight_decay": 0.1}, data="lean"),
)

#: many small tensors, tails of every length, one larger (several vectors and a tail)
SIZES = (1, 2, 15, 16, 17, 31, 33, 64, 1000, 4099)


def _values(n: int, gen: torch.Generator, kind: str, scale: float) -> torch.Tensor:
    """float32 values with ``scale``-sized normals, then adversarial ones in every 5th slot
    (``lean``: only those below 2**63 in magnitude, the largest just below it)."""
    x = torch.randn(n, generator=gen) * scale
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1e-38, 3e-39, 1e-20, -1e-22, 1e30,
                            -3e38, 2.0**-133, 1.0, -1.0])
    if kind == "lean":
        special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1e-38, 3e-39, 1e-20, -1e-22,
                                2.0**-133, 1.0, -1.0, 2.0**62 * 1.98, -(2.0**62) * 1.98])
    if kind == "nonfinite":
        special = torch.cat([special, torch.tensor([float("inf"), -float("inf"),
                                                    float("nan")])])
    picks = torch.randint(0, len(special), (n,), generator=gen)
    every = torch.arange(n) % 5 == 0
    return torch.where(every, special[picks], x)


def _params(strategy: str, kind: str, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if strategy == "fp32" else torch.bfloat16
    return [torch.nn.Parameter(_values(n, gen, "hard" if kind == "hard" else kind, 1.0)
                               .to(dtype)) for n in SIZES]


def _grads(params, step: int, kind: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    scale = 10.0 ** (-3 * step)  # later steps: subnormal-range squares
    return [_values(p.numel(), gen, kind, scale).to(p.dtype) for p in params]


def _clone_state(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


def _reference_step(opt, case: Case, strategy: str, key_param, param, grad, state: dict
                    ) -> None:
    """The foreach kernel (with a correctly rounded sqrt) on ``param`` and ``state``;
    stochastic draws keyed like the optimizer's ``key_param``."""
    group = opt.param_groups[0]
    state["step"] += 1
    step = int(state["step"])
    g = grad.float()
    if case.scale is not None:
        g = g / torch.tensor(case.scale)
    if group["maximize"]:
        g = -g
    draws = None
    if strategy == "stochastic":  # the fused path's in-kernel draws, computed eagerly
        position = opt._parameter_positions()[id(key_param)]
        seeds = draw_key(opt.seed, position, step, 0, param.device)
        draws = counter_uniform(param.numel(), seeds)
    kernels.fast_step(RULE, get_strategy(strategy), param, g, state,
                      RULE.coefficients(group, step), draws)


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str,
                      nan_anyhow: torch.Tensor | None = None) -> None:
    """Bitwise equal; ``nan_anyhow`` marks lanes where any NaN pattern is accepted."""
    diff = bits(got) != bits(want)
    if got.is_floating_point() and got.dtype == torch.float32:
        nan_anyhow = got.isnan() & want.isnan()  # float32 stores keep NaN payloads
    if nan_anyhow is not None:
        diff &= ~nan_anyhow
    if bool(diff.any()):
        i = int(diff.nonzero()[0])
        raise AssertionError(f"{what}: {int(diff.sum())} of {got.numel()} differ; first at "
                             f"{i}: native {got.view(-1)[i].item()!r}, reference "
                             f"{want.view(-1)[i].item()!r}")


def _nan_master(strategy: str, pa, sa: dict, pb, sb: dict) -> torch.Tensor | None:
    """split stores its float32 master's bits verbatim, NaN payload included, and which
    payload an operation on two NaNs returns depends on the compiler's operand order (in
    torch's kernels as in ours): lanes where both masters are NaN match as values."""
    if strategy != "split":
        return None
    st = get_strategy(strategy)
    return (kernels.represented_value(st, pa, sa).isnan()
            & kernels.represented_value(st, pb, sb).isnan())


@pytest.fixture
def calls(monkeypatch):
    """The strategies the native kernels stepped (it must run): by native.adamw or by the
    groups' native plans (the later steps of a group: ``native_plan.step_plans``)."""
    seen: list[str] = []
    original, original_plans = native_calls.adamw, native_plan.step_plans

    def spy(strategy, *args, **kwargs):
        seen.append(strategy.name)
        return original(strategy, *args, **kwargs)

    def plan_spy(runs, check):
        done = original_plans(runs, check)
        if done:
            seen.extend(group.strategy.name for _, group, _ in runs)
        return done

    monkeypatch.setattr(native_calls, "adamw", spy)
    monkeypatch.setattr(native_plan, "step_plans", plan_spy)
    return seen


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_native_is_the_foreach_kernel_bit_for_bit(strategy: str, case: Case, calls) -> None:
    params = _params(strategy, case.data)
    opt = collage.AdamW(params, strategy=strategy, nonfinite="ignore", **case.group)
    shadow = [p.detach().clone() for p in params]
    shadow_state = [{} for _ in params]
    for p, s in zip(shadow, shadow_state):
        get_strategy(strategy).init_state(RULE, p, s)
    for step in range(3):
        grads = _grads(params, step, case.data)
        for p, g in zip(params, grads):
            p.grad = g
        if case.scale is not None:
            opt.grad_scale = torch.tensor(case.scale)
        opt.step()  # fused=None: the native kernels on CPU
        for i, p in enumerate(params):
            _reference_step(opt, case, strategy, p, shadow[i], grads[i], shadow_state[i])
            nan_master = _nan_master(strategy, p.detach(), opt.state[p], shadow[i],
                                     shadow_state[i])
            _assert_same_bits(p.detach(), shadow[i], f"step {step} tensor {i} weight",
                              nan_master)
            for key, value in shadow_state[i].items():
                if key != "step":
                    _assert_same_bits(opt.state[p][key], value, f"step {step} tensor {i} {key}",
                                      nan_master if key == "weight_low_bits" else None)
        opt.param_groups[0]["lr"] *= 0.5  # a new learning rate every step: nothing compiles
    assert calls == [strategy] * 3


@pytest.mark.parametrize("strategy", ["kahan", "light", "plus"])
def test_low_parts_where_the_new_value_rounds_to_infinity(strategy: str) -> None:
    """A pair ``hi + lo`` finite in float32 but past bf16's largest finite value and half
    its spacing (a state written by hand or a checkpoint): the new high part rounds to
    infinity and its low part must be +0, as in the foreach kernel. The 32-wide kernels
    compute the low parts without that mask and send such blocks (an infinite difference)
    to their exact path; the second block of 32 is ordinary. Expected bits by hand: the
    high part 0x7F80 (inf), the low part 0x0000; zero gradients, so the update is zero."""
    n = 64
    largest = torch.finfo(torch.bfloat16).max  # 0x7F7F, 3.3895e38
    crafted = torch.arange(n) < 32
    # 3.3895e38 + 1.2e36 = 3.4015e38 (float32's largest is 3.4028e38) and times 0.999
    # 3.3981e38: past the midpoint 3.39617e38 between 0x7F7F and 2**128
    param = torch.nn.Parameter(torch.where(crafted, largest, 0.5).bfloat16())
    opt = collage.AdamW([param], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0,
                        strategy=strategy, nonfinite="ignore")
    param.grad = torch.zeros(n, dtype=torch.bfloat16)
    opt.step()
    state = opt.state[param]
    low_key = native.row_layout(RULE, get_strategy(strategy))[3][0]  # the extra column
    state[low_key].copy_(torch.where(crafted, 1.2e36, 0.0).bfloat16())
    if strategy == "plus":
        state["exp_avg_sq"].copy_(torch.where(crafted, largest, 1e-8).bfloat16())
        state["exp_avg_sq_lo"].copy_(torch.where(crafted, 1.2e36, 0.0).bfloat16())
    shadow, shadow_state = param.detach().clone(), {k: v.clone() for k, v in state.items()}
    opt.step()
    case = Case("overflow", {})
    _reference_step(opt, case, strategy, param, shadow, param.grad, shadow_state)
    _assert_same_bits(param.detach(), shadow, f"{strategy} weight")
    for key in shadow_state:
        if key != "step":
            _assert_same_bits(state[key], shadow_state[key], f"{strategy} {key}")
    pairs = [(param.detach(), state[low_key])]
    if strategy == "plus":
        pairs.append((state["exp_avg_sq"], state["exp_avg_sq_lo"]))
    for high, low in pairs:
        assert torch.equal(bits(high[:32]), torch.full((32,), 0x7F80, dtype=bits(high).dtype))
        assert torch.equal(bits(low[:32]), torch.zeros(32, dtype=bits(low).dtype))
    assert torch.equal(param.detach()[32:], torch.full((32,), 0.5, dtype=torch.bfloat16))


def test_float32_gradients_for_bf16_weights_and_threads(monkeypatch) -> None:
    """Direct calls: float32 gradients converted in registers; 1 and 3 threads (cut into
    ranges, draws indexed by the element's position) give the same bits."""
    monkeypatch.setattr(native_calls, "_MIN_CHUNK", 64)
    results = []
    for threads, grad_dtype in ((1, torch.float32), (3, torch.float32), (1, torch.bfloat16)):
        gen = torch.Generator().manual_seed(3)
        w = _values(5000, gen, "hard", 1.0).bfloat16()
        g32 = _values(5000, gen, "hard", 1e-3)
        state: dict = {}
        get_strategy("stochastic").init_state(RULE, w, state)
        coeffs = RULE.coefficients({"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8,
                                    "weight_decay": 0.1}, 1)
        grad = g32.to(grad_dtype)
        row = native.row_tensors(RULE, get_strategy("stochastic"), w, grad, state)
        native.adamw(get_strategy("stochastic"), coeffs, [(row, 7, -123456, 987654)],
                     threads=threads)
        results.append((w, state, grad))
        # the reference: the same draws, from element index 7
        ref_w = _values(5000, torch.Generator().manual_seed(3), "hard", 1.0).bfloat16()
        ref_state: dict = {}
        get_strategy("stochastic").init_state(RULE, ref_w, ref_state)
        seeds = torch.tensor([-123456, 987654, 7], dtype=torch.int32)
        kernels.fast_step(RULE, get_strategy("stochastic"), ref_w, grad.float(), ref_state,
                          coeffs, counter_uniform(5000, seeds))
        _assert_same_bits(w, ref_w, f"{threads} threads, {grad_dtype} gradients")
        for key in ("exp_avg", "exp_avg_sq"):
            _assert_same_bits(state[key], ref_state[key], key)
    _assert_same_bits(results[0][0], results[1][0], "1 vs 3 threads")


def test_other_builds_give_the_same_bits(backend_lib) -> None:
    """Every other backend this CPU runs (conftest.OTHER_BACKENDS: the scalar fallback of a
    plain x86-64 or non-x86 target, the vector source at AVX2's 8 lanes and at NEON's 4,
    the AVX-512 build that rounds with integer operations) equals the default build, on
    every strategy: hard values (zeros, subnormals, inf and nan gradients and weights),
    tails shorter than every vector width, a GradScaler scale."""
    other = backend_lib
    for lr in (1e-2, 0.0):  # 0.0: zero weights keep their signs (the lr_zero case)
        coeffs = RULE.coefficients({"lr": lr, "betas": (0.9, 0.99), "eps": 1e-8,
                                    "weight_decay": 0.1}, 2)
        _same_bits_as_the_default(other, coeffs)


def _same_bits_as_the_default(other, coeffs) -> None:
    for strategy in STRATEGIES:
        outputs = []
        for lib in (None, other):
            params = _params(strategy, "nonfinite", seed=4)
            rows = []
            for p, g in zip(params, _grads(params, 2, "nonfinite")):
                state: dict = {}
                get_strategy(strategy).init_state(RULE, p, state)
                for key in ("exp_avg", "exp_avg_sq"):  # nonzero moments
                    state[key].copy_(g.abs().to(state[key].dtype))
                rows.append((native.row_tensors(RULE, get_strategy(strategy), p.detach(), g,
                                                state), 0, 5, 6))
                outputs.append((p, state))
            native.adamw(get_strategy(strategy), coeffs, rows, scale=4.0, lib=lib)
        half = len(outputs) // 2
        for (pa, sa), (pb, sb) in zip(outputs[:half], outputs[half:]):
            nan = _nan_master(strategy, pa.detach(), sa, pb.detach(), sb)
            _assert_same_bits(pb.detach(), pa.detach(), f"{strategy} weight", nan)
            for key in sa:
                if key != "step":
                    _assert_same_bits(sb[key], sa[key], f"{strategy} {key}",
                                      nan if key == "weight_low_bits" else None)


def test_default_path_on_cpu_is_native_and_measured_steps_compile_nothing(calls,
                                                                          monkeypatch) -> None:
    """fused=None on CPU: unmeasured and measured (track_updates) steps both run the native
    kernels, never inductor (tests/optim/test_native_measured.py checks the measured one)."""
    def no_compile(*args, **kwargs):
        raise AssertionError("inductor must not compile here")

    monkeypatch.setattr(compiled, "_compile", no_compile)
    params = _params("plus", "hard")
    opt = collage.AdamW(params, strategy="plus", track_updates=2)
    for step in range(4):
        for p, g in zip(params, _grads(params, 1, "hard")):
            p.grad = g
        opt.step()
        assert bool(opt.update_stats) == (step % 2 == 0)  # steps 0 and 2 measured
        opt.update_stats = {}
    assert calls == ["plus"] * 4


def test_fp16_weights_and_other_rules_are_not_covered(calls) -> None:
    p = torch.nn.Parameter(torch.randn(8).half())
    p.grad = torch.randn(8).half()
    collage.AdamW([p], strategy="mixed", foreach=True).step()
    q = torch.nn.Parameter(torch.randn(8).bfloat16())
    q.grad = torch.randn(8).bfloat16()
    collage.SGD([q], lr=0.1, strategy="plus").step()
    assert calls == []
    assert not native.covers(collage.SGD.rule, get_strategy("plus"), [q], [q.grad])


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """An empty cache directory and a loader that has not tried yet; restored after."""
    monkeypatch.setenv("COLLAGE_CACHE_DIR", str(tmp_path))
    build._reset()
    yield tmp_path
    monkeypatch.undo()
    build._reset()


def test_missing_compiler_warns_once_and_falls_back(fresh_loader, monkeypatch) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc-collage-test")
    a, b = _params("light", "hard"), _params("light", "hard")
    oa = collage.AdamW(a, strategy="light", foreach=True)
    ob = collage.AdamW(b, strategy="light")  # default: native, unavailable -> foreach
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            for pa, pb, g in zip(a, b, _grads(a, step, "hard")):
                pa.grad, pb.grad = g.clone(), g.clone()
            oa.step()
            ob.step()
    ours = [w for w in caught if "native CPU kernels unavailable" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "cc-collage-test" in str(ours[0].message)
    assert not native.available() and ob.last_paths == {0: "foreach"}
    for pa, pb in zip(a, b):
        _assert_same_bits(pb.detach(), pa.detach(), "fallback weight")
    assert not list(fresh_loader.rglob("*.so"))


def test_disabled_by_environment(fresh_loader, monkeypatch, calls) -> None:
    monkeypatch.setenv("COLLAGE_NATIVE", "0")
    p = torch.nn.Parameter(torch.randn(8).bfloat16())
    p.grad = torch.randn(8).bfloat16()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a deliberate switch warns nothing
        collage.AdamW([p], strategy="plus").step()
    assert calls == [] and not native.available()
    assert "COLLAGE_NATIVE" in native.info()["reason"]


def test_c_source_ships_with_the_package() -> None:
    """pyproject.toml's package-data includes every C source (the loader needs them), and
    every C file beside them is one of them (the cache key hashes ``SOURCES``)."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    config = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["collage"]
    for source in native.SOURCES:
        assert any(source.match(f"*/{pattern}") for pattern in patterns), source
        assert source.exists(), source
    assert set(native.SOURCES[0].parent.glob("*.[ch]")) == set(native.SOURCES)
    assert shutil.which(build._compiler()[0])


def test_a_unit_that_fails_to_compile_gives_the_compiler_s_message(tmp_path) -> None:
    """The units compile side by side: one that fails stops the build with its own
    message, and nothing is installed (a pipe left unread would fail too: pyproject makes
    unraisable warnings errors)."""
    wrapper = tmp_path / "cc-refuses-measured"
    wrapper.write_text('#!/bin/sh\nfor a in "$@"; do case "$a" in *measured.c) '
                       'echo "measured.c: refused here" >&2; exit 1;; esac; done\nexit 0\n')
    wrapper.chmod(0o755)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="measured.c: refused here"):
            build._compile([str(wrapper)], build._FLAGS[-1], tmp_path / "library.so")
    assert not (tmp_path / "library.so").exists()


def test_compiler_without_openmp_falls_back_to_the_thread_pool(fresh_loader, monkeypatch,
                                                               tmp_path_factory) -> None:
    """A compiler that refuses -fopenmp: the next flag set builds, with no warning; its
    threaded steps (the Python pool: tensors cut every 64 elements) give the bits of one
    thread. The flag sets are the portable one with and without OpenMP: the fallback does
    not depend on the target flags, and they compile in seconds (-march=native: 20-30 s)."""
    portable = build._FLAGS[-1]
    monkeypatch.setattr(build, "_FLAGS", ((*portable[:-2], "-fopenmp", *portable[-2:]),
                                          portable))
    wrapper = tmp_path_factory.mktemp("cc") / "cc-no-openmp"
    wrapper.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\n'
                       f'exec {shutil.which(build._compiler()[0])} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setattr(native_calls, "_MIN_CHUNK", 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.available()
    assert native.info()["openmp"] is None
    coeffs = RULE.coefficients({"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8,
                                "weight_decay": 0.1}, 1)
    stepped = []
    for threads in (1, 3):
        params = _params("plus", "hard")
        grads = _grads(params, 0, "hard")
        rows = []
        for p, g in zip(params, grads):
            state: dict = {}
            get_strategy("plus").init_state(RULE, p.detach(), state)
            rows.append((native.row_tensors(RULE, get_strategy("plus"), p.detach(), g, state),
                         0, 0, 0))
        native.adamw(get_strategy("plus"), coeffs, rows, threads=threads)
        stepped.append(rows)
    for (one, _, _, _), (three, _, _, _) in zip(*stepped):
        for a, b in zip(one, three):
            if a is not None:
                _assert_same_bits(b, a, "3 pool threads vs 1", a.isnan() & b.isnan()
                                  if a.is_floating_point() else None)


@pytest.mark.parametrize("pairs,first", [(False, 1_000_003), (True, 1_000_003),
                                         (True, 1 << 20)],
                         ids=["16-wide", "32-wide", "32-wide-aligned"])
def test_stochastic_rounding_of_every_low_half_is_the_reference(pairs: bool, first: int,
                                                                kernel_lib) -> None:
    """The kernels' integer stochastic rounding (``v_stochastic32`` on 16 lanes; with
    ``pairs`` ``v_stochastic2``, 32 elements in 16-bit lanes, whose blocks holding a lane
    at or above the largest finite truncation take ``v_stochastic32``) against the float
    reference ``rounding._stochastic_round_bf16`` with the same draws
    (``fused.counter_uniform``), bit for bit: every 16-bit low half under the high halves
    where it is hardest (zero and the subnormals, the smallest normal, 1.0 and its lower
    neighbour, the largest finite values, infinity, NaN), both signs, ties included (low
    half 0x8000 under even and odd high halves). The tail of 7 runs the scalar routine.
    Blocks of 32 that start at a multiple of 32 (``first`` 2**20) hash with ``v_hash2``'s
    table lookup for the first round's multiply, others with the plain hash."""
    from collage.optim.rounding import _stochastic_round_bf16

    highs = torch.tensor([0x0000, 0x0001, 0x007F, 0x0080, 0x0081, 0x3F7F, 0x3F80, 0x7F7E,
                          0x7F7F, 0x7F80, 0x7FC0], dtype=torch.int64)
    lows = torch.arange(1 << 16, dtype=torch.int64)
    words = ((highs[:, None] << 16) | lows[None, :]).reshape(-1)
    words = torch.cat([words, words | (1 << 31), torch.tensor([0x3F808000, 0x3F818000,
                                                               0x12345678, 0, 1, 2, 3])])
    x = (words - ((words >> 31) << 32)).to(torch.int32).view(torch.float32).contiguous()
    key0, key1 = -123_456_789, 987_654_321
    draws = counter_uniform(x.numel(), torch.tensor([key0, key1, first], dtype=torch.int32))
    want = _stochastic_round_bf16(x, draws)
    got = torch.empty(x.numel(), dtype=torch.bfloat16)
    kernel_lib.collage_stochastic_round(x.data_ptr(), x.numel(), first, key0, key1, got.data_ptr(),
                                 int(pairs))
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(bits(got[~nan]), bits(want[~nan]))
    # and stochastic: a value a fraction f of the way from its nearest bf16 neighbour leaves
    # it with probability f, on average 1/4 over uniform low halves (draws near 1 keep all;
    # below the largest finite bf16, where no step reaches infinity; 1.2M values: the
    # standard error of the mean is 0.0004)
    nearest = _stochastic_round_bf16(x, torch.full_like(x, 1 - 2.0**-24))
    below = x.abs() < torch.finfo(torch.bfloat16).max
    moved = (bits(got) != bits(nearest))[below].float().mean()
    assert 0.248 < moved < 0.252


@pytest.mark.parametrize("strategy", ["plus", "split"])
def test_a_second_moment_pair_summing_below_zero_takes_the_exact_code(strategy: str,
                                                                      calls) -> None:
    """A state loaded by hand may hold a pair whose sum v_hi + v_lo is negative (our kernels
    never make one): its square root is NaN, which only the exact code rounds to bf16 as
    NaN. The lean blocks' test (|v_lo| <= v_hi) sends such a block there: the foreach
    kernel's bits, NaN patterns included, on 4,096 elements with one such pair."""
    case = Case("lean", {"lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.1}, data="lean")
    gen = torch.Generator().manual_seed(7)
    # ordinary values only: every block but the one with the pair is a lean one
    param = torch.nn.Parameter(torch.randn(4096, generator=gen).to(torch.bfloat16))
    opt = collage.AdamW([param], strategy=strategy, nonfinite="ignore", **case.group)
    param.grad = (torch.randn(4096, generator=gen) * 1e-2).to(torch.bfloat16)
    opt.step()
    state = opt.state[param]
    state["exp_avg_sq"][1234] = 2.0**-20
    state["exp_avg_sq_lo"][1234] = -(2.0**-19)
    shadow, shadow_state = param.detach().clone(), _clone_state(state)
    grad = (torch.randn(4096, generator=gen) * 1e-2).to(torch.bfloat16)
    grad[1234] = 0.0  # v' = (v_hi + v_lo) beta2 < 0
    param.grad = grad
    opt.step()
    _reference_step(opt, case, strategy, param, shadow, grad, shadow_state)
    assert bool(shadow.float().isnan()[1234])  # (the case is the one meant)
    _assert_same_bits(param.detach(), shadow, "weight", _nan_master(
        strategy, param.detach(), state, shadow, shadow_state))
    for key, value in shadow_state.items():
        if key != "step":
            _assert_same_bits(state[key], value, key)
    assert calls == [strategy] * 2
