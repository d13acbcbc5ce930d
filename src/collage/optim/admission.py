"""Admission: the optimizer's arguments, its param groups and their parameters, checked and
taken in before any tensor changes.

The optimizer keeps a book per group (:class:`GroupBook`: its parameters, strategy and
hyperparameters when last checked, the paths' cache) and a position per parameter (a key of
its stochastic draws). :func:`check_groups` runs at the start of every step (and of the first
hook of a backward): it admits what was done to ``param_groups`` since the last check
(:func:`check_membership`: groups added, removed or moved, parameters added or removed),
validates hyperparameters set or edited in place, and costs one identity comparison per
parameter when nothing changed (#31). :func:`convert_strategies` then converts the states of
groups whose ``strategy`` was set since (``convert.py``).

Functions of the optimizer (as ``state_io.load``): it keeps the books (``_books``), the
positions (``_positions``, ``_next_position``) and calls these.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import required

from . import convert
from .autopilot import AUTO
from .edits import hides_weight, rederive
from .hooks import take_over
from .nonfinite import NONFINITE_POLICIES
from .rules import plain_numbers
from .strategies import check_weight, get_strategy

__all__ = ["GroupBook", "SEEDS", "check_arguments", "check_seed", "check_params_argument",
           "validate_settings", "validate_group", "param_names", "check_groups",
           "check_membership", "name_shared_parameter", "convert_strategies", "states_of"]


@dataclass(eq=False)
class GroupBook:
    """What the optimizer keeps about one param group from step to step. The books are
    keyed by the group itself (``id(group)``; a book holds its group, so that the id is
    never another group's): removing, reordering or inserting groups moves nothing from one
    group to another. Not in the group dict: torch.optim's ``state_dict`` saves its keys."""

    group: dict
    #: the group's parameters when last checked (compared by identity at every step)
    params: list
    #: the strategy its states were made with (a ``strategy`` set since converts them)
    strategy: str
    #: its hyperparameters when last validated (``_hyper_key``)
    hyper: tuple
    #: the group's keys and value objects when last validated, where every hyperparameter
    #: is immutable (:func:`_immutable`), else None: then the same objects under the same
    #: keys are the same hyperparameters (``unchanged``)
    seen: tuple | None = None
    #: the group as the kernels read it (``rules.plain_numbers``: numpy's scalars as
    #: floats), made when its hyperparameters are validated; None until then
    values: Any = None
    #: kept for the paths from step to step (the native and Triton plans)
    cache: dict = field(default_factory=dict)
    #: the path (``dispatch.PATHS``) that stepped it last
    path: str | None = None

    def checked(self, key: tuple | None = None) -> None:
        """Note the group's hyperparameters validated (``key``: their ``_hyper_key``)."""
        self.hyper = _hyper_key(self.group) if key is None else key
        self.values = plain_numbers(self.group)
        self.remember_objects()

    def remember_objects(self) -> None:
        """Keep the group's keys and value objects for :meth:`unchanged` (None where a
        hyperparameter is not immutable)."""
        group = self.group
        self.seen = ((tuple(group), tuple(group.values()))
                     if all(_immutable(value) for key, value in group.items()
                            if key not in _NOT_HYPERPARAMETERS) else None)

    def unchanged(self) -> bool:
        """Whether the group holds, under the same keys, the very objects it held when
        last validated, each immutable: then its hyperparameters are those validated, and
        the snapshot (``_hyper_key``, one Python call per value) need not be made. Reads
        no value: a step's fixed cost (#31)."""
        seen, group = self.seen, self.group
        return (seen is not None and len(group) == len(seen[0])
                and all(map(operator.is_, group.values(), seen[1]))
                and tuple(group) == seen[0])

    @classmethod
    def of(cls, group: dict, path: str | None = None) -> GroupBook:
        """The book of a group just checked."""
        book = cls(group, list(group["params"]), group["strategy"], (), path=path)
        book.checked()
        return book


# ----------------------------------------------------------------------- arguments

def check_arguments(nonfinite: str, track_updates: bool | int, seed: int) -> int:
    """Check the optimizer's own keywords; returns ``track_updates`` as an int k >= 0."""
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite={nonfinite!r} is unknown; use one of: "
                         f"{', '.join(NONFINITE_POLICIES)}")
    if isinstance(track_updates, bool) or track_updates is None:
        track_updates = 1 if track_updates else 0
    if not isinstance(track_updates, int) or track_updates < 0:
        raise ValueError(f"track_updates must be a bool or an int k >= 0 (measure every "
                         f"k-th step), got {track_updates!r}")
    check_seed(seed, "seed")
    return track_updates


