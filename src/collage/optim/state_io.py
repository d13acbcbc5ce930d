"""Loading an optimizer's ``state_dict``, all or nothing.

Everything is checked before anything changes: the number of groups and parameters, each
group's strategy and hyperparameters, each state's keys, dtypes, shapes and step counter.
On any error the optimizer is exactly as before. Then the groups are installed as
torch.optim's loader installs them (the saved values, deep-copied, over our parameters), and
the states as saved (torch.optim would cast floating-point state to the parameter's dtype,
turning fp32 masters and moments into bf16 silently). Entries of ``"state"`` that belong to
no parameter (a hook's marker, say) are kept as they are, as torch.optim keeps them. The
load hooks run around this (``CollageOptimizer.load_state_dict``).

A ``torch.optim.AdamW`` or ``SGD`` state (its groups have no ``strategy``) is converted:
its float32 moments are stored as the group's strategy stores float32 values
(``convert.from_torch_state``): the migration path from an fp32 run.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch

from . import backward, convert
from .admission import check_seed, param_names, validate_group
from .edits import WriteLog
from .nonfinite import settle_skips
from .autopilot import AUTO, RUNG_KEY, Autopilot, Decision, Pilot
from .strategies import Strategy, get_strategy

__all__ = ["load", "mark_rungs", "adopt_rungs"]

#: the keys a ``torch.optim`` state of each rule may hold
_TORCH_STATE_KEYS = {"adamw": {"step", "exp_avg", "exp_avg_sq"},
                     "sgd": {"momentum_buffer", "step"}}


def load(optimizer, state_dict: dict[str, Any]) -> None:
    """Load ``state_dict`` into ``optimizer``, all or nothing."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
        raise ValueError("state_dict must be an optimizer state dict with 'state' and "
                         "'param_groups' (optimizer.state_dict()'s output)")
    saved_groups = state_dict["param_groups"]
    _check_sizes(optimizer, saved_groups)
    merged = [_merged_group(optimizer, group, saved)
              for group, saved in zip(optimizer.param_groups, saved_groups)]
    for index, group in enumerate(merged):
        validate_group(optimizer, {**group, "params": optimizer.param_groups[index]["params"]},
                       index)
    plan = list(_pairs(optimizer, state_dict, merged, saved_groups))
    # each parameter's strategy: its group's, or under "auto" the rung whose layout its
    # saved state has (autopilot.py)
    chosen = [_strategy_to_load(optimizer, name, param, group, saved_state, from_torch)
              for name, param, group, saved_state, from_torch in plan]
    for (name, param, group, saved_state, from_torch), strategy in zip(plan, chosen):
        _check_state(optimizer, name, param, strategy, saved_state, from_torch)
    extra = _checked_extra(state_dict.get("collage"))
    positions = optimizer._positions
    states = {param: _restored(optimizer, param, group, strategy, saved_state, from_torch,
                               optimizer.state.get(param, {}), positions[id(param)])
              for (name, param, group, saved_state, from_torch), strategy
              in zip(plan, chosen) if saved_state is not None}
    rungs = {positions[id(param)]: strategy.name
             for (_, param, group, _, _), strategy in zip(plan, chosen)
             if group["strategy"] == AUTO}
    states.update(_unowned(state_dict["state"], saved_groups))
    groups = [_installed(group, current)
              for group, current in zip(merged, optimizer.param_groups)]
    # nothing changes before this line
    optimizer.param_groups = groups
    optimizer.state.clear()
    optimizer.state.update(states)
    optimizer._pilot.install(rungs)
    _set_extra(optimizer, extra)


def mark_rungs(optimizer, state_dict: dict[str, Any]) -> None:
    """``state_dict()``'s: each ``auto`` tensor's saved state names its rung
    (:data:`RUNG_KEY`), in a copy of that state (the live one is untouched)."""
    states = state_dict["state"]
    for group, saved_group in zip(optimizer.param_groups, state_dict["param_groups"]):
        if group["strategy"] != AUTO:
            continue
        for param, key in zip(group["params"], saved_group["params"]):
            if isinstance(states.get(key), dict):
                rung = optimizer._pilot.strategy_at(AUTO, optimizer._positions[id(param)])
                states[key] = {**states[key], RUNG_KEY: rung}


