"""One training run of one strategy: the loop, its metrics, memory probe and checkpoints.

:func:`train_strategy` is used both by ``collage compare`` (one call per strategy, from the same
float32 initial weights) and by ``collage train`` (with periodic atomic checkpoints and
``--resume``). On CPU a run is bit-for-bit reproducible: the batch of every step is a function
of ``(seed, step)``, and a checkpoint holds everything else that evolves (weights, optimizer
and scheduler state, RNG states, the history so far). What a run is built from (model,
optimizer, schedule) is ``collage.train.build``'s; one step's loss and clipping
``collage.train.step``'s.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .build import (
    initial_weights,
    lr_factor,
    make_optimizer,
    prepare_model,
    resolve_device,
    state_checksum,
    weight_dtype,
)
from .checkpoint import (
    CHECKPOINT_NAME,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from .config import Config
from .data import Batches, Corpus, load_corpus, make_batches
from .distributed import Ranks, setup
from .gemm import BF16, Bf16Gemm, choose, set_mode
from .history import family_means, mean, new_history, record_stats, tail_mean
from .interrupts import HeldInterrupt
from .memory import TensorMemoryProbe, current_rss_bytes, peak_rss_bytes, persistent_bytes
from .models import is_causal
from .report_auto import auto_summary, promoted
from .outputs import machine
from .step import clip_gradients, evaluate, rank_loss, token_loss

__all__ = ["Session", "train_strategy"]


def _memory_probe_step(start: int, end: int, track_every: int) -> int | None:
    """The (0-based) step whose memory is measured: the first one of this call whose
    optimizer step does not measure lost updates (their float64 copies are not what
    training needs), preferring a step after the first, whose lazily created states are
    then already in place; None when this call runs no step."""
    steps = range(start, end)
    if not steps:
        return None
    plain = [s for s in steps if not track_every or s % track_every]
    later = [s for s in steps if s > 0]
    return ([s for s in plain if s > 0] or plain or later or [start])[0]


def _progress(total: int, initial: int, desc: str, quiet: bool):
    disable = quiet or not sys.stderr.isatty()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: no bar
        return None
    return tqdm(total=total, initial=initial, desc=desc, disable=disable, leave=True,
                dynamic_ncols=True, file=sys.stderr)


# --------------------------------------------------------------------------------------------
# One call of train_strategy: its set-up, resumption, steps, memory probe and summary
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Session:
    """What one call of :func:`train_strategy` trains with; the history, the timing
    counters and ``persistent`` evolve as it steps (and are what a checkpoint keeps)."""

    config: Config
    strategy: str
    label: str
    beta2: float
    device: torch.device
    ranks: Ranks
    corpus: Corpus
    train_batches: Batches
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    init_checksum: str
    model: nn.Module
    net: nn.Module  # the model, wrapped in DDP when distributed
    gemm: Bf16Gemm | None  # how its bf16 products are computed; None: float32 weights
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    checkpoint: str | None  # its path; None: no checkpoints
    checkpoint_every: int | None
    log: Callable[[str], None] | None
    rss_start: int | None
    cpu_start: float
    wall_start: float
    start_step: int = 0
    elapsed_train: float = 0.0
    tokens_timed: int = 0
    time_timed: float = 0.0
    persistent: dict[str, int] | None = None
    bar: Any = None  # the progress bar, if any

    def __post_init__(self) -> None:
        self.names = [(n, p.numel()) for n, p in self.model.named_parameters()]
        self.history: dict[str, Any] = new_history()


def _bf16_gemm(config: Config, strategy: str, device: torch.device,
               given: Bf16Gemm | None, ranks: Ranks) -> Bf16Gemm | None:
    """How the run's bf16 matrix products are computed (``--bf16-gemm``): ``given`` (a
    comparison decides once for all its runs), else chosen here, by rank 0 for every rank
    of a distributed run (a timed probe per rank could decide differently on a busy
    machine, and the ranks would then compute different products); None for float32
    weights, whose products are float32 GEMMs anyway. transformers' modules (``--hf``)
    keep torch's kernels."""
    if weight_dtype(strategy) != torch.bfloat16:
        return None
    if config.model.hf:
        return Bf16Gemm(BF16, config.run.bf16_gemm)
    if given is not None:
        return given
    if not ranks.distributed:
        return choose(config.run.bf16_gemm, device)
    decided = [choose(config.run.bf16_gemm, device) if ranks.main else None]
    dist.broadcast_object_list(decided, src=0)
    return decided[0]


