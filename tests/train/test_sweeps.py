"""collage compare over seeds and learning rates: the runs planned, the records (known
answers: each equals the run trained alone, the statistics those of collage.train.stats),
the report's sections, and resumption from --out."""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil

import pytest

from collage.cli import main
from collage.errors import UsageError
from collage.train import compare as compare_module
from collage.train import config as config_module
from collage.train import runs
from collage.train.aggregate import pareto_front, records
from collage.train.compare import compare
from collage.train.plots import _aligned
from collage.train.runner import train_strategy
from collage.train.runs import RESULT_NAME, Run, plan_runs, run_config, run_dir, training_lock
from collage.train.stats import estimate, paired_t_test

from .conftest import micro_config


def _load(out, name="results.json"):
    with open(os.path.join(out, name)) as handle:
        return json.load(handle)


def test_plan_covers_every_setting_once_in_order():
    config = micro_config(run={"strategies": ("fp32", "stochastic"), "beta2s": (0.95, 0.999),
                               "seeds": 2, "seed": 5, "lrs": (1e-3, 3e-3),
                               "lrs_strategies": ("stochastic",)},
                          optim={"lr": 2e-3})
    runs = plan_runs(config)
    coords = [(r.beta2, r.lr, r.strategy, r.seed) for r in runs]
    assert len(coords) == len(set(coords)) == 2 * (1 + 2) * 2
    assert coords[:6] == [(0.95, 1e-3, "stochastic", 5), (0.95, 1e-3, "stochastic", 6),
                          (0.95, 2e-3, "fp32", 5), (0.95, 2e-3, "fp32", 6),
                          (0.95, 3e-3, "stochastic", 5), (0.95, 3e-3, "stochastic", 6)]
    assert runs[0].cell == "stochastic b2=0.95 lr=0.001"
    assert runs[0].label == "stochastic b2=0.95 lr=0.001 seed=5"
    assert runs[0].key == "stochastic_b2-0.95_lr-0.001_seed-5"
    rc = run_config(config, runs[0])
    assert (rc.run.seed, rc.optim.lr, rc.optim.beta2) == (5, 1e-3, 0.95)
    # without seeds and learning rates: today's runs and labels
    plain = plan_runs(micro_config(run={"strategies": ("fp32", "bf16")}))
    assert [(r.label, r.seed, r.lr) for r in plain] == [("fp32", 0, 2e-3), ("bf16", 0, 2e-3)]


def test_sweep_flags_are_checked():
    with pytest.raises(UsageError, match="--lrs: every learning rate must be positive"):
        micro_config(run={"lrs": (1e-3, -1.0)})
    with pytest.raises(UsageError, match="--lrs-strategies: names the strategies of --lrs"):
        micro_config(run={"lrs_strategies": ("plus",)})
    with pytest.raises(UsageError, match="--lrs-strategies: unknown strategy 'fp16'"):
        micro_config(run={"lrs": (1e-3,), "lrs_strategies": ("fp16",)})
    with pytest.raises(UsageError, match="--seeds: must be positive"):
        micro_config(run={"seeds": 0})


def test_lrs_records_are_the_runs_at_each_rate(tmp_path):
    """Known answer: the record at each learning rate is the run trained alone at it."""
    config = micro_config(run={"strategies": ("fp32", "bf16"), "lrs": (1e-3, 8e-3),
                               "isolate": False, "steps": 4})
    compare(config, str(tmp_path), log=None)
    got = _load(tmp_path)
    assert [(r["strategy"], r["lr"]) for r in got] == [
        ("fp32", 1e-3), ("bf16", 1e-3), ("fp32", 8e-3), ("bf16", 8e-3)]
    for r in got:
        alone = train_strategy(config.replace(optim={"lr": r["lr"]}), r["strategy"])["summary"]
        assert r["final_val_loss"] == alone["final_val_loss"]
        fp32 = next(x for x in got if x["strategy"] == "fp32" and x["lr"] == r["lr"])
        assert r["val_loss_vs_fp32"] == pytest.approx(
            r["final_val_loss"] / fp32["final_val_loss"] - 1)
    for strategy in ("fp32", "bf16"):
        mine = [r for r in got if r["strategy"] == strategy]
        best = min(mine, key=lambda r: r["final_val_loss"])
        assert [r["best_lr"] for r in mine] == [r is best for r in mine]
    report = (tmp_path / "report.md").read_text()
    assert "## Best learning rate" in report and "(1 seed: no interval)" in report
    assert "| strategy | β2 | lr |" in report


