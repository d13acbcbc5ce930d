"""Memory: the bytes-per-parameter model of each strategy, and measurements of real runs.

The model counts the tensors that live for the whole run, per parameter element. A collage
strategy's row is read from its components (``Strategy.components(ADAMW)``: each
component's bytes in the column of its role, ``ROLE_COLUMNS``), the gradient has the
weight's dtype; baselines that are not strategies are declared in ``BASELINE_LAYOUTS``:

=========== ======= ========= ================== ============== =====
strategy    weights gradients optimizer states   compensation   total
=========== ======= ========= ================== ============== =====
fp32        4       4         8 (m, v fp32)      0              16
mixed       2 + 4   2         8 (m, v fp32)      0              16
bf16        2       2         4 (m, v bf16)      0              8
stochastic  2       2         4                  0              8
kahan       2       2         4                  2 (Kahan buf)  10
light       2       2         4                  2 (weight lo)  10
plus        2       2         4                  4 (lo, v lo)   12
split       2       2         4                  4 (low16, v lo) 12
plus8       2       2         2.0625 (m, v hi,   3 (w lo, v lo) 9.0625
                              2 scales/128)
torchao8    2       2         2.03 (m, v, 2      0              6.03
                              scales/256)
=========== ======= ========= ================== ============== =====

``plus8`` is ``docs/eight_bit.md``'s strategy: m one e4m3 byte, v an e5m2 byte plus 8 low
bits, each with a float32 power-of-two scale per block of 128 (0.03125 B each).
``torchao-adamw8bit`` (torchao8 above) is torchao's ``AdamW8bit`` on bf16 weights: 8-bit m
and v with a float32 scale per block of 256; torchao keeps tensors under 4096 elements in
full-precision states, so a small model measures more than the model says.

``mixed`` keeps its fp32 master copy (4 bytes) under *weights* (2 + 4). With
``grad_dtype="fp32"`` (gradients accumulated in fp32, as ``grad_accumulation="pair"`` keeps
them between backward and step) every strategy but fp32 pays 2 more bytes; with
``grad_dtype="none"`` (``step_in_backward=True``: each gradient freed as soon as its
parameter is stepped) every strategy saves its gradient bytes (``plus``: 10; one parameter's
gradient at a time is a transient, like activations).
Activations, temporary buffers and the allocator's slack are not in the model: they depend on
batch size and kernels, and are what the measured peak adds on top.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import resource
import sys
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from ..optim.rules import ADAMW, RULES
from ..optim.strategies import NAMES, Component, Strategy, all_strategies
from ..optim.strategies.strategy import ROLE_COLUMNS, dtype_name

__all__ = [
    "BytesPerParam",
    "Layout",
    "bytes_per_param",
    "describe",
    "layouts",
    "persistent_bytes",
    "peak_rss_bytes",
    "current_rss_bytes",
    "TensorMemoryProbe",
    "memory_table",
    "ROLES",
]

#: the gradient's bytes: "bf16" (the weight's dtype, as autograd makes it), "fp32" (fp32
#: gradients; also ``grad_accumulation="pair"``'s float32 sums while accumulating), "none"
#: (``step_in_backward=True``: each gradient is freed as its parameter is stepped); the
#: dtypes by their short names (``dtype_name``)
GRAD_DTYPES = (dtype_name(torch.bfloat16), dtype_name(torch.float32), "none")
DEFAULT_GRAD_DTYPE = GRAD_DTYPES[0]
#: The strategy ``collage memory`` states every total against (the usual mixed precision).
COMPARED_WITH = NAMES.mixed


@dataclass(frozen=True)
class Layout:
    """What one strategy (or baseline) keeps per parameter element, besides the gradient:
    bytes per column and a short description of each side (``weights | g | states``)."""

    weights: float
    optimizer_states: float
    compensation: float
    weight_text: str
    state_text: str
    weight_dtype: torch.dtype = torch.bfloat16
    note: str = ""


#: Optimizers the harness runs that are not collage strategies (``build.make_optimizer``):
#: declared here, as they have no components to read.
BASELINE_LAYOUTS: dict[str, Layout] = {
    # torchao's AdamW8bit: 8-bit m and v, a float32 scale per block of 256 for each
    "torchao-adamw8bit": Layout(2, 2 + 8 / 256, 0, "w bf16 (stochastic rounding)",
                                "m, v 8-bit (torchao), 2 fp32 scales per 256"),
}

# the order roles are listed in a layout: the weight side, then the states
_ROLE_ORDER = ("weight", "master", "low", "compensation", "moment", "moment_low", "scale")


def whole(x: float) -> float:
    """``x`` as an int when it is a whole number (2, not 2.0, in tables and JSON)."""
    return int(x) if float(x).is_integer() else x


def describe(components: Iterable[Component], by_role: bool = True) -> str:
    """``"w bf16 + lo bf16"``, ``"m, v bf16 + v lo bf16"``: the components by role (joined by
    ``+``; ``by_role=False``: one list in the given order), neighbours of one dtype sharing
    it; a dtype already in the label is not repeated, per-block components say their block."""
    if not by_role:
        return _runs(list(components))
    ordered = sorted(components, key=lambda c: _ROLE_ORDER.index(c.role))
    return " + ".join(_runs(list(of_role))
                      for _, of_role in itertools.groupby(ordered, key=lambda c: c.role))


def _runs(components: list[Component]) -> str:
    """``"m, v bf16, m scale fp32 per 128"``: neighbours of one dtype and block share them."""
    runs = []
    for (dtype, per), same in itertools.groupby(components, key=lambda c: (c.dtype, c.per)):
        labels = [c.label for c in same]
        name = dtype_name(dtype)
        suffix = "" if name in labels[-1] else f" {name}"
        runs.append(", ".join(labels) + suffix + (f" per {per}" if per > 1 else ""))
    return ", ".join(runs)


def strategy_layout(strategy: Strategy) -> Layout:
    """The layout of a collage strategy under AdamW, from its components at its default
    weight dtype: each component's bytes in the column of its role (``ROLE_COLUMNS``)."""
    weight_dtype = strategy.weight_dtypes[0]
    columns = dict.fromkeys(("weights", "optimizer_states", "compensation"), 0.0)
    for component in strategy.components(ADAMW, weight_dtype):
        columns[ROLE_COLUMNS[component.role]] += component.bytes
    return Layout(whole(columns["weights"]), whole(columns["optimizer_states"]),
                  whole(columns["compensation"]),
                  describe(strategy.weight_components(weight_dtype)),
                  describe(strategy.state_components(ADAMW, weight_dtype)), weight_dtype,
                  "; stochastic rounding" if strategy.draws else "")


