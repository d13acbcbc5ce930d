"""The numeric claims of the README and the docs that a test can pin, executed: a sentence
or table that goes stale fails CI (issue #25).

* bytes per parameter (README's table, docs/strategies.md's "At a glance") against the
  memory model derived from the strategies' components;
* the second-moment table of docs/strategies.md (``benchmarks/studies/second_moment.py
  --check``) and the bound it is said to hold over 3,000 steps;
* the research-plus table of docs/research_plus.md (``benchmarks/studies/research_plus.py
  --check``); both generated tables are the same on every CPU (constant gradients,
  elementwise arithmetic that rounds correctly on every instruction set: their ``--check``
  passes with torch's AVX2 and portable kernels emulated, docs/compare.md "Which results
  depend on the CPU"), so they are compared exactly everywhere;
* docs/reliability.md's drop-in table quotes the error of an invalid hyperparameter
  passed with ``params=None`` (issue #30; the behaviours of the table's rows are tested in
  ``tests/optim/test_drop_in.py`` and ``tests/optim/test_torch_conventions.py``);
* ``lr = 0`` leaves every weight and compensation term bitwise unchanged:
  ``tests/reliability/test_fuzz.py::test_lr_zero_changes_no_weight`` (every rule, strategy
  and path);
* docs/reliability.md's table of what is set from an edited weight, against the strategies'
  declared components (below); that a step at ``lr = 0`` after an edit keeps the edited
  weights, and each "Weights written between steps" sentence that states a behaviour:
  ``tests/optim/test_edits.py``;
* the tables of docs/benchmarks/amd-epyc-2c_2026-12-06_ceiling.md (#40's goals against the
  CPU step's ceiling) against ``benchmarks/studies/cpu_ceiling.py`` on the committed runs;
* the GPU model's before -> after tables (the gpu-model record's and docs/gpu.md's)
  against ``benchmarks/gpu_compare.py`` on the record's JSON.
"""

from __future__ import annotations

import ast
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import collage
from collage.optim import get_strategy
from collage.train.memory import bytes_per_param

ROOT = Path(__file__).resolve().parents[1]


def _table_rows(text: str, first_header: str) -> list[list[str]]:
    """The cells of the markdown table whose header starts with ``first_header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header}"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _named_strategies(cell: str) -> list[str]:
    return re.findall(r"`([a-z0-9]+)`", cell)


def test_readme_bytes_per_parameter():
    rows = _table_rows((ROOT / "README.md").read_text(), "strategy | bytes/param")
    seen = set()
    for cells in rows:
        for name in _named_strategies(cells[0]):
            assert f"{bytes_per_param(name).total:g}" == cells[1].replace("9.06", "9.0625"), \
                (name, cells[1])
            seen.add(name)
    assert {"fp32", "mixed", "plus", "split", "light", "kahan", "bf16", "stochastic",
            "plus8"} <= seen


def test_strategies_page_bytes_per_parameter():
    rows = _table_rows((ROOT / "docs" / "strategies.md").read_text(), "strategy | weights")
    for cells in rows:
        (name,) = _named_strategies(cells[0])
        documented = float(cells[-1].split()[0])
        assert abs(bytes_per_param(name).total - documented) < 0.01, (name, documented)


# Each regenerates a study's table (23-50 s on 2 AMD EPYC cores): in the slow run (-m slow),
# to keep the default suite within CI's 15 minutes
@pytest.mark.slow
@pytest.mark.parametrize("script", ["second_moment.py", "research_plus.py"])
def test_generated_tables_are_what_the_code_computes(script):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "studies" / script),
                           "--check"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


# ---------------------------------------------------------------------------------------
# issue #30: fp32's relation to torch.optim, per path


def _fp32_adamw_research_form(w, grads, lr, betas, eps, weight_decay):
    """The research code's AdamW, op by op in float32 (adamw_collage.py's order)."""
    w, m, v = w.clone(), torch.zeros_like(w), torch.zeros_like(w)
    (b1, b2) = betas
    for t, g in enumerate(grads, 1):
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        step_size = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        raw = -step_size * m / v.sqrt().add_(eps)
        w.add_(raw - (lr * weight_decay) * w)
    return w


def _fp32_run(make, w0, grads):
    p = torch.nn.Parameter(w0.clone())
    opt = make([p])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def test_fp32_reference_is_the_research_form_not_torch_adamw():
    """README and docs/strategies.md: ``reference=True`` equals the research formula in
    float32 bit for bit, and is not torch's AdamW (with tiny gradients every weight
    differs); the eager paths are torch's bit for bit."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    strategies = " ".join((ROOT / "docs" / "strategies.md").read_text().split())
    assert "`reference=True` is not torch's AdamW" in readme
    assert "`reference=True` is the research code's arithmetic, not torch's" in strategies
    assert "foreach and reference paths" not in readme
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(4096, generator=g)
    hyper = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    for scale in (1.0, 1e-6):
        grads = [torch.randn(4096, generator=g) * scale for _ in range(4)]
        ours = _fp32_run(lambda p: collage.AdamW(p, strategy="fp32", reference=True, **hyper),
                         w0, grads)
        research = _fp32_adamw_research_form(w0, grads, **hyper)
        assert torch.equal(ours.view(torch.int32), research.view(torch.int32)), scale
        theirs = _fp32_run(lambda p: torch.optim.AdamW(p, foreach=False, **hyper), w0, grads)
        for path in ({"foreach": True}, {"foreach": False}):
            eager = _fp32_run(lambda p: collage.AdamW(p, strategy="fp32", **path, **hyper),
                              w0, grads)
            assert torch.equal(eager.view(torch.int32), theirs.view(torch.int32)), path
        if scale < 1e-3:  # eps placement: sqrt(v) + eps against sqrt(v) / sqrt(bc2) + eps
            assert bool((ours != theirs).all())