def adopt_rungs(optimizer, state_dict: dict[str, Any]) -> int:
    """``optimizer.adopt_rungs``: each ``auto`` tensor put at the rung its saved state
    names, exactly (``Pilot.move``), so that a state dict made afterwards has that rung's
    keys; how many moved. Nothing else is loaded."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
        raise ValueError("state_dict must be an optimizer state dict with 'state' and "
                         "'param_groups' (optimizer.state_dict()'s or get_state_dict's)")
    saved_groups = state_dict["param_groups"]
    _check_sizes(optimizer, saved_groups)
    moved = 0
    for index, (group, saved_group) in enumerate(zip(optimizer.param_groups, saved_groups)):
        if group["strategy"] != AUTO:
            continue
        for name, param, key in zip(param_names(group, index), group["params"],
                                    saved_group["params"]):
            saved = state_dict["state"].get(key)
            if isinstance(saved, dict) and RUNG_KEY in saved:
                rung = optimizer._pilot.rung_named(saved[RUNG_KEY], f"parameter {name!r}")
                moved += optimizer._pilot.move(optimizer, param, rung)
    return moved


def _installed(merged: dict, current: dict) -> dict:
    """A loaded group as torch.optim's loader makes it: the saved values deep-copied (no
    list or tensor shared with the state dict), our parameters, our ``param_names`` where
    the state dict has none."""
    group = copy.deepcopy({k: v for k, v in merged.items() if k != "params"})
    group["params"] = current["params"]
    return group


def _unowned(saved_state: dict, saved_groups: list[dict]) -> dict:
    """The entries of a saved ``"state"`` that belong to no saved parameter, as they are."""
    owned = {saved_id for group in saved_groups for saved_id in group["params"]}
    return {key: value for key, value in saved_state.items() if key not in owned}


def _check_sizes(optimizer, saved_groups) -> None:
    if not isinstance(saved_groups, list) or len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"the state dict has {len(saved_groups)} param group(s), this "
                         f"optimizer {len(optimizer.param_groups)}")
    for index, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        if len(saved.get("params", ())) != len(group["params"]):
            raise ValueError(f"param group {index} of the state dict has "
                             f"{len(saved.get('params', ()))} parameters, this optimizer's "
                             f"{len(group['params'])}")


def _merged_group(optimizer, group: dict, saved: dict) -> dict:
    """The group as it will be after loading: the saved values over ours (a torch.optim
    group lacks ours: ``strategy``, ``reference``...), our parameters."""
    if "strategy" in saved and saved["strategy"] != group["strategy"]:
        raise ValueError(
            f"param group {optimizer.param_groups.index(group)} was saved with strategy "
            f"{saved['strategy']!r} but this optimizer uses {group['strategy']!r}; load it "
            "into an optimizer with the same strategy, then set the group's 'strategy' to "
            "convert its state, or move between strategies with collage.consolidate and "
            "collage.load_full_precision")
    if "strategy" not in saved:
        _check_torch_group(optimizer, saved)
    merged = {**group, **{k: v for k, v in saved.items() if k != "params"}}
    merged["params"] = saved["params"]  # ids, as torch.optim's loader expects
    merged.setdefault("reference", False)
    return merged


def _check_torch_group(optimizer, saved: dict) -> None:
    """A torch.optim group: the same update rule as ours (AdamW, not Adam)."""
    rule = optimizer.rule.name
    if rule not in _TORCH_STATE_KEYS or ("betas" in saved) != (rule == "adamw"):
        raise ValueError(f"this state dict is not one of a {optimizer.rule.title} optimizer "
                         f"(a torch.optim state loads into the collage optimizer of the same "
                         "rule: AdamW or SGD)")
    if rule == "adamw" and saved.get("decoupled_weight_decay", True) is False:
        raise ValueError("this state dict is torch.optim.Adam's (weight decay added to the "
                         "gradient), not AdamW's: load it into an Adam optimizer")


def _pairs(optimizer, state_dict: dict, merged: list[dict], saved_groups: list[dict]):
    """(name, parameter, its merged group, its saved state or None, whether it is a
    torch.optim state), in group order."""
    saved_state = state_dict["state"]
    for index, (group, saved_group) in enumerate(zip(merged, saved_groups)):
        names = param_names(optimizer.param_groups[index], index)
        from_torch = "strategy" not in saved_group
        for name, saved_id, param in zip(names, group["params"],
                                         optimizer.param_groups[index]["params"]):
            yield name, param, group, _never_stepped(saved_state.get(saved_id)), from_torch


def _never_stepped(saved):
    """A saved state, or None for an empty one: a parameter never stepped, as if it had
    none (a step refused before any state was made left ``{}`` in states saved before
    ``state_dict`` dropped them; they load as they were saved, not as incomplete ones)."""
    return None if isinstance(saved, dict) and not saved else saved


def _strategy_to_load(optimizer, name: str, param, group: dict, saved: dict | None,
                      from_torch: bool) -> Strategy:
    """The strategy a parameter's saved state is loaded as."""
    if group["strategy"] != AUTO:
        return get_strategy(group["strategy"])
    if from_torch or not isinstance(saved, dict):
        return optimizer._pilot.ladder[0]
    if RUNG_KEY in saved:  # (saved since 2026-12-07; before, the layout says it)
        return optimizer._pilot.rung_named(saved[RUNG_KEY],
                                           f"the saved state of parameter {name!r}")
    try:
        return optimizer._pilot.loaded_strategy(
            optimizer.rule, param, _on(_tensors(saved), param))
    except ValueError as error:
        raise ValueError(f"optimizer state of parameter {name!r}: {error}") from None