#: the seeds taken: torch.manual_seed's range. The draws' keys are mixed from 64-bit words
#: (``draws.mix``: a negative seed is taken modulo 2**64, as torch maps one into its range);
#: beyond it a seed would alias one inside (``2**64 + 5`` drawing what 5 draws)
SEEDS = range(-2**63, 2**64)


def check_seed(seed, where: str) -> None:
    """``seed`` is an int in :data:`SEEDS` (a bool is no seed)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{where} must be an int, got {type(seed).__name__}")
    if seed not in SEEDS:
        raise ValueError(f"{where} must be in [-2**63, 2**64), as torch.manual_seed's (it "
                         f"keys the 64-bit stochastic-rounding draws), got {seed}")


def check_params_argument(params) -> None:
    """A clear error for a ``params`` that is no iterable (torch.optim's is Python's
    "'NoneType' object is not iterable"); torch.optim's own checks follow."""
    if not isinstance(params, Iterable):
        raise TypeError("params must be an iterable of parameters (model.parameters()), of "
                        "(name, parameter) pairs (model.named_parameters()) or of param "
                        f"group dicts, got {type(params).__name__}")


# ----------------------------------------------------------------------- validation

def validate_group(optimizer, group: dict, index: int) -> None:
    validate_settings(optimizer, group)
    names = param_names(group, index)
    for name, param in zip(names, group["params"]):
        _check_parameter(name, param, differentiable=group.get("differentiable", False))
        if param.is_complex():
            raise TypeError(f"parameter {name!r} is complex; collage optimizers support "
                            "real floating-point parameters only (use torch.view_as_real)")
    if group["strategy"] == AUTO:  # every rung of the ladder takes every weight
        optimizer._pilot.check_weights(names, group["params"])
        return
    strategy = get_strategy(group["strategy"])
    for name, param in zip(names, group["params"]):
        check_weight(strategy, param, name)


def validate_settings(optimizer, group: dict) -> None:
    """Check a group's (or the defaults') hyperparameters and flags; reads no
    parameter. ``strategy="auto"``: every rung of the autopilot's ladder (checked for the
    rule when the optimizer was made)."""
    if group["strategy"] == AUTO:
        optimizer.rule.validate(group)
        optimizer._pilot.check_group(optimizer, group)
    else:
        strategy = get_strategy(group["strategy"])
        strategy.check_rule(optimizer.rule)
        optimizer.rule.validate(group)
        strategy.check_group(optimizer.rule, group)
    if group["foreach"] not in (None, True, False):
        raise TypeError(f"foreach must be None, True or False, got {group['foreach']!r}")
    if group["fused"] not in (None, True, False, "triton"):
        raise TypeError(f"fused must be None, True, False or 'triton', got "
                        f"{group['fused']!r}")
    if not isinstance(group["reference"], bool):
        raise TypeError(f"reference must be True or False, got {group['reference']!r}")
    if group["foreach"] and group["fused"]:
        raise ValueError("foreach=True and fused=True are exclusive; set at most one")
    if group["reference"] and group["fused"]:
        raise ValueError("reference=True and fused=True are exclusive; set at most one")
    _refuse_unsupported(group)
    if group.get("capturable", False):
        _validate_capturable(optimizer, group)


def _validate_capturable(optimizer, group: dict) -> None:
    """capturable=True: the Triton kernels, and nothing that reads the device on the
    host during a step (``docs/gpu.md``)."""
    if group["reference"] or group["foreach"] is not None or group["fused"] is False:
        raise ValueError("capturable=True runs the Triton kernels: leave foreach and "
                         "reference unset and fused None, True or 'triton'")
    if optimizer.track_updates:
        raise ValueError("capturable=True cannot measure lost updates (track_updates): "
                         "the sums are read on the host")
    if optimizer.step_in_backward:
        raise ValueError("capturable=True cannot step in backward: each parameter's "
                         "non-finite check is read on the host in its hook; use "
                         "step_in_backward=False")
    if optimizer.nonfinite == "raise":
        raise ValueError("capturable=True cannot raise on a non-finite gradient (raising "
                         "reads the verdict on the host, which waits for the device): use "
                         "nonfinite='skip' (the kernels skip on the device's verdict) or "
                         "'ignore'")


