"""Weights changed outside the optimizer: seen, and the hidden components re-derived.

A strategy that keeps something beside the visible weight (``mixed``'s float32 master, the
low part of ``light``/``plus``/``plus8``'s pair, ``kahan``'s compensation, ``split``'s low
bits: the components of role ``master``, ``low`` or ``compensation``) represents a value the
weight alone does not show. When the user writes the weight (``w.zero_()`` under
``no_grad``, ``model.load_state_dict``, a pruning mask ``w.mul_(mask)``, EMA weights swapped
in with ``w.copy_(...)``, ``w.data = t``), those components describe the old weight, and a
step would start from them: the edit would be undone. torch.optim keeps no such state, so
its next step starts from the weight as the user left it; so does ours:

* after every step, :class:`WriteLog` records per parameter what the optimizer left: the
  weight's version counter and its data pointer, read after the step's own writes (torch's
  in-place ops bump the counter; the native C and Triton kernels write through pointers,
  and ``dispatch`` then moves each counter by one, which :meth:`WriteLog.bumped` follows
  without reading them);
* before the next step's kernels run (after every check, so that a refused step changes
  nothing), a parameter whose counter or pointer differs was written by someone else: its
  hidden components are set from the visible weight with the strategy's own inverse,
  ``Strategy.set_from_full(weight, state, weight)``: ``master = weight``, ``lo = 0``,
  ``compensation = 0``, ``split``'s low bits 0. The represented value is then the weight
  exactly, and a step at lr = 0 keeps it bit for bit. The rule's states (moments) are kept,
  as torch.optim keeps them.

A weight replaced through ``.data`` with the same values (``model.to(memory_format=
torch.channels_last)``, which gives each 4-d weight a new tensor with the same values in
another layout; a move and back) is not an edit: its counter is the same and only its
pointer moved, so the log compares the new data with the data it recorded (it keeps a
detached alias of each weight's data: no copy while the weight keeps its storage; the old
storage of a replaced weight stays alive until the next step looks at it, then is let go).
Equal bits: the components are kept; other values: an edit, as above.

Parameters that are views of one storage (a flat buffer's slices, a fused QKV weight cut
in three) may share one version counter: a write to one moves the others'. So the log
records which parameters share a storage (when it records their marks), and around the
optimizer's own writes to such parameters (:meth:`WriteLog.siblings_before` and
:meth:`WriteLog.siblings_after`) it moves each sharer's mark by what those writes moved its
counter: never read as an edit, whichever of them were written, in whatever order (the
hooks of a step in backward step them one bucket at a time). A user's write to one view
between steps is still an edit of every view whose counter it moves: those are re-derived.

In place, so the native and Triton plans (which check data pointers) stay valid and read
the new values. Strategies with nothing beside the weight are not walked at all. What is
not seen (a write through ``.data``, which has its own version counter, or through another
library's view of the memory) is in ``docs/reliability.md``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from operator import attrgetter, itemgetter

import torch

from .group import ITEM_PARAM, PLAIN_TENSORS, Item, local
from .strategies import Strategy

__all__ = ["WriteLog", "hides_weight", "rederive"]

#: the roles of components that describe the weight beside the visible one
_HIDDEN_ROLES = frozenset({"master", "low", "compensation"})

Mark = tuple[int, int]
#: a storage, for telling which parameters share one: (device, the storage's data pointer)
StorageKey = tuple[str, int]
#: what :meth:`WriteLog.siblings_before` read: the sharers, and their counters then
Snapshot = tuple[list[torch.Tensor], list[int]]

_VERSION = attrgetter("_version")
_VERSION_OF_MARK = itemgetter(0)
_PLUS_ONE = (1).__add__  # a version moved by one, in a pass that runs in C


def hides_weight(strategy: Strategy) -> bool:
    """Whether ``strategy`` keeps a component that describes the weight beside it (read
    from its declared components, kept on the strategy object)."""
    known = strategy.__dict__.get("_hides_weight")
    if known is None:
        known = any(component.role in _HIDDEN_ROLES
                    for dtype in strategy.weight_dtypes
                    for component in strategy.weight_components(dtype))
        strategy.__dict__["_hides_weight"] = known
    return known


def _mark(param: torch.Tensor) -> Mark:
    """What a write changes: the version counter (every in-place torch op bumps it) and the
    data pointer (``p.data = t`` keeps the counter)."""
    if param.__class__ in PLAIN_TENSORS:  # version and pointer are the weight's own
        return param._version, param.data_ptr()
    return _sharded_mark(param)


def _sharded_mark(param: torch.Tensor) -> Mark:
    """A DTensor's mark: an in-place op on the DTensor bumps its own counter, one on its
    local shard (the optimizer's kernels) the shard's; both only grow, so their sum is
    unchanged exactly when neither moved. The pointer is the shard's."""
    shard = local(param)
    return param._version + shard._version, shard.data_ptr()


#: the integer dtype of each element size: bits compared as integers (-0 is not +0, a NaN
#: equals itself)
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(old: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether two tensors hold the same elements bit for bit, whatever their layouts."""
    if (old.shape != new.shape or old.dtype != new.dtype or old.device != new.device
            or old.element_size() not in _BITS):
        return False
    bits = _BITS[old.element_size()]
    return torch.equal(old.view(bits), new.view(bits))


@torch.no_grad()  # also outside a step (state_dict, consolidate): the weight is a leaf
def rederive(strategy: Strategy, param: torch.Tensor, state: dict) -> None:
    """Set the components beside the weight from the visible weight, in place: the
    represented value becomes the weight exactly (``Strategy.set_from_full``; the weight
    itself is written with its own value)."""
    weight = local(param)
    parts = {key: local(value) for key, value in state.items()
             if isinstance(value, torch.Tensor)}
    strategy.set_from_full(weight, parts, weight.double())


class WriteLog:
    """Per parameter (by identity), the mark the optimizer's last write left."""

    __slots__ = ("_left", "_kept", "_bumps", "_data", "_storage_of", "_sharers", "_shared")

    def __init__(self) -> None:
        self._left: dict[int, Mark] = {}
        #: per parameter, a detached alias of the data its mark was taken on: what a
        #: replacement through ``.data`` is compared with (:meth:`_replaced`)
        self._data: dict[int, torch.Tensor] = {}
        #: per tuple of parameter ids (a group stepped through pointers), how many times
        #: a kernel moved each one's counter by one since their marks were taken: added
        #: to the marks before they are read (:meth:`_apply_bumps`), so that the common
        #: step pays one dictionary entry per group, not a Python loop over its parameters
        self._bumps: dict[tuple[int, ...], int] = {}
        # per group (by its first parameter's id), the parameters' ids and the versions
        # :meth:`_versions_kept` last found equal to their marks; emptied whenever a mark
        # changes, so that equal versions still mean "as the optimizer left them"
        self._kept: dict[int, tuple[list[int], list[int]]] = {}
        #: per parameter, its storage; per storage, the parameters on it (weakly: a
        #: parameter dropped from the optimizer must not be kept alive); the parameters
        #: that share their storage with another one
        self._storage_of: dict[int, StorageKey] = {}
        self._sharers: dict[StorageKey, dict[int, weakref.ref]] = {}
        self._shared: set[int] = set()

    def forget(self) -> None:
        """Trust the weights as they are (a fresh ``load_state_dict``: the loaded states
        describe the weights they were saved with)."""
        self._left.clear()
        self._kept.clear()
        self._bumps.clear()
        self._data.clear()

    def note(self, params: Iterable[torch.Tensor]) -> None:
        """Record the marks the optimizer leaves in ``params`` (after its writes)."""
        self._apply_bumps()
        left, data = self._left, self._data
        for param in params:
            key, mark = id(param), _mark(param)
            known = left.get(key)
            if known is None or known[1] != mark[1]:  # new, or new data: which storage
                self._place(param)
            left[key] = mark
            alias = data.get(key)
            if alias is None or alias.data_ptr() != mark[1]:  # (an alias per storage)
                data[key] = local(param).detach()
        self._kept.clear()

    def _place(self, param: torch.Tensor) -> None:
        """Record ``param``'s storage, and which parameters share one."""
        key, data = id(param), local(param)
        storage = (str(data.device), data.untyped_storage().data_ptr())
        old = self._storage_of.get(key)
        if old == storage:
            return
        if old is not None:
            self._sharers.get(old, {}).pop(key, None)
            self._recount(old)
        if storage[1] == 0:  # no memory (meta, empty): shares nothing
            self._storage_of.pop(key, None)
            self._shared.discard(key)
            return
        self._storage_of[key] = storage
        self._sharers.setdefault(storage, {})[key] = weakref.ref(param)
        self._recount(storage)

    def _recount(self, storage: StorageKey) -> None:
        members = self._sharers.get(storage, {})
        live = {key: ref for key, ref in members.items() if ref() is not None}
        if len(live) > 1:
            self._sharers[storage] = live
            self._shared.update(live)
            return
        self._shared.difference_update(members)
        if live:
            self._sharers[storage] = live
        else:
            self._sharers.pop(storage, None)

    def siblings_before(self, params: Iterable[torch.Tensor]) -> Snapshot | None:
        """Before the optimizer writes ``params``: the counters of every parameter that
        shares a storage with one of them (None, at the cost of one set operation, where
        none does: the common case)."""
        if not self._shared:
            return None
        touched = self._shared.intersection(map(id, params))
        if not touched:
            return None
        sharers: dict[int, torch.Tensor] = {}
        for key in touched:
            for other, ref in self._sharers.get(self._storage_of[key], {}).items():
                param = ref()
                if param is not None:
                    sharers[other] = param
        found = list(sharers.values())
        return found, [_mark(param)[0] for param in found]

    def siblings_after(self, snapshot: Snapshot | None,
                       written: Iterable[torch.Tensor]) -> None:
        """After the optimizer's writes (and their :meth:`note` or :meth:`bumped`): each
        sharer's mark moves by what those writes moved its counter. A written parameter
        was checked before them, so its mark is its counter now; another keeps whatever
        an edit of it moved beyond its mark before."""
        if snapshot is None:
            return
        self._apply_bumps()
        written_ids = set(map(id, written))
        for param, before in zip(*snapshot):
            key = id(param)
            mark, now = self._left.get(key), _mark(param)
            if mark is None:
                continue
            if key in written_ids:
                self._left[key] = now
            else:
                self._left[key] = (mark[0] + now[0] - before, mark[1])
        self._kept.clear()

    def bumped(self, items: Sequence[Item]) -> None:
        """The step moved the version counter of each item's parameter by exactly one
        (``dispatch``: kernels that write through pointers), and recorded nothing else:
        the marks follow. The group's cached versions move at once (one list); the marks
        themselves when next read."""
        ids = list(map(id, map(ITEM_PARAM, items)))
        if not ids:
            return
        kept = self._kept.get(ids[0])
        if kept is not None and kept[0] == ids:
            self._kept[ids[0]] = (ids, list(map(_PLUS_ONE, kept[1])))
        bumps, key = self._bumps, tuple(ids)
        bumps[key] = bumps.get(key, 0) + 1  # counts add up: the order of bumps is moot
        if len(bumps) > 64:  # bounded: groups stepped in ever other combinations
            self._apply_bumps()

    def _apply_bumps(self) -> None:
        if not self._bumps:
            return
        left = self._left
        for ids, count in self._bumps.items():
            for key in ids:
                mark = left.get(key)
                if mark is not None:
                    left[key] = (mark[0] + count, mark[1])
        self._bumps.clear()

    def edited(self, param: torch.Tensor) -> bool:
        """Whether ``param`` was written since the optimizer last left it (never for a
        parameter it has not written yet: its state is made from the weight)."""
        self._apply_bumps()
        known = self._left.get(id(param))
        return known is not None and self._moved(param, known, _mark(param))

    def _moved(self, param: torch.Tensor, known: Mark, mark: Mark) -> bool:
        """Whether ``param``, marked ``mark`` now and ``known`` when last left, was written:
        its counter moved, or it was replaced through ``.data`` with other values."""
        if mark == known:
            return False
        return mark[0] != known[0] or self._replaced(param, mark)

    def _replaced(self, param: torch.Tensor, mark: Mark) -> bool:
        """``param``'s data was replaced (a new pointer, the same counter): whether with
        other values than it had. The same bits in another layout, or another tensor of the
        same bits, are not an edit: the mark and alias move to the new data (and the old
        storage is let go; the kernels give the state the weight's layout:
        ``eager.step_one``). Where no alias was recorded, it counts as an edit."""
        key, new = id(param), local(param)
        old = self._data.get(key)
        if old is None or not _same_bits(old, new):
            return True
        self._left[key] = mark
        self._data[key] = new.detach()
        self._place(param)
        self._kept.clear()
        return False

    def rederive_pending(self, strategy: Strategy,
                         states: Iterable[tuple[torch.Tensor, dict]]) -> None:
        """Re-derive now, and record, the edited parameters among ``(param, state)``
        pairs (before a save or an export reads the components: they must describe the
        weights saved beside them)."""
        if not hides_weight(strategy):
            return
        for param, state in states:
            if state and self.edited(param):
                snapshot = self.siblings_before((param,))
                rederive(strategy, param, state)
                self.note((param,))
                self.siblings_after(snapshot, (param,))

    def _versions_kept(self, items: Sequence[Item]) -> bool:
        """Whether every item's parameter is a plain tensor with a recorded mark whose
        version counter it still has: nothing to re-derive, where the pointers are known
        to be the recorded ones. Passes in C (a step's common case: nothing edited)."""
        params = list(map(ITEM_PARAM, items))
        if not params:
            return True
        ids, versions = list(map(id, params)), list(map(_VERSION, params))
        kept = self._kept.get(ids[0])
        if kept is not None and kept[0] == ids and kept[1] == versions:
            return True  # as found equal to the marks since the last change of a mark
        # (unequal: an edit, or moves of these counters as part of other groups, which
        # move the marks but not this entry: the marks decide, and the entry is renewed)
        if not set(map(type, params)) <= PLAIN_TENSORS:
            return False
        self._apply_bumps()
        marks = list(map(self._left.get, ids))
        if None in marks or list(map(_VERSION_OF_MARK, marks)) != versions:
            return False
        self._kept[ids[0]] = (ids, versions)
        return True

    def nothing_to_rederive(self, strategy: Strategy, items: Sequence[Item]) -> bool:
        """Whether :meth:`rederive_edited` with ``same_pointers`` would surely find nothing
        to re-derive among ``items``, read only: the strategy hides nothing beside the
        weights, or every weight's version counter is as the optimizer left it (False
        where unsure: the caller then takes the way that re-derives)."""
        return not hides_weight(strategy) or self._versions_kept(items)

    def rederive_edited(self, strategy: Strategy, items: Iterable[Item],
                        same_pointers: bool = False) -> bool:
        """Re-derive the hidden components of the edited parameters among ``items``;
        returns whether there was one. Per item an identity lookup and one or two integer
        reads (this runs every step: no function call per item). ``same_pointers``: every
        weight is known to have the pointer recorded (a native or Triton plan checked them
        against its table, made when they were recorded): only the counters are read."""
        if not hides_weight(strategy):
            return False
        if same_pointers and self._versions_kept(items):
            return False
        self._apply_bumps()
        get, plain, found = self._left.get, PLAIN_TENSORS, False
        for item in items:
            param = item.param
            known = get(id(param))
            if known is None:  # not written by us yet: which storage, before we write it
                self._place(param)
                continue
            if param.__class__ in plain:
                moved = known[0] != param._version or (
                    not same_pointers and known[1] != param.data_ptr()
                    and self._replaced(param, _mark(param)))
            else:
                moved = self._moved(param, known, _sharded_mark(param))
            if moved and item.state:
                snapshot = self.siblings_before((param,))  # (the write moves theirs too)
                rederive(strategy, param, item.state)
                self.siblings_after(snapshot, ())
                found = True
        return found
