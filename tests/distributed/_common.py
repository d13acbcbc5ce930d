"""Shared by the distributed workers and tests: a tiny GPT, its data, reference training.

A plain module (imported by path from the worker scripts and by the tests), so it must not
import pytest. Everything is deterministic on CPU with one intra-op thread: the same batch
through the same weights gives the same bits in every process.
"""

from __future__ import annotations

import datetime
import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

import collage

VOCAB = 37  # odd: the embedding and head rows shard unevenly (19 + 18) over two ranks
WIDTH = 16
HEADS = 2
SEQ = 8
BATCH = 4  # global batch; each of two ranks gets two sequences
STEPS = 10
LR = 1e-2
BETAS = (0.9, 0.99)
EPS = 1e-8
WEIGHT_DECAY = 0.1
MODEL_SEED = 1234
DATA_SEED = 99

LOW_PRECISION = ("mixed", "bf16", "kahan", "stochastic", "light", "plus", "split")
ALL_STRATEGIES = ("fp32", *LOW_PRECISION)
#: the autopilot (``strategy="auto"``) as the data-parallel tests run it: measured every
#: other step, a threshold low enough that these 10 steps promote tensors at several steps
#: (each rank must decide the same: DDP from the same sums, FSDP2 from reduced ones)
AUTO = "auto"
AUTO_POLICY = collage.Autopilot(every=2, threshold=0.02)


def deterministic() -> None:
    """One thread, deterministic kernels: the same inputs give the same bits everywhere."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def weight_dtype(strategy: str) -> torch.dtype:
    return torch.float32 if strategy == "fp32" else torch.bfloat16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.out = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(c // HEADS))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        y = scores.softmax(-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """A one-block GPT with an odd vocabulary and a one-element parameter (``gain``): the
    one element lives on rank 0 under FSDP2, rank 1 holds an empty shard."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(SEQ, WIDTH)
        self.block = Block()
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.block(self.wte(idx) + self.wpe(pos))
        return self.head(self.ln_f(x)) * self.gain


def build_model(strategy: str, seed: int = MODEL_SEED) -> TinyGPT:
    torch.manual_seed(seed)
    with torch.no_grad():
        model = TinyGPT()
        for p in model.parameters():  # non-trivial norms and biases
            if p.dim() == 1 and p.numel() > 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.to(weight_dtype(strategy))


def make_optimizer(params, strategy: str, **kwargs) -> collage.AdamW:
    kwargs.setdefault("track_updates", True)
    if strategy == AUTO:
        kwargs.setdefault("autopilot", AUTO_POLICY)
    return collage.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                         strategy=strategy, **kwargs)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of the global batch of ``step``: BATCH sequences of SEQ tokens."""
    g = torch.Generator().manual_seed(DATA_SEED + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def shard_of(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous part of a global batch."""
    per = tensor.shape[0] // world
    return tensor[rank * per:(rank + 1) * per]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


# ------------------------------------------------------------------------- references


def reference_grads(model: nn.Module, step: int, world: int) -> torch.Tensor:
    """Set ``.grad`` as data-parallel training over ``world`` ranks produces it.

    Each rank's gradient is that of the mean loss over its own sequences; DDP multiplies it
    by ``1/world`` and all-reduces (sums) the results, FSDP2 reduce-scatters likewise. With
    two ranks the sum of two terms is commutative, so ``g0/2 + g1/2`` rounded once in the
    gradient dtype is exactly what every rank receives. ``world=1`` is plain full-batch
    training. Returns the mean of the per-rank losses (float32)."""
    x, y = batch(step)
    if world == 1:
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, x, y)
        loss.backward()
        return loss.detach()
    params = [p for p in model.parameters() if p.requires_grad]
    total = None
    losses = []
    for rank in range(world):
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, shard_of(x, rank, world), shard_of(y, rank, world))
        loss.backward()
        losses.append(loss.detach())
        scaled = [p.grad * (1.0 / world) for p in params]
        total = scaled if total is None else [a + b for a, b in zip(total, scaled)]
    for p, g in zip(params, total):
        p.grad = g
    return torch.stack(losses).mean()


def train_reference(strategy: str, steps: int = STEPS, *, world: int = 2, model=None,
                    optimizer=None, start: int = 0, **opt_kwargs):
    """Single-process training: ``world=2`` emulates the data-parallel gradient exactly,
    ``world=1`` uses the full-batch gradient. Returns (model, optimizer, losses, stats)."""
    if model is None:
        model = build_model(strategy)
    if optimizer is None:
        optimizer = make_optimizer(model.parameters(), strategy, **opt_kwargs)
    losses, stats = [], []
    for step in range(start, start + steps):
        losses.append(float(reference_grads(model, step, world)))
        optimizer.step()
        stats.append(dict(optimizer.update_stats))
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer, losses, stats