def param_names(group: dict, index: int) -> list[str]:
    """A name per parameter: the group's ``param_names``, and ``group<i>.param<j>``
    for parameters that have none (an unnamed group, or parameters appended to a
    named group's ``params`` without a name)."""
    names = group.get("param_names") or []
    params = group["params"]
    if len(names) > len(params):
        raise ValueError(
            f"param group {index} has {len(names)} param_names for {len(params)} "
            "parameters: a parameter was removed from its 'params' but not its name "
            "from 'param_names'; remove both")
    return [*names, *_generated_names(index, len(names), len(params))]


# ----------------------------------------------------------------------- groups

def check_groups(optimizer) -> None:
    """Check what was done to ``param_groups`` since the last step, before any tensor
    changes: groups added, removed or moved, parameters added to or removed from a
    group (:func:`check_membership`), hyperparameters set or edited in place."""
    check_membership(optimizer)
    books = optimizer._books
    for index, group in enumerate(optimizer.param_groups):
        book = books[id(group)]
        if book.unchanged():
            continue
        key = _hyper_key(group)
        if book.hyper != key:
            if _parameters_checked_as(book.hyper, group):
                # a learning rate schedule's every step: the parameters (the same
                # ones: check_membership) were checked for this strategy already
                validate_settings(optimizer, group)
            else:
                validate_group(optimizer, group, index)
                _refuse_pooled_names(optimizer.param_groups)  # (a group made 'auto')
            book.checked(key)
        else:  # the same values in other objects: compare with these next time
            book.remember_objects()


def check_membership(optimizer) -> None:
    """Admit the groups that are new (inserted into ``param_groups`` by hand) or whose
    parameter list changed (checked as ``add_param_group`` checks them; a new parameter
    takes the next position, and no other parameter's changes), and drop the books of
    groups no longer there. One identity comparison per parameter when nothing
    changed."""
    groups = optimizer.param_groups
    books = optimizer._books
    changed = [(index, group) for index, group in enumerate(groups)
               if (book := books.get(id(group))) is None
               or not _same_tensors(book.params, group["params"])]
    if changed or len(books) != len(groups):  # (or only removals)
        _admit(optimizer, changed)