def test_seeds_records_pool_the_runs_with_paired_tests(tmp_path):
    """Known answer: per-seed values are the runs trained alone with each seed; mean, std,
    interval and the paired tests are collage.train.stats' of those values."""
    strategies = ("fp32", "mixed", "bf16")
    config = micro_config(run={"strategies": strategies, "seeds": 3, "isolate": False,
                               "steps": 3, "eval_every": 3})
    summaries = compare(config, str(tmp_path), log=None)
    assert len(summaries) == 9
    got = {r["strategy"]: r for r in _load(tmp_path)}
    alone = {(s, seed): train_strategy(config.replace(run={"seed": seed}), s)["summary"]
             for s in strategies for seed in range(3)}
    for s, r in got.items():
        losses = [alone[(s, seed)]["final_val_loss"] for seed in range(3)]
        assert r["seeds"] == [0, 1, 2] and [p["final_val_loss"] for p in r["per_seed"]] == losses
        e = estimate(losses)
        assert (r["final_val_loss_mean"], r["final_val_loss_std"], r["final_val_loss_ci95"]) \
            == (e.mean, e.std, e.ci)
        assert r["final_val_loss"] == pytest.approx(e.mean)
        assert len({p["init_checksum"] for p in r["per_seed"]}) == 3  # one init per seed
    fp32 = [alone[("fp32", seed)]["final_val_loss"] for seed in range(3)]
    bf16 = [alone[("bf16", seed)]["final_val_loss"] for seed in range(3)]
    test = got["bf16"]["paired_vs_fp32"]
    assert test["p"] == paired_t_test(bf16, fp32).p and test["seeds"] == [0, 1, 2]
    assert got["fp32"]["paired_vs_fp32"] is None and got["fp32"]["paired_vs_mixed"]
    report = (tmp_path / "report.md").read_text()
    for needle in ("## Results over seeds", "significant?", "## Final validation loss per seed",
                   "## Memory against loss (Pareto front)", "seed 0 `", "seeds 0-2"):
        assert needle in report, needle
    for name in ("loss.png", "edq.png", "memory.png", "pareto.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert set(_load(tmp_path, "history.json")) == {
        f"{s} seed={seed}" for s in strategies for seed in range(3)}


def test_one_seed_keeps_the_records_as_they_were(tmp_path):
    config = micro_config(run={"strategies": ("fp32", "bf16"), "isolate": False})
    compare(config, str(tmp_path), log=None)
    got = _load(tmp_path)
    assert not [k for r in got for k in r if k.startswith(("per_seed", "final_val_loss_",
                                                           "paired", "best_lr", "seeds"))]
    assert [(r["seed"], r["lr"]) for r in got] == [(0, 2e-3), (0, 2e-3)]
    assert not (tmp_path / "pareto.png").exists() and not (tmp_path / "runs").exists()
    assert "over seeds" not in (tmp_path / "report.md").read_text()


def _record(strategy, beta2, lr, loss, bytes_per_param=8):
    return {"strategy": strategy, "beta2": beta2, "lr": lr, "final_val_loss": loss,
            "bytes_per_param_model": bytes_per_param}


def test_a_run_reused_in_a_comparison_extended_with_seeds_takes_the_plans_label():
    """Seed 0 finished as a one-seed comparison (labelled "bf16"), then ``--seeds 2``:
    its per-seed entry is labelled as the plan names it now, "bf16 seed=0"."""
    summary = {**_record("bf16", 0.9, 1e-3, 2.0), "family": {}, "completed": True,
               "final_train_loss": 2.1, "final_val_ppl": 7.4, "best_val_loss": 2.0}
    done = [(Run("bf16", 0.9, 1e-3, seed, "bf16", f"bf16 seed={seed}"),
             {"summary": dict(summary, label=label)})
            for seed, label in ((0, "bf16"), (1, "bf16 seed=1"))]
    (record,) = records(done, 2)
    assert [p["label"] for p in record["per_seed"]] == ["bf16 seed=0", "bf16 seed=1"]


def test_pareto_front_keeps_the_undominated():
    rs = [_record("a", 0.9, 1, 2.0, 8), _record("b", 0.9, 1, 1.9, 10),
          _record("c", 0.9, 1, 1.95, 12), _record("d", 0.9, 1, 1.8, 16),
          _record("e", 0.9, 1, 2.1, 8), _record("f", 0.9, 1, 1.8, 16)]
    assert [r["strategy"] for r in pareto_front(rs)] == ["a", "b", "d"]


