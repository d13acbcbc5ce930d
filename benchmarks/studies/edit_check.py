"""The cost of noticing edited weights (``collage/optim/edits.py``) on a step with no edit.

Two copies of the same parameters and gradients, one collage AdamW each (fused path: the
native plan on CPU), stepped interleaved after warm-up (the order alternates every repeat):
one as shipped, one with the check switched off (``WriteLog.rederive_edited`` and
``WriteLog.note`` made no-ops: the step as it was before the check existed). Prints the
median step time of each, the median over repeats of the paired ratio, and the check alone
(``rederive_edited`` over the step's items, nothing edited: the least of 20 timings of 200
calls, a figure that a loaded machine disturbs far less than a whole step).

    python benchmarks/studies/edit_check.py                          # plus; 148 x 4,096 and 16m
    python benchmarks/studies/edit_check.py --strategy light --repeats 201
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch

import collage
from collage.bench.common import gpt_shapes
from collage.bench.measure import make_params
from collage.optim import edits, get_strategy


def _layouts() -> dict[str, list]:
    """Many small tensors (the check's per-tensor work at its largest share of a step) and
    the 16m GPT layout (52 tensors, 17M parameters)."""
    return {"148 x 4,096": [(f"p{i}", (4096,)) for i in range(148)],
            "16m (52 tensors)": gpt_shapes("16m")}


class _CheckOff:
    """The check switched off while in use (the optimizer's step as before it existed)."""

    def __enter__(self) -> None:
        self.saved = edits.WriteLog.rederive_edited, edits.WriteLog.note
        edits.WriteLog.rederive_edited = lambda *args, **kwargs: False
        edits.WriteLog.note = lambda *args: None

    def __exit__(self, *exc) -> None:
        edits.WriteLog.rederive_edited, edits.WriteLog.note = self.saved


def _step(opt, off: bool) -> float:
    if off:
        with _CheckOff():
            started = time.perf_counter()
            opt.step()
            return time.perf_counter() - started
    started = time.perf_counter()
    opt.step()
    return time.perf_counter() - started


def measure(shapes, strategy: str, repeats: int, warmup: int) -> dict[str, float]:
    opts = {}
    for off in (False, True):
        params = make_params(shapes, torch.bfloat16, torch.device("cpu"), seed=0)
        opts[off] = collage.AdamW(params, lr=1e-3, strategy=strategy, fused=True)
    for off, opt in opts.items():
        for _ in range(warmup):
            _step(opt, off)
    times: dict[bool, list[float]] = {False: [], True: []}
    for k in range(repeats):
        for off in ((False, True) if k % 2 else (True, False)):
            times[off].append(_step(opts[off], off))
    return {"check_us": 1e6 * statistics.median(times[False]),
            "off_us": 1e6 * statistics.median(times[True]),
            "ratio": statistics.median(a / b for a, b in zip(times[False], times[True])),
            "alone_us": _check_alone(opts[False])}


def _check_alone(opt) -> float:
    """Microseconds of the check over every group's items, nothing edited."""
    batches = [(get_strategy(group["strategy"]), items) for _, group, items in opt._gather()]

    def check() -> None:  # as a plan step runs it (the plans checked the pointers)
        for strategy, items in batches:
            opt._writes.rederive_edited(strategy, items, same_pointers=True)

    return 1e6 * min(timeit.repeat(check, number=200, repeat=20)) / 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="plus")
    parser.add_argument("--repeats", type=int, default=101)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    print(f"{args.strategy}, fused, {torch.get_num_threads()} threads, median of "
          f"{args.repeats}")
    print("| layout | step with the check (us) | without (us) | paired ratio | check alone "
          "(us) |")
    print("|---|---:|---:|---:|---:|")
    for name, shapes in _layouts().items():
        row = measure(shapes, args.strategy, args.repeats, args.warmup)
        print(f"| {name} | {row['check_us']:.0f} | {row['off_us']:.0f} | "
              f"{row['ratio']:.3f} | {row['alone_us']:.1f} |")


if __name__ == "__main__":
    main()