def test_fp32_sgd_reference_forms_the_update_before_the_add():
    """docs/strategies.md: SGD's reference path is ``w + fl(grad * -lr)`` (torch fuses)."""
    text = " ".join((ROOT / "docs" / "strategies.md").read_text().split())
    assert "SGD's update is formed as `grad * -lr` before the add" in text
    g = torch.Generator().manual_seed(4)
    w0, grads = torch.randn(4096, generator=g), [torch.randn(4096, generator=g)]
    ours = _fp32_run(lambda p: collage.SGD(p, lr=0.05, strategy="fp32", reference=True),
                     w0, grads)
    assert torch.equal(ours, w0 + grads[0] * -0.05)


def _one_step_from_state(make, grad, m, v, step: int) -> torch.Tensor:
    """The update of one step from the moments ``m``, ``v`` at ``step``: the weights start
    at zero, so decay leaves them zero and the weight after the step is the update."""
    p = torch.nn.Parameter(torch.zeros_like(grad))
    opt = make([p])
    group = dict(opt.state_dict()["param_groups"][0])
    opt.load_state_dict({"state": {0: {"step": torch.tensor(float(step)), "exp_avg": m.clone(),
                                       "exp_avg_sq": v.clone()}},
                         "param_groups": [group]})
    p.grad = grad.clone()
    opt.step()
    return p.detach().clone(), opt


