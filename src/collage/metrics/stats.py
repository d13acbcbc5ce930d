"""Update-quality statistics: how much of the intended update reached the weights.

For one optimizer step on one tensor, let

* ``d`` be the *intended* update (what the update rule computed, in high precision),
* ``e = after - before`` the *effective* change of the **represented** value (``hi + lo`` for
  multi-component strategies, the fp32 master for ``mixed``, the weight itself for ``bf16``),
* ``ev = visible_after - visible_before`` the change of the **visible** weight (the bf16 tensor
  the model computes with).

Then (sums over all elements of every tensor counted into a key)::

    edq         = <e, d> / ||d||^2                     (nan when ||d|| == 0)
    imprecision = #{d != 0 and e == 0} / #{d != 0}     (nan when no d != 0)

and the same with ``ev`` for ``edq_visible`` / ``imprecision_visible``. Everything is computed
in float64 on the tensors' device -- except in the optimizers' measured fused step on CPU,
which uses :func:`component_change` and :func:`update_sums_blocked` (float32, exact counts,
sums within about 1e-5) -- and nothing synchronises with the host until
:meth:`UpdateStats.to_dict`. ``docs/metrics.md`` explains how to read the numbers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

import torch

__all__ = ["BLOCK", "FAMILIES", "FIELDS", "UpdateStats", "component_change", "edq",
           "imprecision", "module_family", "update_sums", "update_sums_blocked"]

#: Most elements per float32 partial sum in :func:`update_sums_blocked`.
BLOCK = 256

#: Layout of the per-key float64 sum vector kept by :class:`UpdateStats`.
FIELDS: tuple[str, ...] = (
    "dot_ed",  # <e, d>
    "dd",  # ||d||^2
    "ee",  # ||e||^2
    "n_nonzero",  # #{d != 0}
    "n_stuck",  # #{d != 0 and e == 0}
    "dot_evd",  # <ev, d>
    "evev",  # ||ev||^2
    "n_stuck_visible",  # #{d != 0 and ev == 0}
    "cc",  # ||compensation||^2
    "n_compensation",  # number of compensation elements counted
    "n_elements",  # number of update elements counted
)
_I = {name: i for i, name in enumerate(FIELDS)}

#: The families returned by :func:`module_family`.
FAMILIES: tuple[str, ...] = ("embedding", "attention", "mlp", "norm", "head", "other")


# --------------------------------------------------------------------------------------------
# Stateless functions
# --------------------------------------------------------------------------------------------


def _flat64(name: str, tensor: torch.Tensor, numel: int) -> torch.Tensor:
    """``tensor`` flattened and converted to float64; checks its element count."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.numel() != numel:
        raise ValueError(
            f"{name} has {tensor.numel()} elements (shape {tuple(tensor.shape)}) but intended "
            f"has {numel}; all tensors of one update must have the same number of elements"
        )
    return tensor.detach().reshape(-1).to(torch.float64)


def _intended(intended: torch.Tensor) -> torch.Tensor:
    """The intended update ``d``, flat float64."""
    if not isinstance(intended, torch.Tensor):
        raise TypeError(f"intended must be a torch.Tensor, got {type(intended).__name__}")
    return _flat64("intended", intended, intended.numel())


def _change(
    before: torch.Tensor, after: torch.Tensor, numel: int, prefix: str = ""
) -> torch.Tensor:
    """``after - before`` in float64, flat; both must have ``numel`` elements."""
    return _flat64(prefix + "after", after, numel) - _flat64(prefix + "before", before, numel)


