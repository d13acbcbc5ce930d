"""What plain bf16 gradient accumulation loses over 4, 16 and 64 micro-batches, and what
``grad_accumulation="pair"`` keeps (issue #32, ``docs/strategies.md``).

Part 1, the gradient: the quick preset's GPT (bf16 weights) runs N micro-batches of its
training data; each backward's bf16 gradient is kept, and four sums of them are compared
with the exact sum (float64; the sum of at most 64 bf16 values that lie within 2**-133 ..
2**127 is exact in float64 but for a rounding of 2**-53 relative, negligible here):

* ``plain``: autograd's accumulation, ``p.grad += g`` in bf16 (one bf16 rounding per add);
* ``bf16_twosum``: a compensated pair of bf16 (hi, lo) grown by ``collage.mcf.eft.grow``
  (TwoSum), the issue's first idea: about 17 significant bits (on a fixed random sample of
  ``TWOSUM_SAMPLE`` elements: ``eft`` computes each operation in float64 and rounds it
  once, correct but slow);
* ``float32``: the float32 running sum, what ``grad_accumulation="pair"`` keeps (4 bytes,
  the bf16 high half and a 16-bit low half);
* ``float32_to_bf16``: that sum rounded once to bf16, the gradient the step reads.

Per sum: ``edq = ||sum - exact||_2 / ||exact||_2`` (an EDQ-like figure for gradients) and
the share of elements whose relative error exceeds 2**-16.

Part 2, the loss: AdamW (``plus``) trains the quick model for ``--steps`` steps of N
micro-batches each, plain vs pair, from the same weights and data; the final losses.

Usage: python benchmarks/grad_accum.py --out docs/benchmarks/NAME (writes NAME.json/.md).
"""

from __future__ import annotations

import time

import torch

import collage
from collage.mcf import eft
from collage.train.build import initial_weights, prepare_model
from collage.train.config import quick
from collage.train.data import load_corpus, make_batches
from collage.train.step import evaluate, token_loss

import record  # benchmarks/record.py: this script's folder is on the path

MICRO_BATCHES = (4, 16, 64)
TWOSUM_SAMPLE = 1 << 14


def _setup(micro_batch: int):
    config = quick()
    config.data.batch_size = micro_batch
    corpus = load_corpus(config.data)
    train, val = make_batches(corpus, config.data, context=config.model.context, causal=True,
                              seed=0)
    return config, initial_weights(config), train, val.fixed(4)


def _flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def micro_gradients(config, init, train, n: int) -> list[torch.Tensor]:
    """The bf16 gradient of each of ``n`` micro-batches (loss scaled by 1/n, as users
    write it: a power of two, exact)."""
    model = prepare_model(config, "plus", init, torch.device("cpu"))
    out = []
    for k in range(n):
        model.zero_grad(set_to_none=True)
        x, y = train.batch(k)
        (token_loss(model, x, y) / n).backward()
        out.append(_flat_grads(model).clone())
    return out