def _check_state(optimizer, name: str, param, strategy: Strategy, saved: dict | None,
                 from_torch: bool) -> None:
    if saved is None:
        return
    if not isinstance(saved, dict):
        raise ValueError(f"the saved state of parameter {name!r} is not a dict")
    if "step" not in saved and not (from_torch and optimizer.rule.name == "sgd"):
        raise ValueError(f"the saved state of parameter {name!r} has no 'step' key (its step "
                         "counter); a state without it would restart the bias corrections "
                         "and draws at step 0. Load a complete optimizer.state_dict()")
    _check_step(name, saved.get("step"))
    if from_torch:
        return _check_torch_state(optimizer, name, param, saved)
    restored = _tensors(saved)
    mismatch = strategy.state_mismatch(optimizer.rule, param, _on(restored, param))
    expected = {c.key for c in strategy.components(optimizer.rule, param.dtype)} - {"param"}
    extra = set(restored) - expected
    if mismatch is None and extra:
        mismatch = f"{sorted(extra)} are not the strategy's"
    if mismatch is not None and RUNG_KEY in saved:
        raise ValueError(
            f"the saved state of parameter {name!r} was at the autopilot's rung "
            f"{strategy.name!r} and does not hold its layout: {mismatch}. A "
            "torch.distributed.checkpoint load fills only the keys of its template: call "
            "optimizer.adopt_rungs(loaded_optimizer_state) and load again with a new "
            "template (docs/autopilot.md, 'torch.distributed.checkpoint')")
    if mismatch is not None:
        raise ValueError(
            f"optimizer state of parameter {name!r} does not match strategy "
            f"{strategy.name!r}: {mismatch}. Load a checkpoint saved with the same strategy "
            "and model, or convert it with collage.consolidate / collage.load_full_precision")


def _tensors(saved: dict) -> dict:
    """A saved state's components: without the step counter and the rung's name."""
    return {k: v for k, v in saved.items() if k not in ("step", RUNG_KEY)}


def _check_step(name: str, step) -> None:
    if step is None:
        return
    value = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 0 and value == int(value)):
        raise ValueError(f"the saved step counter of parameter {name!r} is {step!r}; it must "
                         "be a whole number >= 0")


