"""Shared fixtures of the optimizer tests: cases declared as data, tiny models, snapshots.

Nothing here computes an expected value with collage's own kernels: the only collage internal
used is ``kernels.represented_value`` (to *read* what a strategy represents), and it is itself
cross-checked against ``collage.consolidate`` in test_lost_updates.py.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import torch

import collage
from collage.optim import admission, edits, get_strategy, kernels

BF16 = torch.bfloat16
FP16 = torch.float16
FP32 = torch.float32

#: Every strategy that runs every rule (AdamW, SGD, Lion), and those for low-precision
#: (bf16/fp16) weights. plus8 (AdamW only, 8-bit moments) has its own tests in
#: test_eight_bit.py.
ALL_STRATEGIES: tuple[str, ...] = tuple(s for s in collage.STRATEGIES
                                        if get_strategy(s).rules is None)
LOW_STRATEGIES: tuple[str, ...] = tuple(s for s in ALL_STRATEGIES if s != "fp32")

#: Implementation paths and the constructor flags that select them (optim/dispatch.py).
#: ``foreach=False`` (per tensor) is bit for bit ``foreach=True`` (test_per_tensor.py), so
#: the other tests run the three whose arithmetic differs.
PATHS: dict[str, dict[str, Any]] = {
    "reference": {"reference": True},
    "per_tensor": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


def weight_dtype(strategy: str) -> torch.dtype:
    """The weight dtype a test uses for ``strategy`` (bf16 for all but fp32)."""
    return FP32 if strategy == "fp32" else BF16


@dataclass(frozen=True)
class RuleCase:
    """One update rule with the hyperparameters a test runs it with."""

    name: str
    cls: type
    kwargs: dict = field(default_factory=dict)

    def make(self, params, strategy: str, path: str = "foreach", **extra):
        return self.cls(params, strategy=strategy, **PATHS[path], **{**self.kwargs, **extra})

    def __str__(self) -> str:  # readable pytest ids
        return self.name


RULE_CASES: tuple[RuleCase, ...] = (
    RuleCase("adamw", collage.AdamW, {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1}),
    RuleCase("sgd_momentum", collage.SGD,
             {"lr": 5e-2, "momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-2}),
    RuleCase("lion", collage.Lion, {"lr": 3e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}),
)


class TinyMLP(torch.nn.Module):
    """A 2-layer MLP with a LayerNorm: matrices, biases and norm weights."""

    def __init__(self, d_in: int = 8, d_hidden: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, d_hidden)
        self.norm = torch.nn.LayerNorm(d_hidden)
        self.fc2 = torch.nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def make_mlp(dtype: torch.dtype = BF16, seed: int = 0, **sizes) -> TinyMLP:
    """A TinyMLP whose float32 initialisation depends only on ``seed``, cast to ``dtype``."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = TinyMLP(**sizes)
    return model.to(dtype)


def batch(step: int, dtype: torch.dtype = BF16, n: int = 16, d_in: int = 8, d_out: int = 4):
    """A fixed regression batch for ``step`` (deterministic, independent of the global RNG)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, d_in, generator=g)
    y = torch.randn(n, d_out, generator=g)
    return x.to(dtype), y.to(dtype)


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    x, y = batch(step, dtype)
    return torch.nn.functional.mse_loss(model(x).float(), y.float())


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    opt.zero_grad(set_to_none=True)
    loss = loss_of(model, step)
    loss.backward()
    opt.step()
    return float(loss.detach())


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Clones of every weight and every optimizer state tensor, keyed by name."""
    out = {f"param/{n}": p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"state/{n}/{key}"] = value.detach().clone()
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of a tensor (bitwise comparison, NaN and -0.0 included)."""
    int_of = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(int_of[t.element_size()])


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for key in a:
        assert a[key].dtype == b[key].dtype, (key, a[key].dtype, b[key].dtype)
        assert a[key].shape == b[key].shape, key
        same = torch.equal(bits(a[key]), bits(b[key]))
        assert same, f"{key} differs at {int((bits(a[key]) != bits(b[key])).sum())} element(s)"


def represented(opt: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor:
    """What ``param`` represents under its group's strategy, in float64."""
    group = next(g for g in opt.param_groups if any(p is param for p in g["params"]))
    strategy = get_strategy(group["strategy"])
    return kernels.represented_value(strategy, param.detach(), opt.state.get(param, {}))


def roundtrip(obj: Any) -> Any:
    """``torch.save`` to memory and back, as a checkpoint would (``torch.load``'s default
    ``weights_only=True``: a checkpoint must not need pickled code)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer)


class Rederivations:
    """Counts re-derivations (every one goes through ``edits.rederive``, also where
    ``admission`` calls it)."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        original = edits.rederive

        def counted(*args):
            self.count += 1
            original(*args)

        monkeypatch.setattr(edits, "rederive", counted)
        monkeypatch.setattr(admission, "rederive", counted)