def _start(config: Config, strategy: str, *, beta2: float,
           init: dict[str, torch.Tensor] | None, threads: int | None, distributed: bool,
           out_dir: str | None, checkpoint_every: int | None, label: str,
           log: Callable[[str], None] | None, gemm: Bf16Gemm | None) -> Session:
    """Threads, device and ranks; the data; the model from ``init`` (default: built from the
    seed) with its GEMM mode, its optimizer and schedule."""
    run = config.run
    if threads or run.threads:
        torch.set_num_threads(threads or run.threads)
    device = resolve_device(run.device)
    ranks, device = setup(device, config.data.batch_size) if distributed else (Ranks(), device)
    rss_start = current_rss_bytes()
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    corpus = load_corpus(config.data)
    train_batches, val_source = make_batches(corpus, config.data, context=config.model.context,
                                             causal=is_causal(config.model.family),
                                             seed=run.seed)
    init = initial_weights(config) if init is None else init
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    gemm = _bf16_gemm(config, strategy, device, gemm, ranks)
    model = prepare_model(config, strategy, init, device,
                          bf16_gemm=gemm.mode if gemm else BF16)
    model.train()
    opt = make_optimizer(model, config.optim, strategy, beta2=beta2, track_every=run.track_every,
                         seed=run.seed)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, config.optim, run.steps))
    return Session(
        config=config, strategy=strategy, label=label, beta2=beta2, device=device,
        ranks=ranks, corpus=corpus, train_batches=train_batches,
        val_batches=val_source.fixed(run.eval_batches), init_checksum=state_checksum(init),
        model=model, net=_data_parallel(model, device) if ranks.distributed else model,
        gemm=gemm, opt=opt, sched=sched,
        checkpoint=os.path.join(out_dir, CHECKPOINT_NAME) if out_dir else None,
        checkpoint_every=checkpoint_every, log=log if ranks.main else None,
        rss_start=rss_start, cpu_start=cpu_start, wall_start=wall_start)


def _resume(s: Session, out_dir: str | None) -> None:
    """Continue from the checkpoint in ``out_dir``, if there is one."""
    if s.checkpoint and os.path.exists(s.checkpoint):
        payload = load_checkpoint(s.checkpoint, s.config, s.strategy)
        s.model.load_state_dict(payload["model"])
        s.opt.load_state_dict(payload["optimizer"])
        s.sched.load_state_dict(payload["scheduler"])
        set_rng_state(payload["rng"])
        s.history = payload["history"]
        s.start_step = payload["step"]
        s.elapsed_train, s.tokens_timed, s.time_timed = payload["timing"]
        _continue_gemm(s, payload.get("bf16_gemm"))
        if s.log:
            s.log(f"resuming {s.strategy} from step {s.start_step} ({s.checkpoint})")
    elif s.log:
        s.log(f"no checkpoint in {out_dir}; starting {s.strategy} at step 0")


def _continue_gemm(s: Session, recorded: dict[str, Any] | None) -> None:
    """A resumed ``auto`` run keeps the GEMM mode it started with (a probe on a busy
    machine could decide otherwise, and one run would mix two arithmetics); a forced mode
    equals the recorded one, or the configurations would differ."""
    if recorded is None or s.gemm is None or s.config.run.bf16_gemm != "auto":
        return
    s.gemm = Bf16Gemm.from_record(recorded)
    set_mode(s.model, s.gemm.mode)


def _save(s: Session, step: int, rng: dict[str, Any]) -> None:
    """A checkpoint after ``step`` steps (rank 0, and only when checkpoints were asked)."""
    if s.checkpoint is None or s.checkpoint_every is None or not s.ranks.main:
        return
    save_checkpoint({
        "step": step, "strategy": s.strategy,
        "config": s.config.to_dict(), "model": s.model.state_dict(),
        "optimizer": s.opt.state_dict(), "scheduler": s.sched.state_dict(),
        "data_position": s.train_batches.position(step), "rng": rng,
        "history": s.history, "timing": (s.elapsed_train, s.tokens_timed, s.time_timed),
        "bf16_gemm": s.gemm.record() if s.gemm else None,
    }, s.checkpoint)


