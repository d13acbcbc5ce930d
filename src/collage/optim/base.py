"""The optimizer class: the lifecycle of a precision-aware optimizer (made, groups added,
stepped, saved and loaded, copied), over the functional core (``group.GroupStep`` run by
``dispatch``). Each concern is a module of its own that the class wires:

* ``admission.py``: the arguments, param groups and parameters checked, the groups' books;
* ``stepping.py``: the phases of a step (gather, prepare, land);
* ``nonfinite.py``: the non-finite policy and the skipped steps' count;
* ``backward.py``: the hooks of ``step_in_backward`` and ``grad_accumulation="pair"``;
* ``edits.py``: weights written between steps; ``state_io.py``: ``load_state_dict``.

One class per update rule (``AdamW``, ``SGD``, ``Lion``) over this base; the precision
strategy is a parameter (and a per-group key), never a subclass.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.optim import Optimizer

from . import admission, backward, dispatch, nonfinite, state_io, step_hooks, stepping
from .admission import GroupBook
from .autopilot import Autopilot, Decision, Pilot
from .edits import WriteLog
from .nonfinite import NONFINITE_POLICIES, FiniteProof, settle_skips
from .rules import Rule

__all__ = ["CollageOptimizer", "NONFINITE_POLICIES"]


#: the books' class under its former name here, so that optimizers pickled before the books
#: moved to ``admission.py`` still load
_GroupBook = GroupBook


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
        autopilot: Autopilot | None = None,
    ) -> None:
        backward.check_keywords(step_in_backward, grad_accumulation)
        #: the autopilot of strategy="auto" groups (autopilot.py): each tensor's rung
        self._pilot = Pilot(Autopilot() if autopilot is None else autopilot, self.rule)
        self.track_updates = admission.check_arguments(nonfinite, track_updates, seed)
        self.nonfinite = nonfinite
        self.seed = seed
        self.step_in_backward = step_in_backward
        self.grad_accumulation = grad_accumulation
        backward.start_hooks(self)  # _cycle, _sums, _hooks (backward.py)
        # the non-finite policy's state (nonfinite.py): skips counted on the device, read
        # when skipped_steps is; the device verdict to make once the groups are prepared
        # (check_on_device); the proof of finite gradients left by clip_grad_norm_
        self._device_skips: torch.Tensor | None = None
        self._unchecked: tuple[torch.Tensor, list[stepping.Batch]] | None = None
        self._finite_proof: FiniteProof | None = None
        self.skipped_steps = 0
        self.update_stats: dict[str, float] = {}
        self._steps_taken = 0
        #: ``id(group)``: its book (``admission.GroupBook``)
        self._books: dict[int, GroupBook] = {}
        #: ``id(param)``: the parameter's position in the optimizer, a key of its
        #: stochastic draws. Given once, in the order parameters join (the order of the
        #: groups at construction); kept while the parameter is in a group, so that adding,
        #: removing or moving parameters and groups moves no other parameter's draws. The
        #: keys are the ids of the books' parameters, which the books keep alive.
        self._positions: dict[int, int] = {}
        self._next_position = 0
        self._warned = False
        self._writes = WriteLog()  # what each step left in the weights (edits.py)
        defaults = dict(defaults, strategy=strategy, foreach=foreach, fused=fused,
                        reference=reference)
        # as torch.optim: the hyperparameters are checked before ``params`` is read
        admission.validate_settings(self, defaults)
        admission.check_params_argument(params)
        super().__init__(params, defaults)

    def strategy_of(self, param: torch.Tensor) -> str:
        """The strategy ``param`` is stepped with now: its group's, or under ``"auto"``
        its current rung of the autopilot's ladder (``docs/autopilot.md``)."""
        admission.check_membership(self)
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                return self._pilot.strategy_at(group["strategy"],
                                               self._positions[id(param)])
        raise ValueError("param is not a parameter of this optimizer")

    def adopt_rungs(self, state_dict: dict[str, Any]) -> int:
        """Put each ``auto`` tensor at the rung its saved state names (exactly, as a
        promotion does), loading nothing else; returns how many moved. For
        ``torch.distributed.checkpoint``, which loads only the keys of a template made
        from this optimizer: load once, adopt, make the template again and load
        (``docs/autopilot.md``)."""
        admission.check_membership(self)
        return state_io.adopt_rungs(self, state_dict)

    @property
    def autopilot_decisions(self) -> list[Decision]:
        """The autopilot's promotions (``autopilot.Decision``: step, tensor, from, to,
        the lost fraction that decided), oldest first; a new list."""
        return list(self._pilot.decisions)

    @property
    def last_paths(self) -> dict[int, str]:
        """The path (``dispatch.PATHS``) that stepped each group last, by the group's index
        in ``param_groups`` now (a group moved or removed takes its entry along); groups
        not stepped yet are absent. A new dict at each read."""
        books = self._books
        return {index: book.path for index, group in enumerate(self.param_groups)
                if (book := books.get(id(group))) is not None and book.path is not None}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        try:
            super().add_param_group(param_group)
        except ValueError as refused:  # torch names no parameter: ours where one is shared
            admission.name_shared_parameter(self.param_groups, param_group, refused)
            raise
        try:
            admission.check_membership(self)
        except Exception:
            self.param_groups.pop()
            raise

    # ----------------------------------------------------------------------- step

    # torch's step hooks around it, under no_grad, never traced by dynamo (step_hooks.py)
    @step_hooks.optimizer_step
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; returns the closure's loss (or None).

        Its phases, in order, each in the module of its concern (``docs/design.md``). Where
        a step is refused (changing nothing): ``stepping.step_planned`` and
        ``nonfinite.gradients_usable``; where the updates land: ``stepping.land``
        (``dispatch.run``); where the step in backward steps: ``backward.flush``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # what the backward hooks did since the last step (step_in_backward stepped each
        # parameter in its hook; "pair" keeps each sum in p.grad and the optimizer)
        cycle = backward.take_cycle(self)
        admission.check_groups(self)  # what was done to param_groups since, checked
        admission.convert_strategies(self)  # before gathering: the items hold the states
        batches = stepping.gather(self)
        self._step_gathered(cycle, batches)
        if self.step_in_backward:
            # what step() itself stepped (a gradient set by hand, a reentrant checkpoint's,
            # an unfrozen parameter's first) is consumed as the hooks consume theirs: the
            # loop has no zero_grad, and the next backward would add into it
            backward.free_gradients(batches)
        return loss

    def _step_gathered(self, cycle: backward.Cycle | None, batches: list) -> None:
        """step()'s work once the gradients are gathered: check, then land (or skip)."""
        sharded = stepping.sharded_over(batches)
        if cycle is not None:
            backward.close_cycle(self, cycle, batches)
        stats = stepping.stats_for(self, cycle)
        steps = stepping.group_steps(self, batches, stats)
        # every group on its native plan: prepared first (that creates nothing), then one
        # C call checks every gradient and steps every group (stepping.step_planned)
        planned = dispatch.prepare_native_plans(steps)
        if planned is not None and cycle is None and stepping.step_planned(self, batches,
                                                                           planned):
            return
        if not nonfinite.gradients_usable(self, batches, sharded, steps):
            return  # skipped (counted) or raised: nothing changed
        # every group is checked before any is stepped: a mismatch changes nothing
        prepared = stepping.prepare(batches, steps, planned)
        nonfinite.check_on_device(self, prepared)
        nonfinite.count_device_verdict(self, steps)
        stepping.land(self, batches, prepared, stats, sharded)

    def _warn_fallback(self, reason: str) -> None:
        """The groups' ``warn``: a fused path unavailable, said once per optimizer."""
        if not self._warned:
            warnings.warn(f"collage: fused path unavailable: {reason}", RuntimeWarning,
                          stacklevel=5)
            self._warned = True

    @step_hooks.never_traced  # as torch's
    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim's (without its profiler record where none runs:
        ``step_hooks.zero_grads``), and the accumulated gradients dropped."""
        self._sums.clear()
        if not step_hooks.zero_grads(self, set_to_none):
            super().zero_grad(set_to_none)

    # ----------------------------------------------------------------------- gradients

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
        backward.write_grads(self)
        params = [p for group in self.param_groups for p in group["params"]
                  if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                              error_if_nonfinite=error_if_nonfinite,
                                              foreach=foreach)
        self._finite_proof = None
        if float(norm_type) > 0:  # the 0-"norm" counts non-zeros: inf counts as 1
            self._finite_proof = FiniteProof.of(norm, [p.grad for p in params])
        return norm

    def write_grads(self) -> None:
        """Kept for compatibility: with ``grad_accumulation="pair"``, ``p.grad`` already
        holds each float32 sum's nearest bf16 (the optimizer its low half), for code that
        reads it (``torch.nn.utils.clip_grad_norm_``, GradScaler, logging); nothing to
        write (``docs/memory.md``)."""
        backward.write_grads(self)

    def accumulated_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The float32 sum of ``param``'s gradients accumulated since the last step or
        ``zero_grad`` (``grad_accumulation="pair"``), or None: the optimizer's tensor, to
        read (a copy is the caller's to make)."""
        return self._sums.sum_of(param)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Backward passes that train nothing here: inside, the hooks of
        ``step_in_backward`` and ``grad_accumulation="pair"`` do nothing, and autograd
        leaves each gradient in ``p.grad`` as it does without this optimizer. For a GAN's
        generator loss, which flows through the discriminator (``with d_opt.paused():
        g_loss.backward()``, then ``d_opt.zero_grad()``), and for a backward that only
        reads ``x.grad`` (attribution). Nests; no effect without those hooks."""
        previous = self.__dict__.get("_hooks_paused", False)
        self._hooks_paused = True
        try:
            yield
        finally:
            self._hooks_paused = previous

    def release_hooks(self) -> None:
        """Remove this optimizer's backward hooks for good, so that another optimizer (a
        ``torch.optim`` one, say) sees the gradients (``p.grad`` holds ``"pair"``'s sums,
        to the nearest bf16), and this optimizer goes on as
        ``step_in_backward=False, grad_accumulation="plain"`` (``step()`` steps what
        ``p.grad`` holds). A new collage optimizer over the same parameters releases them
        itself, with a warning."""
        backward.release_hooks(self)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped on a non-finite gradient or GradScaler's overflow. Steps skipped
        on a verdict left on the device are read now (one host sync)."""
        settle_skips(self)
        return self.__dict__["skipped_steps"]

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._device_skips = None
        self.__dict__["skipped_steps"] = value

    # ----------------------------------------------------------------------- state dict

    def state_dict(self) -> dict[str, Any]:
        admission.check_membership(self)
        admission.convert_strategies(self)  # the saved states are those of the saved strategies
        stepping.rederive_pending(self)  # ... and describe the weights as edited (edits.py)
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = OrderedDict()  # they run on the finished dict
        try:
            sd = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        # a parameter whose step was refused before its state was made (a non-finite
        # gradient at the first step) has an empty state: saved as none, as torch.optim's
        # (whose state entries are made by the step that fills them)
        sd["state"] = {key: value for key, value in sd["state"].items()
                       if not (isinstance(value, dict) and not value)}
        state_io.mark_rungs(self, sd)  # an auto tensor's rung, for loaders like DCP's
        sd["collage"] = {
            "skipped_steps": self.skipped_steps,
            "steps_taken": self._steps_taken,
            "seed": self.seed,  # keys the counter-based stochastic-rounding draws
            "autopilot": [list(d) for d in self._pilot.decisions],  # (rungs: the layouts)
        }
        for hook in post_hooks.values():  # as torch.optim's: last, and what one returns is kept
            returned = hook(self, sd)
            if returned is not None:
                sd = returned
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
        admission.check_membership(self)  # positions for parameters added since the last step
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
        admission.rebook(self, paths)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    # ----------------------------------------------------------------------- copies

    def __getstate__(self) -> dict[str, Any]:
        # as state_dict: the copy's states describe the weights as edited (its write log
        # starts afresh over its new parameters, so it would not see an edit made before)
        admission.check_membership(self)
        stepping.rederive_pending(self)
        return state_io.pickled(self, super().__getstate__())

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state_io.unpickled_torch_part(state))
        state_io.unpickle_ours(self, state)

    # ----------------------------------------------------------------------- for others

    # what export, benchmarks and tests read of the optimizer (functions of it, as methods)
    _param_names = staticmethod(admission.param_names)
    _gather = stepping.gather
    _rederive_pending = stepping.rederive_pending

    def _parameter_positions(self) -> dict[int, int]:
        """``id(param)``: the parameter's position in the optimizer (a key of its
        stochastic draws; see ``_positions``), as of the last check of the groups."""
        return self._positions
