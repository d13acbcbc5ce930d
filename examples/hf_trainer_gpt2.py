"""Train a tiny GPT-2 with Hugging Face ``Trainer`` and ``collage.AdamW(strategy="plus")``
in pure bf16, save a checkpoint, resume from it, and check that training continues exactly.

Everything is local: the model is randomly initialised from a ``GPT2Config`` (2 layers,
width 64, 256 byte-level tokens) and the text is Python's own documentation
(``pydoc_data.topics``), read as bytes. Runs on CPU in about a minute::

    python examples/hf_trainer_gpt2.py --out /tmp/collage_hf --steps 40

The recipe (``docs/integrations.md``):

* convert the model to bf16 yourself (``model.to(torch.bfloat16)``) and keep
  ``TrainingArguments(bf16=False, fp16=False)``: Trainer then neither autocasts nor scales
  the loss, and the weights stay bf16; the collage strategy supplies the precision;
* pass the optimizer in: ``Trainer(..., optimizers=(optimizer, None))``; Trainer builds its
  learning-rate schedule on it and saves/restores ``optimizer.state_dict()`` in every
  checkpoint (``optimizer.pt``), the strategy's extra state (``weight_lo``, ...) included;
* ``collage.integrations.adamw_for_trainer`` reads lr/betas/eps/weight decay from the
  arguments and leaves norms and biases without weight decay, as Trainer does.
"""

from __future__ import annotations

import argparse
import json
import pydoc_data.topics
from pathlib import Path

import torch

import collage
import collage.integrations


def byte_corpus() -> torch.Tensor:
    """Python's bundled pydoc topics as a 1-D tensor of byte values (about 800 KB)."""
    text = "\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


class Blocks(torch.utils.data.Dataset):
    """Consecutive, non-overlapping blocks of ``length`` bytes; labels are the inputs
    (GPT-2 shifts them internally)."""

    def __init__(self, data: torch.Tensor, length: int, count: int) -> None:
        self.data, self.length, self.count = data, length, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        block = self.data[index * self.length:(index + 1) * self.length]
        return {"input_ids": block, "labels": block.clone()}


def build_model(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).to(torch.bfloat16)


def make_trainer(out: Path, steps: int, seed: int, strategy: str, save_steps: int,
                 model_seed: int, batch_size: int = 8, block: int = 128):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=batch_size,
        learning_rate=2e-3, warmup_steps=max(1, steps // 10), lr_scheduler_type="cosine",
        weight_decay=0.1, logging_steps=1, save_steps=save_steps, save_strategy="steps",
        bf16=False, fp16=False, use_cpu=True, seed=seed, data_seed=seed,
        report_to=[], disable_tqdm=True, dataloader_num_workers=0,
    )
    model = build_model(model_seed)
    optimizer = collage.integrations.adamw_for_trainer(model, args, strategy=strategy)
    data = Blocks(byte_corpus(), block, batch_size * steps)
    return Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, None))


def losses(trainer) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history
            if "loss" in entry}


def run(out: Path, steps: int = 40, strategy: str = "plus", seed: int = 0,
        batch_size: int = 8, block: int = 128) -> dict:
    """Train ``steps`` steps saving a checkpoint half way, then resume a *fresh* model and
    optimizer (other random weights) from that checkpoint. Returns both runs' losses and
    whether the resumed run ended with the same weights and optimizer state, bit for bit."""
    half = steps // 2
    sizes = {"batch_size": batch_size, "block": block}
    first = make_trainer(out / "run", steps, seed, strategy, save_steps=half, model_seed=seed,
                         **sizes)
    first.train()
    checkpoint = out / "run" / f"checkpoint-{half}"
    resumed = make_trainer(out / "resumed", steps, seed, strategy, save_steps=half,
                           model_seed=seed + 1, **sizes)
    resumed.train(resume_from_checkpoint=str(checkpoint))

    def tensors(trainer) -> dict[str, torch.Tensor]:
        model, optimizer = trainer.model, trainer.optimizer
        out = {name: p.detach() for name, p in model.named_parameters()}
        for name, p in model.named_parameters():
            for key, value in optimizer.state[p].items():
                out[f"{name}:{key}"] = value
        return out

    a, b = tensors(first), tensors(resumed)
    identical = a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    state_dtypes = sorted({str(v.dtype) for s in saved["state"].values()
                           for k, v in s.items() if k != "step"})
    return {
        "losses": losses(first),
        "resumed_losses": losses(resumed),
        "resumed_identical": identical,
        "weight_dtypes": sorted({str(p.dtype) for p in resumed.model.parameters()}),
        "checkpoint_state_keys": sorted({k for s in saved["state"].values() for k in s}),
        "checkpoint_state_dtypes": state_dtypes,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("hf_trainer_gpt2_out"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--strategy", default="plus", choices=collage.STRATEGIES)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = run(args.out, args.steps, args.strategy, args.seed)
    loss = result["losses"]
    print(f"loss: step 1 {loss[1]:.3f} -> step {max(loss)} {loss[max(loss)]:.3f}")
    half = args.steps // 2
    after = [round(v, 4) for s, v in sorted(result["resumed_losses"].items()) if s > half]
    before = [round(v, 4) for s, v in sorted(loss.items()) if s > half]
    print(f"steps {half + 1}..: uninterrupted {before[:4]}..., resumed {after[:4]}...; "
          f"final weights and optimizer state identical: {result['resumed_identical']}")
    print(json.dumps({k: v for k, v in result.items() if "losses" not in k}))
    return result


if __name__ == "__main__":
    main()
