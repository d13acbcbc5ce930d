"""Smoke tests of `collage bench optimizer` and `collage bench train` (seconds each)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from collage.bench import candidates, common, measure, optimizer, train
from collage.cli import main
from collage.optim import compiled

needs_compiler = pytest.mark.skipif(not compiled.available(), reason="no C++ compiler")


@needs_compiler
def test_bench_optimizer_small_json(capsys):
    code = main(["bench", "optimizer", "--size", "small", "--repeats", "1", "--json",
                 "--strategies", "plus", "--paths", "fused,foreach",
                 "--baselines", "torch-foreach-bf16", "--warmup", "1", "--min-time", "0"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    (block,) = result["sizes"]
    assert block["size"] == "small" and block["n_params"] == common.n_params("small")
    keys = [r["key"] for r in block["rows"]]
    assert keys[0] == "torch-fused-fp32"
    for key in ("collage:plus:fused", "collage:plus:foreach",
                "collage:plus:fused+ignore", "torch-foreach-bf16"):
        assert key in keys
    for row in block["rows"]:
        assert row["time_s"]["median"] > 0 and row["time_s"]["p90"] >= row["time_s"]["min"]
        assert row["GBps"] > 0 and row["roofline_fraction"] > 0
    rows = {r["key"]: r for r in block["rows"]}
    # the bytes a step moves: its components, and the default check's read of each bf16
    # gradient (2 bytes) where the row checks; torch's and the no-check rows read none
    plus, bf16 = common.BYTES["plus"].total, common.BYTES["torch-foreach-bf16"].total
    expected = {"torch-fused-fp32": 28, "collage:plus:fused": plus + 2,
                "collage:plus:foreach": plus + 2, "collage:plus:fused+ignore": plus,
                "torch-foreach-bf16": bf16}
    for key, nbytes in expected.items():
        row = rows[key]
        assert row["bytes_per_param"] == nbytes, key
        assert row.get("check_bytes_per_param", 0) == nbytes - common.BYTES[
            key.split(":")[1] if ":" in key else key].total, key
        # the roofline is those bytes at the measured bandwidth
        roofline = nbytes * block["n_params"] / (row["bandwidth_GBps"] * 1e9)
        assert row["roofline_s"] == pytest.approx(roofline, rel=1e-12), key
    # the headline rows are the default configuration; the no-check row says it is not
    assert rows["collage:plus:fused"]["nonfinite"] == "skip"
    assert rows["collage:plus:foreach"]["nonfinite"] == "skip"
    assert rows["collage:plus:fused+ignore"]["nonfinite"] == "ignore"
    assert "nonfinite='ignore'" in rows["collage:plus:fused+ignore"]["label"]
    assert "collage:plus:foreach+ignore" not in rows  # other paths: the default only
    # every collage row says the path that ran (optimizer.last_paths): the one asked for
    assert rows["collage:plus:foreach"]["backend"] == "foreach"
    fused = rows["collage:plus:fused"]
    assert fused["backend"] in ("native", "compiled")
    assert fused["label"] == f"collage plus (fused, {fused['backend']})"
    assert rows["torch-foreach-bf16"].get("backend") is None
    assert result["environment"]["torch"] and "checks" not in result


def test_bench_optimizer_slow_paths(capsys):
    """``reference`` rows run ``reference=True`` (fp32 too: the research form in float32),
    ``per_tensor`` rows ``foreach=False``: each row's path is the one it names."""
    code = main(["bench", "optimizer", "--size", "small", "--repeats", "1", "--json",
                 "--strategies", "fp32,stochastic", "--paths", "per_tensor,reference",
                 "--baselines", "", "--warmup", "1", "--slow-repeats", "1",
                 "--min-time", "0"])
    assert code == 0
    (block,) = json.loads(capsys.readouterr().out)["sizes"]
    paths = {r["key"]: r["backend"] for r in block["rows"] if r["key"].startswith("collage")}
    assert paths == {"collage:fp32:per_tensor": "per_tensor",
                     "collage:fp32:reference": "reference",
                     "collage:stochastic:per_tensor": "per_tensor",
                     "collage:stochastic:reference": "reference"}


def test_bench_optimizer_rejects_unknown_strategy(capsys):
    assert main(["bench", "optimizer", "--strategies", "fp64"]) == 2
    assert "--strategies" in capsys.readouterr().err


