"""One training run of one strategy: model, optimizer, schedule, loop, metrics, checkpoints.

:func:`train_strategy` is used both by ``collage compare`` (one call per strategy, from the same
float32 initial weights) and by ``collage train`` (with periodic atomic checkpoints and
``--resume``). On CPU a run is bit-for-bit reproducible: the batch of every step is a function
of ``(seed, step)``, and a checkpoint holds everything else that evolves (weights, optimizer
and scheduler state, RNG states, the history so far).
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

import collage
from collage.metrics import FAMILIES, module_family

from ..cli import UsageError
from .config import Config, OptimConfig
from .data import VOCAB_SIZE, load_corpus, make_batches
from .distributed import Ranks, all_sum, setup
from .losses import cross_entropy
from .memory import TensorMemoryProbe, current_rss_bytes, peak_rss_bytes, persistent_bytes
from .models import build_model, is_causal, logits_of

__all__ = [
    "CHECKPOINT_NAME",
    "initial_weights",
    "lr_factor",
    "make_optimizer",
    "param_groups",
    "prepare_model",
    "resolve_device",
    "save_atomic",
    "state_checksum",
    "train_strategy",
]

CHECKPOINT_NAME = "checkpoint.pt"
CHECKPOINT_FORMAT = 1
STAT_KEYS = ("edq", "imprecision", "edq_visible", "imprecision_visible")
# Run fields that may differ between an interrupted run and its resumption.
RESUMABLE_RUN_FIELDS = ("resume", "stop_after", "quiet", "out", "checkpoint_every", "threads",
                        "eval_every", "eval_batches", "isolate", "strategies", "beta2s",
                        "jobs", "nproc")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available (use --device cpu)")
    return torch.device(name)


def weight_dtype(strategy: str) -> torch.dtype:
    """fp32 trains float32 weights; every other strategy bfloat16 weights."""
    return torch.float32 if strategy == "fp32" else torch.bfloat16


def initial_weights(config: Config) -> dict[str, torch.Tensor]:
    """The float32 initial state dict of ``config.model`` seeded by ``config.run.seed``."""
    model = build_model(config.model, VOCAB_SIZE, seed=config.run.seed)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def state_checksum(state: dict[str, torch.Tensor]) -> str:
    """A short hash of a state dict's names and bytes (proves identical initial weights)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def prepare_model(config: Config, strategy: str, init: dict[str, torch.Tensor],
                  device: torch.device) -> nn.Module:
    """The model with the float32 weights ``init``, converted to the strategy's dtype."""
    model = build_model(config.model, VOCAB_SIZE, seed=config.run.seed)
    model.load_state_dict(init)
    return model.to(device=device, dtype=weight_dtype(strategy))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Named parameter groups: matrices and embeddings decay, biases and norm gains do not."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append((name, p))
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def make_optimizer(model: nn.Module, optim: OptimConfig, strategy: str, *, beta2: float,
                   track_every: int, seed: int = 0) -> torch.optim.Optimizer:
    """collage.AdamW over named groups; ``track_every`` k measures EDQ on steps 1, k+1, ...;
    ``seed`` seeds stochastic rounding (its generator is saved in the state dict).

    ``"torchao-adamw8bit"`` is torchao's ``AdamW8bit`` on the same bf16 weights with
    ``bf16_stochastic_round=True`` (torchao's option for bf16 weights; without it every
    update is rounded to nearest into bf16, the ``bf16`` strategy's loss): the 8-bit
    baseline of ``docs/eight_bit.md``. It measures no EDQ."""
    if strategy == "torchao-adamw8bit":
        from torchao.optim import AdamW8bit

        groups = [{**g, "params": [p for _, p in g["params"]]}
                  for g in param_groups(model, optim.weight_decay)]
        return AdamW8bit(groups, lr=optim.lr, betas=(optim.beta1, beta2), eps=optim.eps,
                         weight_decay=optim.weight_decay, bf16_stochastic_round=True)
    return collage.AdamW(
        param_groups(model, optim.weight_decay), lr=optim.lr, betas=(optim.beta1, beta2),
        eps=optim.eps, weight_decay=optim.weight_decay, strategy=strategy,
        foreach=optim.foreach, track_updates=track_every or False, seed=seed,
    )


