"""One rank of the 2-process UpdateStats reduction test (run by test_distributed.py).

Usage: ``python _dist_worker.py RANK WORLD_SIZE INIT_FILE``. Exits non-zero (uncaught
exception) if any check fails. A plain script, not a pytest module, so that it works under
any pytest import mode.
"""

from __future__ import annotations

import datetime
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _reference import (  # noqa: E402
    Update,
    assert_metrics_close,
    random_update,
    reference_dict,
)

from collage.metrics import UpdateStats  # noqa: E402

# parameter name -> (group, element count held by each rank: uneven shards)
PARAMS = {
    "blocks.0.attn.weight": ("group0", (96, 160)),
    "blocks.0.mlp.weight": ("group0", (200, 56)),
    "blocks.0.ln.weight": ("group1", (33, 31)),
}


def shard(name: str, rank: int) -> Update:
    """Rank ``rank``'s part of parameter ``name``: deterministic, different on each rank."""
    index = list(PARAMS).index(name)
    n = PARAMS[name][1][rank]
    return random_update(n, seed=100 * index + rank, visible=index != 1, compensation=index == 0)


def keys_of(name: str) -> list[str]:
    """The roll-up keys a parameter is counted into."""
    return ["", PARAMS[name][0], name]


def concatenated(parts: list[Update]) -> Update:
    """The whole parameter: the ranks' shards concatenated."""

    def cat(attr: str) -> torch.Tensor | None:
        values = [getattr(p, attr) for p in parts]
        return None if values[0] is None else torch.cat(values)

    return Update(*(cat(a) for a in vars(parts[0])))  # type: ignore[arg-type]


def single_process_expectation(world: int) -> dict[str, float]:
    """UpdateStats in one process on the concatenated tensors."""
    stats = UpdateStats()
    for name in PARAMS:
        u = concatenated([shard(name, r) for r in range(world)])
        stats.add(keys_of(name), u.intended, u.before, u.after, **u.kwargs())
    return stats.to_dict()


def check_reduction(rank: int, world: int) -> None:
    """The reduced dict equals the single-process one and the brute-force reference."""
    stats = UpdateStats()
    for name in reversed(PARAMS) if rank else PARAMS:  # key insertion order differs
        u = shard(name, rank)
        stats.add(keys_of(name), u.intended, u.before, u.after, **u.kwargs())
    stats.reduce_()  # the production path: one all_reduce, no key check
    got = stats.to_dict()
    assert_metrics_close(got, single_process_expectation(world))  # on every rank
    by_key: dict[str, list[Update]] = {}
    for name in PARAMS:
        for key in keys_of(name):
            by_key.setdefault(key, []).extend(shard(name, r) for r in range(world))
    assert_metrics_close(got, reference_dict(by_key))
    assert not math.isnan(got["edq/group1"])


def check_key_mismatch_is_detected(rank: int) -> None:
    """check_keys=True raises ValueError on every rank when the key sets differ."""
    stats = UpdateStats()
    u = shard("blocks.0.ln.weight", rank)
    stats.add(["", f"only_on_rank{rank}"], u.intended, u.before, u.after)
    try:
        stats.reduce_(check_keys=True)
    except ValueError as exc:
        assert "keys differ across ranks" in str(exc), exc
    else:
        raise AssertionError("mismatched keys were not detected")
    # the refusal reduced nothing, so the stats are not marked reduced: after a reset and
    # the same keys on every rank, reduce_ works (it used to say "already reduced")
    try:
        stats.add(["x"], u.intended, u.before, u.after)
    except RuntimeError as exc:
        raise AssertionError("a refused reduce_ marked the stats reduced") from exc
    stats.reset()
    stats.add([""], u.intended, u.before, u.after)
    stats.reduce_(check_keys=True)


def main(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        check_reduction(rank, world)
        check_key_mismatch_is_detected(rank)
    finally:
        dist.destroy_process_group()
    print(f"rank {rank}: ok")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
