"""The optimizer class: parameter groups, validation, the non-finite policy, clipping and
``state_dict``, over the functional core (``group.GroupStep`` run by ``dispatch``).

One class per update rule (``AdamW``, ``SGD``, ``Lion``) over this base; the precision
strategy is a parameter (and a per-group key), never a subclass.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from ..metrics import UpdateStats
from . import convert, dispatch, state_io
from .edits import WriteLog, hides_weight, rederive
from .group import GroupStep, Item, check_gradient, local
from .nonfinite import FiniteProof, all_ranks_max, nonfinite_flag, shard_group
from .rules import Rule
from .strategies import check_weight, get_strategy

__all__ = ["CollageOptimizer", "NONFINITE_POLICIES"]

NONFINITE_POLICIES = ("skip", "raise", "ignore")

Batch = tuple[int, dict, list[Item]]


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
    ) -> None:
        get_strategy(strategy)
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
        self.skipped_steps = 0
        self.update_stats: dict[str, float] = {}
        #: the path that stepped each group last (``dispatch.PATHS``), by group index
        self.last_paths: dict[int, str] = {}
        self._steps_taken = 0
        self._positions: dict[int, int] | None = None
        self._caches: dict[int, dict] = {}
        self._warned = False
        self._finite_proof: FiniteProof | None = None
        self._writes = WriteLog()  # what each step left in the weights (edits.py)
        #: by group index: the strategy its states were made with (a group's strategy set
        #: since converts them at the next step), and its hyperparameters last checked
        self._state_strategies: dict[int, str] = {}
        self._checked_hyper: dict[int, tuple] = {}
        defaults = dict(defaults, strategy=strategy, foreach=foreach, fused=fused,
                        reference=reference)
        super().__init__(params, defaults)

    # ----------------------------------------------------------------------- validation

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._positions = None
        index = len(self.param_groups) - 1
        group = self.param_groups[-1]
        try:
            self._validate_group(group, index)
            _refuse_duplicates(group, index, self._param_names(group, index))
        except Exception:
            self.param_groups.pop()
            raise
        self._state_strategies[index] = group["strategy"]
        self._checked_hyper[index] = _hyper_key(group)

    def _validate_group(self, group: dict, index: int) -> None:
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
        for name, param in zip(self._param_names(group, index), group["params"]):
            if param.is_complex():
                raise TypeError(f"parameter {name!r} is complex; collage optimizers support "
                                "real floating-point parameters only (use torch.view_as_real)")
            check_weight(strategy, param, name)

    def _validate_capturable(self, group: dict) -> None:
        """capturable=True: the Triton kernels, and nothing that reads the device on the
        host during a step (``docs/gpu.md``)."""
        if group["reference"] or group["foreach"] is not None or group["fused"] is False:
            raise ValueError("capturable=True runs the Triton kernels: leave foreach and "
                             "reference unset and fused None, True or 'triton'")
        if self.track_updates:
            raise ValueError("capturable=True cannot measure lost updates (track_updates): "
                             "the sums are read on the host")
        if self.nonfinite != "ignore":
            raise ValueError("capturable=True needs nonfinite='ignore': the non-finite check "
                             "reads a flag on the host, which waits for the device")

    @staticmethod
    def _param_names(group: dict, index: int) -> list[str]:
        return group.get("param_names") or [
            f"group{index}.param{i}" for i in range(len(group["params"]))
        ]

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
        self._check_hyperparameters()
        self._convert_strategies()  # before gathering: the items hold the states
        batches = self._gather()
        sharded = shard_group(item.param for _, _, items in batches for item in items)
        if not self._gradients_usable(batches, sharded):
            return loss
        stats = UpdateStats() if self._measuring() else None
        # every group is checked before any is stepped: a mismatch changes nothing
        prepared = [(index, dispatch.prepare(self._group_step(index, group, items, stats)))
                    for index, group, items in batches]
        # after every check (a refused step changes nothing), before any kernel: weights
        # written since our last step are the ones the step starts from (edits.py)
        rederived = self._rederive_edits(batches, prepared)
        for index, ready in prepared:
            if ready is not None:
                self.last_paths[index] = dispatch.run(ready)
        self._note_writes(batches, prepared, rederived)
        self._steps_taken += 1
        if stats is not None:
            if sharded is not None:
                stats.reduce_(sharded)
            self.update_stats = stats.to_dict()
        return loss

    def _rederive_pending(self) -> None:
        """Apply now the re-derivations the next step would make (``edits.py``), so that
        what is saved or exported beside the weights describes them."""
        for index, group in enumerate(self.param_groups):
            self._writes.rederive_pending(get_strategy(group["strategy"]),
                                          [(p, s) for _, p, s in self._states_of(index)])

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
                    stats: UpdateStats | None) -> GroupStep:
        """The plain data of one group's step (``group.GroupStep``)."""
        return GroupStep(
            self.rule, get_strategy(group["strategy"]), group, items, seed=self.seed,
            grad_scale=getattr(self, "grad_scale", None), foreach=group["foreach"],
            fused=group["fused"], reference=group["reference"], stats=stats,
            cache=self._caches.setdefault(index, {}), warn=self._warn_fallback)

    def _gather(self) -> list[Batch]:
        """(group index, group, items) for the parameters that have gradients."""
        positions = self._parameter_positions()
        batches = []
        state = self.state
        for index, group in enumerate(self.param_groups):
            named = "param_names" in group
            group_keys = ("", f"group{index}")
            items = []
            for name, param in zip(self._param_names(group, index), group["params"]):
                grad = param.grad
                if grad is None:
                    continue
                check_gradient(name, param, grad)
                keys = (*group_keys, name) if named else group_keys
                items.append(Item(name, param, grad, state[param], positions[id(param)],
                                  keys))
            batches.append((index, group, items))
        return batches

    def _parameter_positions(self) -> dict[int, int]:
        """``id(param)``: the parameter's position in the optimizer over all groups (a key
        of its stochastic draws); rebuilt after ``add_param_group``."""
        if self._positions is None:
            params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
            self._positions = {id(p): i for i, p in enumerate(params)}
        return self._positions

    def _check_hyperparameters(self) -> None:
        """Validate each group whose hyperparameters changed since they were last checked
        (a scheduler or a user editing ``param_groups``), before any tensor changes."""
        for index, group in enumerate(self.param_groups):
            key = _hyper_key(group)
            if self._checked_hyper.get(index) != key:
                self._validate_group(group, index)
                self._checked_hyper[index] = key

    def _convert_strategies(self) -> None:
        """Convert the states of groups whose ``strategy`` was set since their states were
        made (``convert.py``). Every conversion is checked before any is made, so one that
        cannot be made changes nothing."""
        pending = []
        for index, group in enumerate(self.param_groups):
            old = self._state_strategies.get(index, group["strategy"])
            if old != group["strategy"]:
                self._validate_group(group, index)
                pending.append((index, get_strategy(old), get_strategy(group["strategy"])))
        for index, old, new in pending:
            for name, param, state in self._states_of(index):
                mismatch = old.state_mismatch(self.rule, param, state)
                if mismatch is not None:
                    raise ValueError(f"cannot convert the state of parameter {name!r} from "
                                     f"strategy {old.name!r} to {new.name!r}: {mismatch}")
        positions = self._parameter_positions()
        for index, old, new in pending:
            for _, param, state in self._states_of(index):
                if hides_weight(old) and self._writes.edited(param):  # from the edit
                    rederive(old, param, state)
                self.state[param] = convert.convert(self.rule, old, new, param, state,
                                                    self.seed, positions[id(param)])
                self._writes.note((param,))
            self._state_strategies[index] = new.name
            self._caches.pop(index, None)

    def _states_of(self, index: int) -> list[tuple[str, torch.Tensor, dict]]:
        """(name, parameter, state) of the group's parameters that have a state."""
        group = self.param_groups[index]
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

    # ----------------------------------------------------------------------- non-finite

    def _gradients_usable(self, batches: list[Batch], sharded) -> bool:
        """Apply the GradScaler verdict and the non-finite policy with one host sync."""
        proof, self._finite_proof = self._finite_proof, None  # good for one step at most
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:
            # GradScaler already checked every gradient; it skips (and we count) on overflow.
            if bool(found_inf.item() > 0):
                self.skipped_steps += 1
                return False
            return True
        if self.nonfinite == "ignore":
            return True
        grads = [item.grad for _, _, items in batches for item in items]
        if not grads:
            return True
        # A finite norm of these very gradients (clip_grad_norm_) proves every element
        # finite: the check's read of every gradient is skipped.
        if proof is not None and sharded is None and proof.covers(grads) \
                and proof.proves_finite():
            return True
        bad = all_ranks_max(nonfinite_flag([local(grad) for grad in grads]), sharded)
        if not bool(bad.item()):
            return True
        self._report_nonfinite(batches)
        return False

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
        and moments into bf16 silently); see ``state_io.load``."""
        # the native plans hold the old state dicts: drop them before loading, or the old
        # tensors would live beside the new ones until each group's next step
        self._caches.clear()
        state_io.load(self, state_dict, super().load_state_dict)
        # the loaded states describe the weights they were saved with, whichever of the
        # model and the optimizer is loaded first: the next step trusts the weights
        self._writes.forget()
        for index, group in enumerate(self.param_groups):
            self._state_strategies[index] = group["strategy"]
            self._checked_hyper[index] = _hyper_key(group)

    # ----------------------------------------------------------------------- copies

    #: attributes that are the optimizer's (beyond torch.optim's), copied by deepcopy and
    #: pickle; the rest (caches, the clipping proof, warnings given) start afresh
    _COPIED = ("nonfinite", "track_updates", "seed", "skipped_steps", "update_stats",
               "last_paths", "_steps_taken", "_state_strategies", "_checked_hyper")

    def __getstate__(self) -> dict[str, Any]:
        out = super().__getstate__()
        out.update({name: self.__dict__[name] for name in self._COPIED})
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._positions = None
        self._caches = {}
        self._warned = False
        self._finite_proof = None
        self._writes = WriteLog()  # the copy's parameters are new objects


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


def _refuse_duplicates(group: dict, index: int, names: list[str]) -> None:
    """A parameter listed twice in a group would be stepped twice per step (torch.optim
    warns and does so); refuse it, naming the parameter."""
    seen: dict[int, str] = {}
    for name, param in zip(names, group["params"]):
        if id(param) in seen:
            raise ValueError(f"param group {index} lists parameter {seen[id(param)]!r} twice "
                             f"(also as {name!r}); list each parameter once")
        seen[id(param)] = name


def _hyper_key(group: dict) -> tuple:
    """What ``_check_hyperparameters`` compares: every value but the parameters; a tensor by
    identity and version (a new value in place bumps the version)."""
    return tuple((key, ("tensor", id(value), value._version)
                  if isinstance(value, torch.Tensor) else value)
                 for key, value in group.items() if key not in ("params", "param_names"))
