"""Loading an optimizer's ``state_dict``: torch.optim's loading, with the saved dtypes kept
and the layout checked against each group's strategy."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from .strategies import get_strategy

__all__ = ["load"]


def load(optimizer, state_dict: dict[str, Any], torch_load: Callable[[dict], None]) -> None:
    """Load ``state_dict`` into ``optimizer`` (``torch_load``: torch.optim's loader).

    torch.optim casts floating-point state to the parameter's dtype on load, which would
    turn fp32 masters and moments into bf16 silently; the saved tensors are restored.
    """
    state_dict = dict(state_dict)
    extra = state_dict.pop("collage", None)
    saved_state = state_dict["state"]
    _check_same_strategies(optimizer, state_dict["param_groups"])
    torch_load(state_dict)
    saved_ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    params = itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)
    for saved_id, param in zip(saved_ids, params):
        if saved_id not in saved_state:
            continue
        restored = {}
        for key, value in saved_state[saved_id].items():
            if isinstance(value, torch.Tensor) and key != "step":
                value = value.to(device=param.device, copy=True)
            restored[key] = value
        optimizer.state[param] = restored
    for index, group in enumerate(optimizer.param_groups):
        group.setdefault("reference", False)
        optimizer._validate_group(group, index)
        _check_layout(optimizer, group, index)
    if extra is not None:
        optimizer.skipped_steps = extra.get("skipped_steps", 0)
        optimizer._steps_taken = extra.get("steps_taken", 0)
        optimizer.seed = extra.get("seed", optimizer.seed)
    else:
        # torch.distributed.checkpoint's get/set_state_dict keep only "state" and
        # "param_groups" (and step once with lr=0 to create the states before loading):
        # the per-parameter step counts tell how many steps were taken.
        steps = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
        optimizer._steps_taken = max(steps, default=0)


def _check_same_strategies(optimizer, saved_groups: list[dict]) -> None:
    """A checkpoint's groups must use this optimizer's strategies (torch.optim would copy
    the saved strategy over ours and mislabel the states)."""
    for index, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
        if saved.get("strategy", group["strategy"]) != group["strategy"]:
            raise ValueError(
                f"param group {index} was saved with strategy {saved['strategy']!r} but "
                f"this optimizer uses {group['strategy']!r}; load it into an optimizer "
                "with the same strategy, or move between strategies with "
                "collage.consolidate and collage.load_full_precision"
            )


def _check_layout(optimizer, group: dict, index: int) -> None:
    """A loaded state must be the one this group's strategy makes, dtypes included."""
    strategy = get_strategy(group["strategy"])
    for name, param in zip(optimizer._param_names(group, index), group["params"]):
        state = optimizer.state.get(param)
        if not state:
            continue
        for component in strategy.components(optimizer.rule, param.dtype):
            if component.key == "param":
                continue
            have = state.get(component.key)
            if have is None or have.dtype != component.dtype:
                got = "missing" if have is None else str(have.dtype)
                raise ValueError(
                    f"optimizer state of parameter {name!r} does not match strategy "
                    f"{strategy.name!r}: {component.key!r} should be {component.dtype}, "
                    f"found {got}. Load a checkpoint saved with the same strategy, or "
                    "convert it with collage.consolidate / collage.load_full_precision"
                )
