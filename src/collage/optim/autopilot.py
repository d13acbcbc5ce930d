"""The precision autopilot (``strategy="auto"``, issue #43, ``docs/autopilot.md``): each
tensor of an ``auto`` group stored at the cheapest rung of a ladder of strategies its own
measured updates allow.

Every tensor of an ``auto`` group starts at the ladder's first rung (``bf16`` by default).
On the steps the pilot measures (every ``every``-th step, as ``track_updates``; the same
measured step, the same sums: ``collage.metrics``), each tensor's **lost-update fraction**
(``imprecision``: of its elements whose intended update was not zero, the share whose
represented weight did not change) is read; above ``threshold``, the tensor is promoted to
the next rung by the exact conversion of ``convert.py`` (the weight the old state represents
is kept; nothing is lost that the new layout can hold). Promotion only: a tensor never goes
down (``docs/autopilot.md`` says why).

The optimizer wires one :class:`Pilot` (its ``_pilot``): ``stepping.gather`` asks it to
:meth:`Pilot.split` each ``auto`` group's items by their current rung, so that each rung is
stepped as a group of that strategy (:class:`RungGroup`: the group's values, the rung's
strategy) by its normal path (native, Triton, compiled, foreach, reference) at full speed;
``stepping.measuring`` asks :meth:`Pilot.due`; ``stepping.land`` hands the measured step to
:meth:`Pilot.decide`. A tensor's rung is a function of its state's layout (the ladder's rungs
differ in bytes), so ``state_dict`` needs nothing more: loading reads each rung back from the
saved state (:meth:`Pilot.loaded_strategy`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from . import convert
from .rules import Rule
from .strategies import NAMES, Strategy, check_weight, get_strategy

__all__ = ["AUTO", "RUNG_KEY", "Autopilot", "Decision", "Pilot", "RungGroup", "owner_of",
           "cache_of", "strategy_bytes"]

#: the strategy name that asks for the autopilot (not a storage strategy: not registered)
AUTO = "auto"

#: the key of an ``auto`` tensor's rung in its *saved* state (``state_dict()`` only, never
#: in the live state): a loader that fills only the keys of its template
#: (``torch.distributed.checkpoint``) still loads which rung the tensor was at
RUNG_KEY = "autopilot_rung"

#: the default ladder, cheapest first; rungs a rule stores no better than the rung below
#: (``plus`` for SGD, whose momentum is no slow EMA: ``light``'s layout) are left out
DEFAULT_LADDER = (NAMES.bf16, NAMES.light, NAMES.plus)


def strategy_bytes(strategy: Strategy, rule: Rule, dtype: torch.dtype = torch.bfloat16
                   ) -> float:
    """Bytes per parameter a strategy holds for ``rule``: weights, what is kept beside them,
    the rule's states and a gradient of the weight's dtype (``collage memory``'s count: 8
    for ``bf16``, 10 for ``light``, 12 for ``plus`` under AdamW)."""
    gradient = torch.empty((), dtype=dtype).element_size()
    return gradient + sum(c.bytes for c in strategy.components(rule, dtype))


@dataclass(frozen=True)
class Autopilot:
    """The autopilot's policy (the optimizers' ``autopilot=`` keyword), for every group
    whose ``strategy`` is ``"auto"``.

    ``ladder``: strategy names, cheapest first, each holding more bytes per parameter than
    the one before (None: ``bf16 -> light -> plus``, without the rungs the rule stores no
    better than the rung below); ``threshold``: a tensor whose lost-update fraction on a
    measured step is above it moves one rung up; ``every``: the pilot measures every
    ``every``-th step (steps 0, every, 2 every...; it decides on those steps only, so that
    ``track_updates`` changes nothing it decides); ``sinks``: metrics sinks (``collage.metrics``) each decision is written to."""

    ladder: tuple[str, ...] | None = None
    threshold: float = 0.5
    every: int = 50
    sinks: tuple = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.ladder is not None:
            if isinstance(self.ladder, str) or not isinstance(self.ladder, Sequence):
                raise ValueError(f"autopilot ladder must be a sequence of strategy names, "
                                 f"cheapest first (e.g. ('bf16', 'light', 'plus')), got "
                                 f"{self.ladder!r}")
            for name in self.ladder:
                if name == AUTO or not isinstance(name, str):
                    raise ValueError(f"autopilot ladder rung {name!r} is not a storage "
                                     "strategy; name strategies such as 'bf16', 'light'")
                try:
                    get_strategy(name)
                except ValueError as error:
                    raise ValueError(f"autopilot ladder rung {name!r} is unknown: "
                                     f"{error}") from None
            if not self.ladder or len(set(self.ladder)) != len(self.ladder):
                raise ValueError(f"autopilot ladder {self.ladder!r} must name at least one "
                                 "strategy, each once")
            object.__setattr__(self, "ladder", tuple(self.ladder))
        if (isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float))
                or not 0 <= self.threshold < 1):
            raise ValueError(f"autopilot threshold must be a fraction in [0, 1) (a tensor "
                             f"losing more of its updates moves up), got {self.threshold!r}")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"autopilot every must be an int >= 1 (measure every k-th "
                             f"step), got {self.every!r}")
        object.__setattr__(self, "sinks", tuple(self.sinks))

    def rungs_for(self, rule: Rule) -> tuple[Strategy, ...]:
        """The ladder's strategies for ``rule``, checked: each supports the rule and holds
        more bytes per parameter than the one before."""
        if self.ladder is None:
            rungs: list[Strategy] = []
            for name in DEFAULT_LADDER:
                strategy = get_strategy(name)
                if (strategy.rules is None or rule.name in strategy.rules) and (
                        not rungs or strategy_bytes(strategy, rule)
                        > strategy_bytes(rungs[-1], rule)):
                    rungs.append(strategy)
            return tuple(rungs)
        rungs = [get_strategy(name) for name in self.ladder]
        for strategy in rungs:
            try:
                strategy.check_rule(rule)
            except ValueError as error:
                raise ValueError(f"autopilot ladder rung {strategy.name!r} cannot step "
                                 f"{rule.title}: {error}; leave it out of the ladder") from None
        for low, high in zip(rungs, rungs[1:]):
            if strategy_bytes(high, rule) <= strategy_bytes(low, rule):
                raise ValueError(
                    f"autopilot ladder {self.ladder!r} is not ordered by bytes: "
                    f"{high.name!r} keeps {strategy_bytes(high, rule):g} bytes per parameter "
                    f"for {rule.title}, {low.name!r} {strategy_bytes(low, rule):g}; list "
                    "the rungs cheapest first, each holding more than the one before")
        return tuple(rungs)


class Decision(NamedTuple):
    """One promotion: at optimizer step ``step`` (0-based, the measured step), tensor
    ``name`` moved from strategy ``old`` to ``new`` because ``lost`` (its lost-update
    fraction) was above the threshold."""

    step: int
    name: str
    old: str
    new: str
    lost: float


class RungGroup(dict):
    """One rung's share of an ``auto`` group for one step: the group's values with the
    rung's ``strategy``; ``whole``: the group itself (its book, its cache)."""

    __slots__ = ("whole",)