def test_a_strategy_not_swept_is_compared_at_its_only_rate():
    """fp32 ran at one rate only: the swept strategy's records refer to that run."""
    run = Run("stochastic", 0.9, 1e-3, 0, "c", "c")
    done = [(Run(s, 0.9, lr, 0, f"{s}{lr}", f"{s}{lr}"), {"summary": dict(
        _record(s, 0.9, lr, loss), label=f"{s}{lr}")}) for s, lr, loss in
        (("fp32", 2e-3, 2.0), ("stochastic", 1e-3, 2.2), ("stochastic", 3e-3, 1.9))]
    got = records(done, 1)
    assert run.key == "stochastic_b2-0.9_lr-0.001_seed-0"
    assert [round(r["val_loss_vs_fp32"], 6) for r in got] == [0.0, 0.1, -0.05]
    assert [r["best_lr"] for r in got] == [True, False, True]


def test_resume_continues_and_skips_finished_runs(tmp_path, monkeypatch):
    """Interrupted mid-run, the same command continues it from its checkpoint and trains
    nothing that finished; the results are bit for bit those of an uninterrupted run."""
    config = micro_config(run={"strategies": ("fp32", "plus"), "seeds": 2, "isolate": False,
                               "resume": True, "checkpoint_every": 2, "steps": 6})
    full = tmp_path / "full"
    compare(config, str(full), log=None)
    out = tmp_path / "out"
    runs = plan_runs(config)
    # a stopped run (checkpoint at step 3) and a finished one, as an interruption leaves them
    stopped, finished = runs[1], runs[2]
    train_strategy(run_config(config, stopped), stopped.strategy, label=stopped.label,
                   out_dir=run_dir(str(out), stopped), checkpoint_every=2, stop_after=3)
    os.makedirs(run_dir(str(out), finished))
    with open(os.path.join(run_dir(str(full), finished), RESULT_NAME)) as src, \
            open(os.path.join(run_dir(str(out), finished), RESULT_NAME), "w") as dst:
        dst.write(src.read())
    trained = []
    real = compare_module.train_strategy

    def counting(config, strategy, **kwargs):
        trained.append((strategy, config.run.seed))
        return real(config, strategy, **kwargs)

    monkeypatch.setattr(compare_module, "train_strategy", counting)
    compare(config, str(out), log=None)
    assert sorted(trained) == sorted((r.strategy, r.seed) for r in runs if r != finished)
    resumed = _load(run_dir(str(out), stopped), RESULT_NAME)["summary"]
    # its memory was probed at the first step of the resumed call (4), not at step 2
    assert resumed["completed"] and resumed["peak_memory_measured"].endswith("step 4")
    exact = ("final_val_loss", "final_train_loss", "edq_mean", "init_checksum")
    for a, b in zip(_load(full), _load(out)):
        assert [[p[k] for k in exact] for p in a["per_seed"]] == \
            [[p[k] for k in exact] for p in b["per_seed"]]
        assert a["final_val_loss_ci95"] == b["final_val_loss_ci95"]
    assert not [p for p in out.rglob("checkpoint.pt")], "finished runs drop their checkpoints"
    trained.clear()
    compare(config, str(out), log=None)  # everything finished: the outputs again, no training
    assert trained == []
    with pytest.raises(UsageError, match="was made with other settings: --weight-decay"):
        compare(config.replace(optim={"weight_decay": 0.5}), str(out), log=None)
    # another validation set: the reused runs' losses would not compare with new ones
    with pytest.raises(UsageError, match="was made with other settings: --eval-batches"):
        compare(config.replace(run={"eval_batches": config.run.eval_batches + 1}), str(out),
                log=None)


def test_a_resumed_comparison_keeps_each_runs_threads(tmp_path, monkeypatch):
    """The torch threads of a run follow the comparison (3 runs on 2 cores: 1 each), not
    the runs still to train: a resumed run alone keeps its 1 thread, so that it continues
    bit for bit (with 2 it computed other sums)."""
    monkeypatch.setattr(config_module, "_usable_cores", lambda: 2)
    config = micro_config(run={"strategies": ("fp32", "bf16", "plus"), "resume": True})
    seen = []

    class Launched(Exception):
        pass

    def capture(config, runs, tasks, *args):
        seen.append(sorted(task.threads for task in tasks.values()))
        raise Launched

    monkeypatch.setattr(compare_module, "_run_isolated", capture)
    for finished in ([None, None, None], [{}, {}, None]):
        monkeypatch.setattr(compare_module, "_finished", lambda *a, f=finished: list(f))
        with pytest.raises(Launched):
            compare(config, str(tmp_path), log=None)
    assert seen == [[1, 1, 1], [1]]


