"""One call of the native kernels: the table of tensors, the flags and coefficients, the
threads; and the non-finite check.

**Semantics.** The float32-register kernel of the eager paths (``rules.AdamWRule.fast``,
the strategies' ``land`` and ``store_states``) operation for operation, each correctly
rounded, with torch's roundings (``lerp_`` and ``addcmul_`` are fused multiply-adds on CPU;
bf16 stores round to nearest even, NaN -> 0xFFFF) and one deliberate difference: the square
root is correctly rounded, where torch's vectorised CPU ``sqrt`` is not for every input (then
the update differs by one float32 unit). Given a correctly rounded square root the results
are **bitwise identical to the eager paths** for every covered strategy
(``tests/optim/test_native.py``). ``stochastic`` draws its uniforms in the kernel with the
counter-based hash of ``draws.py``.

**Coverage** (:func:`covers`): rule AdamW; the strategies with a ``native_code``; bf16
weights (float32 for ``fp32``); gradients bf16 or float32; contiguous local CPU tensors.

**Batching and threads.** One C call per (group, step value, gradient dtype): a table of
pointers and lengths, no concatenation, no per-tensor kernel launch. With
``torch.get_num_threads() > 1`` the elements are split into that many ranges (at least
65,536 elements each, cut on multiples of 64 elements of a tensor): by OpenMP in C, or
(without OpenMP, and for measured steps) from a Python thread pool (ctypes releases the
GIL). Each element's draw depends only on its index in the whole tensor, so no split
changes a result.

**Measured steps** (``track_updates``): :func:`adamw` with ``sums`` runs
``collage_adamw_measured``, the same per-element step code (the weights and states are bit
for bit those of the unmeasured call) that also reduces each tensor's 11 lost-update sums
(``collage.metrics.FIELDS``) from the values in registers, with the semantics of the
compiled path's CPU kernel: the intended update in float32, the changes with an exact zero
test, products summed in float32 with at most 256 terms per partial sum (one per vector
lane on AVX-512, 256 consecutive elements in the portable build) and those partial sums
in float64; counts exact. A pair's change (kahan, light, plus) is
``fl(fl(hi' - hi) + fl(lo' - lo))``: the TwoSum value wherever both differences are
exact, and an exact zero test for every pair the optimizer produces (the proof is at
``pair_change`` in step.h). The sums land in a float64 host array: no device
synchronisation. A tensor split between threads gets one sum vector per range, added in
float64 (partial sums regroup, within the same bound; counts are unchanged).
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import chain, compress
from operator import attrgetter

import torch

from ..rules import Rule
from ..strategies import Strategy
from .build import info, load, loaded

__all__ = ["covers", "row_layout", "row_tensors", "adamw", "table_row", "arguments",
           "call_threads", "any_nonfinite", "spans_nonfinite",
           "TABLE_COLUMNS", "COLUMN_NUMEL", "COLUMN_GRAD", "COLUMN_KEY0", "COLUMN_KEY1",
           "FIELDS_COUNT"]

# flags of collage_adamw (native.h: F_*)
_LERP_SMALL, _DECAY, _SCALED, _MAXIMIZE, _GRAD_FP32 = 1, 2, 4, 8, 16
# a thread gets at least this many elements (below, the pool's overhead dominates)
_MIN_CHUNK = 1 << 16
# int64 columns of a table row (native.h: T_COLS): elements, weight, gradient, exp_avg,
# exp_avg_sq, exp_avg_sq_lo, extra, first index, key0, key1 (see table_row)
TABLE_COLUMNS = 10
COLUMN_NUMEL, COLUMN_GRAD, COLUMN_KEY0, COLUMN_KEY1 = 0, 2, 8, 9
# the lost-update sums of one tensor (len(collage.metrics.FIELDS); native.h: M_COUNT)
FIELDS_COUNT = 11

_pool: ThreadPoolExecutor | None = None


# ---------------------------------------------------------------------------------------
# coverage and the table's columns
# ---------------------------------------------------------------------------------------


def covers(rule: Rule, strategy: Strategy, params: Sequence[torch.Tensor],
           grads: Sequence[torch.Tensor]) -> bool:
    """Whether the native kernels can step these (local) tensors: AdamW, a strategy with a
    ``native_code``, CPU, its first weight dtype (bf16; float32 for fp32), bf16 or float32
    gradients. Builds the library on first call; False when it is unavailable."""
    if rule.name != "adamw" or strategy.native_code is None:
        return False
    weight = strategy.weight_dtypes[0]
    # is_cpu, not device.type == "cpu": the same answer without a device object per tensor
    # (about 1 us each: a small model's step is mostly such per-tensor costs, #31)
    for param, grad in zip(params, grads):
        if (not param.is_cpu or not grad.is_cpu or param.dtype != weight
                or grad.dtype not in (torch.bfloat16, torch.float32)):
            return False
    return load() is not None


_ROW_ROLES = ("moment", "moment", "moment_low", "extra")
_layouts: dict[str, tuple] = {}


def row_layout(rule: Rule, strategy: Strategy) -> tuple:
    """(state key or None, dtype or None) of the table's four state columns: the two
    moments, the second moment's low part, and what the strategy keeps beside the weight
    (a master, a low part, a buffer), read from the strategy's components."""
    if strategy.name not in _layouts:
        components = strategy.components(rule)
        moments = [(c.key, c.dtype) for c in components if c.role == "moment"]
        low = [(c.key, c.dtype) for c in components if c.role == "moment_low"]
        extra = [(c.key, c.dtype) for c in components
                 if c.role not in ("weight", "moment", "moment_low")]
        if len(moments) != 2 or len(low) > 1 or len(extra) > 1:
            raise ValueError(f"strategy {strategy.name!r} does not fit the native table")
        _layouts[strategy.name] = (*moments, *(low or [(None, None)]),
                                   *(extra or [(None, None)]))
    return _layouts[strategy.name]


