"""Numbers the README and the docs state, recomputed here from the code or from the committed
record they quote (issue #41: each of these had drifted from what it describes).

* docs/strategies.md: a residual landing needs its normalisation for 1 value in 1,024 of
  random low bits (derived there; counted here over every float32 in [1, 2));
* docs/reliability.md: meta parameters with ``fused=True``: torch.optim raises, collage
  steps them;
* README and docs/study.md: the study's figures are the committed re-run's
  (docs/reports/study/both/results.json), its paired tests recomputed from the per-seed
  losses by ``collage.train.stats``;
* docs/strategies.md: the scheduler's cost as its record gives it (ranges over rounds);
* README and docs/gpu.md: the GPU step's host time as the latest committed record gives it.

The second moment's bound over 3,000 steps is ``tests/test_docs_claims.py``'s.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import collage
from collage.optim.strategies.strategy import normalize_pair
from collage.train import stats

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "docs" / "reports" / "study" / "both" / "results.json"
SCHEDULER_RECORD = ROOT / "docs" / "benchmarks" / "intel-xeon-2c_2026-12-05_scheduler-cost.md"
GPU_MODEL_RECORD = ROOT / "docs" / "benchmarks" / "intel-xeon-2c_2026-12-05_gpu-model.json"


def _flat(path: Path) -> str:
    """A page's text with its line breaks and runs of spaces as single spaces."""
    return " ".join(path.read_text().split())