def test_report_only_trains_nothing(tmp_path, capsys):
    out = str(tmp_path / "run")
    argv = ["compare", "--preset", "micro", "--strategies", "fp32", "bf16", "--seeds", "2",
            "--steps", "3", "--no-isolate", "--quiet", "--out", out]
    with pytest.raises(UsageError, match="no finished run"):
        compare_module.compare(micro_config(run={"report_only": True, "seeds": 2}), out,
                               log=None)
    assert not os.path.exists(out)  # refused before --out was made (it was left empty)
    assert main(argv + ["--resume"]) == 0
    first = _load(out)
    os.remove(os.path.join(out, "results.json"))
    assert main(argv + ["--report-only"]) == 0
    again = _load(out)
    assert [r["final_val_loss_ci95"] for r in again] == [r["final_val_loss_ci95"] for r in first]
    assert all(math.isfinite(r["final_val_loss"]) for r in again)


def test_a_partial_report_counts_the_finished_runs(tmp_path):
    """--report-only over runs of which only some finished says how many, not all."""
    out = str(tmp_path / "run")
    trained = micro_config(run={"strategies": ("fp32",), "seeds": 2, "steps": 3,
                                "isolate": False, "resume": True})
    compare_module.compare(trained, out, log=None)
    said: list[str] = []
    report = micro_config(run={"strategies": ("fp32", "bf16"), "seeds": 2, "steps": 3,
                               "isolate": False, "report_only": True})
    compare_module.compare(report, out, log=said.append)
    assert f"2 of 4 runs already finished in {out}" in said
    assert [r["strategy"] for r in _load(out)] == ["fp32"]


def test_fresh_processes_over_seeds_with_resume(tmp_path):
    """Spawned children get their seed's initial weights and record their results."""
    config = micro_config(run={"strategies": ("bf16",), "seeds": 2, "jobs": 2, "steps": 3,
                               "eval_every": 3, "resume": True})
    compare(config, str(tmp_path), log=None)
    (record,) = _load(tmp_path)
    assert record["isolated"] and len({p["init_checksum"] for p in record["per_seed"]}) == 2
    assert sorted(os.listdir(tmp_path / "runs")) == [
        "bf16_b2-0.999_lr-0.002_seed-0", "bf16_b2-0.999_lr-0.002_seed-1"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".init-")]


def test_a_run_trained_elsewhere_is_not_trained_twice(tmp_path):
    config = micro_config(run={"strategies": ("bf16",), "isolate": False, "resume": True})
    (run,) = plan_runs(config)
    with training_lock(run_dir(str(tmp_path), run)):  # another process holds the run
        with pytest.raises(UsageError, match="is being trained by another process"):
            compare(config, str(tmp_path), log=None)
    compare(config, str(tmp_path), log=None)  # released: it trains


def test_a_finished_run_leaves_no_lock_file(tmp_path):
    config = micro_config(run={"strategies": ("bf16",), "isolate": False, "resume": True})
    (run,) = plan_runs(config)
    directory = run_dir(str(tmp_path), run)
    compare(config, str(tmp_path), log=None)
    assert sorted(os.listdir(directory)) == [RESULT_NAME]


def test_the_lock_of_a_killed_run_is_taken_and_removed(tmp_path):
    directory = tmp_path / "run"
    directory.mkdir()
    (directory / ".lock").write_text("")  # left by a run killed while it trained
    with training_lock(str(directory)):
        with pytest.raises(UsageError, match="is being trained by another process"):
            with training_lock(str(directory)):
                pass
    assert not (directory / ".lock").exists()


def test_a_run_directory_removed_while_it_trains_does_not_fail_the_release(tmp_path):
    directory = tmp_path / "run"
    with training_lock(str(directory)):
        shutil.rmtree(directory)  # the run's directory deleted by hand meanwhile
    assert not directory.exists()