def _admit(optimizer, changed: Sequence[tuple[int, dict]]) -> None:
    """Check the ``changed`` (index, group) pairs and that no parameter is in two
    groups, then (nothing changed on error) make or update their books, forget the
    books of groups no longer there and give new parameters positions."""
    for index, group in changed:
        if id(group) not in optimizer._books:
            _complete_group(optimizer.defaults, group, index)
    for index, group in changed:
        validate_group(optimizer, group, index)
        _refuse_duplicates(group, index, param_names(group, index))
    _refuse_shared_parameters(optimizer.param_groups)
    _refuse_pooled_names(optimizer.param_groups)
    books = optimizer._books
    for index, group in changed:
        book = books.get(id(group))
        if book is None:
            books[id(group)] = GroupBook.of(group)
        else:  # the paths' plans describe the old parameter list
            book.params, book.cache = list(group["params"]), {}
            book.checked()
    optimizer._books = {id(group): books[id(group)] for group in optimizer.param_groups}
    old, positions = optimizer._positions, {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            position = old.get(id(param))
            if position is None:
                position = optimizer._next_position
                optimizer._next_position = position + 1
            positions[id(param)] = position
    optimizer._positions = positions
    params = [p for group in optimizer.param_groups for p in group["params"]]
    take_over(params, optimizer._hooks)  # an older optimizer's hooks on them released
    if optimizer._hooks is not None:  # step_in_backward, grad_accumulation (backward.py)
        optimizer._hooks.admit(params)


def _complete_group(defaults: dict, group: dict, index: int) -> None:
    """A group put into ``param_groups`` by hand: the defaults filled in, as
    ``add_param_group`` does."""
    if not isinstance(group, dict) or not isinstance(group.get("params"), list):
        raise TypeError(f"param group {index} must be a dict whose 'params' is a list of "
                        "tensors; add groups with optimizer.add_param_group(...)")
    for key, value in defaults.items():
        if value is required and key not in group:
            raise ValueError(f"param group {index} must specify {key!r}")
        group.setdefault(key, value)


def name_shared_parameter(groups: list[dict], new_group: dict, refused: ValueError) -> None:
    """Where torch.optim's ``add_param_group`` refused ``new_group`` (``refused``: "some
    parameters appear in more than one parameter group", no name), the same refusal naming
    the parameter and both groups; nothing where it refused something else."""
    if isinstance(new_group.get("params"), list):  # torch made it one before refusing
        try:
            _refuse_shared_parameters([*groups, new_group])
        except ValueError as named:
            raise named from refused


def _refuse_shared_parameters(groups: list[dict]) -> None:
    """A parameter in two groups would be stepped twice per step: refuse it, naming it
    (torch.optim's add_param_group refuses it too)."""
    seen: dict[int, tuple[int, str]] = {}
    for index, group in enumerate(groups):
        for name, param in zip(param_names(group, index), group["params"]):
            first = seen.setdefault(id(param), (index, name))
            if first[0] != index:
                raise ValueError(
                    f"parameter {first[1]!r} is in param group {first[0]} and also in "
                    f"param group {index} (as {name!r}); list each parameter in one group")


def _refuse_pooled_names(groups: list[dict]) -> None:
    """Under ``strategy='auto'`` every parameter's name must be its own: the autopilot
    decides each tensor by the lost-update fraction measured under its name
    (``imprecision/<name>``), and two tensors of one name (two modules'
    ``named_parameters()`` in two groups: both have ``weight``) would be measured together
    and promoted, or kept, together. Refuse such a pair, naming it and the fix."""
    if not any(group["strategy"] == AUTO for group in groups):
        return
    seen: dict[str, int] = {}
    for index, group in enumerate(groups):
        for name in param_names(group, index):
            if name in seen:
                raise ValueError(
                    f"two parameters are named {name!r} (param groups {seen[name]} and "
                    f"{index}): strategy='auto' decides each tensor by the lost updates "
                    "measured under its name, so they would be judged together; give each "
                    "parameter its own name, e.g. {'params': [(f'head.{n}', p) for n, p in "
                    "head.named_parameters()]}")
            seen[name] = index


def rebook(optimizer, paths: list[str | None]) -> None:
    """New books for the groups a ``load_state_dict`` installed (new dicts over the same
    parameters), the paths kept by index (the same groups)."""
    optimizer._books = {id(group): GroupBook.of(group, path)
                        for group, path in zip(optimizer.param_groups, paths)}


# ----------------------------------------------------------------------- strategies

def convert_strategies(optimizer) -> None:
    """Convert the states of groups whose ``strategy`` was set since their states were
    made (``convert.py``). Every conversion is checked before any is made, so one that
    cannot be made changes nothing. After :func:`check_membership`."""
    rule, state, books = optimizer.rule, optimizer.state, optimizer._books
    positions, pilot = optimizer._positions, optimizer._pilot
    pending = []
    for index, group in enumerate(optimizer.param_groups):
        old = books[id(group)].strategy
        if old != group["strategy"]:
            validate_group(optimizer, group, index)
            pending.append((index, group, old))
    conversions = []
    for index, group, old_name in pending:
        if group["strategy"] == AUTO and old_name not in pilot.names:
            raise ValueError(f"param group {index} cannot move from strategy {old_name!r} "
                             f"to 'auto': its ladder is {pilot.names}; set 'auto' when "
                             "the optimizer is made, or move from a strategy of the ladder")
        for name, param, param_state in states_of(optimizer, group, index):
            # a tensor's strategy before and after: leaving 'auto', its rung; entering
            # it (from a rung), that rung, kept
            old = get_strategy(pilot.strategy_at(old_name, positions[id(param)]))
            new = get_strategy(old.name if group["strategy"] == AUTO else group["strategy"])
            mismatch = old.state_mismatch(rule, param, param_state)
            if mismatch is not None:
                raise ValueError(f"cannot convert the state of parameter {name!r} from "
                                 f"strategy {old.name!r} to {new.name!r}: {mismatch}")
            conversions.append((param, param_state, old, new))
    writes = optimizer._writes
    for param, param_state, old, new in conversions:
        if hides_weight(old) and writes.edited(param):  # from the edit
            rederive(old, param, param_state)
        if new is not old:
            state[param] = convert.convert(rule, old, new, param, param_state,
                                           optimizer.seed, positions[id(param)])
            writes.note((param,))
    for index, group, _ in pending:
        pilot.install({positions[id(param)]: (
            pilot.strategy_at(books[id(group)].strategy, positions[id(param)])
            if group["strategy"] == AUTO else pilot.names[0])
            for param in group["params"]})
        book = books[id(group)]
        book.strategy, book.cache = group["strategy"], {}


def states_of(optimizer, group: dict, index: int) -> list[tuple[str, torch.Tensor, dict]]:
    """(name, parameter, state) of the group's parameters that have a state."""
    state = optimizer.state
    return [(name, param, state[param])
            for name, param in zip(param_names(group, index), group["params"])
            if state.get(param)]


# ----------------------------------------------------------------------- helpers

#: torch.optim's keywords whose True is not implemented, and why
_UNSUPPORTED = {
    "amsgrad": "AMSGrad's running maximum of the second moment is not implemented; use "
               "amsgrad=False",
    "differentiable": "steps run under torch.no_grad(), as torch.optim's do by default; use "
                      "differentiable=False",
}


def _refuse_unsupported(group: dict) -> None:
    for key, why in _UNSUPPORTED.items():
        if group.get(key, False):
            raise NotImplementedError(f"{key}=True: {why}")


def _check_parameter(name: str, param, *, differentiable: bool) -> None:
    """What torch.optim's add_param_group checks of each parameter (here also of one
    appended to a group's list later), naming it."""
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"parameter {name!r} is a {type(param).__name__}; an optimizer "
                        "steps tensors only")
    if not differentiable and not (param.is_leaf or param.retains_grad):
        raise ValueError(f"parameter {name!r} is not a leaf tensor: an optimizer cannot "
                         "step it (torch.optim: \"can't optimize a non-leaf Tensor\")")