@dataclass
class _StepProbe:
    """The allocator's view of one step (``step``, 0-based; None: this call runs none):
    opened before its forward pass, with the optimizer step as a section."""

    step: int | None
    probe: TensorMemoryProbe | None = None
    open: bool = False

    def enter(self, step: int, s: Session) -> None:
        if step == self.step:
            self.probe = TensorMemoryProbe(s.device, persistent_bytes(s.model, s.opt)["total"])
            self.probe.__enter__()
            self.open = True

    def section(self, step: int) -> AbstractContextManager:
        return self.probe.section("optimizer_step") if step == self.step else nullcontext()

    def exit(self, step: int) -> None:
        if step == self.step:
            self.open = False
            self.probe.__exit__(None, None, None)

    def abort(self) -> None:
        """Interrupted inside the probed step: close the profiler, no result."""
        if self.open:
            self.probe.__exit__(*sys.exc_info())


@dataclass
class _Cursor:
    """Where the loop stands, for an interruption: ``done`` steps, and the phase of the
    next one: ``between`` steps, in ``forward``/backward (nothing persistent changed yet:
    it is redone from ``rng_at_start``), or in the ``update`` (weights and optimizer
    half-updated until the step is recorded: Ctrl-C is ``held`` there and raised once the
    step is recorded, ``interrupts.py``)."""

    done: int
    phase: str = "between"
    rng_at_start: dict[str, Any] | None = None
    held: HeldInterrupt = field(default_factory=HeldInterrupt)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_step(s: Session, step: int, probe: _StepProbe, cursor: _Cursor) -> None:
    """Forward, backward, clipping and the optimizer step of ``step`` (0-based), timed;
    then its record in the history."""
    probe.enter(step, s)  # one step's peak, measured by the allocator
    x, y = s.train_batches.batch(step)
    rows = s.ranks.batch_slice(x.shape[0])
    x, y = x[rows].to(s.device), y[rows].to(s.device)
    _sync(s.device)
    t0 = time.perf_counter()
    if s.config.optim.step_in_backward:  # backward writes the weights: no checkpoint
        cursor.phase = "update"
        cursor.held.hold()
    loss = _backward(s, x, y)
    grad_norm = _clip(s)
    lr = float(s.opt.param_groups[0]["lr"])  # torchao keeps lr as a 0-d tensor
    cursor.phase = "update"
    cursor.held.hold()
    stats_before = getattr(s.opt, "update_stats", None)
    with probe.section(step):
        s.opt.step()
    s.sched.step()
    if s.opt.state and (s.persistent is None  # after the first real (not skipped) step
                        or promoted(s.opt, stats_before)):  # auto: its rungs changed
        s.persistent = persistent_bytes(s.model, s.opt)
    s.opt.zero_grad(set_to_none=True)
    probe.exit(step)
    loss_value = float(getattr(loss, "global_mean", loss).detach())
    _sync(s.device)
    dt = time.perf_counter() - t0
    s.elapsed_train += dt
    stats = getattr(s.opt, "update_stats", None)
    tracked = stats is not stats_before and bool(stats)  # a new dict: measured
    # throughput without measurement overhead (EDQ, the memory probe's profiler) or the
    # first step's warm-up
    if not tracked and step > 0 and step != probe.step:
        s.tokens_timed += s.config.data.batch_size * s.config.model.context
        s.time_timed += dt
    _record_step(s, step, loss_value, lr, grad_norm, stats if tracked else None)