def test_a_lock_file_removed_before_it_is_locked_is_not_held(tmp_path, monkeypatch):
    """The holder may finish, and remove the file, between another process's open and its
    lock: that lock is on a file no longer at the path, so the process locks the new one
    (else a third process could lock the path's new file beside it)."""
    directory = tmp_path / "run"
    directory.mkdir()
    path = directory / ".lock"
    operations = []
    flock = fcntl.flock

    def flock_after_the_holder_let_go(handle, operation):
        if not operations:
            os.unlink(path)
        operations.append(operation)
        flock(handle, operation)

    monkeypatch.setattr(runs.fcntl, "flock", flock_after_the_holder_let_go)
    with training_lock(str(directory)):
        assert len(operations) == 2 and path.exists()
        with pytest.raises(UsageError, match="is being trained by another process"):
            with training_lock(str(directory)):
                pass
    assert not path.exists()


def test_partial_results_pair_only_shared_seeds():
    """A --report-only of an unfinished comparison: tests use the seeds both settings have;
    none in common, no test; a diverged setting is never the best."""
    def done(strategy, lr, seed, loss):
        run = Run(strategy, 0.9, lr, seed, f"{strategy} lr={lr}", f"{strategy} {lr} {seed}")
        summary = dict(_record(strategy, 0.9, lr, loss), label=run.label,
                       final_train_loss=loss, final_val_ppl=math.exp(loss), best_val_loss=loss)
        return run, {"summary": summary}

    got = records([done("fp32", 1, 0, 2.0), done("fp32", 1, 1, 2.1),
                   done("bf16", 1, 1, 2.3), done("bf16", 1, 2, 2.2),
                   done("mixed", 1, 2, 2.0), done("bf16", 2, 0, math.nan),
                   done("bf16", 2, 1, math.nan)], 3)
    bf16 = next(r for r in got if r["strategy"] == "bf16" and r["lr"] == 1)
    assert bf16["paired_vs_fp32"]["seeds"] == [1] and bf16["paired_vs_fp32"]["p"] is None
    fp32 = next(r for r in got if r["strategy"] == "fp32")
    assert fp32["paired_vs_mixed"] is None  # no seed in common
    assert bf16["best_lr"] and bf16["final_val_loss_ci95"] is not None


def test_an_interrupted_comparison_lets_its_children_save_before_stopping_them():
    """On Ctrl-C (which reaches the children too) the parent waits, up to the grace
    period, for each child to save its last completed step and exit; only the children
    still running then are terminated (before, every child was terminated at once, and
    one finishing its step or writing its checkpoint left none)."""
    class Child:
        def __init__(self, exits_after_s: float | None) -> None:
            self.exits_after_s, self.waited, self.terminated = exits_after_s, 0.0, False

        def join(self, timeout: float | None = None) -> None:
            if self.exits_after_s and (timeout is None or timeout >= self.exits_after_s):
                self.waited = self.exits_after_s
                self.exits_after_s = 0.0

        def is_alive(self) -> bool:
            return self.exits_after_s != 0.0 and not self.terminated

        def terminate(self) -> None:
            self.terminated = True

    saving, stuck = Child(exits_after_s=0.2), Child(exits_after_s=None)
    compare_module._stop_children({0: saving, 1: stuck}, grace_s=0.5)
    assert not saving.terminated and saving.waited == 0.2 and stuck.terminated
    late = Child(exits_after_s=0.2)  # no grace (the loop's normal end): stopped at once
    compare_module._stop_children({0: late}, grace_s=0.0)
    assert late.terminated


def test_seeds_resumed_with_another_eval_every_are_plotted_at_their_common_steps(tmp_path):
    """Seed 0 validated every 2 steps, seed 1 (added with --resume) every 3: the plots
    average the seeds only at the steps both have (an audit found a traceback from
    matplotlib here, report.md left stale, 2026-12-07; in the other order the seeds' losses
    at different steps were averaged)."""
    first = micro_config(run={"strategies": ("fp32",), "steps": 6, "eval_every": 2,
                              "isolate": False, "resume": True})
    compare(first, str(tmp_path), log=None)
    second = micro_config(run={"strategies": ("fp32",), "steps": 6, "eval_every": 3,
                               "seeds": 2, "isolate": False, "resume": True})
    compare(second, str(tmp_path), log=None)
    assert (tmp_path / "loss.png").exists() and "2 seeds" in (tmp_path / "report.md").read_text()


def test_aligned_keeps_the_steps_every_history_has():
    histories = [{"val_step": [2, 4, 6]}, {"val_step": [3, 6]}]
    assert _aligned(histories, "val_step", [[1.0, 2.0, 3.0], [10.0, 30.0]]) == (
        [6], [[3.0], [30.0]])