def layouts() -> dict[str, Layout]:
    """Every strategy's layout (``collage.STRATEGIES`` order), then the baselines'."""
    return {**{s.name: strategy_layout(s) for s in all_strategies()}, **BASELINE_LAYOUTS}


_LAYOUTS = layouts()


@dataclass(frozen=True)
class BytesPerParam:
    """Persistent bytes per parameter element, by role (whole numbers are ints)."""

    strategy: str
    weights: float
    gradients: int
    optimizer_states: float  # fractional where block scales are shared (plus8, torchao)
    compensation: float
    layout: str

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer_states + self.compensation

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "total": self.total}


def bytes_per_param(strategy: str, grad_dtype: str = DEFAULT_GRAD_DTYPE) -> BytesPerParam:
    """The persistent bytes per parameter of ``strategy`` (see the module table).

    ``grad_dtype`` is the gradient dtype of the low-precision strategies ("bf16": the
    gradient has the weight's dtype, as autograd produces it; "fp32": gradients accumulated
    in fp32). A strategy with float32 weights always has fp32 gradients.
    """
    if strategy not in _LAYOUTS:
        raise ValueError(f"strategy {strategy!r} is unknown; valid strategies are: "
                         + ", ".join(_LAYOUTS))
    if grad_dtype not in GRAD_DTYPES:
        raise ValueError(f"grad_dtype {grad_dtype!r} is unknown; valid: " + ", ".join(GRAD_DTYPES))
    layout = _LAYOUTS[strategy]
    grad = torch.float32 if grad_dtype == dtype_name(torch.float32) else layout.weight_dtype
    grad_text, grad_bytes = f"g {dtype_name(grad)}", grad.itemsize
    if grad_dtype == "none":  # step in backward: one parameter's gradient at a time
        grad_text, grad_bytes = "g freed in backward", 0
    text = f"{layout.weight_text} | {grad_text} | {layout.state_text}{layout.note}"
    return BytesPerParam(strategy, layout.weights, grad_bytes, layout.optimizer_states,
                         layout.compensation, text)