def test_native_fp32_update_is_torch_within_2_to_the_minus_21():
    """README, docs/strategies.md: the native default differs from torch.optim.AdamW only
    through the square root, by at most 2^-21 of the update; the moments are equal."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "by at most 2^-21 of the update" in readme
    assert "one float32 unit" not in readme
    n, gen = 1 << 18, torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen) * torch.exp2(
        torch.randint(-20, 2, (n,), generator=gen).float())
    m = grad * 0.3 + torch.randn(n, generator=gen) * 1e-3
    v = grad * grad * torch.rand(n, generator=gen) + 1e-12
    hyper = {"lr": 1e-3, "weight_decay": 0.01}
    theirs, opt_t = _one_step_from_state(
        lambda p: torch.optim.AdamW(p, foreach=False, **hyper), grad, m, v, 10)
    ours, opt_o = _one_step_from_state(
        lambda p: collage.AdamW(p, strategy="fp32", **hyper), grad, m, v, 10)
    for key in ("exp_avg", "exp_avg_sq"):
        (a,), (b,) = opt_t.state.values(), opt_o.state.values()
        assert torch.equal(a[key], b[key]), key
    rel = (ours.double() - theirs.double()).abs() / theirs.double().abs()
    assert float(rel.max()) <= 2.0**-21


# ---------------------------------------------------------------------------------------
# issue #30: load_full_precision's precision, per strategy

#: relative error bound of load_full_precision per strategy (docs/strategies.md): 0 where
#: float32 fits (24 bits), the unit roundoff squared of a bf16 pair, bf16's unit roundoff
FULL_PRECISION_BOUND = {"fp32": 0.0, "mixed": 0.0, "split": 0.0, "plus": 2.0**-16,
                        "light": 2.0**-16, "kahan": 2.0**-16, "plus8": 2.0**-16,
                        "bf16": 2.0**-8, "stochastic": 2.0**-8, "feedback": 2.0**-8}


@pytest.mark.parametrize("strategy", sorted(FULL_PRECISION_BOUND))
def test_load_full_precision_is_exact_only_where_documented(strategy):
    text = " ".join((ROOT / "docs" / "strategies.md").read_text().split())
    assert "sets weights *and* compensation exactly" not in text
    assert "a relative error below 2^-16" in text
    gen = torch.Generator().manual_seed(5)
    value = torch.randn(1000, generator=gen) * torch.exp2(
        torch.randint(-30, 30, (1000,), generator=gen).float())
    dtype = torch.float32 if strategy == "fp32" else torch.bfloat16
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(1000, dtype=dtype))
    opt = collage.AdamW(model.parameters(), lr=1e-3, strategy=strategy)
    collage.load_full_precision(model, opt, {"w": value})
    parts = collage.optim.get_strategy(strategy).represented_parts(model.w, opt.state[model.w])
    held = sum(part.detach().double() for part in parts)
    rel = float(((held - value.double()).abs() / value.double().abs()).max())
    bound = FULL_PRECISION_BOUND[strategy]
    assert rel <= bound, (strategy, rel)
    if bound:  # the bound is not loose by more than a factor of 2 (the doc's 0.48 x)
        assert rel > bound / 4, (strategy, rel)


#: steps of the second-moment claims: 3,000, as the table's last column (issue #41: the
#: 1,000 steps checked before missed the largest deviation, at t = 1,831)
SECOND_MOMENT_STEPS = 3000
#: the documented bounds of |v / (1 - beta2**t) - 1| at beta2 = 0.999 per path. Why they
#: can be this tight: g = 1 at lr = 0 is deterministic, elementwise and correctly rounded
#: arithmetic, the same bits on every CPU (the table above is compared exactly), so the
#: worst step is one number. An a-priori bound is no use here: the pair's product and
#: grow err by up to ~8 u**2 (u = 2**-8) of v per step, which 1 / (1 - beta2) = 1,000 steps
#: of memory could accumulate to ~12 % if every rounding went one way.
SECOND_MOMENT_BOUND = {"default": 1.5e-4, "foreach": 1.5e-4, "reference": 6e-4}
PATH_FLAGS = {"default": {}, "foreach": {"foreach": True}, "reference": {"reference": True}}


def _second_moment_errors(flags: dict, strategies: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """|v / (1 - beta2**t) - 1| at every t in 1..SECOND_MOMENT_STEPS under g = 1 at
    lr = 0 (as benchmarks/studies/second_moment.py, every step instead of four): one
    optimizer, a group per strategy, the divisions done once at the end."""
    params = {name: torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
              for name in strategies}
    opt = collage.AdamW([{"params": [p], "strategy": name} for name, p in params.items()],
                        lr=0.0, betas=(0.9, 0.999), weight_decay=0.0, **flags)
    v = torch.empty(len(strategies), SECOND_MOMENT_STEPS, dtype=torch.float64)
    for t in range(SECOND_MOMENT_STEPS):
        for p in params.values():
            p.grad = torch.ones_like(p)
        opt.step()
        for row, (name, p) in enumerate(params.items()):
            v[row, t] = get_strategy(name).moment_value(opt.rule, opt.state[p],
                                                        "exp_avg_sq")[0]
    steps = torch.arange(1, SECOND_MOMENT_STEPS + 1, dtype=torch.float64)
    target = 1.0 - 0.999**steps
    return {name: (v[row] / target - 1.0).abs() for row, name in enumerate(strategies)}


@pytest.mark.parametrize("path", sorted(PATH_FLAGS))
def test_pair_second_moment_tracking_per_path(path):
    """README and docs/strategies.md: ``plus`` and ``split`` track v within 0.015 % over
    3,000 steps on the default and foreach paths (0.0141 % at t = 1,831 at worst; 282 steps
    past 0.01 %, so "within 0.01 %" is false) and within 0.06 % on the reference path
    (0.059 % at t = 9)."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    flat = " ".join((ROOT / "docs" / "strategies.md").read_text().split())
    for text in (readme, flat):
        assert "within 0.01 %" not in text
        assert "within 0.015 % over 3,000 steps" in text
        assert "0.0141 %" in text and "1,831" in text
    assert "within 0.06 % on the reference path" in readme
    assert "within 0.06 % on the reference path (its largest deviation, 0.059 %, at t = 9" \
        in flat
    errors = _second_moment_errors(PATH_FLAGS[path], ("plus", "split"))
    for strategy, error in errors.items():
        worst, at = float(error.max()), int(error.argmax()) + 1
        assert worst <= SECOND_MOMENT_BOUND[path], (strategy, path, worst, at)
        if path == "reference":
            assert (f"{worst:.3%}", at) == ("0.059%", 9), (strategy, worst, at)
        else:  # the figures the docs quote; past 0.01 % (the old claim) at 282 steps
            assert (f"{worst:.4%}", at) == ("0.0141%", 1831), (strategy, path, worst, at)
            assert int((error > 1e-4).sum()) == 282, (strategy, path)
            assert float(error[:1000].max()) <= 1e-4  # why a 1,000-step test missed it