def _parameters_checked_as(hyper: tuple, group: dict) -> bool:
    """Whether a group last validated with the ``_hyper_key`` ``hyper`` had its parameters
    checked for what ``group`` now asks of them: the same strategy (the weights' dtypes)
    and ``differentiable`` flag (leaves only). Then a change of other hyperparameters
    needs no per-parameter check (#31: a scheduler changes the learning rate every step)."""
    old = dict(hyper)
    return (old.get("strategy") == group["strategy"]
            and old.get("differentiable", False) == group.get("differentiable", False))


def _same_tensors(a: list, b: list) -> bool:
    """Whether two lists hold the same tensors, compared by identity (``==`` on tensors
    compares elements)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _refuse_duplicates(group: dict, index: int, names: list[str]) -> None:
    """A parameter listed twice in a group would be stepped twice per step (torch.optim
    warns and does so); refuse it, naming the parameter."""
    seen: dict[int, str] = {}
    for name, param in zip(names, group["params"]):
        if id(param) in seen:
            raise ValueError(f"param group {index} lists parameter {seen[id(param)]!r} twice "
                             f"(also as {name!r}); list each parameter once")
        seen[id(param)] = name


_IMMUTABLE = frozenset({float, int, bool, str, type(None)})
#: the group's keys that are not hyperparameters (checked as membership, not snapshotted)
_NOT_HYPERPARAMETERS = ("params", "param_names")


def _hyper_key(group: dict) -> tuple:
    """What ``check_groups`` compares: every value but the parameters, as a deep, immutable
    snapshot (:func:`_frozen`), so that any change, in place included, is validated."""
    return tuple((key, _frozen(value)) for key, value in group.items()
                 if key not in _NOT_HYPERPARAMETERS)


def _immutable(value) -> bool:
    """Whether ``value`` can never change in place: a number, a string, None, or a tuple
    of such (exact types: a subclass may carry mutable state)."""
    if type(value) in _IMMUTABLE:
        return True
    return type(value) is tuple and all(map(_immutable, value))


def _frozen(value) -> Any:
    """``value`` as an immutable snapshot: lists and tuples as tuples of snapshots (a list
    ``betas`` edited in place compares unequal), a dict as its sorted items, a tensor by
    identity and version (a new value written in place bumps the version), an array (a
    numpy array: ``lr[...] = 0`` keeps the object and has no version) by its bytes."""
    if type(value) in _IMMUTABLE:  # the usual case, first
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_frozen(item) for item in value))
    if isinstance(value, dict):
        return ("dict", *sorted((repr(k), _frozen(v)) for k, v in value.items()))
    if callable(getattr(value, "tobytes", None)):
        return ("array", type(value).__name__, str(getattr(value, "dtype", "")),
                tuple(getattr(value, "shape", ())), value.tobytes())
    return value


@functools.lru_cache(maxsize=256)
def _generated_names(index: int, start: int, stop: int) -> tuple[str, ...]:
    """``group<index>.param<i>`` for ``i`` in ``start .. stop - 1``: made once, not a string
    per parameter and step (a small model's step is mostly per-tensor costs, #31)."""
    return tuple(f"group{index}.param{i}" for i in range(start, stop))