def _check_torch_state(optimizer, name: str, param, saved: dict) -> None:
    keys = _TORCH_STATE_KEYS[optimizer.rule.name]
    if not set(saved) <= keys:
        raise ValueError(f"the saved state of parameter {name!r} has {sorted(set(saved))}; a "
                         f"torch.optim {optimizer.rule.title} state holds {sorted(keys)} "
                         "(amsgrad's max_exp_avg_sq is not supported)")
    for key, value in saved.items():
        if key == "step" or value is None:
            continue
        if (not isinstance(value, torch.Tensor) or not value.is_floating_point()
                or tuple(value.shape) != tuple(param.shape)):
            raise ValueError(f"the saved {key!r} of parameter {name!r} must be a floating "
                             f"tensor of the parameter's shape {tuple(param.shape)}")


def _on(state: dict, param) -> dict:
    """The saved tensors as they will be installed (on the parameter's device)."""
    return {k: (v.to(param.device) if isinstance(v, torch.Tensor) else v)
            for k, v in state.items()}


def _restored(optimizer, param, group: dict, strategy: Strategy, saved: dict,
              from_torch: bool, current: dict, position: int) -> dict:
    if from_torch:  # torch.optim's: convert
        return convert.from_torch_state(optimizer.rule, strategy, param, saved, current,
                                        optimizer.seed, position)
    restored = {}
    for key, value in saved.items():
        if key == RUNG_KEY:
            continue  # (the rung is the pilot's: installed by load)
        if isinstance(value, torch.Tensor) and key == "step":
            # where a new state keeps it: on the host (reading it waits for no device, and
            # a meta parameter's counter still counts), on the device when capturable
            device = param.device if group.get("capturable", False) else "cpu"
            value = value.to(device=device, dtype=torch.float32, copy=True)
        elif isinstance(value, torch.Tensor):
            value = value.to(device=param.device, copy=True)
        restored[key] = value
    if not isinstance(restored.get("step"), torch.Tensor):
        restored["step"] = torch.tensor(float(restored.get("step", 0)), dtype=torch.float32)
    return restored


def _checked_extra(extra) -> dict | None:
    if extra is None:
        return None
    for key in ("skipped_steps", "steps_taken"):
        value = extra.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"state_dict['collage'][{key!r}] must be an int, got {value!r}")
    try:
        check_seed(extra.get("seed", 0), "state_dict['collage']['seed']")
    except TypeError as error:  # a state dict's wrong value: a ValueError, as the others
        raise ValueError(str(error)) from None
    decisions = extra.get("autopilot", [])
    if not isinstance(decisions, list) or not all(
            isinstance(d, (list, tuple)) and len(d) == len(Decision._fields) for d in decisions):
        raise ValueError("state_dict['collage']['autopilot'] must be a list of the "
                         f"autopilot's decisions ({', '.join(Decision._fields)})")
    return extra


def _set_extra(optimizer, extra: dict | None) -> None:
    if extra is not None:
        optimizer.skipped_steps = extra.get("skipped_steps", 0)
        optimizer._steps_taken = extra.get("steps_taken", 0)
        optimizer.seed = extra.get("seed", optimizer.seed)
        optimizer._pilot.decisions = [Decision(*d) for d in extra.get("autopilot", ())]
        return
    # torch.distributed.checkpoint's get/set_state_dict keep only "state" and
    # "param_groups" (and step once with lr=0 to create the states before loading): the
    # per-parameter step counts tell how many steps were taken.
    steps = [int(s["step"]) for s in optimizer.state.values()
             if isinstance(s, dict) and "step" in s]
    optimizer._steps_taken = max(steps, default=0)


# ----------------------------------------------------------------------- pickle, deepcopy

#: attributes that are the optimizer's (beyond torch.optim's), copied by deepcopy and
#: pickle with the groups' books and the positions; the rest (the paths' caches, the
#: clipping proof, warnings given) start afresh
COPIED = ("nonfinite", "track_updates", "seed", "skipped_steps", "update_stats",
          "_steps_taken", "_next_position", "step_in_backward", "grad_accumulation",
          "_pilot")


