"""What the default non-finite check (``nonfinite="skip"``) costs each strategy's step, in
the same rounds (#31).

One collage AdamW per strategy (fused path) on ``collage bench optimizer``'s GPT-shaped
parameters; after warm-up its ``nonfinite`` is switched between ``"skip"`` and ``"ignore"``
every step (the order alternating each round), so both are timed on the same tensors, the
same native plan and the same machine load. Per strategy: the median step time of each, the
median of the per-round differences (what the check costs the step), and where the step
lists its gradients for the check (``any_nonfinite``, timed inside the step) that call with
the read bandwidth it reached on the gradients' 2 bytes per parameter. A step of every
group by its native plan checks inside its one C call (``step_plans`` with ``check``): it
is counted, and its cost is the difference.

    python benchmarks/check_cost.py --size 16m --rounds 15
    python benchmarks/check_cost.py --size 100m --strategies light,plus,kahan,bf16 --rounds 9

``--against LIBRARY.so`` times instead the check's call alone with this library and with
another build of it (an earlier version's, from ``~/.cache/collage/native``), interleaved, on
1 and 2 threads: an A/B of the check's kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch

import collage
import collage.optim.nonfinite as nonfinite_module
from collage.bench.common import SIZES, gpt_shapes, n_params
from collage.bench.measure import make_params
from collage.optim import get_strategy
from collage.optim.native import plan as native_plan


def _timed(function, record: list[float]):
    """``function``, each call timed into ``record``."""
    def timed(*args):
        start = time.perf_counter()
        verdict = function(*args)
        record.append(time.perf_counter() - start)
        return verdict

    return timed


@contextlib.contextmanager
def _timed_checks(record: list[float], in_call: list[int]) -> Iterator[None]:
    """The check as the step calls it: the gradient list's (``any_nonfinite``) timed into
    ``record``; the planned steps' calls that check (``step_plans`` with ``check``) counted
    into ``in_call``; both put back after."""
    check, planned = nonfinite_module.any_nonfinite, native_plan.step_plans

    def counted(runs, check_now):
        if check_now:
            in_call.append(len(runs))
        return planned(runs, check_now)

    nonfinite_module.any_nonfinite = _timed(check, record)
    native_plan.step_plans = counted
    try:
        yield
    finally:
        nonfinite_module.any_nonfinite, native_plan.step_plans = check, planned


def measure(size: str, strategy: str, rounds: int) -> dict:
    params = make_params(gpt_shapes(size), get_strategy(strategy).weight_dtypes[0],
                         torch.device("cpu"), seed=2)
    opt = collage.AdamW(params, strategy=strategy, fused=True)
    opt.step()
    opt.step()
    times: dict[str, list[float]] = {"skip": [], "ignore": []}
    checks: list[float] = []
    in_call: list[int] = []
    with _timed_checks(checks, in_call):
        for r in range(rounds):
            for policy in ("skip", "ignore") if r % 2 == 0 else ("ignore", "skip"):
                opt.nonfinite = policy
                start = time.perf_counter()
                opt.step()
                times[policy].append(time.perf_counter() - start)
    n = n_params(size)
    out = {"strategy": strategy, "path": "+".join(dict.fromkeys(opt.last_paths.values())),
           "skip_ms": 1e3 * statistics.median(times["skip"]),
           "ignore_ms": 1e3 * statistics.median(times["ignore"]),
           "difference_ms": 1e3 * statistics.median(
               a - b for a, b in zip(times["skip"], times["ignore"])),
           "check_calls": len(checks) + len(in_call),
           "checks_in_step_call": len(in_call),
           "check_ms": 1e3 * statistics.median(checks) if checks else None,
           "check_GBps": 2 * n / statistics.median(checks) / 1e9 if checks else None}
    del opt, params
    gc.collect()
    return out


def against(size: str, path: str, rounds: int) -> None:
    """The check's call with the current library and with the one at ``path``."""
    from collage.optim.native import any_nonfinite
    from collage.optim.native.build import _open, load

    libraries = {"this version": load(), path.rsplit("/", 1)[-1]: _open(Path(path))}
    params = make_params(gpt_shapes(size), torch.bfloat16, torch.device("cpu"), seed=2)
    grads = [p.grad for p in params]
    n = n_params(size)
    print("| library | threads | check call ms (median) | read GB/s |")
    print("|---|---:|---:|---:|")
    for threads in (1, 2):
        times: dict[str, list[float]] = {name: [] for name in libraries}
        for r in range(rounds):
            names = list(libraries)
            for name in names[r % 2:] + names[:r % 2]:
                start = time.perf_counter()
                assert any_nonfinite(grads, threads, lib=libraries[name]) is False
                times[name].append(time.perf_counter() - start)
        for name, values in times.items():
            median = statistics.median(values)
            print(f"| {name} | {threads} | {1e3 * median:.2f} | {2 * n / median / 1e9:.1f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="16m", choices=sorted(SIZES))
    parser.add_argument("--strategies", default="bf16,light,kahan,plus")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--against", metavar="LIBRARY.so",
                        help="A/B the check's kernel against another build of the library")
    args = parser.parse_args(argv)
    if args.against:
        against(args.size, args.against, args.rounds)
        return 0
    n = n_params(args.size)
    print(f"{args.size}: {n / 1e6:.1f}M parameters, {len(gpt_shapes(args.size))} tensors, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds\n")
    print("(check call: '-' where the check ran inside the step's one C call of planned "
          "groups; its cost is then the difference)\n")
    print("| strategy | path | skip ms | ignore ms | skip - ignore, per round, median ms | "
          "check call ms | check read GB/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for strategy in args.strategies.split(","):
        r = measure(args.size, strategy, args.rounds)
        call = ("- | -" if r["check_ms"] is None
                else f"{r['check_ms']:.2f} | {r['check_GBps']:.1f}")
        print(f"| {strategy} | {r['path']} | {r['skip_ms']:.2f} | {r['ignore_ms']:.2f} | "
              f"{r['difference_ms']:.2f} | {call} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