def lr_factor(step: int, optim: OptimConfig, total: int) -> float:
    """Multiplier of the peak lr for 0-based ``step``: linear warm-up, then the schedule down
    to ``min_lr_ratio`` at the last step."""
    if optim.warmup_steps and step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return 1.0
    span = max(total - 1 - optim.warmup_steps, 1)
    progress = min(max(step - optim.warmup_steps, 0) / span, 1.0)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if optim.schedule == "cosine" \
        else 1.0 - progress
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * shape


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


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean"):
    # the float32 loss of the logits without a float32 copy of them (collage.train.losses)
    return cross_entropy(logits_of(model, x), y, ignore_index=-100, reduction=reduction)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
             device: torch.device) -> float:
    """Mean token loss over the fixed validation batches."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        total += float(_loss(model, x, y, reduction="sum"))
        count += int((y != -100).sum())
    model.train(was_training)
    return total / max(count, 1)


@torch.no_grad()
def clip_gradients(model: nn.Module, max_norm: float) -> float:
    """Scale all gradients so that their global norm (computed in fp32) is at most
    ``max_norm``; returns the norm before clipping."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.sqrt(sum(_squared_sum(g) for g in grads)).float()
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
    return float(norm)


#: Elements per float32 conversion in :func:`_squared_sum`: a bf16 gradient is never widened
#: whole (a float32 copy of the largest gradient would be a peak the memory model does not have).
_NORM_CHUNK = 1 << 16


def _squared_sum(grad: torch.Tensor) -> torch.Tensor:
    """``sum(grad**2)``: each range of ``_NORM_CHUNK`` elements squared and summed in float32,
    the range sums added in float64."""
    flat = grad.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=grad.device)
    for part in flat.split(_NORM_CHUNK):
        total += part.float().pow(2).sum()
    return total


def family_stats(stats: dict[str, float], names: list[tuple[str, int]]
                 ) -> dict[str, dict[str, float]]:
    """EDQ and imprecision per module family, from the per-parameter entries of
    ``optimizer.update_stats``.

    Exact roll-up from the per-name ratios: ``<e,d> = edq * ||d||^2`` and
    ``||d||^2 = update_norm^2`` are summed per family, so the family EDQ is
    ``sum <e,d> / sum ||d||^2``, the same as measuring the family as one tensor. Imprecision
    is a fraction of elements; it is averaged weighted by each parameter's number of
    elements (equal to the exact roll-up when every element has a non-zero intended update,
    the usual case for AdamW).
    """
    sums: dict[str, list[float]] = {}
    for name, numel in names:
        family = module_family(name)
        edq, norm = stats.get(f"edq/{name}"), stats.get(f"update_norm/{name}")
        if edq is None or norm is None or not math.isfinite(edq):
            continue
        s = sums.setdefault(family, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
        dd = norm * norm
        s[0] += edq * dd
        s[1] += dd
        for i, key in ((2, "imprecision"), (4, "imprecision_visible")):
            value = stats.get(f"{key}/{name}")
            if value is not None and math.isfinite(value):
                s[i] += value * numel
                s[i + 1] += numel
    out = {}
    for family, s in sums.items():
        out[family] = {
            "edq": s[0] / s[1] if s[1] else math.nan,
            "imprecision": s[2] / s[3] if s[3] else math.nan,
            "imprecision_visible": s[4] / s[5] if s[5] else math.nan,
        }
    return out


def _record_stats(history: dict[str, Any], stats: dict[str, float] | None, step: int,
                  names: list[tuple[str, int]]) -> None:
    if not stats:
        return
    history["stats_step"].append(step)
    for k in STAT_KEYS:
        history[k].append(stats.get(k, math.nan))
    per_family = family_stats(stats, names)
    for family in FAMILIES:
        entry = history["family"][family]
        for k in ("edq", "imprecision", "imprecision_visible"):
            entry.setdefault(k, []).append(per_family.get(family, {}).get(k, math.nan))


def save_atomic(obj: Any, path: str) -> None:
    """``torch.save`` to a temporary file in the same directory, fsync, then ``os.replace``:
    ``path`` holds either the previous complete file or the new one, never a partial one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _comparable(config_dict: dict[str, Any]) -> dict[str, Any]:
    d = {k: dict(v) if isinstance(v, dict) else v for k, v in config_dict.items()}
    for name in RESUMABLE_RUN_FIELDS:
        d["run"].pop(name, None)
    d.pop("preset", None)
    return d


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    out = []
    for section in a:
        if isinstance(a[section], dict):
            for key in a[section]:
                if a[section][key] != b.get(section, {}).get(key):
                    out.append(f"--{key.replace('_', '-')} {b.get(section, {}).get(key)} "
                               f"(checkpoint: {a[section][key]})")
    return out


def load_checkpoint(path: str, config: Config, strategy: str) -> dict[str, Any]:
    """A checkpoint written by this module for the same configuration and strategy."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise UsageError(f"--resume: cannot read checkpoint {path!r}: "
                         f"{str(error).splitlines()[0] if str(error) else error!r}") from None
    if payload.get("format") != CHECKPOINT_FORMAT:
        raise UsageError(f"--resume: {path!r} is not a collage train checkpoint")
    if payload["strategy"] != strategy:
        raise UsageError(f"--resume: the checkpoint in {path!r} is for strategy "
                         f"{payload['strategy']!r}, not {strategy!r}")
    diffs = _differences(_comparable(payload["config"]), _comparable(config.to_dict()))
    if diffs:
        raise UsageError(f"--resume: the checkpoint in {path!r} was made with other settings: "
                         + "; ".join(diffs[:3]))
    return payload


