"""docs/distributed.md's "What is observed" table, computed in one process.

DDP and FSDP2 over two ranks are bitwise equal to a single process that combines the two
half-batch gradients as ``fl(g0/2 + g1/2)`` (``test_bitwise_equal_to_single_process``), so
their distance to full-batch training is that single process's: this script trains both in
one process (``_common.train_reference`` with ``world=2`` and ``world=1``, the workers'
comparison in ``_worker.compare_with_single_process``) and prints the table.

Its exact figures (but the bound column) depend on the CPU: the two runs' gradients come
from torch's CPU kernels (GEMMs, reductions, vectorised exp/log/tanh), whose rounding
differs between instruction sets, and a strategy amplifies every difference in the last
bit into the elements that differ (docs/compare.md, "Which results depend on the CPU").
So the table names the machine it came from (:func:`machine_line`), and
``tests/distributed/test_observed.py`` compares it figure for figure only on that machine;
everywhere it checks what the table shows (:func:`problems`): each run within the proved
bound, and the loss curves within :data:`LOSS_AGREEMENT`.

Usage::

    python tests/distributed/observed.py            # print the table
    python tests/distributed/observed.py --write    # rewrite it in docs/distributed.md
    python tests/distributed/observed.py --check    # exit 1 if docs/distributed.md differs
                                                    # (on another machine: if a run breaks
                                                    # what the table shows)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from collage.bench.common import cpu_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"
BEGIN = "<!-- observed table: python tests/distributed/observed.py --write -->"
END = "<!-- end of the observed table -->"
HEADER = ("| strategy | max \\|Δw\\| | bound | elements that differ "
          "| \\|Δ loss\\| max over steps |\n|---|---|---|---|---|")

#: How far the loss curves of data-parallel and full-batch training may be apart, at any
#: step, on any CPU. Measured (``python tests/distributed/observed.py``, 2026-12-06, the
#: largest over the strategies, always ``plus``): 1.08e-3 with torch's AVX-512 kernels
#: (the table's Xeon), and 1.08e-3 again with its AVX2 kernels and with its portable ones
#: (emulated there: ATEN_CPU_CAPABILITY=avx2 or default, ONEDNN_MAX_CPU_ISA=AVX2 or SSE41,
#: with and without MKL_ENABLE_INSTRUCTIONS=AVX2); `fp32` at most 7.2e-7 there, 4.8e-7 on
#: an AMD EPYC with AVX2 (#40). 2e-3 leaves CPUs not tried nearly twice the largest; draws
#: of ``stochastic`` keyed differently in the two runs (a bug, planted by the test) give
#: 5.4e-3.
LOSS_AGREEMENT = 2e-3


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """``_common.deterministic`` for the duration, the caller's settings restored after."""
    threads, strict = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    C.deterministic()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(strict)


def measure(strategy: str, **full_batch_options) -> dict:
    """Data-parallel training (emulated bitwise) against full-batch training, 10 steps.
    ``full_batch_options``: optimizer options of the full-batch run alone (a test plants a
    difference there)."""
    initial = {n: p.detach().clone() for n, p in C.build_model(strategy).named_parameters()}
    with deterministic():
        dp_model, dp_opt, dp_losses, _ = C.train_reference(strategy, world=2)
        full_model, full_opt, full_losses, _ = C.train_reference(strategy, world=1,
                                                                 **full_batch_options)
    dp, full = C.snapshot(dp_model, dp_opt), C.snapshot(full_model, full_opt)
    weights = [k for k in dp if ":" not in k]
    largest = max(float(t.abs().max()) for s in (dp, full, initial) for k, t in s.items()
                  if ":" not in k and t.numel())
    return {
        "max_dw": max(float((dp[k].double() - full[k].double()).abs().max()) for k in weights),
        "bound": C.divergence_bound(strategy, C.STEPS, 2 * largest),
        "differ": sum(int((dp[k] != full[k]).sum()) for k in weights),
        "dloss": max(abs(a - b) for a, b in zip(dp_losses, full_losses)),
    }


def measure_all() -> dict[str, dict]:
    return {strategy: measure(strategy) for strategy in C.ALL_STRATEGIES}


def table(measured: dict[str, dict] | None = None) -> str:
    rows = [HEADER]
    for strategy, m in (measured or measure_all()).items():
        rows.append(f"| `{strategy}` | {m['max_dw']:.2g} | {m['bound']:.2f} | {m['differ']:,} "
                    f"| {m['dloss']:.1e} |")
    return "\n".join(rows)


def problems(strategy: str, m: dict) -> list[str]:
    """What the table shows that a run ``m`` of ``strategy`` breaks, on any CPU: every
    element within the bound proved for any two gradient sequences
    (``_common.divergence_bound``: exact arithmetic, so CPU-independent), the loss curves
    within :data:`LOSS_AGREEMENT` (measured on both kinds of CPU)."""
    bad = []
    if not m["max_dw"] <= m["bound"]:
        bad.append(f"{strategy}: max |dw| {m['max_dw']:.3g} exceeds the bound {m['bound']:.3g}")
    if not m["dloss"] <= LOSS_AGREEMENT:
        bad.append(f"{strategy}: the loss curves differ by {m['dloss']:.2e} at some step, "
                   f"more than {LOSS_AGREEMENT:g}")
    return bad


def machine() -> str:
    """This machine as the table names it: what decides torch's CPU kernels
    (``collage.bench.common.cpu_kernels``) and torch's version (its MKL and oneDNN)."""
    k = cpu_kernels()
    text = (f"{k['cpu']}, torch's CPU capability {k['cpu_capability']} "
            f"({' '.join(k['isa']) or 'no x86 vector extensions'}), torch {torch.__version__}")
    if k["overrides"]:
        text += ", with " + " ".join(f"{name}={value}" for name, value in k["overrides"].items())
    return text


def machine_line(date: str | None = None) -> str:
    date = date or datetime.date.today().isoformat()
    return f"Measured on {machine()}, one thread, on {date}:"


def documented_machine() -> str:
    """The machine named above the documented table (its line without the date)."""
    line = _block().splitlines()[0]
    if not line.startswith("Measured on ") or ", one thread, on " not in line:
        raise ValueError(f"docs/distributed.md's observed table names no machine: {line!r}")
    return line.removeprefix("Measured on ").rsplit(", one thread, on ", 1)[0]


def same_machine() -> bool:
    """Whether this machine runs the kernels of the one the table came from."""
    return machine() == documented_machine()


def _block() -> str:
    text = DOC.read_text()
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()


def documented() -> str:
    """The documented table (without the machine's line)."""
    return "\n".join(line for line in _block().splitlines() if line.startswith("|"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    measured = measure_all()
    computed = table(measured)
    if args.write:
        text = DOC.read_text()
        head, tail = text[:text.index(BEGIN) + len(BEGIN)], text[text.index(END):]
        DOC.write_text(f"{head}\n{machine_line()}\n\n{computed}\n{tail}")
    elif args.check:
        if same_machine() and computed != documented():
            print(f"docs/distributed.md's observed table differs from the code's:\n{computed}")
            return 1
        bad = [p for strategy, m in measured.items() for p in problems(strategy, m)]
        if bad:
            print("\n".join(["runs break what the observed table shows:", *bad]))
            return 1
        if not same_machine():
            print(f"the table's exact figures are of {documented_machine()}; this is "
                  f"{machine()}: its runs keep the bound and the loss agreement")
    print(computed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
