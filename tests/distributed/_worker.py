"""One rank of the distributed checks (run by the tests in this folder, or by hand).

Usage::

    python _worker.py RANK WORLD INIT_FILE OUT_DIR TASK[:STRATEGY,...] [...]

Tasks: ``ddp``, ``fsdp``, ``fsdp_inner`` (FSDP2 with the matrices sharded on dimension 1)
(train 10 steps, compare with single-process training),
``dcp_save`` (FSDP2: 5 steps, DCP checkpoint, 5 more) and ``dcp_load`` (fresh model, load
that checkpoint with this world size, sharded under FSDP2 for WORLD > 1, a plain model for
WORLD == 1, 5 steps; must equal the uninterrupted run). No strategies means all eight.
Rendezvous through a FileStore at INIT_FILE; WORLD == 1 starts no process group at all.

Every check that fails is printed as ``FAIL <task> <strategy> <check>: <what>``; the
process then exits 3 (0 if all passed; an uncaught exception exits 1). Rank 0 prints
``RESULT {json}`` lines with measured quantities. A plain script, not a pytest module.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

import collage  # noqa: E402

HALF = C.STEPS // 2
CHECKS_FAILED = 3  # exit code: checks failed (an uncaught exception exits with 1)
FAILURES: list[str] = []


def fail(task: str, strategy: str, check: str, problems) -> None:
    """Record failed ``check`` of (task, strategy): one ``FAIL`` line per problem."""
    for problem in problems:
        line = f"FAIL {task} {strategy} {check}: {problem}"
        FAILURES.append(line)
        print(line, flush=True)


def result(**fields) -> None:
    print("RESULT " + json.dumps(fields), flush=True)


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world() -> int:
    return dist.get_world_size() if distributed() else 1


def same_on_all_ranks(snap: dict) -> bool:
    digests = [None] * world()
    dist.all_gather_object(digests, C.digest(snap))
    return len(set(digests)) == 1


def local_steps(model, optimizer, start: int, steps: int):
    """Data-parallel training: this rank's share of each global batch."""
    losses, stats = [], []
    for step in range(start, start + steps):
        x, y = C.batch(step)
        loss = C.loss_fn(model, C.shard_of(x, rank(), world()), C.shard_of(y, rank(), world()))
        loss.backward()
        optimizer.step()
        stats.append(dict(optimizer.update_stats))
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world())
    return losses, stats


def max_abs(*snaps) -> float:
    return max(float(t.abs().max()) for s in snaps for k, t in s.items()
               if ":" not in k and t.numel())


def compare_with_single_process(task, strategy, snap, stats, losses, initial) -> None:
    """The same run in one process, on the data-parallel gradient (bitwise) and on
    the full-batch gradient (within the divergence bound)."""
    ref_model, ref_opt, ref_losses, ref_stats = C.train_reference(strategy, world=2)
    ref = C.snapshot(ref_model, ref_opt)
    mismatches = C.bitwise_mismatches(snap, ref)
    fail(task, strategy, "bitwise", mismatches)
    fail(task, strategy, "stats", C.stats_mismatches(stats, ref_stats))
    full_model, full_opt, full_losses, _ = C.train_reference(strategy, world=1)
    full_snap = C.snapshot(full_model, full_opt)
    weights = [k for k in snap if ":" not in k]
    bound = C.divergence_bound(strategy, C.STEPS, 2 * max_abs(snap, full_snap, initial))
    div_full = max(float((snap[k].double() - full_snap[k].double()).abs().max()) for k in weights)
    div_emul = max(float((snap[k].double() - ref[k].double()).abs().max()) for k in weights)
    if div_full > bound or div_emul > bound:
        fail(task, strategy, "bound", [f"weights differ by {max(div_full, div_emul):.3g} > bound "
                              f"{bound:.3g}"])
    loss_gap = max(abs(a - b) for a, b in zip(losses, full_losses))
    result(task=task, strategy=strategy, bitwise=not mismatches, div_full=div_full,
           div_emulated=div_emul, bound=bound, loss_gap_full=loss_gap,
           final_loss=losses[-1], full_batch_final_loss=full_losses[-1],
           elements_differing_full=sum(int((snap[k] != full_snap[k]).sum()) for k in weights),
           elements=sum(snap[k].numel() for k in weights))