# ------------------------------------------------------------------------- snapshots


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a (possibly sharded) tensor; a collective for a DTensor."""
    tensor = tensor.detach()
    if hasattr(tensor, "full_tensor"):
        if tensor.dtype == torch.int16:
            # gloo (and NCCL) cannot all-gather int16: move the bits as bfloat16
            from torch.distributed.tensor import DTensor

            bits = DTensor.from_local(tensor.to_local().view(torch.bfloat16),
                                      tensor.device_mesh, tensor.placements,
                                      shape=tensor.shape, stride=tensor.stride())
            return bits.full_tensor().view(torch.int16)
        tensor = tensor.full_tensor()
    return tensor.clone()


def snapshot(model: nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """Every weight and every optimizer state tensor, whole, keyed ``name`` and
    ``name:state_key``. Collective under FSDP2: call on every rank in the same order."""
    out = {}
    for name, param in model.named_parameters():
        out[name] = full(param)
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if isinstance(value, torch.Tensor):
                out[f"{name}:{key}"] = full(value)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.float64: torch.int64}
    return t.view(ints[t.dtype]) if t.dtype in ints else t


def bitwise_mismatches(got: dict, want: dict) -> list[str]:
    """Keys whose tensors differ in dtype, shape or any bit (nan and -0 included)."""
    bad = []
    if set(got) != set(want):
        bad.append(f"keys differ: only got {sorted(set(got) - set(want))[:5]}, only want "
                   f"{sorted(set(want) - set(got))[:5]}")
    for key in sorted(set(got) & set(want)):
        a, b = got[key], want[key]
        if a.dtype != b.dtype or a.shape != b.shape:
            bad.append(f"{key}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
        elif not torch.equal(_bits(a), _bits(b)):
            diff = (a.double() - b.double()).abs().max().item()
            n = int((_bits(a) != _bits(b)).sum())
            bad.append(f"{key}: {n}/{a.numel()} elements differ, max |diff| {diff:.3g}")
    return bad


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """A hash of names, dtypes, shapes and bytes: equal digests mean bitwise-equal dicts."""
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].detach().contiguous().cpu()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(_bits(t).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes())
    return h.hexdigest()


#: Relative tolerance of a sharded run's sums against one process's: on CPU the native
#: measured step (the default for AdamW) sums float32 partial sums of at most 256 terms per
#: local shard, so shards regroup them (collage.metrics.update_sums_blocked states the
#: bound); the counts, and so the imprecision ratios, stay exact.
STATS_REL = (256 + 8) * 2.0**-24


def stats_mismatches(got: list[dict], want: list[dict], rel: float = STATS_REL) -> list[str]:
    """Per-step update_stats that differ: imprecision ratios (of exact counts) must be
    equal, the other metrics within ``rel`` (sums taken in another grouping)."""
    bad = []
    if len(got) != len(want):
        return [f"{len(got)} steps of stats vs {len(want)}"]
    for step, (a, b) in enumerate(zip(got, want)):
        if set(a) != set(b):
            bad.append(f"step {step}: keys differ {sorted(set(a) ^ set(b))[:4]}")
            continue
        for key in a:
            x, y = a[key], b[key]
            if math.isnan(x) and math.isnan(y):
                continue
            if key.startswith("imprecision") and x != y:
                bad.append(f"step {step} {key}: {x!r} vs {y!r} (counts are exact)")
            elif not math.isclose(x, y, rel_tol=rel, abs_tol=1e-300):
                bad.append(f"step {step} {key}: {x!r} vs {y!r}")
    return bad[:10]


# ------------------------------------------------------------------------- the bound


def adam_step_bound(step: int, betas=BETAS) -> float:
    """An upper bound of ``|m_hat / sqrt(v_hat)|`` at ``step`` (1-based), for any gradients.

    By Cauchy-Schwarz, ``|sum_k b1^k (1-b1) g_k| <= (1-b1) sqrt(sum_k (b1^2/b2)^k)
    sqrt(sum_k b2^k g_k^2)``; with the bias corrections this is
    ``(1-b1)/(1-b1^t) * sqrt((1-b2^t)/(1-b2)) * sqrt(sum_{k<t} (b1^2/b2)^k)`` (1 at t=1)."""
    b1, b2 = betas
    series = sum((b1 * b1 / b2) ** k for k in range(step))
    return (1 - b1) / (1 - b1**step) * math.sqrt((1 - b2**step) / (1 - b2)) * math.sqrt(series)


def divergence_bound(strategy: str, steps: int, max_abs_weight: float,
                     lr: float = LR, weight_decay: float = WEIGHT_DECAY,
                     betas=BETAS) -> float:
    """Largest possible ``|w_a - w_b|`` per element after ``steps`` AdamW steps from the same
    weights, whatever the two gradient sequences: each run moves an element by at most
    ``sum_t lr * (C_t + wd |w|)`` in exact arithmetic; the landing of a rounded strategy can
    at most double a step (round to nearest: the old weight is a candidate) or add one unit
    in the last place (stochastic rounding, MCF/Kahan visible weight); 10% slack covers the
    bf16 arithmetic of the moments."""
    ulp = 0.0 if strategy == "fp32" else max_abs_weight * 2.0**-7
    landing = 2.0 if strategy in ("bf16", "kahan", AUTO) else 1.0  # (auto: a bf16 rung)
    per_run = 0.0
    for t in range(1, steps + 1):
        per_run += landing * lr * (1.1 * adam_step_bound(t, betas) + weight_decay
                                   * max_abs_weight) + ulp
    return 2.0 * per_run


def init_process_group(rank: int, world: int, init_file: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))


def fsdp_wrap(model: nn.Module, inner: bool = False) -> nn.Module:
    """FSDP2 (``fully_shard``) on the block and the root, over all ranks (1-D mesh).
    ``inner``: matrices sharded on their second dimension (``Shard(1)``, where it divides
    evenly), so that a rank's shard is no flat range of the whole tensor."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    def placement(param: torch.Tensor):
        return Shard(1) if param.dim() == 2 and param.shape[1] % 2 == 0 else Shard(0)

    kwargs = {"shard_placement_fn": placement} if inner else {}
    fully_shard(model.block, **kwargs)
    fully_shard(model, **kwargs)
    return model