def sums(grads: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The exact sum and the four accumulations of ``grads`` (module docstring)."""
    exact = torch.stack([g.double() for g in grads]).sum(0)
    sample = torch.randperm(exact.numel(), generator=torch.Generator().manual_seed(0))
    sample = sample[:TWOSUM_SAMPLE]
    plain = grads[0].clone()
    hi, lo = grads[0][sample].clone(), torch.zeros(len(sample), dtype=grads[0].dtype)
    wide = grads[0].float()
    for g in grads[1:]:
        plain += g  # bf16 += bf16, as AccumulateGrad does
        hi, lo = eft.grow(hi, lo, g[sample])
        wide += g
    return {"exact": exact, "plain": plain.double(),
            "bf16_twosum": (hi.double() + lo.double(), sample),
            "float32": wide.double(), "float32_to_bf16": wide.to(torch.bfloat16).double()}


def errors(found: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    out = {}
    for name, value in found.items():
        if name == "exact":
            continue
        exact = found["exact"]
        if isinstance(value, tuple):  # (values, the sample's indices)
            value, sample = value
            exact = exact[sample]
        norm = float(exact.norm())
        diff = (value - exact).abs()
        rel = diff / exact.abs().clamp(min=torch.finfo(torch.float64).tiny)
        out[name] = {"edq": float(diff.norm()) / norm,
                     "share_above_2^-16": float((rel > 2.0 ** -16).double().mean()),
                     "max_relative": float(rel[exact != 0].max())}
    return out


def train(config, init, train_batches, val_batches, n: int, steps: int,
          accumulation: str) -> dict[str, float]:
    """``steps`` AdamW steps of ``n`` micro-batches each; the final losses."""
    torch.manual_seed(0)
    model = prepare_model(config, "plus", init, torch.device("cpu"))
    opt = collage.AdamW(model.parameters(), lr=config.optim.lr, weight_decay=0.1,
                        strategy="plus", grad_accumulation=accumulation)
    losses = []
    for step in range(steps):
        total = 0.0
        for k in range(n):
            x, y = train_batches.batch(step * n + k)
            loss = token_loss(model, x, y) / n
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    weights = torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])
    tail = losses[-5:]
    return {"final_train_loss": sum(tail) / len(tail),
            "val_loss": evaluate(model, val_batches, torch.device("cpu")),
            "weights": weights}


def run(steps: int, micro_batch: int) -> dict:
    config, init, train_batches, val_batches = _setup(micro_batch)
    result = {"gradient": {}, "loss": {}}
    for n in MICRO_BATCHES:
        grads = micro_gradients(config, init, train_batches, n)
        result["gradient"][str(n)] = errors(sums(grads))
    for n in MICRO_BATCHES:
        plain = train(config, init, train_batches, val_batches, n, steps, "plain")
        pair = train(config, init, train_batches, val_batches, n, steps, "pair")
        drift = float((plain.pop("weights") - pair["weights"]).norm()
                      / pair.pop("weights").norm())
        result["loss"][str(n)] = {"plain": plain, "pair": pair,
                                  "weights_relative_distance": drift}
    return result


def markdown(meta: dict, result: dict) -> str:
    lines = [f"# Gradient accumulation: plain bf16 vs pair ({meta['date']})", "",
             f"Hardware: {meta['hardware']}; torch {meta['torch']}; "
             f"{meta['threads']} threads; {meta['seconds']:.0f} s.", "",
             f"Command: `{meta['command']}`", "",
             "## The accumulated gradient against the exact sum (quick preset's GPT, "
             f"micro-batches of {meta['micro_batch']} sequences)", "",
             "| micro-batches | sum | edq (norm-relative error) | share of elements off by "
             "> 2^-16 | max relative error |", "|---|---|---|---|---|"]
    for n, per in result["gradient"].items():
        for name, e in per.items():
            lines.append(f"| {n} | {name} | {e['edq']:.3g} | {e['share_above_2^-16']:.3g} | "
                         f"{e['max_relative']:.3g} |")
    lines += ["", f"## Training loss after {meta['steps']} AdamW (plus) steps", "",
              "| micro-batches | plain: train / val loss | pair: train / val loss | "
              "weights' relative distance |", "|---|---|---|---|"]
    for n, r in result["loss"].items():
        lines.append(f"| {n} | {r['plain']['final_train_loss']:.4f} / "
                     f"{r['plain']['val_loss']:.4f} | {r['pair']['final_train_loss']:.4f} / "
                     f"{r['pair']['val_loss']:.4f} | {r['weights_relative_distance']:.3g} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = record.parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args()
    start = time.perf_counter()
    result = run(args.steps, args.micro_batch)
    meta = record.metadata(
        args.hardware, threads=torch.get_num_threads(), steps=args.steps,
        micro_batch=args.micro_batch, seconds=time.perf_counter() - start,
        command="python benchmarks/grad_accum.py --out " + args.out
                + f" --steps {args.steps} --micro-batch {args.micro_batch}")
    record.write(args.out, meta, result, markdown)


if __name__ == "__main__":
    main()
