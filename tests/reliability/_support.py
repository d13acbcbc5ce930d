"""Shared helpers of the reliability tests: strategies, paths, snapshots, bitwise checks."""

from __future__ import annotations

import os

import pytest
import torch

import collage
from collage import mcf
from collage.mcf import format_info, ulp
from collage.optim import kernels
from collage.optim.strategies import get_strategy

ALL_STRATEGIES = ("fp32", "mixed", "bf16", "kahan", "stochastic", "light", "plus", "split")
LOW_PRECISION = tuple(s for s in ALL_STRATEGIES if s != "fp32")
FP16_STRATEGIES = tuple(s for s in LOW_PRECISION if s != "split")  # split needs bf16
PATHS = ("foreach", "reference")
RULES = {"adamw": collage.AdamW, "sgd": collage.SGD, "lion": collage.Lion}

# Slow (``-m slow``) runs get the full sizes; the default run a quick subset.
FULL = os.environ.get("COLLAGE_RELIABILITY_FULL", "") not in ("", "0")


def path_kwargs(path: str) -> dict:
    """Optimizer arguments that select one implementation path."""
    return {
        "reference": {"reference": True, "fused": False},
        "foreach": {"foreach": True, "fused": False},
        "fused": {"foreach": False, "fused": True},
        "per_tensor": {"foreach": False},
        "default": {},
    }[path]


def weight_dtypes(strategy: str) -> tuple[torch.dtype, ...]:
    if strategy == "fp32":
        return (torch.float32,)
    if strategy == "split":
        return (torch.bfloat16,)
    return (torch.bfloat16, torch.float16)


def dtype_id(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def strategy_dtype_params(strategies=ALL_STRATEGIES):
    """pytest params (strategy, dtype) for every weight dtype a strategy accepts."""
    return [
        pytest.param(s, d, id=f"{s}-{dtype_id(d)}")
        for s in strategies
        for d in weight_dtypes(s)
    ]


def int_view(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of a tensor (so that -0.0 != +0.0 and nan == nan of the same bits)."""
    if not t.is_floating_point():
        return t
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(int_view(a), int_view(b))


def snapshot(opt: torch.optim.Optimizer) -> dict:
    """A deep copy of everything a step may change: weights, every state and the counters
    (stochastic rounding keeps no generator: its draws are keyed by the step counters)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return {
        "params": [p.detach().clone() for p in params],
        "state": [
            {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
             for k, v in opt.state.get(p, {}).items()}
            for p in params
        ],
        "skipped_steps": opt.skipped_steps,
        "steps_taken": opt._steps_taken,
    }


def assert_unchanged(before: dict, opt: torch.optim.Optimizer, *,
                     skipped_delta: int | None) -> None:
    """Every weight, compensation term, state and step counter bitwise equal to ``before``;
    ``skipped_steps`` grown by ``skipped_delta`` (None: not checked here)."""
    after = snapshot(opt)
    names = [n for i, g in enumerate(opt.param_groups) for n in opt._param_names(g, i)]
    for name, b, a in zip(names, before["params"], after["params"]):
        assert bits_equal(b, a), f"weight {name!r} changed"
    for name, sb, sa in zip(names, before["state"], after["state"]):
        assert sb.keys() == sa.keys(), f"state keys of {name!r} changed"
        for key in sb:
            vb, va = sb[key], sa[key]
            if isinstance(vb, torch.Tensor):
                assert bits_equal(vb, va), f"state {key!r} of {name!r} changed"
            else:
                assert vb == va, f"state {key!r} of {name!r} changed"
    assert after["steps_taken"] == before["steps_taken"], "the step counter advanced"
    if skipped_delta is not None:
        assert after["skipped_steps"] == before["skipped_steps"] + skipped_delta, (
            f"skipped_steps went from {before['skipped_steps']} to {after['skipped_steps']}, "
            f"expected +{skipped_delta}")


def normalisation_violations(strategy: str, param: torch.Tensor, state: dict) -> list[str]:
    """Check the non-overlap invariants of a parameter's components; return what fails.

    * light/plus, kahan: the pair (weight, weight_lo or compensation) is canonical: the
      weight is ``hi + lo`` rounded to nearest, ties to even (so ``|lo| <= ulp(weight)/2``);
    * plus/split: ``exp_avg_sq``'s pair likewise (and Lion's ``exp_avg``);
    * split: the visible weight is the float32 master rounded to nearest:
      ``|master - weight| <= ulp(weight)/2``;
    * mixed: the visible weight is the master rounded to nearest (``weight == fl(master)``).

    Only finite leading components are checked; the non-finite rule is tested separately.
    """
    failures = []
    w = param.detach()

    def check_pair(name: str, hi: torch.Tensor, lo: torch.Tensor, canonical: bool = True
                   ) -> None:
        finite = torch.isfinite(hi)
        bound = ulp(hi) / 2
        bad = finite & ~(lo.double().abs() <= bound)
        if canonical:  # hi is the nearest (ties to even) of hi + lo, computed exactly
            # (compared as values: -0.0 + +0.0 is +0.0, the sign of a zero aside)
            nearest = mcf.round_to(hi.double() + lo.double(), hi.dtype)
            bad |= finite & (nearest != hi)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0]) if bad.dim() else 0
            h, l_ = hi.reshape(-1)[i].item(), lo.reshape(-1)[i].item()
            failures.append(f"{name}: not canonical at {int(bad.sum())} element(s), "
                            f"e.g. hi={h!r} lo={l_!r} ulp/2={bound.reshape(-1)[i].item()!r}")

    if "weight_lo" in state:
        check_pair("weight", w, state["weight_lo"])
    if "compensation" in state:
        check_pair("kahan", w, state["compensation"])
    for key in list(state):
        if key.endswith("_lo") and key != "weight_lo":
            check_pair(key[:-3], state[key[:-3]], state[key])
    if "weight_low_bits" in state:
        master = kernels.represented_value(get_strategy(strategy), w, state)
        check_pair("split master", w, (master - w.double()), canonical=False)
    if "master" in state:
        rounded = state["master"].to(w.dtype)
        finite = torch.isfinite(state["master"])
        if not bits_equal(torch.where(finite, rounded, w), w):
            failures.append("mixed: the model weight is not the master rounded to nearest")
    return failures


def represented(strategy: str, param: torch.Tensor, state: dict) -> torch.Tensor:
    """The value the strategy represents (float64)."""
    return kernels.represented_value(get_strategy(strategy), param.detach(), state)


def max_finite(dtype: torch.dtype) -> float:
    return format_info(dtype).max_finite


def overflow_threshold(dtype: torch.dtype) -> float:
    """The smallest magnitude that rounds to inf (round to nearest even)."""
    info = format_info(dtype)
    return info.max_finite + float(ulp(torch.tensor(info.max_finite, dtype=dtype))) / 2
