"""The optimizer class: parameter groups, validation, the non-finite policy, clipping and
``state_dict``, over the functional core (``group.GroupStep`` run by ``dispatch``).

One class per update rule (``AdamW``, ``SGD``, ``Lion``) over this base; the precision
strategy is a parameter (and a per-group key), never a subclass.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import required

from ..metrics import UpdateStats
from . import convert, dispatch, state_io
from .backward import Cycle, GradSums, HookSet, check_keywords, refuse_data_parallel
from .edits import WriteLog, hides_weight, rederive
from .group import (ITEM_GRAD, ITEM_PARAM, PLAIN_TENSORS, GroupStep, Item, check_gradient,
                    local, make_item)
from .nonfinite import FiniteProof, all_ranks_max, nonfinite_flag, shard_group
from .rules import Rule, plain_numbers
from .strategies import check_weight, get_strategy

__all__ = ["CollageOptimizer", "NONFINITE_POLICIES"]

NONFINITE_POLICIES = ("skip", "raise", "ignore")

Batch = tuple[int, dict, list[Item]]


@dataclass(eq=False)
class _GroupBook:
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
    def of(cls, group: dict, path: str | None = None) -> _GroupBook:
        """The book of a group just checked."""
        book = cls(group, list(group["params"]), group["strategy"], (), path=path)
        book.checked()
        return book


class CollageOptimizer(Optimizer):
    """Base of the precision-aware optimizers (see ``collage.AdamW`` for the arguments)."""

    rule: Rule
    # GradScaler sets ``grad_scale`` and ``found_inf`` on us and calls step(): we unscale in
    # float32 registers (fp16 gradients never need an fp16 unscale) and skip on overflow.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable,
        defaults: dict[str, Any],
        *,
        strategy: str,
        foreach: bool | None,
        fused: bool | None,
        reference: bool,
        track_updates: bool | int,
        nonfinite: str,
        seed: int,
        step_in_backward: bool = False,
        grad_accumulation: str = "plain",
    ) -> None:
        check_keywords(step_in_backward, grad_accumulation)
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite={nonfinite!r} is unknown; use one of: "
                             f"{', '.join(NONFINITE_POLICIES)}")
        if isinstance(track_updates, bool) or track_updates is None:
            track_updates = 1 if track_updates else 0
        if not isinstance(track_updates, int) or track_updates < 0:
            raise ValueError(f"track_updates must be a bool or an int k >= 0 (measure every "
                             f"k-th step), got {track_updates!r}")
        if not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.nonfinite = nonfinite
        self.track_updates = track_updates
        self.seed = seed
        self.step_in_backward = step_in_backward
        self.grad_accumulation = grad_accumulation
        self._start_backward_hooks()
        self._device_skips: torch.Tensor | None = None
        #: the device verdict to make once the groups are prepared (_check_on_device)
        self._unchecked: tuple[torch.Tensor, list[Batch]] | None = None
        self.skipped_steps = 0
        self.update_stats: dict[str, float] = {}
        self._steps_taken = 0
        #: ``id(group)``: its book (:class:`_GroupBook`)
        self._books: dict[int, _GroupBook] = {}
        #: ``id(param)``: the parameter's position in the optimizer, a key of its
        #: stochastic draws. Given once, in the order parameters join (the order of the
        #: groups at construction); kept while the parameter is in a group, so that adding,
        #: removing or moving parameters and groups moves no other parameter's draws. The
        #: keys are the ids of the books' parameters, which the books keep alive.
        self._positions: dict[int, int] = {}
        self._next_position = 0
        self._warned = False
        self._finite_proof: FiniteProof | None = None
        self._writes = WriteLog()  # what each step left in the weights (edits.py)
        defaults = dict(defaults, strategy=strategy, foreach=foreach, fused=fused,
                        reference=reference)
        # as torch.optim: the hyperparameters are checked before ``params`` is read
        self._validate_settings(defaults)
        _check_params_argument(params)
        super().__init__(params, defaults)

    @property
    def last_paths(self) -> dict[int, str]:
        """The path (``dispatch.PATHS``) that stepped each group last, by the group's index
        in ``param_groups`` now (a group moved or removed takes its entry along); groups
        not stepped yet are absent. A new dict at each read."""
        books = self._books
        return {index: book.path for index, group in enumerate(self.param_groups)
                if (book := books.get(id(group))) is not None and book.path is not None}

    # ----------------------------------------------------------------------- validation

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            self._check_membership()
        except Exception:
            self.param_groups.pop()
            raise

    def _validate_group(self, group: dict, index: int) -> None:
        self._validate_settings(group)
        strategy = get_strategy(group["strategy"])
        for name, param in zip(self._param_names(group, index), group["params"]):
            _check_parameter(name, param, differentiable=group.get("differentiable", False))
            if param.is_complex():
                raise TypeError(f"parameter {name!r} is complex; collage optimizers support "
                                "real floating-point parameters only (use torch.view_as_real)")
            check_weight(strategy, param, name)

    def _validate_settings(self, group: dict) -> None:
        """Check a group's (or the defaults') hyperparameters and flags; reads no
        parameter."""
        strategy = get_strategy(group["strategy"])
        strategy.check_rule(self.rule)
        self.rule.validate(group)
        strategy.check_group(self.rule, group)
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
            self._validate_capturable(group)

    def _validate_capturable(self, group: dict) -> None:
        """capturable=True: the Triton kernels, and nothing that reads the device on the
        host during a step (``docs/gpu.md``)."""
        if group["reference"] or group["foreach"] is not None or group["fused"] is False:
            raise ValueError("capturable=True runs the Triton kernels: leave foreach and "
                             "reference unset and fused None, True or 'triton'")
        if self.track_updates:
            raise ValueError("capturable=True cannot measure lost updates (track_updates): "
                             "the sums are read on the host")
        if self.step_in_backward:
            raise ValueError("capturable=True cannot step in backward: each parameter's "
                             "non-finite check is read on the host in its hook; use "
                             "step_in_backward=False")
        if self.nonfinite == "raise":
            raise ValueError("capturable=True cannot raise on a non-finite gradient (raising "
                             "reads the verdict on the host, which waits for the device): use "
                             "nonfinite='skip' (the kernels skip on the device's verdict) or "
                             "'ignore'")

    @staticmethod
    def _param_names(group: dict, index: int) -> list[str]:
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

    def _check_groups(self) -> None:
        """Check what was done to ``param_groups`` since the last step, before any tensor
        changes: groups added, removed or moved, parameters added to or removed from a
        group (:meth:`_check_membership`), hyperparameters set or edited in place."""
        self._check_membership()
        for index, group in enumerate(self.param_groups):
            book = self._books[id(group)]
            if book.unchanged():
                continue
            key = _hyper_key(group)
            if book.hyper != key:
                if _parameters_checked_as(book.hyper, group):
                    # a learning rate schedule's every step: the parameters (the same
                    # ones: _check_membership) were checked for this strategy already
                    self._validate_settings(group)
                else:
                    self._validate_group(group, index)
                book.checked(key)
            else:  # the same values in other objects: compare with these next time
                book.remember_objects()

    def _check_membership(self) -> None:
        """Admit the groups that are new (inserted into ``param_groups`` by hand) or whose
        parameter list changed (checked as ``add_param_group`` checks them; a new parameter
        takes the next position, and no other parameter's changes), and drop the books of
        groups no longer there. One identity comparison per parameter when nothing
        changed."""
        groups = self.param_groups
        books = self._books
        changed = [(index, group) for index, group in enumerate(groups)
                   if (book := books.get(id(group))) is None
                   or not _same_tensors(book.params, group["params"])]
        if changed or len(books) != len(groups):  # (or only removals)
            self._admit(changed)

    def _admit(self, changed: Sequence[tuple[int, dict]]) -> None:
        """Check the ``changed`` (index, group) pairs and that no parameter is in two
        groups, then (nothing changed on error) make or update their books, forget the
        books of groups no longer there and give new parameters positions."""
        for index, group in changed:
            if id(group) not in self._books:
                self._complete_group(group, index)
        for index, group in changed:
            self._validate_group(group, index)
            _refuse_duplicates(group, index, self._param_names(group, index))
        self._refuse_shared_parameters()
        books = self._books
        for index, group in changed:
            book = books.get(id(group))
            if book is None:
                books[id(group)] = _GroupBook.of(group)
            else:  # the paths' plans describe the old parameter list
                book.params, book.cache = list(group["params"]), {}
                book.checked()
        self._books = {id(group): books[id(group)] for group in self.param_groups}
        old, self._positions = self._positions, {}
        for group in self.param_groups:
            for param in group["params"]:
                position = old.get(id(param))
                if position is None:
                    position, self._next_position = self._next_position, self._next_position + 1
                self._positions[id(param)] = position
        if self._hooks is not None:
            params = [p for group in self.param_groups for p in group["params"]]
            refuse_data_parallel(params, self._hooked_feature())
            self._hooks.sync(params)

    def _complete_group(self, group: dict, index: int) -> None:
        """A group put into ``param_groups`` by hand: the defaults filled in, as
        ``add_param_group`` does."""
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise TypeError(f"param group {index} must be a dict whose 'params' is a list of "
                            "tensors; add groups with optimizer.add_param_group(...)")
        for key, value in self.defaults.items():
            if value is required and key not in group:
                raise ValueError(f"param group {index} must specify {key!r}")
            group.setdefault(key, value)

    def _refuse_shared_parameters(self) -> None:
        """A parameter in two groups would be stepped twice per step: refuse it, naming it
        (torch.optim's add_param_group refuses it too)."""
        seen: dict[int, tuple[int, str]] = {}
        for index, group in enumerate(self.param_groups):
            for name, param in zip(self._param_names(group, index), group["params"]):
                first = seen.setdefault(id(param), (index, name))
                if first[0] != index:
                    raise ValueError(
                        f"parameter {first[1]!r} is in param group {first[0]} and also in "
                        f"param group {index} (as {name!r}); list each parameter in one group")

    # ----------------------------------------------------------------------- step

    # Never traced by dynamo: inside a torch.compile'd training step, inductor would drop the
    # bf16 round trips the compensation terms are made of (weight_lo and the Kahan
    # compensation become 0). The step runs eagerly there; fused=True compiles its own
    # kernels with the casts kept.
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; returns the closure's loss (or None)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # the step in backward's books: what its hooks did since the last step
        cycle, self._cycle = self._cycle, None
        self._refuse_scaler_after_hooks()
        self._sums.write_grads(self._name_of)  # grad_accumulation="pair": sums to p.grad
        self._check_groups()
        self._convert_strategies()  # before gathering: the items hold the states
        batches = self._gather()
        sharded = shard_group(itertools.chain.from_iterable(map(ITEM_PARAM, items)
                                                            for _, _, items in batches))
        if cycle is not None:
            cycle.refuse_regrown((item.name, item.param) for _, _, items in batches
                                 for item in items)
            self._report_skipped(cycle)
        stats = (cycle.stats if cycle is not None
                 else UpdateStats() if self._measuring() else None)
        steps = [self._group_step(index, group, items, stats)
                 for index, group, items in batches]
        # every group on its native plan: prepared first (that creates nothing), then one
        # C call checks every gradient and steps every group (_step_planned)
        planned = dispatch.prepare_native_plans(steps)
        if planned is not None and cycle is None and self._step_planned(batches, planned):
            return loss
        if not self._gradients_usable(batches, sharded, steps):
            return loss
        # every group is checked before any is stepped: a mismatch changes nothing
        prepared = [(group, dispatch.prepare(step) if planned is None else ready)
                    for (_, group, _), step, ready
                    in zip(batches, steps, planned or itertools.repeat(None))]
        self._check_on_device(prepared)
        self._count_device_verdict(steps)
        # after every check (a refused step changes nothing), before any kernel: weights
        # written since our last step are the ones the step starts from (edits.py)
        rederived = self._rederive_edits(batches, prepared)
        for group, ready in prepared:
            if ready is not None:
                self._books[id(group)].path = dispatch.run(ready)
        self._note_writes(batches, prepared, rederived)
        self._steps_taken += 1
        if stats is not None:
            if sharded is not None:
                stats.reduce_(sharded)
            self.update_stats = stats.to_dict()
        return loss

    def _step_planned(self, batches: list[Batch], planned: list) -> bool:
        """Every group on its native plan (``planned``, from ``prepare_native_plans``), and
        nothing else due this step: no GradScaler verdict, no weight written since our last
        step (nothing to re-derive). Then one C call checks every gradient for inf and nan
        and steps every group (``dispatch.step_native_plans``: a small model's step is
        mostly fixed costs, #31), with the general way's semantics: a non-finite gradient
        anywhere skips the step (or raises) with every weight and state unchanged. True: the
        step was made, skipped or refused; False: nothing was written (nor the finite proof
        of ``clip_grad_norm_`` used), the caller takes the general way."""
        if getattr(self, "found_inf", None) is not None or not all(
                self._writes.nothing_to_rederive(ready.group.strategy, ready.group.items)
                for ready in planned if ready is not None):
            return False
        proof = self._finite_proof
        check = self.nonfinite != "ignore" and not (
            proof is not None and proof.spares_check_of(list(itertools.chain.from_iterable(
                map(ITEM_GRAD, items) for _, _, items in batches))))
        stepped = dispatch.step_native_plans(planned, check)
        if stepped is None:  # a step counter was changed since: the general way reads them
            return False
        self._finite_proof = self._unchecked = None  # as _gradients_usable leaves them
        if not stepped:
            self._report_nonfinite(batches)  # raises, or counts the skipped step
            return True
        for (_, group, _), ready in zip(batches, planned):
            if ready is not None:
                self._books[id(group)].path = ready.path
        self._steps_taken += 1
        return True

    def _rederive_pending(self) -> None:
        """Apply now the re-derivations the next step would make (``edits.py``), so that
        what is saved or exported beside the weights describes them."""
        for index, group in enumerate(self.param_groups):
            self._writes.rederive_pending(get_strategy(group["strategy"]),
                                          [(p, s) for _, p, s in self._states_of(group, index)])

    def _rederive_edits(self, batches: list[Batch], prepared: list) -> list[bool]:
        """Per group: whether a weight written since our last step had its hidden
        components set from it (``edits.WriteLog.rederive_edited``). A group about to
        run its plan has had every weight's pointer checked against the plan's table."""
        return [self._writes.rederive_edited(
            get_strategy(group["strategy"]), items,
            same_pointers=ready is not None and ready.plan_grads is not None)
            for (_, group, items), (_, ready) in zip(batches, prepared)]

    def _note_writes(self, batches: list[Batch], prepared: list, rederived: list[bool]
                     ) -> None:
        """Record what this step left in the weights it wrote (``edits.WriteLog``). A group
        stepped by its plan, nothing re-derived, left them as the check read them (its
        kernels write through pointers): nothing to record."""
        for (_, group, items), (_, ready), again in zip(batches, prepared, rederived):
            unchanged = ready is not None and ready.by_plan and not again
            if not unchanged and hides_weight(get_strategy(group["strategy"])):
                self._writes.note(item.param for item in items)

    def _group_step(self, index: int, group: dict, items: list[Item],
                    stats: UpdateStats | None, cache: dict | None = None) -> GroupStep:
        """The plain data of one group's step (``group.GroupStep``); ``cache``: the paths'
        cache, the group's by default."""
        book = self._books[id(group)]
        return GroupStep(
            self.rule, get_strategy(group["strategy"]), book.values, items, seed=self.seed,
            grad_scale=getattr(self, "grad_scale", None), foreach=group["foreach"],
            fused=group["fused"], reference=group["reference"], stats=stats,
            cache=book.cache if cache is None else cache, warn=self._warn_fallback)

    def _gather(self) -> list[Batch]:
        """(group index, group, items) for the parameters that have gradients. This runs
        every step, per parameter (issue #29: on a GPU it is host time the step waits
        for): each group is read in passes that run in C (``map`` over the parameters: a
        Python loop costs about 1 us per parameter, a pass about 0.05 us), each item made
        as the tuple it is, without the named tuple's Python-level constructor. Only the
        layout is checked here (a sparse gradient is refused before the non-finite check
        reads it); each path checks dtype and shape where it takes its items
        (``group.check_item``, or a plan against its table), before anything changes."""
        positions = self._parameter_positions()
        state = self.state
        batches = []
        for index, group in enumerate(self.param_groups):
            params = group["params"]
            names = self._param_names(group, index)
            grads = list(map(_GRAD, params))
            if any(map(operator.is_, grads, itertools.repeat(None))):
                present = [grad is not None for grad in grads]
                params = list(itertools.compress(params, present))
                names = list(itertools.compress(names, present))
                grads = list(itertools.compress(grads, present))
            if list(map(_LAYOUT, grads)).count(torch.strided) != len(grads):
                # a sparse gradient: refused here, before the non-finite check reads it;
                # dtype and shape are checked where each path takes its items (a plan
                # compares them with its table, the other paths check every item)
                for name, param, grad in zip(names, params, grads):
                    check_gradient(name, param, grad)
            group_keys = ("", f"group{index}")
            keys = ([(*group_keys, name) for name in names] if "param_names" in group
                    else itertools.repeat(group_keys))
            items = list(map(make_item, zip(
                names, params, grads, map(state.__getitem__, params),
                map(positions.__getitem__, map(id, params)), keys)))
            batches.append((index, group, items))
        return batches

    def _item_of(self, index: int, group: dict, name: str, param: torch.Tensor) -> Item:
        """One parameter's item, as :meth:`_gather` makes it (the same metric keys)."""
        check_gradient(name, param, param.grad)
        keys = ("", f"group{index}")
        if "param_names" in group:
            keys = (*keys, name)
        return Item(name, param, param.grad, self.state[param],
                    self._parameter_positions()[id(param)], keys)

    def _parameter_positions(self) -> dict[int, int]:
        """``id(param)``: the parameter's position in the optimizer (a key of its
        stochastic draws; see ``_positions``), as of the last check of the groups."""
        return self._positions

    def _convert_strategies(self) -> None:
        """Convert the states of groups whose ``strategy`` was set since their states were
        made (``convert.py``). Every conversion is checked before any is made, so one that
        cannot be made changes nothing. After :meth:`_check_membership`."""
        pending = []
        for index, group in enumerate(self.param_groups):
            old = self._books[id(group)].strategy
            if old != group["strategy"]:
                self._validate_group(group, index)
                pending.append((index, group, get_strategy(old),
                                get_strategy(group["strategy"])))
        for index, group, old, new in pending:
            for name, param, state in self._states_of(group, index):
                mismatch = old.state_mismatch(self.rule, param, state)
                if mismatch is not None:
                    raise ValueError(f"cannot convert the state of parameter {name!r} from "
                                     f"strategy {old.name!r} to {new.name!r}: {mismatch}")
        positions = self._parameter_positions()
        for index, group, old, new in pending:
            for _, param, state in self._states_of(group, index):
                if hides_weight(old) and self._writes.edited(param):  # from the edit
                    rederive(old, param, state)
                self.state[param] = convert.convert(self.rule, old, new, param, state,
                                                    self.seed, positions[id(param)])
                self._writes.note((param,))
            book = self._books[id(group)]
            book.strategy, book.cache = new.name, {}

    def _states_of(self, group: dict, index: int) -> list[tuple[str, torch.Tensor, dict]]:
        """(name, parameter, state) of the group's parameters that have a state."""
        return [(name, param, self.state[param])
                for name, param in zip(self._param_names(group, index), group["params"])
                if self.state.get(param)]

    def _measuring(self) -> bool:
        return self.track_updates > 0 and self._steps_taken % self.track_updates == 0

    def _warn_fallback(self, reason: str) -> None:
        if not self._warned:
            warnings.warn(f"collage: fused path unavailable: {reason}", RuntimeWarning,
                          stacklevel=5)
            self._warned = True

    # ----------------------------------------------------------------------- in backward

    def _start_backward_hooks(self) -> None:
        """The hooks of ``step_in_backward`` and ``grad_accumulation="pair"``
        (``backward.py``); parameters are hooked as they join (:meth:`_admit`)."""
        self._cycle: Cycle | None = None
        self._sums = GradSums()
        wanted = self.step_in_backward or self.grad_accumulation != "plain"
        self._hooks = HookSet(self, CollageOptimizer._on_grad_ready) if wanted else None

    def _hooked_feature(self) -> str:
        return ("step_in_backward=True" if self.step_in_backward
                else f"grad_accumulation={self.grad_accumulation!r}")

    # Autograd calls it in the middle of backward: never traced (see step()).
    @torch.compiler.disable
    @torch.no_grad()
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        """A parameter's gradient is complete (its post-accumulate-grad hook)."""
        refuse_data_parallel((), self._hooked_feature())  # a process group made since
        if self.step_in_backward:
            self._step_one(param)
        else:
            self._sums.fold(param)

    def _open_cycle(self) -> Cycle:
        """At the first hook since the last step: check the groups as step() does, once,
        and decide whether this step is measured."""
        self._check_groups()
        self._convert_strategies()
        owner = {id(param): (index, group, name)
                 for index, group in enumerate(self.param_groups)
                 for name, param in zip(self._param_names(group, index), group["params"])}
        self._cycle = Cycle(owner, UpdateStats() if self._measuring() else None)
        return self._cycle

    def _step_one(self, param: torch.Tensor) -> None:
        """Step one parameter on its complete gradient, then free the gradient: what
        step() does to it, through the same dispatch, as a group of one."""
        cycle = self._cycle if self._cycle is not None else self._open_cycle()
        owner = cycle.owner.get(id(param))
        if owner is None or param.grad is None:  # not ours (a hook copied with the model)
            return
        self._refuse_scaler_in_hook()
        index, group, name = owner
        item = self._item_of(index, group, name, param)
        if self._finite_or_skipped(cycle, item):
            book = self._books[id(group)]
            # a plan (native, Triton) per parameter, kept in the group's cache (reset with
            # it) so that the parameters' plans never evict each other
            cache = book.cache.setdefault(("in_backward", id(param)), {})
            ready = dispatch.prepare(self._group_step(index, group, [item], cycle.stats,
                                                      cache))
            strategy = get_strategy(group["strategy"])
            again = self._writes.rederive_edited(
                strategy, [item], same_pointers=ready.plan_grads is not None)
            book.path = dispatch.run(ready)
            if not (ready.by_plan and not again) and hides_weight(strategy):
                self._writes.note((param,))
            cycle.stepped.add(id(param))
        param.grad = None

    def _finite_or_skipped(self, cycle: Cycle, item: Item) -> bool:
        """The non-finite policy for one parameter stepped in backward: the others'
        gradients do not exist yet, so the verdict is per parameter (``docs/memory.md``)."""
        if self.nonfinite == "ignore" or item.grad.device.type == "meta":
            return True
        if not bool(nonfinite_flag([local(item.grad)]).item()):
            return True
        if self.nonfinite == "raise":
            raise FloatingPointError(
                f"non-finite gradient in parameter {item.name!r}; it was not updated, but "
                "with step_in_backward=True the parameters whose gradients completed "
                "earlier in this backward were. Use nonfinite='skip' to skip such a "
                "parameter's update, or find the overflow")
        cycle.skipped.append(item.name)
        return False

    def _report_skipped(self, cycle: Cycle) -> None:
        """At step(): count a step whose backward skipped parameters as one skipped step,
        and say which were skipped."""
        if not cycle.skipped:
            return
        self.skipped_steps += 1
        where = ", ".join(repr(n) for n in cycle.skipped[:5])
        warnings.warn(f"collage: step in backward skipped {len(cycle.skipped)} parameter(s) "
                      f"on a non-finite gradient ({where}); they and their states are "
                      "unchanged, the other parameters were stepped", RuntimeWarning,
                      stacklevel=4)

    def _refuse_scaler_in_hook(self) -> None:
        if getattr(self, "grad_scale", None) is not None:
            raise RuntimeError(_SCALER_IN_BACKWARD)

    def _refuse_scaler_after_hooks(self) -> None:
        """GradScaler sets ``found_inf`` from the gradients it sees in p.grad: under our
        hooks there are none (stepped, or accumulated here)."""
        if getattr(self, "found_inf", None) is None:
            return
        if self.step_in_backward:
            raise RuntimeError(_SCALER_IN_BACKWARD)
        if len(self._sums):
            raise RuntimeError(
                "grad_accumulation='pair' keeps the gradients in the optimizer until "
                "step(), so GradScaler found no gradient to check for inf: call "
                "optimizer.write_grads() before scaler.step(optimizer) (or before "
                "scaler.unscale_(optimizer))")

    def _name_of(self, param: torch.Tensor) -> str:
        """The name of one of the optimizer's parameters (for an error message)."""
        for index, group in enumerate(self.param_groups):
            for name, member in zip(self._param_names(group, index), group["params"]):
                if member is param:
                    return name
        return "(not in the optimizer)"

    def write_grads(self) -> None:
        """Write the gradients accumulated in the optimizer (``grad_accumulation="pair"``)
        into ``p.grad``, each float32 sum rounded once to the weight dtype, and free the
        sums. step() and clip_grad_norm_ do it themselves; call it before other code that
        reads ``p.grad`` (``torch.nn.utils.clip_grad_norm_``, GradScaler, logging). Until
        then ``p.grad`` is None after backward. Nothing to do otherwise."""
        self._sums.write_grads(self._name_of)

    def accumulated_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The float32 sum of ``param``'s gradients accumulated since the last step or
        ``zero_grad`` (``grad_accumulation="pair"``), or None: the optimizer's tensor, to
        read (a copy is the caller's to make)."""
        return self._sums.sum_of(param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim's, and the accumulated gradients dropped (``grad_accumulation``)."""
        self._sums.clear()
        super().zero_grad(set_to_none)

    # ----------------------------------------------------------------------- non-finite

    def _gradients_usable(self, batches: list[Batch], sharded, groups: list[GroupStep]
                          ) -> bool:
        """Apply the GradScaler verdict and the non-finite policy: with one host sync, or,
        where every group's path reads it on the device (``dispatch.verdict_on_device``),
        with none: the verdict goes to the groups and the kernels skip on it. (A step of
        every group by its native plan checks in its own C call: :meth:`_step_planned`.)"""
        proof, self._finite_proof = self._finite_proof, None  # good for one step at most
        self._unchecked = None  # (a step that raised before making its verdict left one)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:
            # GradScaler already checked every gradient; it skips (and we count) on overflow.
            if bool(found_inf.item() > 0):
                self.skipped_steps += 1
                return False
            return True
        if self.nonfinite == "ignore":
            return True
        # a meta tensor holds no values to check (torch.optim steps meta parameters too)
        # is_meta, not device.type: a device object per tensor costs about 1 us (#31)
        grads = list(itertools.chain.from_iterable(map(ITEM_GRAD, items)
                                                   for _, _, items in batches))
        if any(map(_IS_META, grads)):
            grads = [grad for grad in grads if not grad.is_meta]
        if not grads:
            return True
        # A finite norm of these very gradients (clip_grad_norm_) proves every element
        # finite: the check's read of every gradient is skipped.
        if proof is not None and sharded is None and proof.spares_check_of(grads):
            return True
        on_device = self.nonfinite == "skip" and all(dispatch.verdict_on_device(g)
                                                      for g in groups)
        local_grads = (grads if set(map(type, grads)) <= PLAIN_TENSORS
                       else [local(grad) for grad in grads])
        if on_device and sharded is None:
            # the verdict is made once the groups are prepared (_check_on_device): a
            # planned Triton group checks its gradients in kernels over its own tiles
            bad = torch.empty((), dtype=torch.float32, device=local_grads[0].device)
            for group in groups:
                group.found_nonfinite = bad
            self._unchecked = (bad, batches)
            return True
        if sharded is None and not on_device:
            # one process, decided on the host: the native check's verdict as a bool where
            # it reads the gradients (no flag tensor made and read back)
            bad = nonfinite_flag(local_grads, host=True)
        else:
            bad = all_ranks_max(nonfinite_flag(local_grads), sharded)
        if on_device:  # counted by step() once every group is prepared (nothing raised)
            for group in groups:
                group.found_nonfinite = bad
            return True
        if not (bad if isinstance(bad, bool) else bool(bad.item())):
            return True
        self._report_nonfinite(batches)
        return False

    def _check_on_device(self, prepared: list) -> None:
        """Make the device verdict :meth:`_gradients_usable` left to be made (the default
        policy, one process, every group on the Triton kernels), once the groups are
        prepared: a group its Triton plan steps checks its gradients with the plan's
        kernels (``dispatch.check_planned``: over the step's own tiles, no Python per
        tensor); the others' gradients by ``nonfinite_flag``, first (it writes the
        verdict, the kernels only raise it). Nothing is read on the host."""
        unchecked, self._unchecked = self._unchecked, None
        if unchecked is None:
            return
        bad, batches = unchecked
        planned = [ready is not None and dispatch.checks_planned(ready)
                   for _, ready in prepared]
        rest = [item.grad for (_, _, items), done in zip(batches, planned) if not done
                for item in items if not item.grad.is_meta]
        if rest:
            bad.copy_(nonfinite_flag([local(grad) for grad in rest]))
        else:
            bad.zero_()
        for (_, ready), done in zip(prepared, planned):
            if done:
                dispatch.check_planned(ready, bad)

    def _count_device_verdict(self, groups: list[GroupStep]) -> None:
        """Count the verdict :meth:`_gradients_usable` left on the device (the same tensor
        in every group), if it did: after every group was prepared, so that a step that
        raises counts no skip."""
        for group in groups:
            if group.found_nonfinite is not None:
                self._count_on_device(group.found_nonfinite)
                return

    def _count_on_device(self, bad: torch.Tensor) -> None:
        """Add a device verdict to the skipped steps' count kept there (float64: exact), read
        when ``skipped_steps`` is (:meth:`_settle_skips`)."""
        if self._device_skips is None or self._device_skips.device != bad.device:
            self._settle_skips()
            self._device_skips = bad.to(torch.float64)
        else:
            self._device_skips.add_(bad)

    def _settle_skips(self) -> None:
        """Read the steps the kernels skipped on the device's verdict (one host sync), count
        them and warn once for them (their gradients are gone: no names)."""
        pending, self._device_skips = self._device_skips, None
        if pending is None:
            return
        skipped = int(pending.item())
        if skipped:
            self.__dict__["skipped_steps"] += skipped
            warnings.warn(f"collage: skipped {skipped} step(s) on a non-finite gradient, "
                          f"found on the device ({self.__dict__['skipped_steps']} skipped so "
                          "far); weights and states unchanged", RuntimeWarning, stacklevel=3)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped on a non-finite gradient or GradScaler's overflow. Steps skipped
        on a verdict left on the device are read now (one host sync)."""
        self._settle_skips()
        return self.__dict__["skipped_steps"]

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._device_skips = None
        self.__dict__["skipped_steps"] = value

    def _report_nonfinite(self, batches: list[Batch]) -> None:
        names = [item.name for _, _, items in batches for item in items
                 if not bool(torch.isfinite(local(item.grad)).all())]
        where = ", ".join(repr(n) for n in names[:5]) or "(another rank)"
        if self.nonfinite == "raise":
            raise FloatingPointError(
                f"non-finite gradient in parameter {where}; nothing was updated. Use "
                "nonfinite='skip' to skip such steps, or find the overflow (fp16 needs loss "
                "scaling: torch.amp.GradScaler)"
            )
        self.skipped_steps += 1
        warnings.warn(f"collage: skipped step: non-finite gradient in {where} "
                      f"({self.skipped_steps} skipped so far); weights and states unchanged",
                      RuntimeWarning, stacklevel=4)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this optimizer's parameters (those with a
        gradient); returns the total norm. The same arguments, the same clipping, the same
        result bit for bit.

        One thing more: a finite total norm (``norm_type > 0``) proves every gradient
        element finite, since an inf or nan element makes the norm inf or nan. So the next
        :meth:`step` skips its own non-finite check (``nonfinite='skip'`` or ``'raise'``),
        one read of every gradient. The proof holds for the gradients just clipped: the
        next step checks that it sees the same tensors, not modified since (their version
        counters), and otherwise checks as usual; it is used by one step at most.
        Parameters sharded over ranks (FSDP2) are checked as usual. What the version
        counters cannot see (writes through ``.data``) is in ``docs/reliability.md``.
        """
        if self.step_in_backward:
            raise RuntimeError(
                "clip_grad_norm_ cannot clip under step_in_backward=True: each parameter is "
                "stepped as soon as its gradient is complete, before the global norm "
                "exists; use step_in_backward=False to clip by the global norm")
        self._sums.write_grads(self._name_of)
        params = [p for group in self.param_groups for p in group["params"]
                  if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                              error_if_nonfinite=error_if_nonfinite,
                                              foreach=foreach)
        self._finite_proof = None
        if float(norm_type) > 0:  # the 0-"norm" counts non-zeros: inf counts as 1
            self._finite_proof = FiniteProof.of(norm, [p.grad for p in params])
        return norm

    # ----------------------------------------------------------------------- state dict

    def state_dict(self) -> dict[str, Any]:
        self._check_membership()
        self._convert_strategies()  # the saved states are those of the saved strategies
        self._rederive_pending()  # ... and describe the weights as edited (edits.py)
        sd = super().state_dict()
        sd["collage"] = {
            "skipped_steps": self.skipped_steps,
            "steps_taken": self._steps_taken,
            "seed": self.seed,  # keys the counter-based stochastic-rounding draws
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load like torch.optim, but keep every state tensor's saved dtype (torch.optim
        casts floating-point state to the parameter's dtype, which would turn fp32 masters
        and moments into bf16 silently), and all or nothing; see ``state_io.load``. The
        hooks run as torch.optim's: ``register_load_state_dict_pre_hook``'s see (and may
        change or replace) the whole state dict before anything is checked, and
        ``register_load_state_dict_post_hook``'s see the groups and states installed."""
        if isinstance(state_dict, dict):  # (else state_io.load says what it must be)
            state_dict = state_dict.copy()  # shallow, as torch.optim's
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._check_membership()  # positions for parameters added since the last step
        paths = [self._books[id(group)].path for group in self.param_groups]
        # the native plans hold the old state dicts: drop them before loading, or the old
        # tensors would live beside the new ones until each group's next step
        for book in self._books.values():
            book.cache = {}
        self._cycle = None  # (its books describe the old groups)
        state_io.load(self, state_dict)
        # the loaded states describe the weights they were saved with, whichever of the
        # model and the optimizer is loaded first: the next step trusts the weights
        self._writes.forget()
        # the loaded groups are new dicts over the same parameters: new books, the paths
        # kept by index (the same groups)
        self._books = {id(group): _GroupBook.of(group, path)
                       for group, path in zip(self.param_groups, paths)}
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    # ----------------------------------------------------------------------- copies

    #: attributes that are the optimizer's (beyond torch.optim's), copied by deepcopy and
    #: pickle with the groups' books and the positions; the rest (the paths' caches, the
    #: clipping proof, warnings given) start afresh
    _COPIED = ("nonfinite", "track_updates", "seed", "skipped_steps", "update_stats",
               "_steps_taken", "_next_position", "step_in_backward", "grad_accumulation")

    def __getstate__(self) -> dict[str, Any]:
        self._settle_skips()
        out = super().__getstate__()
        out.update({name: self.__dict__[name] for name in self._COPIED})
        # the books and positions with the group dicts and parameters themselves (copied
        # once with param_groups, pickle and deepcopy keep identities), not their ids;
        # the paths' caches start afresh
        books = list(self._books.values())
        out["_books"] = [dataclasses.replace(book, cache={}) for book in books]
        out["_positions"] = [(param, self._positions[id(param)])
                             for book in books for param in book.params]
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        books, positions = state.pop("_books", None), state.pop("_positions", None)
        state.setdefault("step_in_backward", False)  # (pickled before these keywords)
        state.setdefault("grad_accumulation", "plain")
        super().__setstate__(state)
        self._device_skips = None
        self._books = {id(book.group): book for book in books or ()}
        self._positions = {id(param): position for param, position in positions or ()}
        self._warned = False
        self._finite_proof = None
        self._writes = WriteLog()  # the copy's parameters are new objects
        # the copy hooks its own parameters; accumulated gradients are not copied (as
        # p.grad is not part of an optimizer's state)
        self._start_backward_hooks()
        if self._hooks is not None:
            self._hooks.sync(p for group in self.param_groups for p in group["params"])


_SCALER_IN_BACKWARD = (
    "GradScaler cannot be used with step_in_backward=True: the parameters are stepped "
    "during backward, on the scaled gradients, before the scaler unscales or checks them "
    "(the weights stepped in the last backward used scaled gradients). Use bf16 weights "
    "without a scaler, or step_in_backward=False")

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


def _check_params_argument(params) -> None:
    """A clear error for a ``params`` that is no iterable (torch.optim's is Python's
    "'NoneType' object is not iterable"); torch.optim's own checks follow."""
    if not isinstance(params, Iterable):
        raise TypeError("params must be an iterable of parameters (model.parameters()), of "
                        "(name, parameter) pairs (model.named_parameters()) or of param "
                        f"group dicts, got {type(params).__name__}")


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
    """What ``_check_groups`` compares: every value but the parameters, as a deep, immutable
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
    identity and version (a new value written in place bumps the version)."""
    if type(value) in _IMMUTABLE:  # the usual case, first
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_frozen(item) for item in value))
    if isinstance(value, dict):
        return ("dict", *sorted((repr(k), _frozen(v)) for k, v in value.items()))
    return value


@functools.lru_cache(maxsize=256)
def _generated_names(index: int, start: int, stop: int) -> tuple[str, ...]:
    """``group<index>.param<i>`` for ``i`` in ``start .. stop - 1``: made once, not a string
    per parameter and step (a small model's step is mostly per-tensor costs, #31)."""
    return tuple(f"group{index}.param{i}" for i in range(start, stop))


_GRAD = operator.attrgetter("grad")
_LAYOUT = operator.attrgetter("layout")
_IS_META = operator.attrgetter("is_meta")
