"""docs/distributed.md's "What is observed" table, computed in one process.

DDP and FSDP2 over two ranks are bitwise equal to a single process that combines the two
half-batch gradients as ``fl(g0/2 + g1/2)`` (``test_bitwise_equal_to_single_process``), so
their distance to full-batch training is that single process's: this script trains both in
one process (``_common.train_reference`` with ``world=2`` and ``world=1``, the workers'
comparison in ``_worker.compare_with_single_process``) and prints the table.

Usage::

    python tests/distributed/observed.py            # print the table
    python tests/distributed/observed.py --write    # rewrite it in docs/distributed.md
    python tests/distributed/observed.py --check    # exit 1 if docs/distributed.md differs

``tests/distributed/test_observed.py`` runs the check.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"
BEGIN = "<!-- observed table: python tests/distributed/observed.py --write -->"
END = "<!-- end of the observed table -->"
HEADER = ("| strategy | max \\|Δw\\| | bound | elements that differ "
          "| \\|Δ loss\\| max over steps |\n|---|---|---|---|---|")


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


def measure(strategy: str) -> dict:
    """Data-parallel training (emulated bitwise) against full-batch training, 10 steps."""
    initial = {n: p.detach().clone() for n, p in C.build_model(strategy).named_parameters()}
    with deterministic():
        dp_model, dp_opt, dp_losses, _ = C.train_reference(strategy, world=2)
        full_model, full_opt, full_losses, _ = C.train_reference(strategy, world=1)
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


def table() -> str:
    rows = [HEADER]
    for strategy in C.ALL_STRATEGIES:
        m = measure(strategy)
        rows.append(f"| `{strategy}` | {m['max_dw']:.2g} | {m['bound']:.2f} | {m['differ']:,} "
                    f"| {m['dloss']:.1e} |")
    return "\n".join(rows)


def documented() -> str:
    text = DOC.read_text()
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    computed = table()
    if args.write:
        text = DOC.read_text()
        head, tail = text[:text.index(BEGIN) + len(BEGIN)], text[text.index(END):]
        DOC.write_text(f"{head}\n{computed}\n{tail}")
    elif args.check and computed != documented():
        print(f"docs/distributed.md's observed table differs from the code's:\n{computed}")
        return 1
    print(computed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
