"""``collage compare``: the same model, data and seeds under several precision strategies.

The float32 initial weights are built once from the seed and converted per strategy; every
strategy reads the same batches in the same order. By default each strategy runs in a fresh
``spawn``-ed process, so that the process's peak resident memory (``ru_maxrss``) belongs to
that strategy alone. Output (``--out DIR``): ``results.json``, ``results.csv``,
``history.json``, ``config.json``, ``report.md`` and PNG plots.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from queue import Empty
from typing import Any

import torch

from ..errors import UsageError
from .build import initial_weights, resolve_device, state_checksum
from .config import Config
from .gemm import Bf16Gemm, choose
from .outputs import write_outputs
from .report import fmt
from .runner import train_strategy
from .runs import (
    Run,
    load_result,
    plan_runs,
    run_config,
    run_dir,
    save_result,
    training_lock,
)

__all__ = ["compare"]


@dataclass(frozen=True)
class _Task:
    """What a process needs to train one run (plain data: it crosses to spawned children).
    ``directory``: the run's own directory under ``--out/runs`` (with ``--resume``), where
    it checkpoints and records its result; None: nothing is kept."""

    config: dict[str, Any]  # the run's configuration (its seed, lr and beta2 set)
    strategy: str
    beta2: float
    label: str
    threads: int | None
    jobs: int  # runs trained at the same time (recorded in the summary)
    directory: str | None
    checkpoint_every: int
    gemm: Bf16Gemm | None  # --bf16-gemm, decided once for every run of the comparison


def _task(config: Config, run: Run, out_dir: str, threads: int | None, jobs: int,
          gemm: Bf16Gemm | None) -> _Task:
    keep = config.run.resume
    return _Task(config=run_config(config, run).to_dict(), strategy=run.strategy,
                 beta2=run.beta2, label=run.label, threads=threads, jobs=jobs,
                 directory=run_dir(out_dir, run) if keep else None,
                 checkpoint_every=config.run.checkpoint_every, gemm=gemm)


def _run_one(task: _Task, init: dict[str, torch.Tensor], isolated: bool,
             progress=None) -> dict[str, Any]:
    """Train one run (continuing its checkpoint, if it has a directory); the part of the
    result that crosses process boundaries, recorded in its directory when it has one."""
    config = Config.from_dict(task.config)
    t0 = time.perf_counter()
    kept = {} if task.directory is None else {
        "out_dir": task.directory, "checkpoint_every": task.checkpoint_every, "resume": True}
    with training_lock(task.directory) if task.directory else nullcontext():
        result = train_strategy(config, task.strategy, beta2=task.beta2, init=init,
                                label=task.label, progress=progress, threads=task.threads,
                                gemm=task.gemm, **kept)
        summary = result["summary"]
        summary["wall_time_s"] = time.perf_counter() - t0
        summary["isolated"] = isolated
        summary["jobs"] = task.jobs
        finished = {"summary": summary, "history": result["history"]}
        if task.directory is not None:
            save_result(task.directory, config, finished)
    return finished


def _child(index: int, queue, task: _Task, init_path: str) -> None:
    """Entry point of a spawned process: train, report progress and the result on ``queue``."""
    pending = [0, time.monotonic()]

    def progress(n: int) -> None:  # batch the messages: at most about 5 per second
        pending[0] += n
        if time.monotonic() - pending[1] > 0.2:
            queue.put(("progress", index, pending[0]))
            pending[0], pending[1] = 0, time.monotonic()

    try:
        init = torch.load(init_path, map_location="cpu", weights_only=True)
        result = _run_one(task, init, True, progress)
        if pending[0]:
            queue.put(("progress", index, pending[0]))
        queue.put(("done", index, result))
    except BaseException as error:  # report everything; the parent decides
        try:
            queue.put(("error", index, error))
        except Exception:  # an unpicklable exception: send its text
            queue.put(("error", index, RuntimeError(f"{type(error).__name__}: {error}")))


class _InitialWeights:
    """The float32 initial weights of each seed, built once (``initial_weights``), and
    their checksums; for spawned children, saved once per seed in a temporary directory."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._weights: dict[int, dict[str, torch.Tensor]] = {}
        self._paths: dict[int, str] = {}

    def weights(self, seed: int) -> dict[str, torch.Tensor]:
        if seed not in self._weights:
            self._weights[seed] = initial_weights(self.config.replace(run={"seed": seed}))
        return self._weights[seed]

    def checksum(self, seed: int) -> str:
        return state_checksum(self.weights(seed))

    def path(self, seed: int, directory: str) -> str:
        if seed not in self._paths:
            self._paths[seed] = os.path.join(directory, f"init-seed{seed}.pt")
            torch.save(self.weights(seed), self._paths[seed])
        return self._paths[seed]


def _bar(total: int, quiet: bool):
    if quiet or not sys.stderr.isatty() or not total:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="compare", unit="step", dynamic_ncols=True, file=sys.stderr)


def _finished(config: Config, runs: list[Run], out_dir: str) -> list[dict[str, Any] | None]:
    """The results already recorded in ``out_dir`` (``--resume``, ``--report-only``); None
    for the runs still to train."""
    if not (config.run.resume or config.run.report_only):
        return [None] * len(runs)
    return [load_result(run_dir(out_dir, run), run_config(config, run)) for run in runs]