#: dtypes whose tensors torch pickles but cannot unpickle (torch 2.14's ``pickle.loads`` of
#: a float8 tensor: "type object 'torch.storage.UntypedStorage' has no attribute 'dtype'";
#: deepcopy and ``torch.save`` work): plus8's moments travel as uint8 views
_UNPICKLABLE = frozenset(getattr(torch, name) for name in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name))


class _AsBytes:
    """A tensor of an :data:`_UNPICKLABLE` dtype as pickle and deepcopy carry it: a uint8
    view of the same bytes, viewed back as its dtype when loaded (:func:`_viewed_as`)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self) -> tuple:
        name = str(self.tensor.dtype).removeprefix("torch.")
        return _viewed_as, (self.tensor.view(torch.uint8), name)


def _viewed_as(raw: torch.Tensor, dtype: str) -> torch.Tensor:
    """A pickled :class:`_AsBytes` loaded: its bytes as the dtype named ``dtype``."""
    return raw.view(getattr(torch, dtype))


def _unpicklable(value) -> bool:
    return value.__class__ is torch.Tensor and value.dtype in _UNPICKLABLE


def _picklable_states(state: dict) -> dict:
    """``state`` (the optimizer's, by parameter) with every tensor of an unpicklable dtype
    wrapped (:class:`_AsBytes`, one per tensor: identities kept); ``state`` itself where
    there is none (every strategy but plus8)."""
    if not any(isinstance(s, dict) and any(map(_unpicklable, s.values()))
               for s in state.values()):
        return state
    wrappers: dict[int, _AsBytes] = {}

    def carried(value):
        if not _unpicklable(value):
            return value
        return wrappers.setdefault(id(value), _AsBytes(value))

    out = copy.copy(state)  # a defaultdict stays one
    for key, saved in state.items():
        if isinstance(saved, dict):
            out[key] = {name: carried(value) for name, value in saved.items()}
    return out


def pickled(optimizer, torch_part: dict[str, Any]) -> dict[str, Any]:
    """``__getstate__``: torch.optim's part (``torch_part``) and ours."""
    settle_skips(optimizer)
    out = dict(torch_part)
    out["state"] = _picklable_states(torch_part["state"])
    out.update({name: optimizer.__dict__[name] for name in COPIED})
    # the books and positions with the group dicts and parameters themselves (copied
    # once with param_groups, pickle and deepcopy keep identities), not their ids;
    # the paths' caches start afresh
    books = list(optimizer._books.values())
    out["_books"] = [dataclasses.replace(book, cache={}) for book in books]
    out["_positions"] = [(param, optimizer._positions[id(param)])
                         for book in books for param in book.params]
    return out


def unpickled_torch_part(state: dict[str, Any]) -> dict[str, Any]:
    """``__setstate__``: what torch.optim's ``__setstate__`` takes (ours left out, and
    the keywords a pickle made before them lacked filled in)."""
    state = {key: value for key, value in state.items() if key not in ("_books", "_positions")}
    state.setdefault("step_in_backward", False)
    state.setdefault("grad_accumulation", "plain")
    return state


def unpickle_ours(optimizer, state: dict[str, Any]) -> None:
    """``__setstate__``, after torch.optim's: the books, positions and hooks."""
    if "_pilot" not in optimizer.__dict__:  # pickled before the autopilot
        optimizer._pilot = Pilot(Autopilot(), optimizer.rule)
    optimizer._device_skips = None
    optimizer._books = {id(book.group): book for book in state.get("_books") or ()}
    optimizer._positions = {id(param): position
                            for param, position in state.get("_positions") or ()}
    optimizer._warned = False
    optimizer._finite_proof = None
    optimizer._writes = WriteLog()  # the copy's parameters are new objects
    # the copy hooks its own parameters; accumulated gradients are not copied (as
    # p.grad is not part of an optimizer's state)
    backward.start_hooks(optimizer)
    if optimizer._hooks is not None:
        optimizer._hooks.sync(p for group in optimizer.param_groups for p in group["params"])
