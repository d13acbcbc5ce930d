"""Train a small byte-level language model with Hugging Face Accelerate and
``collage.AdamW(strategy="plus")`` in pure bf16; checkpoint with ``accelerator.save_state``,
resume a fresh model and optimizer with ``accelerator.load_state``, and check that the
resumed run ends exactly where the uninterrupted one does.

    python examples/accelerate_train.py --out /tmp/collage_accelerate --steps 40
    torchrun --nproc-per-node 2 examples/accelerate_train.py --out ...   # DDP on 2 CPU ranks
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --out ...

The recipe (``docs/integrations.md``): convert the model to bf16 yourself, create the collage
optimizer on its parameters, then ``accelerator.prepare(model, optimizer)``. Keep
``mixed_precision="no"`` (the default): "bf16" would only add autocast, "fp16" would add
float16 autocast and a GradScaler to a bf16 model. ``accelerator.prepare`` wraps the
optimizer (``AcceleratedOptimizer``); ``step``, ``zero_grad``, ``state_dict`` and
``load_state_dict`` pass through, and ``optimizer.optimizer`` is the collage optimizer
(``update_stats``, ``skipped_steps``).
"""

from __future__ import annotations

import argparse
import json
import pydoc_data.topics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import collage
import collage.integrations

CONTEXT = 16


def byte_corpus() -> torch.Tensor:
    """Python's bundled pydoc topics as a 1-D tensor of byte values."""
    text = "\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def batches(count: int, batch_size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of (CONTEXT bytes, the next byte) at seeded random positions."""
    data = byte_corpus()
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        start = torch.randint(0, len(data) - CONTEXT - 1, (batch_size, 1), generator=g)
        window = data[start + torch.arange(CONTEXT + 1)]
        out.append((window[:, :-1], window[:, -1]))
    return out


class ByteMLP(nn.Module):
    """Embed CONTEXT bytes, two layers, predict the next byte."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.hidden = nn.Linear(CONTEXT * width, 4 * width)
        self.norm = nn.LayerNorm(4 * width)
        self.out = nn.Linear(4 * width, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.hidden(self.embed(x).flatten(1)))
        return self.out(self.norm(h))


def build(seed: int, strategy: str):
    torch.manual_seed(seed)
    # the weight dtype the strategy trains in: float32 for fp32, bfloat16 for the others
    model = ByteMLP().to(collage.optim.get_strategy(strategy).weight_dtypes[0])
    optimizer = collage.AdamW(collage.integrations.param_groups(model, 0.1), lr=3e-3,
                              strategy=strategy)
    return model, optimizer


def train(accelerator, model, optimizer, data) -> list[float]:
    losses = []
    rank, world = accelerator.process_index, accelerator.num_processes
    for x, y in data:  # under DDP each process takes its share of every batch
        x, y = x[rank::world].to(accelerator.device), y[rank::world].to(accelerator.device)
        loss = F.cross_entropy(model(x).float(), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def snapshot(accelerator, model, optimizer) -> dict[str, torch.Tensor]:
    model = accelerator.unwrap_model(model)
    inner = optimizer.optimizer  # the collage optimizer inside AcceleratedOptimizer
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.detach().clone()
        for key, value in inner.state[p].items():
            out[f"{name}:{key}"] = value.clone()
    return out


def run(out: Path, steps: int = 40, strategy: str = "plus", seed: int = 0,
        batch_size: int = 32) -> dict:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision="no")
    data = batches(steps, batch_size, seed)
    half = steps // 2

    model, optimizer = build(seed, strategy)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = train(accelerator, model, optimizer, data[:half])
    accelerator.save_state(str(out / "checkpoint"))
    losses += train(accelerator, model, optimizer, data[half:])
    uninterrupted = snapshot(accelerator, model, optimizer)

    accelerator.free_memory()  # forget the first run's prepared objects
    model, optimizer = build(seed + 1, strategy)  # other weights: the checkpoint must win
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.load_state(str(out / "checkpoint"))
    resumed_losses = train(accelerator, model, optimizer, data[half:])
    resumed = snapshot(accelerator, model, optimizer)
    identical = uninterrupted.keys() == resumed.keys() and all(
        uninterrupted[k].dtype == resumed[k].dtype and torch.equal(uninterrupted[k], resumed[k])
        for k in resumed)
    return {
        "losses": losses,
        "resumed_losses": resumed_losses,
        "resumed_identical": identical,
        "state_dtypes": sorted({str(v.dtype) for k, v in resumed.items() if ":" in k
                                and not k.endswith(":step")}),
        "weight_dtypes": sorted({str(v.dtype) for k, v in resumed.items() if ":" not in k}),
        "optimizer_type": type(optimizer).__name__,
        "processes": accelerator.num_processes,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("accelerate_out"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--strategy", default="plus", choices=collage.STRATEGIES)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = run(args.out, args.steps, args.strategy, args.seed)
    loss = result["losses"]
    print(f"loss {loss[0]:.3f} -> {loss[-1]:.3f} over {len(loss)} steps; resumed run "
          f"identical: {result['resumed_identical']}")
    print(json.dumps({k: v for k, v in result.items() if "losses" not in k}))
    return result


if __name__ == "__main__":
    main()