#: The optimizer state each strategy keeps per parameter, with dtypes (AdamW).
EXPECTED_STATE: dict[str, dict[str, torch.dtype]] = {
    "fp32": {"exp_avg": torch.float32, "exp_avg_sq": torch.float32},
    "mixed": {"exp_avg": torch.float32, "exp_avg_sq": torch.float32, "master": torch.float32},
    "bf16": {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16},
    "kahan": {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16,
              "compensation": torch.bfloat16},
    "stochastic": {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16},
    "light": {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16,
              "weight_lo": torch.bfloat16},
    "plus": {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16,
             "exp_avg_sq_lo": torch.bfloat16, "weight_lo": torch.bfloat16},
    "split": {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16,
              "exp_avg_sq_lo": torch.bfloat16, "weight_low_bits": torch.int16},
}


def state_layout_problems(model: nn.Module, optimizer, strategy: str) -> list[str]:
    """Each state tensor has the strategy's dtype and, for a sharded (DTensor) weight, is a
    DTensor with the weight's mesh, placements and local shape; ``step`` is a plain 0-d
    float32 tensor."""
    bad = []
    for name, param in model.named_parameters():
        want = EXPECTED_STATE[optimizer.strategy_of(param) if strategy == AUTO else strategy]
        state = optimizer.state.get(param, {})
        if set(state) != {"step", *want}:
            bad.append(f"{name}: state keys {sorted(state)}")
            continue
        step = state["step"]
        if hasattr(step, "to_local") or step.dtype != torch.float32 or step.dim() != 0:
            bad.append(f"{name}: step is {type(step).__name__} {step.dtype} {tuple(step.shape)}")
        for key, dtype in want.items():
            value = state[key]
            if value.dtype != dtype:
                bad.append(f"{name}:{key} is {value.dtype}, want {dtype}")
            if hasattr(param, "to_local"):
                if not hasattr(value, "to_local"):
                    bad.append(f"{name}:{key} is not a DTensor")
                elif (value.placements != param.placements
                      or value.device_mesh != param.device_mesh
                      or value.to_local().shape != param.to_local().shape
                      or value.shape != param.shape):
                    bad.append(f"{name}:{key} placements {value.placements} local "
                               f"{tuple(value.to_local().shape)} vs weight {param.placements} "
                               f"{tuple(param.to_local().shape)}")
            elif value.shape != param.shape:
                bad.append(f"{name}:{key} shape {tuple(value.shape)}")
    return bad