def _bits16(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


# ---------------------------------------------------------------------------------------
# normalisation ties


def test_one_landing_in_1024_needs_its_normalisation():
    """Every float32 in [1, 2) landed as ``hi = RN(x)``, ``lo = RN(x - hi)`` (computed here,
    not by the code under test: ``x - hi`` is exact in float64 and fits float32), then
    normalised by the eager paths' ``normalize_pair``. The derivation in
    docs/strategies.md: under each of the binade's 128 high halves, exactly the 64 low
    halves whose rest rounds up to half a gap beside an odd ``hi`` change."""
    text = _flat(ROOT / "docs" / "strategies.md")
    assert "1 value in 500" not in text
    assert "1 value in 1,024 of random low bits" in text
    assert "64 under each of its 128 high halves, 8,192 of 8,388,608 pairs changed" in text
    words = torch.arange(0x3F800000, 0x40000000, dtype=torch.int64)
    x = words.to(torch.int32).view(torch.float32)
    hi = x.to(torch.bfloat16)
    lo = (x.double() - hi.double()).to(torch.float32).to(torch.bfloat16)
    new_hi, new_lo = normalize_pair(hi, lo)
    changed = (_bits16(new_hi) != _bits16(hi)) | (_bits16(new_lo) != _bits16(lo))
    per_high_half = changed.view(128, 1 << 16).sum(dim=1)
    assert per_high_half.tolist() == [64] * 128
    assert int(changed.sum()) * 1024 == x.numel()
    # the value is kept: every changed pair is the same sum, only split the other way
    kept = hi.double() + lo.double() == new_hi.double() + new_lo.double()
    assert bool(kept.all())


# ---------------------------------------------------------------------------------------
# meta parameters with fused=True


@pytest.mark.parametrize("rule", ["AdamW", "SGD"])
def test_meta_parameters_with_fused_true_raise_in_torch_and_step_in_collage(rule):
    text = _flat(ROOT / "docs" / "reliability.md")
    assert "where torch.optim raises at `step()`" in text
    hyper = {"lr": 1e-3} if rule == "AdamW" else {"lr": 1e-3, "momentum": 0.9}
    theirs = torch.nn.Parameter(torch.empty(8, device="meta"))
    theirs.grad = torch.empty_like(theirs)
    with pytest.raises(RuntimeError, match="`fused=True` requires all the params"):
        getattr(torch.optim, rule)([theirs], fused=True, **hyper).step()
    ours = torch.nn.Parameter(torch.empty(8, dtype=torch.bfloat16, device="meta"))
    ours.grad = torch.empty_like(ours)
    opt = getattr(collage, rule)([ours], strategy="plus", fused=True, **hyper)
    opt.step()
    assert opt.last_paths == {0: "compiled"}
    assert float(opt.state[ours]["step"]) == 1
    assert all(v.is_meta for k, v in opt.state[ours].items() if k != "step")


# ---------------------------------------------------------------------------------------
# the study's figures


def _study_rows() -> dict[tuple[str, float, float], list[float]]:
    """Per-seed final validation losses of the committed re-run, by (strategy, beta2, lr)."""
    rows = json.loads(STUDY.read_text())
    return {(r["strategy"], r["beta2"], r["lr"]):
            [seed["final_val_loss"] for seed in sorted(r["per_seed"], key=lambda s: s["seed"])]
            for r in rows}


def _against_fp32(strategy: str, lr: float, beta2: float = 0.999) -> tuple[str, str]:
    """The relative difference of mean losses and the paired test's p against fp32 (which
    ran at 2e-3 only), formatted as the docs write them."""
    rows = _study_rows()
    ours, fp32 = rows[(strategy, beta2, lr)], rows[("fp32", beta2, 0.002)]
    relative = sum(ours) / sum(fp32) - 1.0
    test = stats.paired_t_test(ours, fp32)
    return f"{relative * 100:+.2f} %", f"p {test.p:.2g}"


def test_readme_and_study_page_quote_the_committed_rerun():
    readme, study = _flat(ROOT / "README.md"), _flat(ROOT / "docs" / "study.md")
    assert "+2.3 % vs fp32" not in readme and "4e-3 has not run" not in study
    assert "What these 30 runs support" not in study
    bf16, bf16_p = _against_fp32("bf16", 0.002)
    kahan, kahan_p = _against_fp32("kahan", 0.002)
    fast, fast_p = _against_fp32("stochastic", 0.004)
    assert (bf16, kahan, fast) == ("+2.17 %", "+0.21 %", "+1.64 %")
    assert (kahan_p, fast_p) == ("p 0.049", "p 0.027")
    assert f"pure bf16 {bf16} vs fp32, significant (p {float(bf16_p[2:]):.1g})" in readme
    assert f"+2.17 % (+0.0984 ± 0.0177 nats, {bf16_p})" in study
    assert f"`kahan` {kahan}, significant at the edge ({kahan_p})" in readme
    assert f"{fast} at 4e-3" in readme
    assert f"**{fast} at beta2 = 0.999** (+0.0743 ± 0.0535 nats, {fast_p}, significant" \
        in study
    assert f"`kahan` (10) is {kahan} at 0.999" in study and kahan_p in study


# ---------------------------------------------------------------------------------------
# records quoted


#: a round's row of the record: tree, tensors, two step times, the scheduler's cost (us)
ROUND_ROW = re.compile(r"\| (before|after), round \d \| (\d+) \|"
                       r"(?: [-\d.]+ \|){2} ([-\d.]+) \|")


def _scheduler_costs() -> dict[tuple[str, int], list[float]]:
    """The scheduler's cost (us) per (tree, tensors) over the record's rounds."""
    costs: dict[tuple[str, int], list[float]] = {}
    for line in SCHEDULER_RECORD.read_text().splitlines():
        match = ROUND_ROW.match(line)
        if match:
            costs.setdefault((match[1], int(match[2])), []).append(float(match[3]))
    return costs


def test_strategies_page_quotes_the_scheduler_record():
    costs = _scheduler_costs()
    assert sorted(costs) == [("after", 28), ("after", 148), ("before", 28), ("before", 148)]
    span = {key: f"{min(v):.1f}-{max(v):.1f}" for key, v in costs.items()}
    text = _flat(ROOT / "docs" / "strategies.md")
    assert "from 87 to 20 us" not in text
    assert (f"went from {span['before', 28]} to {span['after', 28]} us at 28 tensors and from "
            f"{span['before', 148]} to {span['after', 148]} us at 148") in text


def test_readme_and_gpu_page_give_the_recorded_host_time():
    """Both pages give the latest committed record's host time (with its date) first; the
    later, unrecorded measurements only as such."""
    rows = json.loads(GPU_MODEL_RECORD.read_text())
    host_ms = {round(row["host_seconds"] * 1e3, 2) for row in rows  # rows without a host: 0
               if row["configuration"] == "default" and row.get("host_seconds")}
    assert len(host_ms) == 1
    (figure,) = host_ms
    quoted = f"{figure:.2f} ms"
    readme, gpu = _flat(ROOT / "README.md"), _flat(ROOT / "docs" / "gpu.md")
    assert (f"{quoted} for GPT-2 small's 148 tensors in the latest committed record "
            "(2026-12-05") in readme
    assert f"{quoted} in the latest committed record (2026-12-05" in gpu
    for text in (readme, gpu):
        assert "intel-xeon-2c_2026-12-05_gpu-model.md" in text
        assert "not kept as records" in text
        assert "test_this_torch_cpu_sqrt_is_not_correctly_rounded" not in text  # deleted
