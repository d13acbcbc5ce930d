"""What ``collage bench optimizer`` times: collage's AdamW per strategy and path, and the
optimizers it is compared with (torch.optim, optimi's Kahan summation, torchao's bf16
stochastic rounding), each as a :class:`Candidate` that builds a ``step()`` on parameters.

Collage rows run the default configuration, ``nonfinite="skip"`` (one more read of the
gradients, for the check). The fused path also gets a row per strategy for each other policy
asked for (by default ``ignore``, key ``collage:plus:fused+ignore``): no check, which is what
a step after ``optimizer.clip_grad_norm_`` costs (a finite norm spares the check) and what
torch.optim, optimi and torchao do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..optim import AdamW, get_strategy
from ..optim.strategies import MAIN_STRATEGIES

__all__ = ["Candidate", "candidates", "available_baselines", "torchao_adamw", "torch_adamw",
           "STRATEGIES", "PATHS", "DEFAULT_PATHS", "BASELINES", "BASELINE_KEY",
           "DEFAULT_NONFINITE", "NONFINITE"]

#: the strategies benchmarked by default (the main report's; any strategy is accepted)
STRATEGIES = MAIN_STRATEGIES
#: collage's paths and the optimizer flags that select each (``collage.optim.dispatch``)
PATH_FLAGS = {"fused": {"fused": True}, "foreach": {"foreach": True},
              "per_tensor": {"foreach": False}, "reference": {"reference": True}}
PATHS = tuple(PATH_FLAGS)
#: the paths benchmarked without ``--paths`` (per_tensor, the foreach arithmetic one tensor
#: at a time, is opt-in)
DEFAULT_PATHS = ("fused", "foreach", "reference")
BASELINES = ("torch-foreach-bf16", "torch-fused-bf16", "optimi-kahan", "torchao-sr")
BASELINE_KEY = "torch-fused-fp32"
#: the optimizers' default non-finite policy (the headline rows) and the policies a fused row
#: may be timed with besides (``--nonfinite``)
DEFAULT_NONFINITE = "skip"
NONFINITE = ("skip", "ignore")
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01


@dataclass
class Candidate:
    key: str  # row id: "collage:plus:fused", "torch-fused-fp32", ...
    label: str
    bytes_key: str
    weight_dtype: torch.dtype
    make: Callable[[list[torch.nn.Parameter]], Callable[[], object]]  # params -> step()
    path: str | None = None
    strategy: str | None = None
    nonfinite: str | None = None  # collage rows: the optimizer's policy


def _collage(strategy: str, path: str, nonfinite: str = DEFAULT_NONFINITE):
    def make(params):
        opt = AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                    strategy=strategy, nonfinite=nonfinite, **PATH_FLAGS[path])

        def step():
            return opt.step()

        step.optimizer = opt  # read back which path ran (optimizer.last_paths)
        return step

    return make


def torch_adamw(fused: bool):
    """``torch.optim.AdamW``: the fused kernel, or foreach."""
    def make(params):
        opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS,
                                weight_decay=WEIGHT_DECAY, fused=fused or None,
                                foreach=None if fused else True)
        return opt.step

    return make


def _optimi_kahan(params):
    import optimi

    opt = optimi.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                       kahan_sum=True, foreach=True)
    return opt.step


def torchao_adamw():
    """torchao's plain AdamW with ``bf16_stochastic_round`` (``torchao.optim.AdamW`` in some
    releases, ``_AdamW`` in others; ``torchao.prototype.low_bit_optim`` before 0.8)."""
    for module_name in ("torchao.optim", "torchao.prototype.low_bit_optim"):
        try:
            module = __import__(module_name, fromlist=["_"])
        except ImportError:
            continue
        for name in ("AdamW", "_AdamW"):
            cls = getattr(module, name, None)
            if cls is not None:
                return cls
    return None


def _torchao_sr(params):
    cls = torchao_adamw()
    opt = cls(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
              bf16_stochastic_round=True)
    return opt.step


def available_baselines() -> dict[str, str | None]:
    """baseline -> None when usable, else why not."""
    out: dict[str, str | None] = {"torch-foreach-bf16": None, "torch-fused-bf16": None}
    try:
        import optimi  # noqa: F401

        out["optimi-kahan"] = None
    except ImportError:
        out["optimi-kahan"] = "not installed (pip install torch-optimi)"
    try:
        out["torchao-sr"] = None if torchao_adamw() is not None else \
            "torchao has no AdamW with bf16_stochastic_round"
    except Exception as error:  # a broken torchao install
        out["torchao-sr"] = f"import failed: {error}"
    return out


def _baseline_rows(baselines) -> list[Candidate]:
    usable = available_baselines()
    makers = {"torch-foreach-bf16": ("torch.optim.AdamW(foreach) bf16", torch_adamw(False)),
              "torch-fused-bf16": ("torch.optim.AdamW(fused) bf16", torch_adamw(True)),
              "optimi-kahan": ("optimi AdamW kahan_sum bf16", _optimi_kahan),
              "torchao-sr": ("torchao AdamW bf16_stochastic_round", _torchao_sr)}
    rows = []
    for key in baselines:
        if usable.get(key) is None:
            label, make = makers[key]
            rows.append(Candidate(key, label, key, torch.bfloat16, make))
    return rows


def _collage_row(name: str, path: str, nonfinite: str) -> Candidate:
    key, label = f"collage:{name}:{path}", f"collage {name} ({path}"
    if path == "reference":
        label += " = research algorithm"
    if nonfinite != DEFAULT_NONFINITE:
        key += f"+{nonfinite}"
        label += f", nonfinite={nonfinite!r}"
    return Candidate(key, label + ")", name, get_strategy(name).weight_dtypes[0],
                     _collage(name, path, nonfinite), path, name, nonfinite)


def candidates(strategies=STRATEGIES, paths=DEFAULT_PATHS, baselines=BASELINES,
               nonfinite=NONFINITE) -> list[Candidate]:
    """The baselines that are installed, then every strategy on every path in the default
    configuration, then the fused rows of the other ``nonfinite`` policies."""
    rows = _baseline_rows(baselines)
    for path in paths:
        rows += [_collage_row(name, path, DEFAULT_NONFINITE) for name in strategies]
    if "fused" in paths:
        rows += [_collage_row(name, "fused", policy) for policy in nonfinite
                 if policy != DEFAULT_NONFINITE for name in strategies]
    return rows
