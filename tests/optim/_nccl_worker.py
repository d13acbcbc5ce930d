"""One rank of ``test_triton_cuda.test_data_parallel_over_nccl``: ``TASK RANK WORLD STORE``.

Both ranks train a small bf16 MLP with ``collage.AdamW`` (the default path on CUDA: the
Triton kernels) on the same batches, wrapped in DDP or sharded by FSDP2 (``fully_shard``),
over NCCL; rank 0 also trains it unwrapped on its GPU. With the same batch on every rank
the averaged gradients are each rank's own exactly (x + x and the halving are exact), so
the weights must be the unwrapped run's bit for bit: under FSDP2 each rank steps its shard,
whose stochastic draws are keyed by the element's index in the whole tensor. Prints OK.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

import collage

STEPS = 4


def model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 257), torch.nn.GELU(),
                              torch.nn.Linear(257, 64))
    return net.to(device=device, dtype=torch.bfloat16)


def train(net: torch.nn.Module, strategy: str, device: torch.device) -> list[str]:
    opt = collage.AdamW(net.parameters(), lr=1e-2, strategy=strategy, nonfinite="ignore",
                        seed=5)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, 64, generator=g).to(device=device, dtype=torch.bfloat16)
        net(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    return sorted(set(opt.last_paths.values()))


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def main() -> None:
    task, rank, world, store = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    for strategy in ("plus", "stochastic"):
        net = model(device)
        if task == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(net, device_ids=[rank])
        else:
            from torch.distributed.fsdp import fully_shard

            wrapped = fully_shard(net)
        paths = train(wrapped, strategy, device)
        assert paths == ["triton"], paths
        weights = [full(p.detach()) for p in net.parameters()]
        if rank == 0:
            alone = model(device)
            train(alone, strategy, device)
            for got, want in zip(weights, alone.parameters()):
                assert torch.equal(got.view(torch.int16), want.detach().view(torch.int16)), \
                    f"{task} {strategy}: differs from one process"
    dist.barrier()
    dist.destroy_process_group()
    print("OK")


if __name__ == "__main__":
    main()