def row_tensors(rule: Rule, strategy: Strategy, param: torch.Tensor, grad: torch.Tensor,
                state: Mapping, checked: bool = False) -> tuple | None:
    """(param, grad, exp_avg, exp_avg_sq, exp_avg_sq_lo, extra) of one tensor, each of the
    dtype the kernel expects and ``param``'s size, contiguous on the CPU (``checked``: the
    caller has verified contiguity and device); None otherwise."""
    n = param.numel()
    tensors = [param, grad]
    for key, dtype in row_layout(rule, strategy):
        if key is None:
            tensors.append(None)
            continue
        t = state.get(key)
        if t is None or t.dtype != dtype or t.numel() != n:
            return None
        tensors.append(t)
    if grad.numel() != n:
        return None
    if not checked and not all(t is None or (t.is_contiguous() and t.device.type == "cpu")
                               for t in tensors):
        return None
    return tuple(tensors)


def adamw(strategy: Strategy, coeffs: Mapping[str, float], rows: Sequence[tuple], *,
          scale: float | None = None, maximize: bool = False, threads: int | None = None,
          sums: torch.Tensor | None = None, lib: ctypes.CDLL | None = None) -> None:
    """Step tensors of one strategy with one set of AdamW coefficients.

    ``rows``: ``(tensors, first_index, key0, key1)`` with ``tensors`` from
    :func:`row_tensors` (all gradients of one dtype), ``first_index`` the index of the first
    element in the whole tensor and ``key0``, ``key1`` the int32 key words of
    ``draws.draw_key`` (stochastic; else 0). ``coeffs``: ``rules.AdamW
    .coefficients`` (float64, rounded to float32 here as torch rounds a Python number).
    ``scale``: the GradScaler scale (float32 value) or None. ``threads``: default
    ``torch.get_num_threads()``. ``sums``: a contiguous CPU float64 tensor of shape
    ``(len(rows), len(collage.metrics.FIELDS))``: measure the step, each row's lost-update
    sums are written there (overwritten). ``lib``: another build of the library (tests).
    """
    lib = lib or load()
    if lib is None:
        raise RuntimeError("native kernels are unavailable: " + str(info().get("reason")))
    if sums is not None and (sums.dtype != torch.float64 or sums.device.type != "cpu"
                             or not sums.is_contiguous()
                             or tuple(sums.shape) != (len(rows), FIELDS_COUNT)):
        raise ValueError(f"sums must be a contiguous CPU float64 tensor of shape "
                         f"({len(rows)}, {FIELDS_COUNT}), got {sums.dtype} {tuple(sums.shape)}")
    if not rows:
        return
    grad_dtype = rows[0][0][1].dtype
    flags, h = arguments(coeffs, scale, maximize, grad_dtype == torch.float32)
    table = []
    for tensors, first, key0, key1 in rows:
        if tensors[1].dtype != grad_dtype:
            raise ValueError("one call steps gradients of one dtype")
        table.append(table_row(tensors, first, key0, key1))
    code = strategy.native_code
    threads = torch.get_num_threads() if threads is None else threads
    if sums is None and lib.collage_native_openmp():  # the C code splits the work itself
        call_threads(lib, code, flags, len(table), array("q", chain.from_iterable(table)),
                     h, threads)
        return
    total = sum(r[0] for r in table)
    parts = max(1, min(threads, total // _MIN_CHUNK))
    if parts == 1:
        _call(lib, code, flags, table, h, None if sums is None else sums.data_ptr())
        return
    sizes = [tuple(0 if t is None else t.element_size() for t in row[0]) for row in rows]
    chunks = _split(table, sizes, parts)
    # measured: one sum vector per piece, added into its tensor's row afterwards
    pieces = [None if sums is None else array("d", bytes(8 * FIELDS_COUNT * len(c)))
              for c, _ in chunks]
    pool = _executor(len(chunks) - 1)
    futures = [pool.submit(_call, lib, code, flags, chunk, h,
                           None if out is None else out.buffer_info()[0])
               for (chunk, _), out in zip(chunks[1:], pieces[1:])]
    _call(lib, code, flags, chunks[0][0], h,
          None if pieces[0] is None else pieces[0].buffer_info()[0])
    for future in futures:
        future.result()
    if sums is not None:
        owners = torch.tensor([o for _, chunk_owners in chunks for o in chunk_owners])
        values = torch.cat([torch.frombuffer(out, dtype=torch.float64) for out in pieces])
        sums.zero_().index_add_(0, owners, values.view(-1, FIELDS_COUNT))


def table_row(tensors: tuple, first: int, key0: int, key1: int) -> list[int]:
    """One row of a call's table, the T_* columns of native.h: ``tensors`` from
    :func:`row_tensors`, then the stochastic draws' first index and keys."""
    w, g, m, v, vlo, x = tensors
    return [w.numel(), w.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(),
            0 if vlo is None else vlo.data_ptr(), 0 if x is None else x.data_ptr(),
            first, key0, key1]


def arguments(coeffs: Mapping[str, float], scale: float | None, maximize: bool,
              grad_fp32: bool) -> tuple[int, array]:
    """(flags, hyperparameters) of a C call: ``coeffs`` as in :func:`adamw`, each
    hyperparameter rounded to float32 as torch rounds a Python number."""
    decay = float(coeffs["decay"])
    h = array("f", [coeffs["one_minus_beta1"], coeffs["beta2"], coeffs["one_minus_beta2"],
                    coeffs["bias_correction2_sqrt"], coeffs["eps"], -coeffs["step_size"],
                    decay, coeffs["lr_wd"], 1.0 if scale is None else scale])
    # torch's lerp picks its formula on the float32 weight: h[0], the float32 of 1 - beta1
    flags = ((_LERP_SMALL if abs(h[0]) < 0.5 else 0)
             | (_DECAY if decay != 1.0 else 0) | (_SCALED if scale is not None else 0)
             | (_MAXIMIZE if maximize else 0) | (_GRAD_FP32 if grad_fp32 else 0))
    return flags, h


def call_threads(lib, code: int, flags: int, count: int, flat: array, h: array,
                 threads: int) -> None:
    """One unmeasured call of an OpenMP build: ``count`` rows of ``TABLE_COLUMNS`` int64 in
    ``flat``, split between ``threads`` threads in C."""
    status = lib.collage_adamw_threads(code, flags, count, flat.buffer_info()[0],
                                       h.buffer_info()[0], threads)
    if status != 0:  # pragma: no cover - codes come from the strategies
        raise RuntimeError(f"collage_adamw_threads returned {status}")


def any_nonfinite(tensors: Sequence[torch.Tensor], threads: int | None = None,
                  lib: ctypes.CDLL | None = None) -> bool | None:
    """Whether any element of ``tensors`` is inf or nan, read once at memory speed on
    ``threads`` threads (default ``torch.get_num_threads()``); None where the library is not
    loaded or a tensor is not a contiguous CPU bf16/float32 tensor (the caller then checks
    with torch). The same verdict as ``not torch.isfinite(t).all()`` for each tensor."""
    lib = lib or loaded()
    if lib is None:
        return None
    # passes in C over the tensors, not a Python loop: this runs every step, and a small
    # model's step is mostly per-tensor costs (#31)
    if not (all(map(_IS_CPU, tensors)) and all(map(_CONTIGUOUS, tensors))):
        return None
    dtypes = list(map(_DTYPE, tensors))
    if len(dtypes) != dtypes.count(torch.bfloat16) + dtypes.count(torch.float32):
        return None  # another dtype: the caller checks with torch
    pairs = list(zip(map(_DATA_PTR, tensors), map(_NUMEL, tensors)))
    threads = torch.get_num_threads() if threads is None else threads
    for dtype in (torch.bfloat16, torch.float32):
        if dtypes.count(dtype) == len(dtypes):  # one dtype (the common case): one table
            table = pairs
        else:
            table = list(compress(pairs, [d is dtype for d in dtypes]))
        if not table:
            continue
        if spans_nonfinite(lib, dtype, array("q", chain.from_iterable(table)), threads):
            return True
    return False


def spans_nonfinite(lib, dtype: torch.dtype, spans: array, threads: int) -> bool:
    """Whether an element of the memory ``spans`` (int64 ``address, size`` pairs, of
    contiguous ``dtype`` elements: bfloat16 or float32) is inf or nan: the native check's C
    pass, on up to ``threads`` threads."""
    return bool(lib.collage_nonfinite(int(dtype == torch.float32), len(spans) // 2,
                                      spans.buffer_info()[0], threads))


_IS_CPU = attrgetter("is_cpu")
_DTYPE = attrgetter("dtype")
_CONTIGUOUS = torch.Tensor.is_contiguous
_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel


def _call(lib, code: int, flags: int, table: list[list[int]], h: array,
          sums: int | None = None) -> None:
    """One C call on this thread; ``sums``: the address of ``len(table)`` float64 sum
    vectors (measured)."""
    flat = array("q", chain.from_iterable(table))
    if sums is None:
        status = lib.collage_adamw(code, flags, len(table), flat.buffer_info()[0],
                                   h.buffer_info()[0])
    else:
        status = lib.collage_adamw_measured(code, flags, len(table), flat.buffer_info()[0],
                                            h.buffer_info()[0], sums)
    if status != 0:  # pragma: no cover - codes come from the strategies
        raise RuntimeError(f"collage_adamw returned {status}")


def _split(table, sizes, parts: int) -> list[tuple[list[list[int]], list[int]]]:
    """The rows cut into ``parts`` runs of about equal element counts (cuts on multiples of
    64 elements: no two threads write one cache line): ``(pieces, owners)`` per run, where
    ``owners[j]`` is the index in ``table`` of the row piece ``j`` comes from."""
    total = sum(row[0] for row in table)
    target = -(-total // parts)
    chunks: list[tuple[list[list[int]], list[int]]] = [([], [])]
    room = target
    for owner, (row, size) in enumerate(zip(table, sizes)):
        start, n = 0, row[0]
        while start < n:
            take = n - start
            if take > room and len(chunks) < parts:  # cut, rounded up to 64 elements
                take = min(take, -(-room // 64) * 64)
            piece = [take] + [p + start * s if p else 0 for p, s in zip(row[1:7], size)] + \
                [row[7] + start, row[8], row[9]]
            chunks[-1][0].append(piece)
            chunks[-1][1].append(owner)
            start += take
            room -= take
            if room <= 0 and len(chunks) < parts:
                chunks.append(([], []))
                room = target
    return [c for c in chunks if c[0]]


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool
    if _pool is None or _pool._max_workers < workers:
        _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="collage-native")
    return _pool