def _delta(
    intended: torch.Tensor, before: torch.Tensor, after: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d, e)``: the intended update and the effective change, flat float64."""
    d = _intended(intended)
    return d, _change(before, after, d.numel())


def edq(intended: torch.Tensor, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Effective descent quality ``<e, d> / ||d||^2`` with ``e = after - before``.

    1 means the whole intended update ``d`` arrived, 0 that nothing did (or what arrived is
    orthogonal to ``d``). Returns a 0-dim float64 tensor on ``intended``'s device, nan when
    ``||d|| == 0`` (no update was intended, so the ratio is undefined). ``e`` is
    ``after.double() - before.double()``: exact (Sterbenz's lemma) whenever ``after`` is
    within a factor 2 of ``before``, the normal case for one step, and otherwise at most one
    float64 rounding (2**-53 relative). Pass a multi-component value as the float64 sum of
    its components (``hi.double() + lo.double()``; exact for bf16/fp16 pairs unless ``|lo|``
    is below about ``2**-45 * |hi|``, far under anything an update can change).
    """
    d, e = _delta(intended, before, after)
    return torch.dot(e, d) / torch.dot(d, d)  # 0 / 0 = nan when d == 0


def imprecision(
    intended: torch.Tensor, before: torch.Tensor, after: torch.Tensor
) -> torch.Tensor:
    """Fraction of the elements with ``d != 0`` whose value did not change (``e == 0``).

    Returns a 0-dim float64 tensor on ``intended``'s device, nan when no element has
    ``d != 0``.
    """
    d, e = _delta(intended, before, after)
    moving = d != 0
    stuck = (moving & (e == 0)).sum(dtype=torch.float64)
    return stuck / moving.sum(dtype=torch.float64)


def update_sums(
    intended: torch.Tensor,
    change: torch.Tensor,
    visible_change: torch.Tensor | None = None,
    compensation: torch.Tensor | None = None,
) -> torch.Tensor:
    """The float64 sum vector (layout :data:`FIELDS`) of one update from the intended update
    and the changes, for kernels that compute them in registers (see
    :meth:`UpdateStats.add_sums`). Pure tensor code: safe inside ``torch.compile``."""
    flat = [t.reshape(-1).to(torch.float64) if t is not None else None
            for t in (intended, change, visible_change)]
    return _stat_vector(flat[0], flat[1], flat[2], compensation)


def component_change(
    before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e, e == 0)`` of a value held as one or two float32-representable components,
    computed in float32 with an **exact** zero test. For kernels that cannot afford float64
    (see :func:`update_sums_blocked`). No host sync; safe inside ``torch.compile``.

    One component ``a``: ``e = fl(a' - a)``, one rounding (exact when ``a'`` and ``a`` are
    within a factor 2, Sterbenz; for bf16/fp16 values within 2**15 resp. 2**12 of each other,
    since the difference then fits in 24 bits). ``fl(a' - a) == 0`` iff ``a' == a`` (with
    gradual underflow, a floating-point difference is zero only when the operands are
    equal), so the zero test is exact; inf/nan give an inf/nan ``e``, never zero.

    Two components ``(hi, lo)`` (value ``hi + lo``): with Knuth's error-free TwoSum,
    ``hi' - hi = sh + th`` and ``lo' - lo = sl + tl`` exactly (``s = fl(a - b)``, ``t`` its
    error; valid for any finite float32 inputs without overflow). Then
    ``e = fl(fl(sh + sl) + fl(th + tl))`` (relative error about 2**-23) and the zero test
    ``sh == -sl and th == -tl`` is exact: ``(s, t)`` is a function of the exact difference
    alone and rounding to nearest is symmetric, so ``hi' - hi == -(lo' - lo)`` gives
    ``(sh, th) == (-sl, -tl)``; conversely those equalities sum to ``e == 0``.
    """
    if len(before) == 1:
        e = after[0] - before[0]
        return e, e == 0
    sh, th = _two_diff(after[0], before[0])
    sl, tl = _two_diff(after[1], before[1])
    return (sh + sl) + (th + tl), (sh == -sl) & (th == -tl)


def _two_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, t)`` with ``s = fl(a - b)`` and ``s + t == a - b`` exactly (Knuth's TwoSum on
    ``a + (-b)``; six operations, no precondition on the magnitudes). Relies on the compiler
    not reassociating: inductor compiles C++ with ``-fno-unsafe-math-optimizations``."""
    s = a - b
    a_part = s + b  # the part of s that came from a
    b_part = a_part - s  # minus the part that came from -b
    return s, (a - a_part) + (b_part - b)