def _progress(total: int, initial: int, desc: str, quiet: bool):
    disable = quiet or not sys.stderr.isatty()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: no bar
        return None
    return tqdm(total=total, initial=initial, desc=desc, disable=disable, leave=True,
                dynamic_ncols=True, file=sys.stderr)


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
) -> dict[str, Any]:
    """Train ``strategy`` for ``config.run.steps`` steps; return ``{"summary", "history"}``.

    ``init``: float32 initial weights (default: built from the seed). With ``out_dir`` and
    ``checkpoint_every`` not None, ``checkpoint.pt`` is written there every
    ``checkpoint_every`` steps (0: never in between) and when the session ends; ``resume``
    continues from it. ``stop_after`` ends the session after that step with a
    checkpoint, as an interruption would (``resume`` continues it). KeyboardInterrupt also
    writes a checkpoint of the last completed step before it propagates. ``progress(n)`` is
    called after every step (instead of showing a progress bar); ``threads`` overrides
    ``config.run.threads``.

    ``distributed``: this process is one rank of a launcher (torchrun); join the process
    group, train the model wrapped in DDP on this rank's slice of each global batch, and
    write checkpoints and log from rank 0 only. The result's ``"ranks"`` says which rank.
    """
    run = config.run
    beta2 = config.optim.beta2 if beta2 is None else beta2
    threads = threads or run.threads
    if threads:
        torch.set_num_threads(threads)
    device = resolve_device(run.device)
    ranks, device = setup(device, config.data.batch_size) if distributed else (Ranks(), device)
    if not ranks.main:
        log = None
    rss_start = current_rss_bytes()
    cpu_start, wall_start = time.process_time(), time.perf_counter()

    corpus = load_corpus(config.data)
    causal = is_causal(config.model.family)
    train_batches, val_source = make_batches(corpus, config.data, context=config.model.context,
                                             causal=causal, seed=run.seed)
    val_batches = val_source.fixed(run.eval_batches)

    init = initial_weights(config) if init is None else init
    init_checksum = state_checksum(init)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = prepare_model(config, strategy, init, device)
    model.train()
    names = [(n, p.numel()) for n, p in model.named_parameters()]
    opt = make_optimizer(model, config.optim, strategy, beta2=beta2, track_every=run.track_every,
                         seed=run.seed)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, config.optim, run.steps))
    net = _data_parallel(model, device) if ranks.distributed else model

    history: dict[str, Any] = {
        "step": [], "train_loss": [], "lr": [], "grad_norm": [],
        "val_step": [], "val_loss": [],
        "stats_step": [], **{k: [] for k in STAT_KEYS}, "family": {f: {} for f in FAMILIES},
    }
    start_step, elapsed_train, tokens_timed, time_timed = 0, 0.0, 0, 0.0
    torch.manual_seed(run.seed + 1)  # dropout; stochastic rounding draws from the optimizer
    random.seed(run.seed + 1)
    checkpoint = os.path.join(out_dir, CHECKPOINT_NAME) if out_dir else None
    if resume and checkpoint and os.path.exists(checkpoint):
        payload = load_checkpoint(checkpoint, config, strategy)
        model.load_state_dict(payload["model"])
        opt.load_state_dict(payload["optimizer"])
        sched.load_state_dict(payload["scheduler"])
        _set_rng_state(payload["rng"])
        history = payload["history"]
        start_step = payload["step"]
        elapsed_train, tokens_timed, time_timed = payload["timing"]
        if log:
            log(f"resuming {strategy} from step {start_step} ({checkpoint})")
    elif resume and log:
        log(f"no checkpoint in {out_dir}; starting {strategy} at step 0")

    def save(step: int, rng: dict[str, Any]) -> None:
        if checkpoint is None or checkpoint_every is None or not ranks.main:
            return
        save_atomic({
            "format": CHECKPOINT_FORMAT, "step": step, "strategy": strategy,
            "config": config.to_dict(), "model": model.state_dict(),
            "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "data_position": train_batches.position(step), "rng": rng,
            "history": history, "timing": (elapsed_train, tokens_timed, time_timed),
        }, checkpoint)

    tokens_per_step = config.data.batch_size * config.model.context
    persistent = None
    end = run.steps if stop_after is None else min(stop_after, run.steps)
    bar = None if progress else _progress(run.steps, start_step, label or strategy,
                                          run.quiet or not ranks.main)
    if start_step == 0 and not history["val_step"]:
        history["val_step"].append(0)
        history["val_loss"].append(evaluate(model, val_batches, device))
    # phase: "between" steps, in "forward"/backward (nothing persistent changed yet), or in
    # the "update" (weights and optimizer half-updated until the step is recorded).
    done, phase, rng_at_start = start_step, "between", _rng_state()
    probe_step, probe = _memory_probe_step(start_step, end, run.track_every), None
    probing = False
    try:
        for step in range(start_step, end):
            phase, rng_at_start = "forward", _rng_state()
            if step == probe_step:  # one step's peak, measured by the allocator
                probe = TensorMemoryProbe(device, persistent_bytes(model, opt)["total"])
                probe.__enter__()
                probing = True
            x, y = train_batches.batch(step)
            rows = ranks.batch_slice(x.shape[0])
            x, y = x[rows].to(device), y[rows].to(device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            loss = _loss(net, x, y) if not ranks.distributed else _rank_loss(net, x, y, ranks)
            loss.backward()
            grad_norm = clip_gradients(model, config.optim.grad_clip)
            lr = float(opt.param_groups[0]["lr"])  # torchao keeps lr as a 0-d tensor
            phase = "update"
            stats_before = getattr(opt, "update_stats", None)
            with probe.section("optimizer_step") if step == probe_step else nullcontext():
                opt.step()
            sched.step()
            if persistent is None and opt.state:  # after the first real (not skipped) step
                persistent = persistent_bytes(model, opt)
            opt.zero_grad(set_to_none=True)
            if step == probe_step:
                probing = False
                probe.__exit__(None, None, None)
            loss_value = float(getattr(loss, "global_mean", loss).detach())
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            elapsed_train += dt
            stats = getattr(opt, "update_stats", None)
            tracked = stats is not stats_before and bool(stats)  # a new dict: measured
            # throughput without measurement overhead (EDQ, the memory probe's profiler) or
            # the first step's warm-up
            if not tracked and step > 0 and step != probe_step:
                tokens_timed += tokens_per_step
                time_timed += dt

            history["step"].append(step + 1)
            history["train_loss"].append(loss_value)
            history["lr"].append(lr)
            history["grad_norm"].append(grad_norm)
            if tracked:
                _record_stats(history, stats, step + 1, names)
            if (step + 1) % run.eval_every == 0 or step + 1 == run.steps:
                history["val_step"].append(step + 1)
                history["val_loss"].append(evaluate(model, val_batches, device))
                if log is not None and (bar is None or bar.disable):
                    log(f"{label or strategy} step {step + 1}/{run.steps}: train loss "
                        f"{loss_value:.4f}, val loss {history['val_loss'][-1]:.4f}")
            done, phase = step + 1, "between"
            if progress is not None:
                progress(1)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.3f}", val=f"{history['val_loss'][-1]:.3f}",
                                refresh=False)
            if checkpoint_every and done % checkpoint_every == 0 and done < end:
                save(done, _rng_state())
    except KeyboardInterrupt:
        if phase == "between":
            save(done, _rng_state())
        elif phase == "forward":  # the step had not changed anything persistent: redo it
            save(done, rng_at_start)
        raise
    finally:
        if probing:  # interrupted inside the probed step: close the profiler, no result
            probe.__exit__(*sys.exc_info())
        if bar is not None:
            bar.close()
    if checkpoint_every is not None:
        save(done, _rng_state())

    if persistent is None:  # resumed at the end: measure once now
        persistent = persistent_bytes(model, opt)
    if probe is not None and probe.peak_bytes is not None:
        peak, measured = probe.peak_bytes, f"{probe.method}, step {probe_step + 1}"
        step_peak = probe.section_peak_bytes.get("optimizer_step")
    elif device.type == "cuda":
        peak, measured = torch.cuda.max_memory_allocated(device), "cuda_max_memory_allocated"
        step_peak = None
    else:  # a resumed call that ran no step
        peak, measured, step_peak = peak_rss_bytes(), "process_peak_rss", None
    finite = [v for v in history["edq"] if math.isfinite(v)]
    summary = {
        "strategy": strategy,
        "label": label or strategy,
        "beta2": beta2,
        "steps": done,
        "completed": done == run.steps,
        "final_train_loss": _tail_mean(history["train_loss"]),
        "final_val_loss": history["val_loss"][-1],
        "final_val_ppl": math.exp(min(history["val_loss"][-1], 700)),
        "best_val_loss": min(history["val_loss"]),
        "tokens_per_s": tokens_timed / time_timed if time_timed else math.nan,
        "train_time_s": elapsed_train,
        # CPU seconds of this process vs wall seconds of this call: far apart on a machine
        # busy with other work (the wall-clock numbers, tokens/s included, then suffer).
        "cpu_time_s": time.process_time() - cpu_start,
        "run_time_s": time.perf_counter() - wall_start,
        "peak_memory_bytes": peak,
        "peak_memory_measured": measured,
        "optimizer_step_peak_bytes": step_peak,
        "process_peak_rss_bytes": peak_rss_bytes(),
        "rss_before_bytes": rss_start,
        "persistent_bytes": persistent["total"],
        "persistent": persistent,
        "n_params": persistent["n_params"],
        "bytes_per_param_measured": persistent["model_total"] / persistent["n_params"],
        "edq_mean": sum(finite) / len(finite) if finite else math.nan,
        "imprecision_mean": _mean(history["imprecision"]),
        "edq_visible_mean": _mean(history["edq_visible"]),
        "imprecision_visible_mean": _mean(history["imprecision_visible"]),
        "family": {f: {k: _mean(v) for k, v in history["family"][f].items()}
                   for f in FAMILIES if history["family"][f]},
        "init_checksum": init_checksum,
        "data_source": corpus.source,
        "train_tokens": len(corpus.train),
        "val_tokens": len(corpus.val),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "world_size": ranks.world_size,
    }
    return {"summary": summary, "history": history, "model": model, "optimizer": opt,
            "ranks": ranks}


def _data_parallel(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                   else None)


def _rank_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor, ranks: Ranks
               ) -> torch.Tensor:
    """This rank's share of the global mean token loss, scaled for DDP's gradient average.

    DDP averages gradients over ranks, so the rank loss is ``sum_rank * world / count``
    with ``count`` the global number of targets: the average is then the gradient of the
    global mean, whatever each rank's share of the targets. The global mean itself (for
    the history) is attached as ``.global_mean``.
    """
    total = _loss(net, x, y, reduction="sum")
    count = all_sum((y != -100).sum(), ranks).clamp(min=1)
    loss = total * (ranks.world_size / count)
    loss.global_mean = all_sum(total.detach(), ranks) / count
    return loss


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _tail_mean(values: list[float], fraction: float = 0.05) -> float:
    """Mean of the last ``fraction`` of the values (at least one): a less noisy final loss."""
    if not values:
        return math.nan
    n = max(1, int(len(values) * fraction))
    return sum(values[-n:]) / n