# ---------------------------------------------------------------------------------------
# issue #30: integrations.md's fused=True, study.md's registry


def _flat(page: str) -> str:
    return " ".join((ROOT / "docs" / page).read_text().split())


@pytest.mark.skipif(not collage.optim.native.available(),
                    reason="no C compiler: the native kernels cannot be built")
def test_fused_true_on_cpu_runs_what_integrations_md_says():
    """docs/integrations.md: on CPU ``fused=True`` runs the native kernels for AdamW with a
    covered strategy, inductor's for SGD, Lion, ``plus8`` and ``feedback``."""
    text = _flat("integrations.md")
    assert "one compiled loop per tensor" not in text
    assert "AdamW groups that the native C kernels cover" in text
    cases = {("AdamW", "plus"): "native", ("AdamW", "fp32"): "native",
             ("AdamW", "mixed"): "native",  # two compiled cases of four: a compile costs ~6 s
             ("AdamW", "feedback"): "compiled", ("SGD", "plus"): "compiled"}
    for (rule, strategy), want in cases.items():
        dtype = torch.float32 if strategy == "fp32" else torch.bfloat16
        param = torch.nn.Parameter(torch.ones(8, dtype=dtype))
        opt = getattr(collage, rule)([param], lr=1e-3, strategy=strategy, fused=True)
        param.grad = torch.ones_like(param)
        opt.step()
        assert opt.last_paths == {0: want}, (rule, strategy, opt.last_paths)


def test_study_page_knows_feedback_is_registered():
    text = _flat("study.md")
    assert "feedback" in collage.STRATEGIES
    assert "not registered yet" not in text
    assert "runs once `collage.STRATEGIES` registers it" not in text


# ---------------------------------------------------------------------------------------
# issue #30: docs/security.md lists every deserialization and native load in src/

#: calls that load a file's bytes as objects or code: (module as written, function)
LOADERS = {("torch", "load"), ("pickle", "load"), ("pickle", "loads"), ("np", "load"),
           ("numpy", "load"), ("ctypes", "CDLL"), ("marshal", "load"), ("marshal", "loads")}
NUMBERS = {1: "once", 2: "twice", 3: "three times", 4: "four times", 5: "five times"}