def owner_of(group: dict) -> dict:
    """The param group a step's group belongs to (itself, or a rung's whole group)."""
    return group.whole if type(group) is RungGroup else group


def cache_of(book, group: dict) -> dict:
    """The paths' cache of a step's group: a rung has its own, inside its group's (emptied
    with it), so that its native or Triton plan is never another rung's."""
    if type(group) is RungGroup:
        return book.cache.setdefault((AUTO, group["strategy"]), {})
    return book.cache


class Pilot:
    """The autopilot's state across steps (see the module docstring): each tensor's rung,
    by its position in the optimizer (absent: the first rung), and the decisions made."""

    def __init__(self, policy: Autopilot, rule: Rule) -> None:
        if not isinstance(policy, Autopilot):
            raise TypeError(f"autopilot must be a collage.Autopilot, got "
                            f"{type(policy).__name__}")
        self.policy = policy
        self.ladder = policy.rungs_for(rule)
        self.names = tuple(s.name for s in self.ladder)
        self.rungs: dict[int, str] = {}
        self.decisions: list[Decision] = []
        self.active = False  # an auto group was seen at the last split

    def __getstate__(self) -> dict[str, Any]:  # sinks (open files) are not copied
        return {**self.__dict__, "policy": Autopilot(self.policy.ladder,
                                                     self.policy.threshold,
                                                     self.policy.every)}

    # ------------------------------------------------------------------ checks

    def check_group(self, optimizer, group: dict) -> None:
        """What ``admission.validate_settings`` checks of an ``auto`` group, per rung."""
        if optimizer.step_in_backward:
            raise ValueError("strategy='auto' cannot step in backward (each parameter is "
                             "stepped in its hook, before a step's measurement is read): "
                             "use step_in_backward=False, or a fixed strategy")
        if group.get("capturable", False):
            raise ValueError("strategy='auto' cannot be capturable: it measures lost updates "
                             "and decides on the host; use a fixed strategy with "
                             "capturable=True")
        for strategy in self.ladder:
            strategy.check_group(optimizer.rule, group)

    def check_weights(self, names: Sequence[str], params: Sequence[torch.Tensor]) -> None:
        for name, param in zip(names, params):
            for strategy in self.ladder:
                check_weight(strategy, param, name, asked=AUTO)

    # ------------------------------------------------------------------ strategies

    def strategy_at(self, strategy: str, position: int) -> str:
        """The strategy a parameter at ``position`` of a group of ``strategy`` steps with."""
        if strategy != AUTO:
            return strategy
        return self.rungs.get(position, self.names[0])

    def loaded_strategy(self, rule: Rule, param: torch.Tensor, state: Mapping | None
                        ) -> Strategy:
        """The rung a saved state of an ``auto`` group's parameter is at: the rung whose
        layout it has (the ladder's rungs differ in bytes: one at most), the first rung
        for no state; a ValueError where no rung has it."""
        if not state:
            return self.ladder[0]
        for strategy in self.ladder:
            if strategy.matches(rule, param, state):
                return strategy
        raise ValueError(f"the saved state has keys {sorted(set(state) - {'step'})}, the "
                         f"layout of no rung of the autopilot's ladder {self.names}: load "
                         "it into an optimizer with the ladder it was saved with")

    def rung_named(self, name: object, where: str) -> Strategy:
        """The ladder's rung called ``name`` (a saved state's :data:`RUNG_KEY`); a
        ValueError naming ``where`` and the ladder where it has none."""
        if name not in self.names:
            raise ValueError(f"{where} is at rung {name!r}, which the autopilot's ladder "
                             f"{self.names} does not have: load it into an optimizer with "
                             "the ladder it was saved with")
        return self.ladder[self.names.index(name)]

    def move(self, optimizer, param: torch.Tensor, new: Strategy) -> bool:
        """Put an ``auto`` tensor at rung ``new`` (a loaded state's), as a promotion puts
        it (:meth:`_convert`); whether it moved."""
        position = optimizer._positions[id(param)]
        old = self.ladder[self.names.index(self.strategy_at(AUTO, position))]
        if new is old:
            return False
        self._convert(optimizer, param, optimizer.state.get(param), position, old, new)
        for book in optimizer._books.values():
            book.cache = {}  # the plans hold the old states
        return True

    def _convert(self, optimizer, param: torch.Tensor, state: dict | None, position: int,
                 old: Strategy, new: Strategy) -> None:
        """A tensor from rung ``old`` to ``new``: its state converted exactly (none yet:
        made at ``new`` by its first step), the conversion's writes noted (not an edit),
        its rung recorded. The caller drops the plans that hold the old state."""
        if state:
            optimizer.state[param] = convert.convert(optimizer.rule, old, new, param, state,
                                                     optimizer.seed, position)
            optimizer._writes.note((param,))
        self.install({position: new.name})

    def install(self, positions: Mapping[int, str]) -> None:
        """Set the rungs of an ``auto`` group's parameters (a loaded state's); the first
        rung is not stored."""
        for position, name in positions.items():
            if name == self.names[0]:
                self.rungs.pop(position, None)
            else:
                self.rungs[position] = name

    # ------------------------------------------------------------------ a step

    def split(self, batches: list) -> list:
        """Each ``auto`` group's (index, group, items) as one batch per rung that holds
        items, each a :class:`RungGroup` of that rung's strategy; other batches as they
        are."""
        out = []
        self.active = False
        for index, group, items in batches:
            if group["strategy"] != AUTO:
                out.append((index, group, items))
                continue
            self.active = True
            first, rungs = self.names[0], self.rungs
            names = [rungs.get(item.position, first) for item in items]
            for name in self.names:
                share = [item for item, rung in zip(items, names) if rung == name]
                if share or name == first:
                    view = RungGroup(group, strategy=name)
                    view.whole = group
                    out.append((index, view, share))
        return out

    def due(self, steps_taken: int) -> bool:
        """Whether the pilot measures this step (an ``auto`` group seen at the split)."""
        return self.active and steps_taken % self.policy.every == 0

    def decide(self, optimizer, batches: list, stats: Mapping[str, float], step: int
               ) -> dict[str, float]:
        """Promote every tensor of a rung whose measured lost-update fraction is above the
        threshold, by the exact conversion; returns the metrics of the decisions
        (``auto/...``), also written to the sinks. ``stats``: the measured step's
        ``update_stats`` (reduced over the ranks first where the parameters are
        sharded)."""
        promote = []
        for _, group, items in batches:
            if type(group) is not RungGroup:
                continue
            rung = self.names.index(group["strategy"])
            if rung + 1 == len(self.names):
                continue
            for item in items:
                lost = stats.get(f"imprecision/{item.name}", math.nan)
                if lost > self.policy.threshold:  # nan (nothing intended): no decision
                    promote.append((group.whole, item, rung, lost))
        metrics: dict[str, float] = {}
        books = optimizer._books
        for whole, item, rung, lost in promote:
            old, new = self.ladder[rung], self.ladder[rung + 1]
            # after the step's writes were noted: nothing edited to re-derive
            self._convert(optimizer, item.param, item.state, item.position, old, new)
            books[id(whole)].cache = {}  # the plans hold the old states
            self.decisions.append(Decision(step, item.name, old.name, new.name, lost))
            metrics[f"auto/lost/{item.name}"] = lost
            metrics[f"auto/rung/{item.name}"] = float(rung + 1)
        metrics["auto/bytes_per_param"] = self.bytes_per_param(optimizer)
        metrics["auto/promoted"] = float(len(promote))
        for sink in self.policy.sinks:
            sink(step, metrics)
        return metrics

    def bytes_per_param(self, optimizer) -> float:
        """Bytes per parameter the ``auto`` groups hold now: weights, what is kept beside
        them, the rule's states and a gradient of the weight's dtype (``collage memory``'s
        count: 8 for ``bf16``, 10 for ``light``, 12 for ``plus``)."""
        total = elements = 0.0
        by_name = {s.name: s for s in self.ladder}
        for index, group in enumerate(optimizer.param_groups):
            if group["strategy"] != AUTO:
                continue
            for param in group["params"]:
                rung = self.strategy_at(AUTO, optimizer._positions[id(param)])
                n = param.numel()
                total += n * strategy_bytes(by_name[rung], optimizer.rule, param.dtype)
                elements += n
        return total / elements if elements else math.nan