# ------------------------------------------------------------------------------ tasks


def task_ddp(strategy: str, checks: list) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = C.build_model(strategy)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    ddp = DDP(model)
    optimizer = C.make_optimizer(ddp.parameters(), strategy)
    losses, stats = local_steps(ddp, optimizer, 0, C.STEPS)
    snap = C.snapshot(model, optimizer)
    if not same_on_all_ranks(snap):
        fail("ddp", strategy, "ranks", ["weights or states differ across ranks"])
    checks.append(lambda: compare_with_single_process("ddp", strategy, snap, stats, losses,
                                                      initial))


def task_fsdp(strategy: str, checks: list, task: str = "fsdp") -> None:
    """``fsdp_inner``: the matrices sharded on their second dimension (no rank's shard is a
    flat range: the native kernels take them where the strategy draws nothing)."""
    model = C.build_model(strategy)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    C.fsdp_wrap(model, inner=task == "fsdp_inner")
    optimizer = C.make_optimizer(model.parameters(), strategy)
    losses, stats = local_steps(model, optimizer, 0, C.STEPS)
    fail(task, strategy, "layout", C.state_layout_problems(model, optimizer, strategy))
    snap = C.snapshot(model, optimizer)
    consolidated = collage.consolidate(model, optimizer)
    if any(hasattr(v, "to_local") or v.dtype != torch.float32 for v in consolidated.values()):
        fail(task, strategy, "consolidate", ["did not return whole float32 tensors"])
    if not same_on_all_ranks(consolidated):
        fail(task, strategy, "ranks", ["consolidate differs across ranks"])
    collage.load_full_precision(model, optimizer, consolidated)  # sharded: each rank's slice
    reloaded = C.snapshot(model, optimizer)

    def check() -> None:
        compare_with_single_process(task, strategy, snap, stats, losses, initial)
        ref_model, ref_opt, _, _ = C.train_reference(strategy, world=2)
        ref_consolidated = collage.consolidate(ref_model, ref_opt)
        fail(task, strategy, "consolidate", [
            "vs single process: " + m for m in C.bitwise_mismatches(
                consolidated, ref_consolidated)])
        collage.load_full_precision(ref_model, ref_opt, ref_consolidated)
        fail(task, strategy, "consolidate", [
            "load_full_precision vs single process: " + m for m in C.bitwise_mismatches(
                reloaded, C.snapshot(ref_model, ref_opt))])

    checks.append(check)


def _checkpoint_dir(out: Path, strategy: str) -> Path:
    return out / f"dcp_{strategy}"


def _dcp_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def task_dcp_save(strategy: str, out: Path, checks: list) -> None:
    """FSDP2 over the ranks: 5 steps, a DCP checkpoint, 5 more steps (the reference)."""
    import torch.distributed.checkpoint as dcp

    model = C.fsdp_wrap(C.build_model(strategy))
    optimizer = C.make_optimizer(model.parameters(), strategy)
    local_steps(model, optimizer, 0, HALF)
    dcp.save(_dcp_state(model, optimizer), checkpoint_id=str(_checkpoint_dir(out, strategy)))
    consolidated = collage.consolidate(model, optimizer)
    _, stats = local_steps(model, optimizer, HALF, C.STEPS - HALF)
    snap = C.snapshot(model, optimizer)
    if rank() == 0:
        torch.save({"snapshot": snap, "stats": stats, "consolidated": consolidated},
                   out / f"uninterrupted_{strategy}.pt")
        checks.append(lambda: check_checkpoint_dtypes(strategy, _checkpoint_dir(out, strategy)))