def _loader_calls() -> dict[str, list[str]]:
    """Every call of a LOADERS function in src/, by file (``collage/...py``); parsed, so
    comments and docstrings do not count."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and (node.func.value.id, node.func.attr) in LOADERS):
                name = str(path.relative_to(ROOT / "src"))
                found.setdefault(name, []).append(f"{node.func.value.id}.{node.func.attr}")
    return found


def test_security_page_lists_every_load_of_a_file():
    text = " ".join((ROOT / "docs" / "security.md").read_text().split())
    calls = _loader_calls()
    assert "collage/train/bpe.py" in calls  # the scan sees the known ones
    for name in calls:
        assert f"`{name}`" in text, f"docs/security.md does not name {name} ({calls[name]})"
    torch_loads = sum(kinds.count("torch.load") for kinds in calls.values())
    assert f"`src/` calls `torch.load` {NUMBERS[torch_loads]}" in text
    assert not any(k.startswith(("pickle", "np", "numpy", "marshal"))
                   for kinds in calls.values() for k in kinds), calls
    assert "collage/train/runner.py`, `load_checkpoint`" not in text
    assert "| BPE token ids" in text


def test_reliability_quotes_the_hyperparameter_error_as_raised():
    """The drop-in row quotes ``collage.AdamW(None, lr=-1)``'s error: it is raised, before
    ``params`` is read, word for word."""
    text = (ROOT / "docs" / "reliability.md").read_text()
    quoted = "`lr must be >= 0, got -1`"
    assert "`collage.AdamW(None, lr=-1)`" in text and quoted in text
    with pytest.raises(ValueError) as error:
        collage.AdamW(None, lr=-1)
    assert str(error.value) == quoted.strip("`")


def test_reliability_edit_table_names_what_each_strategy_keeps_beside_the_weight():
    """Each row's strategies keep exactly the components its second cell names beside the
    weight (roles master, low, compensation), each set as the third cell says; together
    the rows name every strategy."""
    rows = _table_rows((ROOT / "docs" / "reliability.md").read_text(),
                       "strategy | kept beside the weight")
    seen = set()
    for names, kept, set_to in rows:
        keys = set(re.findall(r"`([a-z_]+)`", kept))
        for name in _named_strategies(names):
            strategy = get_strategy(name)
            declared = {c.key for dtype in strategy.weight_dtypes
                        for c in strategy.weight_components(dtype)
                        if c.role in ("master", "low", "compensation")}
            assert declared == keys, (name, declared, kept)
            seen.add(name)
        for key in keys:
            assert f"`{key} = " in set_to, (names, key)
    assert seen == set(collage.STRATEGIES)


def test_the_study_s_records_are_not_ignored_by_git():
    """docs/study.md says the finished runs' records are committed under
    docs/reports/study/runs/; an ignore rule matching them (``runs/`` did) makes that
    silently false (issue #33)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q",
                           "docs/reports/study/runs/any-run/result.json"], check=False)
    assert done.returncode == 1  # 1: not ignored; 0: ignored


def test_the_cpu_ceiling_tables_are_what_the_study_computes():
    """docs/benchmarks/amd-epyc-2c_2026-12-06_ceiling.md's tables (#40's goals against the
    step's ceiling) are ``benchmarks/studies/cpu_ceiling.py``'s output on the committed
    runs: each of its table rows, section by section, is in the record."""
    runs = "docs/benchmarks/amd-epyc-2c_2026-12-06_ceiling-*t-run*.json"
    core = "docs/benchmarks/amd-epyc-2c_2026-12-06_ceiling-core-run*.txt"
    script = ROOT / "benchmarks" / "studies" / "cpu_ceiling.py"
    done = subprocess.run([sys.executable, str(script), runs, "--core", core], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    record = (ROOT / "docs" / "benchmarks" / "amd-epyc-2c_2026-12-06_ceiling.md").read_text()
    sections = done.stdout.strip().split("### ")[1:]
    assert len(sections) == 4  # 17M and 111M, on two threads and on one
    for section in sections:
        assert "### " + section.strip() in record, section.splitlines()[0]


GPU_MODEL_RECORD = ROOT / "docs" / "benchmarks" / "amd-epyc-2c_2026-12-07_gpu-model"


def _gpu_compare(before: str, after: str) -> list[str]:
    """``benchmarks/gpu_compare.py``'s two tables (default, ``ignore``) of the record's
    JSON keys ``before`` and ``after``."""
    record = f"{GPU_MODEL_RECORD}.json"
    script = ROOT / "benchmarks" / "gpu_compare.py"
    done = subprocess.run([sys.executable, str(script), f"{record}:{before}",
                           f"{record}:{after}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    tables = done.stdout.strip().split("\n\n")
    assert len(tables) == 2
    return tables


def test_the_gpu_model_tables_are_what_the_comparison_computes():
    """The gpu-model record's "before and after" tables (4d569cc's kernels -> this tree's)
    and its third change's (1522bbb's -> this tree's), and docs/gpu.md's copies of the
    first two, are ``benchmarks/gpu_compare.py``'s output on the record's JSON: a figure
    edited by hand, or a JSON re-run without its tables, fails."""
    record = Path(f"{GPU_MODEL_RECORD}.md").read_text()
    gpu_doc = (ROOT / "docs" / "gpu.md").read_text()
    for table in _gpu_compare("before", "after"):
        assert table in record
        assert table in gpu_doc
    for table in _gpu_compare("previous", "after"):
        assert table in record