def _backward(s: Session, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The forward and backward passes of one step: one, or ``--grad-accum`` N on equal
    slices of the batch, each loss the slice's token sum over the whole batch's count, so
    that the gradients add up to the whole batch's mean loss; returns that loss."""
    if s.ranks.distributed:  # (--grad-accum > 1 is refused with --nproc > 1: config.py)
        loss = rank_loss(s.net, x, y, s.ranks)
        loss.backward()
        return loss
    n = s.config.optim.grad_accum
    if n == 1:
        loss = token_loss(s.net, x, y)
        loss.backward()
        return loss
    count = (y != -100).sum().clamp(min=1)
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    for xs, ys in zip(x.chunk(n), y.chunk(n)):
        part = token_loss(s.net, xs, ys, reduction="sum") / count
        part.backward()
        total += part.detach()
    return total


def _clip(s: Session) -> float:
    """Clip the gradients (``--grad-clip``); returns their norm, nan where it is never
    formed (``--step-in-backward``: no gradient outlives backward)."""
    if s.config.optim.step_in_backward:
        return math.nan
    return clip_gradients(s.model, s.config.optim.grad_clip)


def _record_step(s: Session, step: int, loss: float, lr: float, grad_norm: float,
                 stats: dict[str, float] | None) -> None:
    """Append a finished step to the history; evaluate (and log) when it is due."""
    run, history = s.config.run, s.history
    history["step"].append(step + 1)
    history["train_loss"].append(loss)
    history["lr"].append(lr)
    history["grad_norm"].append(grad_norm)
    record_stats(history, stats, step + 1, s.names)
    if (step + 1) % run.eval_every == 0 or step + 1 == run.steps:
        history["val_step"].append(step + 1)
        history["val_loss"].append(evaluate(s.model, s.val_batches, s.device))
        if s.log is not None and (s.bar is None or s.bar.disable):
            s.log(f"{s.label} step {step + 1}/{run.steps}: train loss {loss:.4f}, val loss "
                  f"{history['val_loss'][-1]:.4f}")


def _run_steps(s: Session, end: int, probe: _StepProbe,
               progress: Callable[[int], None] | None) -> int:
    """Train from ``s.start_step`` up to ``end``; returns the steps done. An interruption
    writes a checkpoint of the last completed step before it propagates."""
    cursor = _Cursor(s.start_step, rng_at_start=rng_state())
    try:
        for step in range(s.start_step, end):
            cursor.phase, cursor.rng_at_start = "forward", rng_state()
            _train_step(s, step, probe, cursor)
            cursor.done, cursor.phase = step + 1, "between"
            cursor.held.release()  # a Ctrl-C held over the update: raised now
            _show_progress(s, progress)
            if s.checkpoint_every and cursor.done % s.checkpoint_every == 0 \
                    and cursor.done < end:
                _save(s, cursor.done, rng_state())
    except KeyboardInterrupt:
        if cursor.phase == "between":
            _save(s, cursor.done, rng_state())
        elif cursor.phase == "forward":  # nothing persistent changed yet: redo the step
            _save(s, cursor.done, cursor.rng_at_start)
        raise
    finally:
        cursor.held.restore()
        probe.abort()
        if s.bar is not None:
            s.bar.close()
    return cursor.done


def _show_progress(s: Session, progress: Callable[[int], None] | None) -> None:
    if progress is not None:
        progress(1)
    if s.bar is not None:
        s.bar.update(1)
        s.bar.set_postfix(loss=f"{s.history['train_loss'][-1]:.3f}",
                          val=f"{s.history['val_loss'][-1]:.3f}", refresh=False)


def _peak_memory(s: Session, probe: _StepProbe) -> tuple[int, str, int | None]:
    """(peak bytes, how they were measured, the optimizer step's own peak)."""
    measured = probe.probe
    if measured is not None and measured.peak_bytes is not None:
        return (measured.peak_bytes, f"{measured.method}, step {probe.step + 1}",
                measured.section_peak_bytes.get("optimizer_step"))
    if s.device.type == "cuda":
        return torch.cuda.max_memory_allocated(s.device), "cuda_max_memory_allocated", None
    return peak_rss_bytes(), "process_peak_rss", None  # a resumed call that ran no step


def _summary(s: Session, done: int, probe: _StepProbe) -> dict[str, Any]:
    """The run's summary: final losses, means of the measured steps, speed, memory."""
    if s.persistent is None:  # resumed at the end: measure once now
        s.persistent = persistent_bytes(s.model, s.opt)
    peak, measured, step_peak = _peak_memory(s, probe)
    history, persistent = s.history, s.persistent
    return {
        "strategy": s.strategy,
        "label": s.label,
        "beta2": s.beta2,
        "steps": done,
        "completed": done == s.config.run.steps,
        "final_train_loss": tail_mean(history["train_loss"]),
        "final_val_loss": history["val_loss"][-1],
        "final_val_ppl": math.exp(min(history["val_loss"][-1], 700)),
        "best_val_loss": min(history["val_loss"]),
        "tokens_per_s": s.tokens_timed / s.time_timed if s.time_timed else math.nan,
        "train_time_s": s.elapsed_train,
        # CPU seconds of this process vs wall seconds of this call: far apart on a machine
        # busy with other work (the wall-clock numbers, tokens/s included, then suffer).
        "cpu_time_s": time.process_time() - s.cpu_start,
        "run_time_s": time.perf_counter() - s.wall_start,
        "peak_memory_bytes": peak,
        "peak_memory_measured": measured,
        "optimizer_step_peak_bytes": step_peak,
        "process_peak_rss_bytes": peak_rss_bytes(),
        "rss_before_bytes": s.rss_start,
        "persistent_bytes": persistent["total"],
        "persistent": persistent,
        "n_params": persistent["n_params"],
        "bytes_per_param_measured": persistent["model_total"] / persistent["n_params"],
        "edq_mean": mean(history["edq"]),
        "imprecision_mean": mean(history["imprecision"]),
        "edq_visible_mean": mean(history["edq_visible"]),
        "imprecision_visible_mean": mean(history["imprecision_visible"]),
        "family": family_means(history),
        **auto_summary(s.opt, history),
        "init_checksum": s.init_checksum,
        "data_source": s.corpus.source,
        "train_tokens": len(s.corpus.train),
        "val_tokens": len(s.corpus.val),
        "val_batches": len(s.val_batches),  # --eval-batches, or fewer where the text ends
        "device": str(s.device),
        "threads": torch.get_num_threads(),
        "world_size": s.ranks.world_size,
        **(s.gemm.record() if s.gemm else Bf16Gemm(None, s.config.run.bf16_gemm).record()),
        "machine": machine(s.device.type),
    }


def train_strategy(
    config: Config,
    strategy: str,
    *,
    beta2: float | None = None,
    init: dict[str, torch.Tensor] | None = None,
    out_dir: str | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    label: str | None = None,
    log: Callable[[str], None] | None = None,
    progress: Callable[[int], None] | None = None,
    threads: int | None = None,
    distributed: bool = False,
    gemm: Bf16Gemm | None = None,
) -> dict[str, Any]:
    """Train ``strategy`` for ``config.run.steps`` steps; return ``{"summary", "history"}``.

    ``init``: float32 initial weights (default: built from the seed). With ``out_dir`` and
    ``checkpoint_every`` not None, ``checkpoint.pt`` is written there every
    ``checkpoint_every`` steps (0: never in between) and when the session ends; ``resume``
    continues from it. ``stop_after`` ends the session after that step with a
    checkpoint, as an interruption would (``resume`` continues it). KeyboardInterrupt also
    writes a checkpoint of the last completed step before it propagates. ``progress(n)`` is
    called after every step (instead of showing a progress bar); ``threads`` overrides
    ``config.run.threads``; ``gemm``, the ``--bf16-gemm`` decision (default: made here,
    the probe once per process).

    ``distributed``: this process is one rank of a launcher (torchrun); join the process
    group, train the model wrapped in DDP on this rank's slice of each global batch, and
    write checkpoints and log from rank 0 only. The result's ``"ranks"`` says which rank.
    """
    run = config.run
    s = _start(config, strategy, beta2=config.optim.beta2 if beta2 is None else beta2,
               init=init, threads=threads, distributed=distributed, out_dir=out_dir,
               checkpoint_every=checkpoint_every, label=label or strategy, log=log, gemm=gemm)
    torch.manual_seed(run.seed + 1)  # dropout; stochastic rounding draws from the optimizer
    random.seed(run.seed + 1)
    if resume:
        _resume(s, out_dir)
    if s.log is not None and s.gemm is not None and gemm is None:  # compare logs its own
        s.log(f"bf16 matrix multiplies: {s.gemm.describe()}")
    end = run.steps if stop_after is None else min(stop_after, run.steps)
    if not progress:
        s.bar = _progress(run.steps, s.start_step, s.label, run.quiet or not s.ranks.main)
    if s.start_step == 0 and not s.history["val_step"]:
        s.history["val_step"].append(0)
        s.history["val_loss"].append(evaluate(s.model, s.val_batches, s.device))
    probe = _StepProbe(_memory_probe_step(s.start_step, end, run.track_every))
    done = _run_steps(s, end, probe, progress)
    if checkpoint_every is not None:
        _save(s, done, rng_state())
    return {"summary": _summary(s, done, probe), "history": s.history, "model": s.model,
            "optimizer": s.opt, "ranks": s.ranks}


def _data_parallel(model: nn.Module, device: torch.device) -> nn.Module:
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                   else None)