def check_checkpoint_dtypes(strategy: str, path: Path) -> None:
    """The checkpoint's metadata records every state tensor with the strategy's dtype."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    want = C.EXPECTED_STATE[strategy]
    seen = 0
    problems = []
    for key, meta in metadata.items():
        if not key.startswith("optim.state."):
            continue
        state_key = key.rsplit(".", 1)[1]
        if state_key in want:
            seen += 1
            if meta.properties.dtype != want[state_key]:
                problems.append(f"checkpoint {key} is {meta.properties.dtype}")
    if seen == 0:
        problems.append(f"no optimizer state found in the checkpoint: {sorted(metadata)[:8]}")
    weight = C.weight_dtype(strategy)
    problems += [f"checkpoint {k} is {m.properties.dtype}" for k, m in metadata.items()
                 if k.startswith("model.") and m.properties.dtype != weight]
    fail("dcp_save", strategy, "dtypes", problems)


def task_dcp_load(strategy: str, out: Path, checks: list) -> None:
    """A fresh model (other weights), sharded over this world (plain if WORLD == 1), loads
    the checkpoint and trains the last 5 steps: must equal the uninterrupted run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    task = f"dcp_load{world()}"
    model = C.build_model(strategy, seed=C.MODEL_SEED + 1)  # other weights: load must win
    if distributed():
        C.fsdp_wrap(model)
    optimizer = C.make_optimizer(model.parameters(), strategy)
    state = _dcp_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(_checkpoint_dir(out, strategy)))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    fail(task, strategy, "layout", C.state_layout_problems(model, optimizer, strategy))
    counters = optimizer.state_dict()["collage"]
    if counters["steps_taken"] != HALF:
        fail(task, strategy, "counters", [f"steps_taken is {counters['steps_taken']} after "
                                          f"loading a checkpoint taken after {HALF} steps"])
    consolidated = collage.consolidate(model, optimizer)
    if distributed():
        _, stats = local_steps(model, optimizer, HALF, C.STEPS - HALF)
    else:
        _, _, _, stats = C.train_reference(strategy, C.STEPS - HALF, world=2, model=model,
                                           optimizer=optimizer, start=HALF)
    snap = C.snapshot(model, optimizer)
    if rank() != 0:
        return

    def check() -> None:
        saved = torch.load(out / f"uninterrupted_{strategy}.pt", weights_only=True)
        fail(task, strategy, "consolidate",
             C.bitwise_mismatches(consolidated, saved["consolidated"]))
        mismatches = C.bitwise_mismatches(snap, saved["snapshot"])
        fail(task, strategy, "resume", mismatches)
        if not mismatches:
            fail(task, strategy, "stats", C.stats_mismatches(stats, saved["stats"]))
        result(task=task, strategy=strategy, resumed_bitwise=not mismatches)

    checks.append(check)


# ------------------------------------------------------------------------------ main

TASKS = {"ddp": task_ddp, "fsdp": task_fsdp,
         "fsdp_inner": lambda strategy, checks: task_fsdp(strategy, checks, "fsdp_inner"),
         "dcp_save": task_dcp_save, "dcp_load": task_dcp_load}


def parse_case(text: str) -> tuple[str, list[str]]:
    """``task`` or ``task:strategy,strategy``; no strategies means all of them."""
    task, _, strategies = text.partition(":")
    if task not in TASKS:
        raise SystemExit(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    names = strategies.split(",") if strategies else list(C.ALL_STRATEGIES)
    for name in names:
        if name not in (*C.ALL_STRATEGIES, C.AUTO):
            raise SystemExit(f"unknown strategy {name!r}")
    return task, names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rank", type=int)
    parser.add_argument("world", type=int)
    parser.add_argument("init_file")
    parser.add_argument("out", type=Path)
    parser.add_argument("cases", nargs="+", type=parse_case,
                        help="task[:strategy,...] with task in " + ", ".join(TASKS))
    args = parser.parse_args()
    C.deterministic()
    warnings.filterwarnings("ignore")
    if args.world > 1:
        C.init_process_group(args.rank, args.world, args.init_file)
    # Single-process references run after the process group is gone: a collage optimizer
    # all-reduces (non-finite flag, metrics) over the default group whenever one exists.
    checks: list = []
    try:
        for task, strategies in args.cases:
            for strategy in strategies:
                if task in ("dcp_save", "dcp_load"):
                    TASKS[task](strategy, args.out, checks)
                else:
                    TASKS[task](strategy, checks)
        if distributed():
            dist.barrier()
    finally:
        if distributed():
            dist.destroy_process_group()
    if args.rank == 0:
        for check in checks:
            check()
    print(f"rank {args.rank}: {'FAILED' if FAILURES else 'ok'}", flush=True)
    return CHECKS_FAILED if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
