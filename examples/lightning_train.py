"""Train a small byte-level language model with PyTorch Lightning and
``collage.AdamW(strategy="plus")`` in pure bf16 (``precision="bf16-true"``); resume a fresh
model from the epoch-1 checkpoint and check that epoch 2 ends exactly where the
uninterrupted run does.

    python examples/lightning_train.py --out /tmp/collage_lightning --epochs 2

The recipe (``docs/integrations.md``): return the collage optimizer from
``configure_optimizers`` and train with ``precision="bf16-true"``: Lightning converts the
module to bf16 *before* calling ``configure_optimizers``, so the optimizer sees bf16 weights
(``"bf16-mixed"`` would keep float32 weights and autocast, which needs ``strategy="fp32"``).
Lightning calls ``optimizer.step(closure)``; collage optimizers run the closure like
torch.optim does. Checkpoints hold ``optimizer.state_dict()``, strategy state included.
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


def dataset(count: int, seed: int) -> torch.utils.data.TensorDataset:
    """``count`` windows of CONTEXT bytes and the byte that follows, at random positions."""
    data = byte_corpus()
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, len(data) - CONTEXT - 1, (count, 1), generator=g)
    window = data[start + torch.arange(CONTEXT + 1)]
    return torch.utils.data.TensorDataset(window[:, :-1], window[:, -1])


def make_module(strategy: str = "plus", lr: float = 3e-3, width: int = 64):
    import lightning.pytorch as pl

    class ByteLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(256, width)
            self.hidden = nn.Linear(CONTEXT * width, 4 * width)
            self.norm = nn.LayerNorm(4 * width)
            self.out = nn.Linear(4 * width, 256)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.norm(F.gelu(self.hidden(self.embed(x).flatten(1)))))

        def training_step(self, batch, batch_index):
            x, y = batch
            loss = F.cross_entropy(self(x).float(), y)
            self.log("loss", loss, on_step=True, prog_bar=False)
            return loss

        def configure_optimizers(self):
            # Under precision="bf16-true" the parameters are bf16 already at this point.
            groups = collage.integrations.param_groups(self, weight_decay=0.1)
            return collage.AdamW(groups, lr=lr, strategy=strategy)

    return ByteLM()


def trainer(out: Path, epochs: int, callbacks=()):
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=1, precision="bf16-true", max_epochs=epochs,
                      default_root_dir=str(out), logger=False, enable_progress_bar=False,
                      enable_model_summary=False, deterministic=True, callbacks=list(callbacks))


def snapshot(module) -> dict[str, torch.Tensor]:
    optimizer = module.trainer.optimizers[0]
    out = {}
    for name, p in module.named_parameters():
        out[name] = p.detach().clone()
        for key, value in optimizer.state[p].items():
            out[f"{name}:{key}"] = value.clone()
    return out


def run(out: Path, epochs: int = 2, strategy: str = "plus", seed: int = 0,
        batches_per_epoch: int = 20, batch_size: int = 32) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = dataset(batches_per_epoch * batch_size, seed)

    def loader():
        return torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False)

    pl.seed_everything(seed, verbose=False)
    module = make_module(strategy)
    every_epoch = ModelCheckpoint(dirpath=str(out / "checkpoints"), save_top_k=-1,
                                  every_n_epochs=1, filename="{epoch}")
    trainer(out, epochs, [every_epoch]).fit(module, loader())
    uninterrupted = snapshot(module)

    pl.seed_everything(seed + 1, verbose=False)
    fresh = make_module(strategy)  # other weights: the checkpoint must win
    checkpoint = out / "checkpoints" / f"epoch={epochs - 2}.ckpt"
    trainer(out / "resumed", epochs).fit(fresh, loader(), ckpt_path=str(checkpoint))
    resumed = snapshot(fresh)
    identical = uninterrupted.keys() == resumed.keys() and all(
        uninterrupted[k].dtype == resumed[k].dtype and torch.equal(uninterrupted[k], resumed[k])
        for k in resumed)
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    saved_state = saved["optimizer_states"][0]["state"]
    return {
        "resumed_identical": identical,
        "weight_dtypes": sorted({str(p.dtype) for p in fresh.parameters()}),
        "checkpoint_state_dtypes": sorted({str(v.dtype) for s in saved_state.values()
                                           for k, v in s.items() if k != "step"}),
        "final_loss": float(module.trainer.callback_metrics["loss"]),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("lightning_out"))
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--strategy", default="plus", choices=collage.STRATEGIES)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (the run resumes from the second-to-last)")
    result = run(args.out, args.epochs, args.strategy, args.seed)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