def update_sums_blocked(
    intended: torch.Tensor,
    change: torch.Tensor,
    stuck: torch.Tensor,
    visible_change: torch.Tensor | None = None,
    stuck_visible: torch.Tensor | None = None,
    compensation: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`update_sums` for float32 ``(rows, block)`` tensors, with ``block <= BLOCK``:
    every row is summed in float32 and the row sums are added in float64.

    Why: on CPU, inductor converts float32 to float64 one element at a time (ATen has no
    vectorised AVX-512 conversion), which made a measured step 3-5x an unmeasured one; here
    only one value per row is converted. ``stuck``/``stuck_visible`` are the exact
    ``e == 0``/``ev == 0`` masks (:func:`component_change`); ``visible_change`` None means
    the visible value is the represented one.

    Accuracy: counts are exact (a row counts at most ``BLOCK <= 2**24`` ones in float32,
    rows add integers in float64). A product ``x * y`` is rounded once (``u = 2**-24``
    relative) and, in whatever order the row is summed, each term meets at most
    ``block - 1`` further roundings, so each inner product and squared norm is within
    ``block * u * sum|x * y|`` (standard bound, to first order) -- 1.5e-5 of
    ``sum|x * y|`` for ``block = 256``, and inductor's 16 to 32 vector lanes make it about
    ``(block / 16 + 6) * u`` = 1.3e-6 -- plus the error of ``x`` and ``y`` themselves
    (``change`` about 2**-23 relative, ``intended`` as the kernel computed it). The float64
    sum over rows adds nothing measurable. Row boundaries follow the tensor's local layout,
    so a sharded tensor's sums may differ from one process's within that bound; counts not.
    """
    moving = intended != 0

    def total(x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=-1).to(torch.float64).sum()

    def count(mask: torch.Tensor) -> torch.Tensor:
        return total(mask.to(torch.float32))

    dot_ed, dd, ee = total(change * intended), total(intended * intended), total(change * change)
    n_nonzero, n_stuck = count(moving), count(moving & stuck)
    if visible_change is None or stuck_visible is None:
        dot_evd, evev, n_stuck_v = dot_ed, ee, n_stuck
    else:
        dot_evd, evev = total(visible_change * intended), total(visible_change * visible_change)
        n_stuck_v = count(moving & stuck_visible)
    zero = torch.zeros((), dtype=torch.float64, device=intended.device)
    cc = n_comp = zero
    if compensation is not None:
        c = compensation.float()
        cc = total(c * c)
        n_comp = torch.full((), c.numel(), dtype=torch.float64, device=intended.device)
    n_elements = torch.full((), intended.numel(), dtype=torch.float64, device=intended.device)
    return torch.stack(
        (dot_ed, dd, ee, n_nonzero, n_stuck, dot_evd, evev, n_stuck_v, cc, n_comp, n_elements)
    )


def _stat_vector(
    d: torch.Tensor,
    e: torch.Tensor,
    ev: torch.Tensor | None,
    compensation: torch.Tensor | None,
) -> torch.Tensor:
    """The float64 sum vector (layout :data:`FIELDS`) of one update. No host sync."""
    moving = d != 0
    dot_ed, dd, ee = torch.dot(e, d), torch.dot(d, d), torch.dot(e, e)
    n_nonzero = moving.sum(dtype=torch.float64)
    n_stuck = (moving & (e == 0)).sum(dtype=torch.float64)
    if ev is None:  # the visible value is the represented one
        dot_evd, evev, n_stuck_v = dot_ed, ee, n_stuck
    else:
        dot_evd, evev = torch.dot(ev, d), torch.dot(ev, ev)
        n_stuck_v = (moving & (ev == 0)).sum(dtype=torch.float64)
    if compensation is None:
        cc = n_comp = torch.zeros((), dtype=torch.float64, device=d.device)
    else:
        c = compensation.detach().reshape(-1).to(device=d.device, dtype=torch.float64)
        cc = torch.dot(c, c)
        n_comp = torch.full((), c.numel(), dtype=torch.float64, device=d.device)
    n_elements = torch.full((), d.numel(), dtype=torch.float64, device=d.device)
    return torch.stack(
        (dot_ed, dd, ee, n_nonzero, n_stuck, dot_evd, evev, n_stuck_v, cc, n_comp, n_elements)
    )


# --------------------------------------------------------------------------------------------
# Accumulator
# --------------------------------------------------------------------------------------------


def _ratio(num: float, den: float) -> float:
    """``num / den``, nan when ``den == 0`` (an undefined ratio, not an error)."""
    return num / den if den != 0 else math.nan


def _derive(s: Sequence[float]) -> dict[str, float]:
    """The reported metrics of one key from its sum vector (layout :data:`FIELDS`)."""
    out = {
        "edq": _ratio(s[_I["dot_ed"]], s[_I["dd"]]),
        "imprecision": _ratio(s[_I["n_stuck"]], s[_I["n_nonzero"]]),
        "update_norm": math.sqrt(s[_I["dd"]]),
        "effective_norm": math.sqrt(s[_I["ee"]]),
        "edq_visible": _ratio(s[_I["dot_evd"]], s[_I["dd"]]),
        "imprecision_visible": _ratio(s[_I["n_stuck_visible"]], s[_I["n_nonzero"]]),
        "effective_norm_visible": math.sqrt(s[_I["evev"]]),
    }
    if s[_I["n_compensation"]] > 0:
        out["compensation_norm"] = math.sqrt(s[_I["cc"]])
    return out


def _unique(keys: str | Iterable[str]) -> list[str]:
    """``keys`` as a list without duplicates (first occurrence kept); a str is one key."""
    if isinstance(keys, str):
        return [keys]
    if not isinstance(keys, Iterable):
        raise TypeError(f"keys must be a str or an iterable of str, got {type(keys).__name__}")
    out: list[str] = []
    for key in keys:
        if not isinstance(key, str):
            raise TypeError(f"keys must be strings, got {type(key).__name__}")
        if key not in out:
            out.append(key)
    return out


class UpdateStats:
    """Accumulates update-quality sums per key, on device, and reports them on request.

    Each :meth:`add` computes one float64 vector of *sums* (layout :data:`FIELDS`: inner
    products, squared norms, counts) and adds it into every key it is given. Keys are
    roll-ups chosen by the caller: ``""`` is the overall key, others are typically a param
    group (``"group0"``), a family (``"family/mlp"``) or a parameter name. Because only sums
    are kept, roll-ups and the distributed reduction are exact: ratios are formed once, in
    :meth:`to_dict`, never averaged.

    Typical use per step::

        stats.add(["", f"group{i}", name], d, before, after, visible_before=..., ...)
        ...
        stats.reduce_()          # one all_reduce if torch.distributed is initialised
        log(stats.to_dict())     # one host sync
        stats.reset()
    """

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._reduced = False

    def __len__(self) -> int:
        return len(self._sums)

    def __contains__(self, key: object) -> bool:
        return key in self._sums

    def keys(self) -> list[str]:
        """The keys seen since the last :meth:`reset`, sorted."""
        return sorted(self._sums)

    def sums(self) -> dict[str, torch.Tensor]:
        """The raw per-key float64 sum vectors (layout :data:`FIELDS`), not copied."""
        return dict(self._sums)

    def add(
        self,
        keys: str | Sequence[str],
        intended: torch.Tensor,
        before: torch.Tensor,
        after: torch.Tensor,
        *,
        visible_before: torch.Tensor | None = None,
        visible_after: torch.Tensor | None = None,
        compensation: torch.Tensor | None = None,
    ) -> None:
        """Count one update into each of ``keys`` (a str is one key; duplicates count once).

        ``before``/``after`` are the represented value (pass float64 ``hi + lo`` for
        multi-component strategies). ``visible_before``/``visible_after`` are the weight the
        model computes with; pass both or neither, and neither means the visible value *is*
        the represented one (``bf16``, ``fp32``). ``compensation`` (``lo``, a Kahan buffer)
        only contributes its squared norm. No host synchronisation, no ``.item()``. A tensor
        on the ``meta`` device (shapes only, as in deferred initialisation) is not counted.
        """
        if self._reduced:
            raise RuntimeError("UpdateStats was already reduced; call reset() before add()")
        if (visible_before is None) != (visible_after is None):
            raise ValueError("pass both visible_before and visible_after, or neither")
        key_list = _unique(keys)
        if not key_list:
            raise ValueError("keys is empty: give at least one key (\"\" is the overall key)")
        if isinstance(intended, torch.Tensor) and intended.device.type == "meta":
            return  # a meta tensor has a shape and no values: nothing landed, nothing to count
        d, e = _delta(intended, before, after)
        ev = None
        if visible_before is not None and visible_after is not None:
            ev = _change(visible_before, visible_after, d.numel(), prefix="visible_")
        vec = _stat_vector(d, e, ev, compensation)
        for key in key_list:
            acc = self._sums.get(key)
            if acc is None:
                self._sums[key] = vec.clone()
            else:
                acc.add_(vec.to(acc.device))

    def add_sums(self, keys: str | Sequence[str], sums: torch.Tensor) -> None:
        """Count a sum vector made by :func:`update_sums` into each of ``keys``."""
        if self._reduced:
            raise RuntimeError("UpdateStats was already reduced; call reset() before add()")
        if sums.shape != (len(FIELDS),):
            raise ValueError(f"sums must have shape ({len(FIELDS)},), got {tuple(sums.shape)}")
        for key in _unique(keys):
            acc = self._sums.get(key)
            if acc is None:
                self._sums[key] = sums.detach().to(torch.float64).clone()
            else:
                acc.add_(sums.to(acc.device, torch.float64))

    def reduce_(self, group: object | None = None, *, check_keys: bool = False) -> None:
        """Sum the accumulators over all ranks, in place, with ONE ``all_reduce(SUM)``.

        A no-op (apart from marking the stats reduced) unless ``torch.distributed`` is
        initialised. Every rank must hold the same keys; they are stacked in sorted order.
        ``check_keys=True`` verifies that first with an ``all_gather_object`` (a host sync and
        an extra collective; for debugging) and raises ``ValueError`` on every rank if the
        keys differ. Call it once after the last :meth:`add`; a second call raises.
        """
        if self._reduced:
            raise RuntimeError("UpdateStats was already reduced; call reset() first")
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            self._all_reduce(group, check_keys)
        self._reduced = True  # only now: a refused key check leaves the local sums as local

    def _all_reduce(self, group: object | None, check_keys: bool) -> None:
        keys = self.keys()
        if check_keys:
            _check_same_keys(keys, group)
        if not keys:
            return
        stacked = self._stacked(keys)
        dist = torch.distributed
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)  # type: ignore[arg-type]
        for key, row in zip(keys, stacked.unbind(0)):
            self._sums[key] = row.to(self._sums[key].device)

    def to_dict(self) -> dict[str, float]:
        """The metrics as python floats, with one host sync (a single ``.tolist()``).

        The overall key ``""`` gives ``edq``, ``imprecision``, ``update_norm``,
        ``effective_norm``, ``edq_visible``, ``imprecision_visible``,
        ``effective_norm_visible`` and, if any compensation was given, ``compensation_norm``;
        any other key ``k`` gives the same names suffixed ``/k`` (``edq/group0``). Undefined
        ratios (nothing intended) are nan.
        """
        keys = self.keys()
        if not keys:
            return {}
        rows = self._stacked(keys).tolist()
        ordered = sorted(zip(keys, rows), key=lambda kv: kv[0] != "")  # "" first, stable
        out: dict[str, float] = {}
        for key, row in ordered:
            for name, value in _derive(row).items():
                out[name if key == "" else f"{name}/{key}"] = value
        return out

    def reset(self) -> None:
        """Forget all keys and sums; the next :meth:`add` starts a new period."""
        self._sums.clear()
        self._reduced = False

    def _stacked(self, keys: Sequence[str]) -> torch.Tensor:
        """The sum vectors of ``keys`` stacked into a ``(len(keys), len(FIELDS))`` tensor."""
        device = self._sums[keys[0]].device
        return torch.stack([self._sums[k].to(device) for k in keys])


def _check_same_keys(keys: list[str], group: object | None) -> None:
    """Raise ValueError on every rank unless all ranks of ``group`` hold exactly ``keys``."""
    dist = torch.distributed
    gathered: list[list[str] | None] = [None] * dist.get_world_size(group)  # type: ignore[arg-type]
    dist.all_gather_object(gathered, keys, group=group)  # type: ignore[arg-type]
    reference = gathered[0]
    for rank, other in enumerate(gathered):
        if other != reference:
            only_0 = sorted(set(reference or []) - set(other or []))
            only_r = sorted(set(other or []) - set(reference or []))
            raise ValueError(
                f"UpdateStats keys differ across ranks: rank 0 alone has {only_0[:5]}, "
                f"rank {rank} alone has {only_r[:5]}; every rank must add() the same keys"
            )


# --------------------------------------------------------------------------------------------
# Parameter families
# --------------------------------------------------------------------------------------------

_NORM = re.compile(r"ln(_?[a-z0-9]+)?|.*norm.*|bn\d*")
_EMBEDDING = re.compile(r"wte|wpe|.*emb.*")
_ATTENTION = re.compile(
    r".*(attn|attention).*|[qkvo]_proj|qkv(_proj)?|query|key|value|wqkv"
)
_MLP = re.compile(
    r".*(mlp|ffn|feed_?forward|intermediate|densereludense|moe).*"
    r"|c_fc|fc\d|gate_proj|up_proj|down_proj|gate_up_proj|experts?"
)
_HEAD = re.compile(r"lm_head|head|heads|classifier|cls|pooler|score|qa_outputs")


def module_family(name: str) -> str:
    """Map a parameter name to a family in :data:`FAMILIES` by common naming patterns.

    Covers GPT-2/nanoGPT (``wte``, ``h.0.attn.c_attn``, ``mlp.c_fc``, ``ln_1``,
    ``lm_head``), LLaMA (``embed_tokens``, ``self_attn.q_proj``, ``mlp.gate_proj``,
    ``input_layernorm``, Meta's ``tok_embeddings``/``feed_forward``/``output``), BERT
    (``embeddings.word_embeddings``, ``attention.self.query``, ``intermediate.dense``,
    ``output.dense``, ``LayerNorm``, ``cls``/``pooler``) and minGPT (``tok_emb``,
    ``blocks.0.attn``, ``ln1``, ``head``). Precedence: norm, embedding, attention, mlp,
    head, so ``post_attention_layernorm`` and ``embeddings.LayerNorm`` are norms.
    """
    modules = [p.lower() for p in name.split(".") if p]
    if any(_NORM.fullmatch(p) for p in modules):
        return "norm"
    if any(_EMBEDDING.fullmatch(p) for p in modules):
        return "embedding"
    if any(_ATTENTION.fullmatch(p) for p in modules):
        return "attention"
    if any(_MLP.fullmatch(p) for p in modules) or _is_bert_ffn_output(modules):
        return "mlp"
    if any(_HEAD.fullmatch(p) for p in modules) or modules[:1] == ["output"]:  # Meta LLaMA
        return "head"
    return "other"


def _is_bert_ffn_output(modules: list[str]) -> bool:
    """BERT's second FFN matrix is ``layer.N.output.dense`` (attention ones are caught first)."""
    return any(a == "output" and b == "dense" for a, b in zip(modules, modules[1:]))
