"""Data-parallel runs of the harness: ``collage train --nproc N`` under ``torchrun``.

The parent re-executes the same command line under ``python -m torch.distributed.run``
(PyTorch's own launcher; rendezvous on localhost) as ``python -m collage``, whose entry
point reads the command line back with :func:`launched_argv`; every rank then trains with PyTorch's
own :class:`~torch.nn.parallel.DistributedDataParallel` (gloo on CPU, NCCL on CUDA). Each
rank takes an equal slice of every global batch; the loss is normalised by the *global*
number of target tokens, so that DDP's gradient average equals the single-process
full-batch gradient (up to the order of the sums) even when the ranks hold different
numbers of targets (BERT masking). Rank 0 alone writes checkpoints and results; all ranks
hold identical weights and optimizer state, so any of them could.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import UsageError

__all__ = ["Ranks", "launch", "launched_argv", "setup", "teardown", "under_launcher"]


def under_launcher() -> bool:
    """True inside a process started by torchrun (or any launcher that sets WORLD_SIZE)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


ARGV_VARIABLE = "COLLAGE_RANK_ARGV"


def launch(nproc: int, argv: Sequence[str]) -> int:
    """Run ``collage *argv`` as ``nproc`` processes under torchrun; return its exit code.

    ``--standalone`` makes torchrun start its own rendezvous on a free localhost port, so
    concurrent launches do not collide. torchrun already sets ``OMP_NUM_THREADS=1`` per rank
    unless the user set it (``--threads`` overrides it per rank). The command line travels
    in an environment variable, not as arguments: torchrun's own parser would claim
    options of ours that abbreviate its own (``--nproc`` for ``--nproc-per-node``).
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), "-m", "collage"]
    return subprocess.call(command, env={**os.environ, ARGV_VARIABLE: json.dumps(list(argv))})


def launched_argv() -> list[str] | None:
    """The command line :func:`launch` handed to this rank; None outside such a rank (the
    process's own arguments then apply)."""
    if not under_launcher() or ARGV_VARIABLE not in os.environ:
        return None
    return json.loads(os.environ[ARGV_VARIABLE])


@dataclass(frozen=True)
class Ranks:
    """Where this process stands in the job (a single process is rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def batch_slice(self, batch_size: int) -> slice:
        """This rank's rows of a global batch (equal slices; checked by :func:`setup`)."""
        per_rank = batch_size // self.world_size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)


def setup(device: torch.device, batch_size: int) -> tuple[Ranks, torch.device]:
    """Join the process group when run under a launcher; the ranks and this rank's device."""
    if not under_launcher() or int(os.environ["WORLD_SIZE"]) == 1:
        return Ranks(), device
    ranks = Ranks(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                  int(os.environ.get("LOCAL_RANK", 0)))
    if batch_size % ranks.world_size:
        raise UsageError(f"--batch-size {batch_size} must be divisible by the number of "
                         f"processes ({ranks.world_size}): every rank takes an equal slice")
    if device.type == "cuda":
        device = torch.device("cuda", ranks.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return ranks, device


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_sum(value: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """The sum of a tensor over ranks (the tensor itself in one process)."""
    if ranks.distributed:
        value = value.clone()
        dist.all_reduce(value)
    return value
