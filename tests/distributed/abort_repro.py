"""Reproducer of issue #30 item 13: a 2-rank FSDP2 + DCP run over gloo that may abort at exit.

A 3-layer bf16 MLP sharded with ``fully_shard``, 8 steps, a ``dcp.save``/``dcp.load`` round
trip, ``destroy_process_group`` at the end. Run it with collage's AdamW (``plus``) or with
``torch.optim.AdamW`` to tell whose an abort is::

    python tests/distributed/abort_repro.py --optimizer collage --runs 10
    python tests/distributed/abort_repro.py --optimizer torch --runs 10

Each run starts two ranks (FileStore rendezvous in a temporary folder, no ports) and prints
the ranks' exit codes; a rank killed by SIGABRT exits -6 and its output names the C++
message (``terminate called without an active exception``). A plain script, not a test.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile

ABORT_SIGNATURE = "terminate called without an active exception"


def rank_main(rank: int, store: str, checkpoint: str, optimizer_name: str,
              threads: int) -> None:
    """One rank: train, save, load into a fresh model, train on, tear down."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    import collage

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))

    def model_and_optimizer():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                              nn.Linear(256, 8)).to(torch.bfloat16)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        if optimizer_name == "torch":
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            optimizer = collage.AdamW(model.parameters(), lr=1e-3, strategy="plus")
        return model, optimizer

    def train(model, optimizer, steps: int) -> None:
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            x = torch.randn(16, 64, generator=g).to(torch.bfloat16)
            model(x).float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    model, optimizer = model_and_optimizer()
    train(model, optimizer, 8)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)
    model, optimizer = model_and_optimizer()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    train(model, optimizer, 2)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)


def one_run(optimizer_name: str, threads: int, timeout: float) -> tuple[list[int], list[str]]:
    """Both ranks' exit codes and outputs."""
    with tempfile.TemporaryDirectory() as folder:
        store, checkpoint = os.path.join(folder, "store"), os.path.join(folder, "ckpt")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
        command = [sys.executable, __file__, "--store", store, "--checkpoint", checkpoint,
                   "--optimizer", optimizer_name, "--threads", str(threads)]
        procs = [subprocess.Popen([*command, "--rank", str(rank)], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for rank in range(2)]
        outputs = []
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                proc.kill()
                outputs.append(proc.communicate()[0] + "\n(timed out)")
        return [p.returncode for p in procs], outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=("collage", "torch"), default="collage")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op (and OpenMP) threads per rank")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.store, args.checkpoint, args.optimizer, args.threads)
        return 0
    aborts = 0
    for run in range(args.runs):
        codes, outputs = one_run(args.optimizer, args.threads, args.timeout)
        aborted = [r for r, out in enumerate(outputs) if ABORT_SIGNATURE in out]
        aborts += bool(aborted)
        print(f"run {run}: exit codes {codes}, abort in ranks {aborted}", flush=True)
        for r, (code, out) in enumerate(zip(codes, outputs)):
            if code != 0:
                print(f"--- rank {r} (exit {code}) ---\n{out[-3000:]}", flush=True)
    print(f"{args.optimizer}: {aborts} of {args.runs} runs aborted", flush=True)
    return 1 if aborts else 0


if __name__ == "__main__":
    sys.exit(main())