def memory_table(n_params: float, strategies: Iterable[str],
                 grad_dtype: str = DEFAULT_GRAD_DTYPE) -> str:
    """A plain-text table of bytes per parameter and totals for ``n_params`` parameters."""
    baseline = bytes_per_param(COMPARED_WITH, grad_dtype).total * n_params
    unit, size = memory_unit(baseline)
    strategies = list(strategies)
    width = max([11] + [len(name) for name in strategies])
    header = (f"{'strategy':<{width}} {'weights':>7} {'grads':>5} {'states':>6} {'comp':>4} "
              f"{'B/param':>7} {'total ' + unit:>9} {'vs mixed':>16}  layout")
    lines = [header, "-" * len(header)]
    for name in strategies:
        b = bytes_per_param(name, grad_dtype)
        total = b.total * n_params
        saving = baseline - total
        vs = (f"{-saving / size:+.2f} {unit} ({-saving / baseline:+.0%})" if saving else "0")
        lines.append(
            f"{name:<{width}} {b.weights:>7} {b.gradients:>5} {_num(b.optimizer_states):>6} "
            f"{b.compensation:>4} {_num(b.total):>7} {total / size:>9.2f} {vs:>16}  {b.layout}"
        )
    return "\n".join(lines)


def memory_unit(total_bytes: float) -> tuple[str, float]:
    """GB (1e9 bytes) for a total of a gigabyte or more, else MB (1e6), else kB (1e3): a
    small model's totals are not all 0.00 GB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6)):
        if total_bytes >= size:
            return unit, size
    return "kB", 1e3


def _num(x: float) -> str:
    """2 for whole numbers, 2.06 otherwise (block scales make fractional bytes)."""
    return f"{x:g}" if float(x).is_integer() else f"{x:.2f}"


# --------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------


def _tensors(obj: object) -> Iterable[torch.Tensor]:
    """Every tensor inside nested dicts/lists/tuples; a wrapper tensor subclass (torchao's
    8-bit optimizer states) as the plain tensors it holds."""
    if isinstance(obj, torch.Tensor):
        flatten = getattr(obj, "__tensor_flatten__", None)
        if flatten is not None and not hasattr(obj, "device_mesh"):
            for name in flatten()[0]:
                yield from _tensors(getattr(obj, name))
        else:
            yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


#: Roles of :func:`persistent_bytes`, in the order the reports stack them.
ROLES = ("weights", "master", "gradients", "optimizer_states", "compensation", "buffers")


def _state_roles() -> dict[str, str]:
    """The role of every state key a collage strategy keeps, under any rule: ``master``
    apart (mixed's fp32 copy), the rest by its component's column (``ROLE_COLUMNS``)."""
    roles = {}
    for strategy in all_strategies():
        for rule in RULES.values():
            for component in strategy.components(rule):
                if component.key != "param":
                    roles[component.key] = ("master" if component.role == "master"
                                            else ROLE_COLUMNS[component.role])
    return roles


_STATE_ROLES = _state_roles()


def _state_role(key: object) -> str:
    """The role of an optimizer-state entry, by its key (collage's components; any other
    key, the step counters and other optimizers' states: optimizer states)."""
    return _STATE_ROLES.get(key, "optimizer_states") if isinstance(key, str) \
        else "optimizer_states"


def persistent_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
                     ) -> dict[str, int]:
    """Exact bytes of the tensors that persist across steps, deduplicated by storage.

    Walks the model's parameters and buffers, their ``.grad``, and every tensor in
    ``optimizer.state``; a storage shared by several tensors (tied weights, views into a
    flat buffer) counts once, under the first role that reaches it. Optimizer-state entries
    are sorted by key, as the strategies' components declare them: ``master`` (mixed's
    fp32 copy), compensation (``weight_lo``, ``compensation``, ``weight_low_bits``, a
    state's ``*_lo``) and optimizer states (moments, scales, step counters). Returns bytes
    per role (:data:`ROLES`), ``total``, ``model_total`` (all but buffers: what
    :func:`bytes_per_param` models) and ``n_params``.
    """
    seen: set[tuple[str, int]] = set()
    out = dict.fromkeys(ROLES, 0)

    def count(role: str, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            return
        seen.add(key)
        out[role] += storage.nbytes()

    params = list(model.parameters())  # deduplicated (tied weights once)
    for p in params:
        count("weights", p)
    for p in params:
        if p.grad is not None:
            count("gradients", p.grad)
    for b in model.buffers():
        count("buffers", b)
    if optimizer is not None:
        for state in optimizer.state.values():
            items = state.items() if isinstance(state, dict) else [(None, state)]
            for key, value in items:
                for t in _tensors(value):
                    count(_state_role(key), t)
    out["total"] = sum(out[r] for r in ROLES)
    out["model_total"] = out["total"] - out["buffers"]
    out["n_params"] = sum(p.numel() for p in params)
    return out


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (``getrusage``; KiB on Linux, B on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def current_rss_bytes() -> int | None:
    """This process's current resident set size, where /proc tells it (Linux)."""
    try:
        with open("/proc/self/statm") as handle:
            pages = int(handle.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * resource.getpagesize()


# --------------------------------------------------------------------------------------------
# Peak bytes held by tensors during a window (one training step)
# --------------------------------------------------------------------------------------------


@dataclass
class TensorMemoryProbe:
    """The peak bytes held by tensors on ``device`` during a window, measured by the
    allocator, and the peak inside named sections of it.

    CUDA: ``torch.cuda.max_memory_allocated`` (the caching allocator's own statistic).
    CPU: torch keeps no allocator statistic, but its profiler records every allocation and
    free of the CPU allocator with its size; the probe profiles the window (memory events
    only, to keep the profiler's own cost small) and replays the events in time order on top of
    ``base_bytes``, the exact bytes of the tensors alive when the window opens (the caller
    passes :func:`persistent_bytes`: weights, optimizer states, buffers). Tensors that exist
    before the window and are not in ``base_bytes`` (the data set, a float32 copy of the
    initial weights) are not counted, and neither are their frees during the window: the
    probe measures what training holds.

    Use::

        probe = TensorMemoryProbe(device, base_bytes=persistent_bytes(model, opt)["total"])
        with probe:
            loss = model(x).backward()
            with probe.section("optimizer_step"):
                opt.step()
        probe.peak_bytes, probe.section_peak_bytes["optimizer_step"]
    """

    device: torch.device
    base_bytes: int = 0
    peak_bytes: int | None = None
    section_peak_bytes: dict[str, int] = field(default_factory=dict)
    method: str = ""

    def __post_init__(self) -> None:
        self._profiler = None
        self._sections: list[str] = []

    def __enter__(self) -> TensorMemoryProbe:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.method = "cuda_max_memory_allocated"
            self._cuda_peak = 0
        else:
            from torch.profiler import ProfilerActivity, profile

            self.method = "cpu_allocator_events"
            # freed while profiling, muted: spends c10's once-per-process "unknown block"
            # line on this block instead of on a tensor of the user's previous step
            old_block = [torch.empty(1)]
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with _quiet_stderr():
                self._profiler.__enter__()
                old_block.clear()
        return self

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """A named part of the window whose own peak is reported."""
        self._sections.append(name)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._cuda_peak = max(self._cuda_peak, torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            self.section_peak_bytes[name] = max(self.section_peak_bytes.get(name, 0), peak)
            self._cuda_peak = max(self._cuda_peak, peak)
            return
        from torch.profiler import record_function

        with record_function(_SECTION_PREFIX + name):
            yield

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = max(self._cuda_peak, torch.cuda.max_memory_allocated(self.device))
            return
        with _quiet_stderr():
            self._profiler.__exit__(*exc)
        if exc[0] is None:
            self._replay(self._profiler.profiler.kineto_results)
        self._profiler = None

    def _replay(self, results) -> None:
        """Live bytes after each allocation event, in time order; peaks overall and inside
        each section's time ranges (a section starts at the live bytes it opens with)."""
        events = list(_profiled_events(results.experimental_event_tree()))
        timeline = [(e.start_time_ns, 1, nbytes, "")
                    for e, nbytes in _window_allocations(events)]
        for e in events:
            if e.name.startswith(_SECTION_PREFIX):
                name = e.name[len(_SECTION_PREFIX):]
                timeline += [(e.start_time_ns, 0, 0, name), (e.end_time_ns, 2, 0, name)]
        timeline.sort(key=lambda item: (item[0], item[1]))
        live = peak = self.base_bytes
        open_sections: set[str] = set()
        for _, kind, nbytes, name in timeline:
            if kind == 0:
                open_sections.add(name)
            elif kind == 2:
                open_sections.discard(name)
            live += nbytes
            peak = max(peak, live)
            for section in open_sections:
                self.section_peak_bytes[section] = max(self.section_peak_bytes.get(section, 0),
                                                       live)
        self.peak_bytes = peak


def _profiled_events(roots) -> Iterator:
    """Every event of the profiler's tree (ops, sections, allocations), depth first."""
    pending = list(reversed(roots))
    while pending:
        event = pending.pop()
        yield event
        pending.extend(reversed(event.children))


def _window_allocations(events) -> Iterator[tuple]:
    """(event, signed bytes) of the allocations made in the window and of the frees of those
    blocks, in time order. A free of a block allocated before the window is left out: the
    profiler reports it whenever the block was allocated while *any* earlier profiler ran
    (c10 keeps their sizes), e.g. a previous step's or test's tensor that the garbage
    collector happens to free now; counting it would lower the live bytes by a tensor that
    ``base_bytes`` never counted, and hide a peak (by 8 KiB in a CI run)."""
    allocations = sorted((e for e in events if hasattr(e.extra_fields, "alloc_size")),
                         key=lambda e: e.start_time_ns)
    born: set[int] = set()
    for event in allocations:
        fields = event.extra_fields
        if fields.alloc_size > 0:
            born.add(fields.ptr)
            yield event, fields.alloc_size
        elif fields.ptr in born:
            born.discard(fields.ptr)
            yield event, fields.alloc_size


_SECTION_PREFIX = "collage.memory::"


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Mute C-level stderr (file descriptor 2) for a few profiler calls.

    Starting and stopping torch's profiler makes kineto print its own lines
    ("profiler_start", "profiler_stop", and on machines without a GPU "gpuGetDeviceCount
    failed") and c10 log once per process that a block allocated before profiling was freed
    during it (the probe accounts for those through ``base_bytes``). None of it concerns the
    user of a training run; only those calls run muted, and Python exceptions still
    propagate normally."""
    try:
        sys.stderr.flush()
        saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except OSError:  # no file descriptor 2: nothing would be printed anyway
        yield
        return
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
