"""Launching the Triton kernels: the kernel module per mode, the launch table of a bucket of
tensors (kept between steps), the coefficients, one launch.

A :class:`Launch` is what torch's ``multi_tensor_apply`` builds per call, made once and
kept: a device table with one row per tensor (``layout``: its components' addresses, its
size, its draws' counter), the gradients' addresses (refreshed when they move), and the
programs' ``(row, block)`` pairs, so that one launch steps every tensor of a bucket, the
model's hundreds of biases and norms with its matrices.

Nothing here synchronises with the device: tables are built on the host and copied from
pinned memory without blocking (the caching host allocator keeps a pinned buffer until its
copy has run), coefficients travel as kernel arguments, or, capturable, are computed on the
device from the step counters.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import operator
import os
import struct
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from .. import draws as keyed
from ..group import Entry, GroupStep
from ..rules import Rule
from ..strategies import Strategy
from ..strategies.strategy import is_one
from . import layout

try:  # optional: collage works without Triton (the dispatch asks ``path.available``)
    import triton
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

__all__ = ["triton", "GPU_BLOCK", "GPU_WARPS", "INTERPRETED_BLOCK", "interpreting",
           "kernel_module", "block_size", "Launch", "build", "on_16_bytes", "signature_of",
           "refresh_grads", "grad_scale", "kernel_flags", "variant_flags", "launch_flags", "programs",
           "step_arguments", "decays", "DeviceCoefficients", "device_coefficients", "check",
           "capturable_decays", "counter_vector", "gather_counters", "advance_counters",
           "launch"]

#: elements per program: on a GPU 8 per thread of 4 warps (16-byte loads of bf16); in the
#: interpreter small, so that small test tensors span several programs
GPU_BLOCK, GPU_WARPS = 1024, 4
INTERPRETED_BLOCK = 256
#: persistent programs per multiprocessor on a GPU, and in the interpreter in all
PROGRAMS_PER_SM = 4
INTERPRETED_PROGRAMS = 3

_MODULES: dict[bool, ModuleType] = {}


def interpreting() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET=1``), read now."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # Triton < 3.4


@contextmanager
def _mode(interpret: bool) -> Iterator[None]:
    """Triton's interpreter on or off while a module is decorated, restored after."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        with knobs.runtime.scope():
            knobs.runtime.interpret = interpret
            yield
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def kernel_module(interpret: bool) -> ModuleType:
    """The ``kernels`` package compiled (GPU) or interpreted (``interpret``: CPU tensors).

    ``@triton.jit`` reads ``TRITON_INTERPRET`` when it decorates, so the package is executed
    once per mode under that mode, not imported: a process can step CPU tensors through
    the interpreter and CUDA tensors with compiled kernels, whatever the variable said
    when collage was imported. Each mode's copy has a name of its own (registered, so that
    its modules' relative imports load that mode's copies of each other)."""
    if interpret not in _MODULES:
        name = f"{__package__}.kernels_{'interpreted' if interpret else 'compiled'}"
        folder = Path(__file__).with_name("kernels")
        spec = importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        with _mode(interpret):
            spec.loader.exec_module(module)
        _MODULES[interpret] = module
    return _MODULES[interpret]


def block_size(device: torch.device) -> int:
    return INTERPRETED_BLOCK if device.type == "cpu" else GPU_BLOCK


# ---------------------------------------------------------------------------------------
# the launch table
# ---------------------------------------------------------------------------------------


def _signed64(value: int) -> int:
    """A uint64 as the int64 with the same bits (a table cell)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _row(group: GroupStep, entry: Entry, weight_keys: Sequence[str],
         state_keys: Sequence[str], capturable: bool) -> list[int]:
    """One tensor's table row (``layout``)."""
    pointers = [entry.param.data_ptr()]
    pointers += [entry.tensors[key].data_ptr() for key in weight_keys[1:]] or [0]
    states = [entry.tensors[key].data_ptr() for key in state_keys]
    states += [0] * (layout.MAX_STATES - len(states))
    mix = keyed.mix_state(keyed.MIX_START, group.seed, entry.item.position)
    step = entry.state["step"].data_ptr() if capturable else 0
    return [0, *pointers, *states, entry.numel, entry.offset, _signed64(mix), step]


