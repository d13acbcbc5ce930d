"""``torch.compile`` with a collage optimizer: compile the model (forward and backward), or the
whole training step, and keep the optimizer's arithmetic exact.

    python examples/compile_train_step.py --steps 20

Three ways, all training the same bf16 byte-level model with ``strategy="plus"``:

* ``model``: ``torch.compile(model)``; ``optimizer.step()`` runs eagerly (the usual choice);
* ``step``: ``torch.compile`` of a function doing forward, backward, ``optimizer.step()`` and
  ``zero_grad()``. The optimizer's step must stay out of the traced graph: inductor would
  otherwise drop the bf16 round trips that Collage's compensation terms are made of
  (``weight_lo`` would become 0, silently). See ``docs/integrations.md``;
* ``fused``: ``collage.AdamW(..., fused=True)`` compiles the optimizer's own kernels (one
  loop per tensor, with the precision casts kept); combinable with either of the above.

For each, the script reports the first and last loss and the largest ``|weight_lo|`` (0
means the compensation died and "plus" degraded to plain bf16 rounding). Compiling the model
changes the rounding of the forward and backward passes (inductor fuses bf16 operations), so
the runs differ from eager in the last bits; the optimizer's own arithmetic does not change.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import nn

import collage

CONTEXT = 8


class ByteMLP(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.hidden = nn.Linear(CONTEXT * width, 4 * width)
        self.norm = nn.LayerNorm(4 * width)
        self.out = nn.Linear(4 * width, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(F.gelu(self.hidden(self.embed(x).flatten(1)))))


def batches(steps: int, batch_size: int = 32, seed: int = 1):
    import pydoc_data.topics

    text = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    data = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, len(data) - CONTEXT - 1, (batch_size, 1), generator=g)
        window = data[start + torch.arange(CONTEXT + 1)]
        yield window[:, :-1], window[:, -1]


def train(mode: str, steps: int, strategy: str = "plus", seed: int = 0) -> dict:
    """Train ``steps`` steps with ``mode`` in ``eager``, ``model``, ``step``, ``fused``."""
    torch.manual_seed(seed)
    model = ByteMLP().to(torch.bfloat16)
    optimizer = collage.AdamW(model.parameters(), lr=3e-3, strategy=strategy,
                              fused=True if mode == "fused" else None)
    forward = torch.compile(model) if mode in ("model", "fused") else model

    def train_step(x, y):
        loss = F.cross_entropy(forward(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    step = torch.compile(train_step) if mode == "step" else train_step
    start = time.perf_counter()
    losses = [float(step(x, y)) for x, y in batches(steps)]
    lo = [optimizer.state[p].get("weight_lo") for p in model.parameters()]
    return {
        "mode": mode,
        "seconds": round(time.perf_counter() - start, 1),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "weight_lo_max": max(float(t.float().abs().max()) for t in lo) if lo[0] is not None
        else None,
        "state_dtypes": sorted({str(v.dtype) for p in model.parameters()
                                for k, v in optimizer.state[p].items() if k != "step"}),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--modes", default="model,step,fused",
                        help="comma-separated: model, step, fused (step: see the docstring)")
    args = parser.parse_args(argv)
    eager = train("eager", args.steps)
    rows = []
    for mode in args.modes.split(","):
        rows.append(train(mode, args.steps))
    for row in [eager, *rows]:
        print(json.dumps(row))
    return [eager, *rows]


if __name__ == "__main__":
    main()