def test_byte_counts():
    b = common.BYTES
    assert b["torch-fused-fp32"].total == 28
    assert (b["light"].total, b["plus"].total, b["bf16"].total) == (18, 22, 14)
    assert (b["fp32"].total, b["mixed"].total, b["kahan"].total, b["split"].total) == (
        28, 28, 18, 22)
    assert (b["mixed"].read, b["mixed"].write) == (14, 14)  # its bf16 copy: written only
    assert b["plus8"].total == 2 * (2 + 2 + 1 + 1 + 1 + 8 / 128) + 2  # + the bf16 gradient
    # the ideal speed-ups over torch's fused fp32 AdamW
    assert round(28 / b["light"].total, 2) == 1.56 and round(28 / b["plus"].total, 2) == 1.27


def test_gpt_shapes_cover_sizes():
    assert 1.0e6 < common.n_params("1m") < 1.2e6
    assert 16e6 < common.n_params("16m") < 18e6
    assert common.n_params("100m") > 100e6


@needs_compiler
def test_bench_train_smoke(capsys):
    code = main(["bench", "train", "--preset", "micro", "--modes", "autocast,plus",
                 "--steps", "3", "--warmup", "0", "--json", "--threads", "1", "--rounds", "2"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    modes = [r["mode"] for r in result["rows"]]
    assert modes == ["autocast", "plus"]
    for row in result["rows"]:  # two speed rounds of three steps each
        assert len(row["tokens_per_s_rounds"]) == 2 and row["step_s"]["n"] == 6
        assert row["tokens_per_s"] == pytest.approx(
            row["tokens_per_step"] / row["step_s"]["median"])
    assert result["rows"][0]["tokens_per_s_vs_autocast_rounds"] == [1.0, 1.0]
    for row in result["rows"]:
        assert row["tokens_per_s"] > 0 and row["persistent_bytes"] > 0
        assert row["peak_bytes"] >= row["persistent_bytes"]  # measured by the allocator
    autocast, plus = result["rows"]
    # counted after zero_grad(set_to_none=True), so without gradients: fp32 weights and two
    # fp32 moments (12 B per parameter) against plus's bf16 weight, lo, m, v, v lo (10 B)
    assert plus["persistent_bytes"] == pytest.approx(10 / 12 * autocast["persistent_bytes"],
                                                     rel=0.001)
    assert {c["check"] for c in result["checks"]} == {
        "plus tokens/s >= autocast tokens/s", "plus peak memory <= 0.85 x autocast"}


@needs_compiler
def test_bench_train_checkpoint_activations_lowers_the_peak():
    """The flag reaches the worker processes' model: the same mode's peak is lower."""

    peaks = {}
    for flag in (None, True):
        result = train.run(modes=("plus",), preset="micro",
                           model={"n_layers": 3, "checkpoint_activations": flag},
                           steps=1, warmup=0, rounds=1, threads=1)
        assert bool(result["settings"]["model"]["checkpoint_activations"]) == bool(flag)
        peaks[flag] = result["rows"][0]["peak_bytes"]
    assert peaks[True] < 0.9 * peaks[None]
    assert "activation checkpointing" in train.table(result)
    # no autocast row: its ratio columns are "-", not nan (audit, 2026-12-07)
    row = next(line for line in train.table(result).splitlines() if line.startswith("| plus |"))
    assert "nan" not in row and row.count("| - |") == 2


def test_speed_worker_interleaves_the_modes(monkeypatch):
    """Step k of every mode, the order rotated by k: no mode is always first."""

    order = []

    class Recorder:
        def __init__(self, mode, *args, **kwargs):
            self.mode = mode

        def step(self):
            order.append(self.mode)
            return 1.0

    monkeypatch.setattr(train, "_Trainer", Recorder)
    monkeypatch.setattr(train, "_compile_kernels", lambda mode, cfg, device: None)
    done = train.speed_worker({"modes": ["a", "b", "c"], "preset": "micro", "model": {},
                               "batch": 2, "steps": 3, "warmup": 1, "threads": None})
    assert order == ["a", "b", "c"] + ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert done == {"times": {m: [1.0, 1.0, 1.0] for m in "abc"}}


@pytest.mark.parametrize(("device", "at_once"), [("cpu", 2), ("cuda", 1)])
def test_memory_workers_run_two_at_a_time_on_the_cpu(monkeypatch, device, at_once):
    """Each memory worker reads its own process's allocator, so on the CPU two run at
    once; on a GPU, whose memory they would share, one at a time. The rows keep the modes'
    order whichever finishes first."""

    lock, running, most = threading.Lock(), [0], [0]

    def fake_process(function, spec):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.2 if spec["mode"] == "a" else 0.05)  # "a" finishes last
        with lock:
            running[0] -= 1
        return {"mode": spec["mode"], "peak_bytes": 1, "persistent_bytes": 1}

    monkeypatch.setattr(train, "_run_process", fake_process)
    rows = train._memory_rows(["a", "b", "c"], {}, device, quiet=True)
    assert [row["mode"] for row in rows] == ["a", "b", "c"]
    assert most[0] == at_once


def _late_params():
    params = [torch.nn.Parameter(torch.randn(40).bfloat16()) for _ in range(2)]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


@pytest.mark.parametrize("maker", ["torch", "collage", "optimi"])
def test_start_step_sets_every_step_counter(maker):
    """--start-step: the next step of every optimizer kind is step N + 1."""
    if maker == "optimi":
        pytest.importorskip("optimi")
    make = {"torch": candidates.torch_adamw(False),
            "collage": candidates._collage("plus", "foreach"),
            "optimi": candidates._optimi_kahan}[maker]
    params = _late_params()
    step = make(params)
    step()
    assert measure._set_step_counter(step, 20_000)
    step()
    opt = measure.optimizer_of(step)
    counters = [s["step"] for s in opt.state.values() if "step" in s] + \
        [g["step"] for g in opt.param_groups if "step" in g]
    assert counters and all(int(c) == 20_001 for c in counters)


def test_start_step_without_an_optimizer_is_reported():
    assert measure._set_step_counter(lambda: None, 5) is False


def test_bench_optimizer_start_step_json(capsys):
    code = main(["bench", "optimizer", "--size", "small", "--repeats", "1", "--json",
                 "--strategies", "light", "--paths", "fused", "--baselines", "",
                 "--warmup", "1", "--min-time", "0", "--start-step", "20000"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["settings"]["start_step"] == 20000
    rows = [r for r in result["sizes"][0]["rows"] if r["key"].startswith("collage")]
    assert rows and all(r["start_step"] == 20000 for r in rows)


@needs_compiler
def test_bench_train_in_backward_mode_lowers_the_peak():
    """``plus+backward`` trains plus with the step in backward: its gradients are freed in
    backward, so its step's peak is below plain plus's. On a model whose weights dominate
    (d 128, one sequence of 8 tokens) the memory model says 10/12 = 0.83 (measured 0.80 by
    benchmarks/studies/memory_in_backward.py); below 0.9 leaves room for the activations."""

    result = train.run(modes=("plus", "plus+backward"), preset="micro",
                       model={"d_model": 128, "n_layers": 2, "n_heads": 4, "context": 8},
                       batch=1, steps=1, warmup=1, rounds=1, threads=1)
    plus, in_backward = result["rows"]
    assert in_backward["mode"] == "plus+backward"
    assert in_backward["peak_bytes"] < 0.9 * plus["peak_bytes"]


def test_bench_train_rejects_an_unknown_in_backward_mode(capsys):
    assert main(["bench", "train", "--modes", "plus+backwards"]) == 2
    err = capsys.readouterr().err
    assert "unknown mode 'plus+backwards'" in err and "any strategy with +backward" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["optimizer", "--device", "bogus"], "--device: unknown device 'bogus'"),
    (["train", "--device", "bogus"], "--device: unknown device 'bogus'"),
    (["optimizer", "--device", "meta"], "--device: the benches run on cpu or cuda"),
    (["train", "--threads", "0"], "--threads must be at least 1"),
    (["optimizer", "--markdown", "/no/such/folder/x.md"], "--markdown: cannot write"),
    (["train", "--markdown", "/no/such/folder/x.md"], "--markdown: cannot write"),
])
def test_bench_flags_are_refused_before_anything_runs(argv, message, capsys, monkeypatch):
    """A bad --device, --threads or --markdown: one line naming the flag, before the bench
    runs (a --markdown that cannot be written used to fail after minutes of measuring,
    the results lost)."""
    monkeypatch.setattr(train, "run", lambda **kwargs: pytest.fail("the bench ran"))
    monkeypatch.setattr(optimizer, "run", lambda **kwargs: pytest.fail("the bench ran"))
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_min_time_out_of_range_is_refused(capsys):
    assert main(["bench", "optimizer", "--size", "small", "--min-time", "-3"]) == 2
    assert "--min-time must be between 0 and 200 seconds, got -3" in capsys.readouterr().err