@dataclass
class Launch:
    """One bucket's kernel launch, kept between steps: the table and the gradients'
    addresses on the device, and the tiles (``blocks``, each ``(row, block index)``): the
    tensors' ``whole`` blocks first (unmasked), then each tensor's last, partial block
    (masked), all stepped by one launch. ``aligned``: every address is a multiple of 16
    bytes; ``signature``: every address and size the table was built from (a change
    rebuilds it)."""

    signature: tuple
    table: torch.Tensor
    grads: torch.Tensor
    grad_addresses: list[int]
    blocks: torch.Tensor
    whole: int
    aligned: bool

    @property
    def tiles(self) -> int:
        """How many tiles: whole blocks and tails."""
        return self.blocks.shape[0]


def _pinned(values: torch.Tensor) -> torch.Tensor:
    """``values`` in pinned host memory, from which a copy to a GPU does not block."""
    pinned = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    return pinned.copy_(values)


def _to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without blocking the host."""
    if device.type == "cpu":
        return values
    return _pinned(values).to(device, non_blocking=True)


def _blocks(numels: Sequence[int], block: int, whole: bool) -> torch.Tensor:
    """``(row, block index)`` of the tiles of each row's whole ``block``-element blocks
    (``whole``), or of its last, partial block (an empty tensor has neither)."""
    if whole:
        counts = torch.tensor([n // block for n in numels], dtype=torch.int64)
    else:
        counts = torch.tensor([int(n % block != 0) for n in numels], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(numels)), counts)
    firsts = torch.cumsum(counts, 0) - counts
    index = torch.arange(rows.numel()) - firsts[rows]
    if not whole:
        index = torch.tensor([n // block for n in numels], dtype=torch.int64)[rows]
    return torch.stack([rows, index], dim=1).to(torch.int32)


def _tiles(numels: Sequence[int], block: int) -> tuple[torch.Tensor, int]:
    """Every tile of the rows, whole blocks first, then the tails; and the whole blocks'
    count."""
    whole = _blocks(numels, block, True)
    return torch.cat([whole, _blocks(numels, block, False)]), whole.shape[0]


def on_16_bytes(addresses: Iterable[int]) -> bool:
    """Whether every address is a multiple of 16 bytes (a 16-byte vector's): no low bit
    set in any (their bitwise or, one pass in C)."""
    return functools.reduce(operator.or_, addresses, 0) & 15 == 0


def build(group: GroupStep, entries: Sequence[Entry], capturable: bool,
          signature: tuple) -> Launch:
    """The launch of ``entries`` (one weight dtype; contiguous, on one device)."""
    device = entries[0].param.device
    dtype = entries[0].param.dtype
    weight_keys = [c.key for c in group.strategy.weight_components(dtype)]
    state_keys = [c.key for c in group.strategy.state_components(group.rule, dtype)]
    rows = [_row(group, e, weight_keys, state_keys, capturable) for e in entries]
    grad_addresses = [e.grad.data_ptr() for e in entries]
    addresses = [a for row in rows for a in row[layout.C_PARAM:layout.C_NUMEL]]
    numels = [e.numel for e in entries]
    blocks, whole = _tiles(numels, block_size(device))
    return Launch(signature, _to_device(torch.tensor(rows, dtype=torch.int64), device),
                  _to_device(torch.tensor(grad_addresses, dtype=torch.int64), device),
                  grad_addresses, _to_device(blocks, device), whole,
                  on_16_bytes(addresses + grad_addresses))


def signature_of(entries: Sequence[Entry], capturable: bool) -> tuple:
    """Every address and size a launch table holds, but the gradients'."""
    out = []
    for e in entries:
        out += [e.param.data_ptr(), e.numel, e.offset, e.item.position]
        out += [t.data_ptr() for t in e.tensors.values()]
        if capturable:
            out.append(e.state["step"].data_ptr())
    return tuple(out)


def refresh_grads(launch: Launch, addresses: list[int]) -> None:
    """Point the launch at the gradients at ``addresses`` where they moved (a new
    ``.grad``)."""
    if addresses != launch.grad_addresses:
        fresh = torch.tensor(addresses, dtype=torch.int64)
        if launch.grads.device.type != "cpu":
            fresh = _pinned(fresh)
        # stream-ordered: the last launch has read the old addresses before this copy
        launch.grads.copy_(fresh, non_blocking=True)
        launch.grad_addresses = addresses
        launch.aligned = launch.aligned and on_16_bytes(addresses)


# ---------------------------------------------------------------------------------------
# the kernel's arguments
# ---------------------------------------------------------------------------------------


def grad_scale(group: GroupStep, device: torch.device) -> torch.Tensor | None:
    """GradScaler's scale as the kernel reads it (float32, on the device), or None."""
    if group.grad_scale is None:
        return None
    return group.grad_scale.to(device=device, dtype=torch.float32).reshape(1)


def _float32(value: float) -> float:
    """``value`` rounded to float32 (as torch rounds a Python scalar for a float32 tensor),
    so that the compiled and the interpreted kernel read the same number."""
    return struct.unpack("f", struct.pack("f", value))[0]


def kernel_flags(group: GroupStep, dtype: torch.dtype, decays: bool, capturable: bool,
                 interpreted: bool, skippable: bool = False) -> dict:
    """The compile-time arguments of ``kernels.multi_tensor_step`` for a bucket."""
    hyper = group.hyper
    return variant_flags(group.rule, group.strategy, dtype, decays=decays,
                         scaled=group.grad_scale is not None, maximize=group.maximize,
                         capturable=capturable, interpreted=interpreted,
                         skippable=skippable,
                         weight_decay=group.rule.name == "sgd" and hyper["weight_decay"] != 0,
                         momentum=group.rule.name == "sgd" and hyper["momentum"] != 0,
                         nesterov=group.rule.name == "sgd" and bool(hyper["nesterov"]))


def variant_flags(rule: Rule, strategy: Strategy, dtype: torch.dtype, *, decays: bool,
                  scaled: bool = False, maximize: bool = False, capturable: bool = False,
                  interpreted: bool = False, skippable: bool = False,
                  weight_decay: bool = False, momentum: bool = False,
                  nesterov: bool = False) -> dict:
    """The compile-time arguments of one kernel variant, from plain data (a bucket's, or
    one ``benchmarks/gpu_model.py`` compiles); ``launch_flags`` adds the launch's own."""
    components = strategy.weight_components(dtype)
    states = strategy.state_components(rule, dtype)
    return {
        "RULE": layout.RULE_CODES[rule.name],
        "LANDING": strategy.native_code,
        "W_KIND": layout.KINDS[dtype],
        "X_KIND": layout.KINDS[components[1].dtype] if len(components) > 1 else 0,
        "S_KIND": layout.KINDS[states[0].dtype],
        "SLOW_PAIR": strategy.mcf_slow_states,
        "DECAY": decays,
        "SCALED": scaled,
        "MAXIMIZE": maximize,
        "CAPTURABLE": capturable,
        "WEIGHT_DECAY": weight_decay,
        "MOMENTUM": momentum,
        "NESTEROV": nesterov,
        "HAS_SCALE": rule.name != "adamw",  # rule.fast returns a scale (-lr)
        # the interpreter's fma rounds twice and its bf16 conversion is not to nearest:
        # there both are computed exactly in software; a GPU's hardware does them
        "EMULATE_FMA": interpreted,
        "HW": not interpreted,
        "SKIPPABLE": skippable,
    }


def launch_flags(whole: bool, tails: bool, aligned: bool, interpreted: bool) -> dict:
    """The launch's compile-time arguments: whether it has whole blocks and tails (each
    loop compiled only where it runs), the alignment hint, the block size."""
    return {"WHOLE": whole, "TAILS": tails, "ALIGNED": aligned,
            "BLOCK": INTERPRETED_BLOCK if interpreted else GPU_BLOCK}


def step_arguments(rule: Rule, coefficients: dict) -> list[float]:
    """The rule's coefficients at one step, float32, in ``layout.COEFFICIENTS`` order
    (padded to ``NCOEF``)."""
    values = [_float32(float(coefficients[key])) for key in layout.COEFFICIENTS[rule.name]]
    return values + [0.0] * (layout.NCOEF - len(values))


def decays(coefficients: dict) -> bool:
    """Whether the update multiplies the weight by ``decay`` (``strategy.is_one``)."""
    return not is_one(coefficients["decay"])


class DeviceCoefficients:
    """float32 ``[rows, NCOEF]`` on the device: each row's coefficients at its step counter
    (``steps``: the rows' counters as one float32 vector there, ``counter_vector``),
    computed there in float64 (``Rule.step_coefficients``) and rounded once to float32.

    Kept from step to step (a plan holds one): a column that is a number (the betas, eps,
    a float learning rate's terms) is filled only when the number changes; the columns that
    depend on the counters (or on a learning rate held in a device tensor) are computed
    and copied in at every step. So a step costs the device operations of those columns
    (about 10) instead of building the whole table (about 20: one fill per number, a stack,
    a cast), each a launch the host pays for on a GPU (issue #29). Same bits: a fill rounds
    its float64 number to float32 to nearest, as the cast of a float64 fill did; a copy
    into the float32 column rounds the float64 values as ``.to(torch.float32)`` did. The
    writes are stream-ordered after the last step's kernels, which read the table before."""

    __slots__ = ("table", "columns", "numbers")

    def __init__(self, rows: int, device: torch.device) -> None:
        self.table = torch.zeros((rows, layout.NCOEF), dtype=torch.float32, device=device)
        self.columns = self.table.unbind(1)  # views, made once
        self.numbers: list[float | None] = [None] * layout.NCOEF

    def update(self, group: GroupStep, steps: torch.Tensor) -> torch.Tensor:
        """The table at the counters ``steps`` (float32, one per row, on the device)."""
        device = steps.device
        step = steps.to(torch.float64)
        lr = group.hyper["lr"]
        if isinstance(lr, torch.Tensor):  # the terms the host computes in lr's dtype, too
            lr = lr.detach().to(device).reshape(())
            values = group.rule.step_coefficients(group.hyper, lr.to(torch.float64), step,
                                                  next_step=False)
            values.update(group.rule.tensor_lr_coefficients(group.hyper, lr, step))
        else:
            values = group.rule.step_coefficients(group.hyper, lr, step, next_step=False)
        for j, key in enumerate(layout.COEFFICIENTS[group.rule.name]):
            value = values[key]
            if isinstance(value, torch.Tensor):
                self.columns[j].copy_(value)  # float64 -> float32, to nearest
                self.numbers[j] = None
            elif not _same_number(self.numbers[j], float(value)):
                self.columns[j].fill_(float(value))  # a fill, no copy from the host
                self.numbers[j] = float(value)
        return self.table


def _same_number(known: float | None, value: float) -> bool:
    """Whether a column filled with ``known`` holds ``value``: the same float, the sign of
    a zero included (a kernel's result can depend on it); never for NaN (filled again)."""
    return known == value and math.copysign(1.0, known) == math.copysign(1.0, value)


def device_coefficients(group: GroupStep, steps: torch.Tensor) -> torch.Tensor:
    """:class:`DeviceCoefficients` of one step (a table made for it)."""
    return DeviceCoefficients(steps.numel(), steps.device).update(group, steps)


def counter_vector(counters: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The float32 vector whose elements ``counters`` are, in order (each a 0-d view of
    it, as :func:`gather_counters` makes them), or None where they are not: then one
    operation on the vector advances or reads them all, whatever their number."""
    first = counters[0]
    vector = first._base
    if (vector is None or vector.dim() != 1 or vector.numel() != len(counters)
            or vector.dtype != torch.float32 or not vector.is_contiguous()):
        return None
    offset = vector.storage_offset()
    for index, counter in enumerate(counters):
        if (counter._base is not vector or counter.dim() != 0
                or counter.storage_offset() != offset + index):
            return None
    return vector


def gather_counters(entries: list[Entry], device: torch.device) -> torch.Tensor:
    """The entries' step counters as one float32 vector on ``device``, in their order, each
    entry's ``state["step"]`` a 0-d view of its element (``launch.counter_vector``), so
    that one operation advances them and one reads them, whatever the number of tensors
    (issue #29: a planned group's host time does not grow with its tensors). Made where
    they are not that yet (the first step, or the group's tensors changed): the values
    stacked on the device, or filled from the host's counters (never read back there)."""
    counters = [entry.state["step"] for entry in entries]
    vector = counter_vector(counters)
    if vector is not None and vector.device == device:
        return vector
    vector = torch.stack([
        counter.to(torch.float32) if counter.device == device
        # a fill on the device, not a copy from the host (which would wait for it)
        else torch.full((), float(counter), dtype=torch.float32, device=device)
        for counter in counters])
    for index, entry in enumerate(entries):
        entry.state["step"] = vector[index]
    return vector


def advance_counters(counters: torch.Tensor, found: torch.Tensor | None) -> None:
    """Step counters on the device (``counters``: their vector, ``counter_vector``)
    advanced by one, or by ``1 - found`` (the device's non-finite verdict: a skipped step
    leaves them), without the host reading anything: one operation, whatever the number
    of tensors (as torch's fused optimizers subtract ``found_inf``)."""
    if found is None:
        counters.add_(1.0)
    else:
        counters.add_(1.0 - found.to(counters.device))


def capturable_decays(group: GroupStep) -> bool:
    """Whether a capturable step decays: from the hyperparameters (the learning rate may
    be a device tensor, never read on the host)."""
    return group.rule.name != "sgd" and float(group.hyper["weight_decay"]) != 0.0


def programs(tiles: int, device: torch.device) -> int:
    """How many persistent programs step ``tiles`` tiles: on a GPU ``PROGRAMS_PER_SM`` per
    multiprocessor (each then loops over its share, fetching the next tile before it
    computes the current one); in the interpreter a few, so that tests cross the loop."""
    if device.type == "cpu":
        return min(tiles, INTERPRETED_PROGRAMS)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return min(tiles, sms * PROGRAMS_PER_SM)


def _one_launch(plan: Launch, run: Callable[[tuple, dict], None]) -> None:
    """``run(grid, flags)``: the launch's one kernel call over its whole blocks and tails,
    on its device, where it has any tile."""
    device = plan.table.device
    tiles = plan.tiles
    if not tiles:
        return
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        run((programs(tiles, device),), launch_flags(plan.whole > 0, tiles > plan.whole,
                                                     plan.aligned, device.type == "cpu"))


def _options(device: torch.device, **compiled) -> dict:
    """The launch options: none in the interpreter; on a GPU the warps and ``compiled``."""
    return {} if device.type == "cpu" else {"num_warps": GPU_WARPS, **compiled}


def launch(plan: Launch, flags: dict, arguments: Sequence[float], step: int,
           coefficients: torch.Tensor | None, scale: torch.Tensor | None,
           found: torch.Tensor | None = None) -> None:
    """Run a bucket's step, one kernel launch: its whole blocks unmasked, then its tails
    masked. ``found``: the device's non-finite verdict (``flags["SKIPPABLE"]``): nonzero,
    the kernel writes nothing."""
    device = plan.table.device
    kernel = kernel_module(device.type == "cpu").multi_tensor_step
    spare = plan.table  # any pointer, for an argument the flags leave unread
    options = _options(device, enable_fp_fusion=False)
    _one_launch(plan, lambda grid, kind: kernel[grid](
        plan.table, plan.grads, plan.blocks, spare if coefficients is None else coefficients,
        spare if scale is None else scale, spare if found is None else found, *arguments,
        step, plan.tiles, plan.whole, **flags, **kind, **options))


def check(plan: Launch, dtype: torch.dtype, found: torch.Tensor) -> None:
    """Raise ``found`` (float32, zeroed before the step's first check) to 1 where a
    gradient of the bucket holds inf or nan (``kernels.nonfinite_check`` over the step's
    own tiles, one launch: its whole blocks, then its tails), reading nothing on the host."""
    device = plan.table.device
    kernel = kernel_module(device.type == "cpu").nonfinite_check
    options = _options(device)
    _one_launch(plan, lambda grid, kind: kernel[grid](
        plan.table, plan.grads, plan.blocks, found, plan.tiles, plan.whole,
        W_KIND=layout.KINDS[dtype], **kind, **options))