def compare(config: Config, out_dir: str, *, log=print) -> list[dict[str, Any]]:
    """Train every run of ``config`` (strategy x beta2 x learning rate x seed), write the
    outputs, return the runs' summaries.

    With ``config.run.isolate`` each run is a fresh ``spawn``-ed process (``jobs`` of them at
    a time, ``threads`` torch threads each); otherwise all run here, one after the other.
    With ``config.run.resume`` runs finished in ``out_dir`` are not trained again and
    interrupted ones continue from their checkpoints; ``report_only`` trains nothing.
    """
    runs = plan_runs(config)
    results = _finished(config, runs, out_dir)
    if config.run.report_only and not any(results):  # refused before --out is made
        raise UsageError(f"--report-only: no finished run in {out_dir}/runs")
    os.makedirs(out_dir, exist_ok=True)
    inits = _InitialWeights(config)
    pending = [] if config.run.report_only else [i for i, r in enumerate(results) if r is None]
    n_jobs = config.run.resolved_jobs(len(pending) or 1)
    threads = config.run.threads_per_run(len(runs))  # (not len(pending): bit for bit)
    started = time.time()
    bar = _bar(len(pending) * config.run.steps, config.run.quiet)
    say = (lambda msg: (bar.write(msg) if bar is not None else log(msg))) if log else None
    finished = sum(result is not None for result in results)
    if say and finished:
        say(f"{finished} of {len(runs)} runs already finished in {out_dir}")
    # one decision for all runs (a probe per child could differ on a busy machine)
    gemm = choose(config.run.bf16_gemm, resolve_device(config.run.device)) if pending \
        else None
    if say and gemm is not None and not config.run.quiet:
        say(f"bf16 matrix multiplies: {gemm.describe()}")
    tasks = {i: _task(config, runs[i], out_dir, threads, n_jobs, gemm) for i in pending}
    try:
        if config.run.isolate:
            _run_isolated(config, runs, tasks, inits, out_dir, n_jobs, results, bar, say)
        else:
            update = bar.update if bar is not None else None
            for i, task in tasks.items():
                results[i] = _run_one(task, inits.weights(runs[i].seed), False, update)
                _log_result(say, results[i]["summary"], config.run.quiet)
    finally:
        if bar is not None:
            bar.close()
    done = [(run, r) for run, r in zip(runs, results) if r is not None]
    if not done:
        raise UsageError(f"--report-only: no finished run in {out_dir}/runs")
    for run, r in done:
        if r["summary"]["init_checksum"] != inits.checksum(run.seed):  # a broken invariant
            raise RuntimeError(f"{run.label} did not start from the shared initial weights")
    write_outputs(config, done, out_dir, wall_time_s=time.time() - started)
    return [r["summary"] for _, r in done]


def _run_isolated(config, runs, tasks, inits, out_dir, n_jobs, results, bar, say) -> None:
    """Train ``tasks`` in spawned processes, ``n_jobs`` at a time; fill ``results``."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix=".init-", dir=out_dir) as tmp:
        waiting = list(tasks)
        running: dict[int, Any] = {}
        try:
            while waiting or running:
                while waiting and len(running) < n_jobs:
                    i = waiting.pop(0)
                    proc = ctx.Process(target=_child, name=f"collage-{runs[i].label}",
                                       daemon=True, args=(i, queue, tasks[i],
                                                          inits.path(runs[i].seed, tmp)))
                    proc.start()
                    running[i] = proc
                    if bar is not None:
                        bar.set_postfix_str(", ".join(runs[j].label for j in sorted(running)))
                message = _next_message(queue, running, runs)
                if message is None:
                    continue
                kind, i, payload = message
                if kind == "progress":
                    if bar is not None:
                        bar.update(payload)
                    continue
                running.pop(i).join()
                if kind == "error":
                    raise payload
                results[i] = payload
                _log_result(say, payload["summary"], config.run.quiet)
        except KeyboardInterrupt:
            _stop_children(running, INTERRUPT_GRACE_S)
            raise
        finally:
            _stop_children(running, 0.0)


#: seconds the children of an interrupted comparison get to save their last completed step
#: (Ctrl-C reaches them too: one process group) before they are stopped
INTERRUPT_GRACE_S = 10.0


def _stop_children(running: dict[int, Any], grace_s: float) -> None:
    """Wait up to ``grace_s`` seconds in all for the running children to end on their own
    (an interrupted child saves its last completed step, then exits), then terminate those
    still alive. Terminated at once, a child saving or finishing a step left no checkpoint."""
    deadline = time.monotonic() + grace_s
    for proc in running.values():
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in running.values():
        if proc.is_alive():
            proc.terminate()
        proc.join()


def _next_message(queue, running: dict[int, Any], runs: list[Run]):
    """The next message of a child, or None after a second of silence; a RuntimeError when
    a child died without a word."""
    try:
        return queue.get(timeout=1.0)
    except Empty:
        for j, proc in list(running.items()):
            if not proc.is_alive() and queue.empty():
                proc.join(1.0)
                raise RuntimeError(
                    f"the process training {runs[j].label!r} died (exit code "
                    f"{proc.exitcode}) without a result; out of memory?") from None
        return None


def _log_result(log, s: dict[str, Any], quiet: bool) -> None:
    if not quiet and log is not None:
        log(f"{s['label']:<16} val loss {s['final_val_loss']:.4f}  "
            f"EDQ {fmt(s['edq_mean'], '.3f')}  {fmt(s['tokens_per_s'], ',.0f')} tok/s  "
            f"{s['wall_time_s']:.1f} s")
