"""What plain bf16 gradient accumulation loses over 4, 16 and 64 micro-batches, and what
``grad_accumulation="pair"`` keeps: the gradient the step reads (issues #32 and #42,
``docs/memory.md``).

Part 1, the gradient: the quick preset's GPT (bf16 weights) runs N micro-batches of its
training data under a collage AdamW with ``grad_accumulation="pair"``, and again under one
with ``"plain"``. A tensor hook keeps each backward's bf16 gradient (the one autograd hands
the pair's hooks); the exact sum of them is taken in float64 (the sum of at most 64 bf16
values that lie within 2**-133 .. 2**127 is exact in float64 but for a rounding of 2**-53
relative, negligible here) and their sequential float32 sum. Against both:

* ``pair_step``: the gradient pair's ``step()`` reads. The optimizer is AdamW with strategy
  "mixed" (float32 moments) and beta1 = 0.5, so that after the first step ``exp_avg`` is
  exactly half the gradient it read (``tests/optim/test_grad_accumulation.py``): the
  measured value is ``2 * exp_avg``, nothing inferred;
* ``pair_accumulated_grad``: ``opt.accumulated_grad(p)`` before the step (the float32 sum
  ``S``: ``p.grad``'s bf16 high half and the optimizer's int16 low half);
* ``pair_p_grad``: ``p.grad`` before the step, ``S`` rounded to the nearest bf16 (ties away
  from zero), what torch's own tools see;
* ``plain_step``: the gradient plain's ``step()`` reads (``2 * exp_avg`` likewise),
  autograd's ``p.grad += g`` in bf16 (one bf16 rounding per add);
* ``plain``: that bf16 accumulation simulated over the kept gradients (``plain_step``
  should equal it);
* ``bf16_twosum``: a compensated pair of bf16 (hi, lo) grown by ``collage.mcf.eft.grow``
  (TwoSum), the issue's first idea: about 17 significant bits (on a fixed random sample of
  ``TWOSUM_SAMPLE`` elements: ``eft`` computes each operation in float64 and rounds it
  once, correct but slow);
* ``float32``: the float32 running sum, simulated (the reference of the second columns);
* ``float32_to_bf16``: that sum rounded once to bf16 by torch (ties to even), the gradient
  pair's step read before commit cd7432e.

Per sum, against the exact sum: ``edq = ||sum - exact||_2 / ||exact||_2`` (an EDQ-like
figure for gradients), the share of elements whose relative error exceeds 2**-16 and the
largest relative error; against the float32 sum: the norm-relative error, the largest
elementwise relative error and the share of elements not bit for bit equal to it.

Part 2, the loss: AdamW (``plus``) trains the quick model for ``--steps`` steps of N
micro-batches each, plain vs pair, from the same weights and data; the final losses
(``--steps 0`` skips it).

Usage: python benchmarks/studies/grad_accum.py --out docs/benchmarks/NAME (writes NAME.json/.md).
"""

from __future__ import annotations

import pathlib
import platform
import shlex
import subprocess
import time

import torch

import collage
from collage.mcf import eft
from collage.train.build import initial_weights, prepare_model
from collage.train.presets import quick
from collage.train.data import load_corpus, make_batches
from collage.train.step import evaluate, token_loss

import record  # benchmarks/studies/record.py: this script's folder is on the path

MICRO_BATCHES = (4, 16, 64)
TWOSUM_SAMPLE = 1 << 14


def _setup(micro_batch: int):
    config = quick()
    config.data.batch_size = micro_batch
    corpus = load_corpus(config.data)
    train, val = make_batches(corpus, config.data, context=config.model.context, causal=True,
                              seed=0)
    return config, initial_weights(config), train, val.fixed(4)


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def micro_and_steps(config, init, train, n: int) -> tuple[list[torch.Tensor], dict]:
    """The bf16 gradient of each of ``n`` micro-batches (from the pair run; the plain run's
    checked equal) and the sums read from the two optimizers, all in parameter order."""
    found = {}
    micro = None
    for accumulation in ("pair", "plain"):
        model = prepare_model(config, "plus", init, torch.device("cpu"))
        params = list(model.parameters())
        opt = collage.AdamW(params, lr=1e-6, betas=(0.5, 0.75), weight_decay=0.0,
                            strategy="mixed", grad_accumulation=accumulation)
        kept = [[None] * len(params) for _ in range(n)]
        micro_index = [0]

        def keep(i: int, grad: torch.Tensor) -> None:
            kept[micro_index[0]][i] = grad.detach().clone()

        handles = [p.register_hook(lambda g, i=i: keep(i, g)) for i, p in enumerate(params)]
        for k in range(n):
            micro_index[0] = k
            x, y = train.batch(k)
            (token_loss(model, x, y) / n).backward()
        for handle in handles:
            handle.remove()
        grads = [_flat(g) for g in kept]
        if micro is None:
            micro = grads
        else:
            found["micro_batches_identical"] = all(torch.equal(a, b)
                                                   for a, b in zip(micro, grads))
        if accumulation == "pair":
            found["pair_accumulated_grad"] = _flat(
                [opt.accumulated_grad(p).clone() for p in params]).double()
            found["pair_p_grad"] = _flat([p.grad.clone() for p in params]).double()
        opt.step()
        assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
        found[accumulation + "_step"] = _flat(
            [opt.state[p]["exp_avg"] * 2 for p in params]).double()
    return micro, found


def sums(grads: list[torch.Tensor], measured: dict) -> dict[str, torch.Tensor]:
    """The exact sum, the measured sums and the simulated accumulations of ``grads``
    (module docstring)."""
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
    return {"exact": exact, "float32_reference": wide.double(),
            "pair_step": measured["pair_step"],
            "pair_accumulated_grad": measured["pair_accumulated_grad"],
            "pair_p_grad": measured["pair_p_grad"],
            "plain_step": measured["plain_step"], "plain": plain.double(),
            "bf16_twosum": (hi.double() + lo.double(), sample),
            "float32": wide.double(), "float32_to_bf16": wide.to(torch.bfloat16).double()}


def _relative(value: torch.Tensor, ref: torch.Tensor) -> tuple[float, torch.Tensor]:
    diff = (value - ref).abs()
    rel = diff / ref.abs().clamp(min=torch.finfo(torch.float64).tiny)
    return float(diff.norm()) / float(ref.norm()), rel


def errors(found: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    out = {}
    for name, value in found.items():
        if name in ("exact", "float32_reference"):
            continue
        exact, wide = found["exact"], found["float32_reference"]
        if isinstance(value, tuple):  # (values, the sample's indices)
            value, sample = value
            exact, wide = exact[sample], wide[sample]
        edq, rel = _relative(value, exact)
        edq32, rel32 = _relative(value, wide)
        out[name] = {"edq": edq,
                     "share_above_2^-16": float((rel > 2.0 ** -16).double().mean()),
                     "max_relative": float(rel[exact != 0].max()),
                     "edq_vs_float32": edq32,
                     "max_relative_vs_float32": float(rel32[wide != 0].max()),
                     "share_not_float32": float((value != wide).double().mean())}
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
    result = {"micro_batches_identical": {}, "gradient": {}, "loss": {}}
    for n in MICRO_BATCHES:
        grads, measured = micro_and_steps(config, init, train_batches, n)
        result["micro_batches_identical"][str(n)] = measured.pop("micro_batches_identical")
        result["gradient"][str(n)] = errors(sums(grads, measured))
    for n in MICRO_BATCHES if steps else ():
        plain = train(config, init, train_batches, val_batches, n, steps, "plain")
        pair = train(config, init, train_batches, val_batches, n, steps, "pair")
        drift = float((plain.pop("weights") - pair["weights"]).norm()
                      / pair.pop("weights").norm())
        result["loss"][str(n)] = {"plain": plain, "pair": pair,
                                  "weights_relative_distance": drift}
    return result


def markdown(meta: dict, result: dict) -> str:
    lines = [f"# Gradient accumulation: plain bf16 vs pair ({meta['date']})", "",
             f"Hardware: {meta['hardware']}; torch {meta['torch']}; python {meta['python']}; "
             f"{meta['threads']} threads; {meta['seconds']:.0f} s. Commit {meta['commit']}.",
             "", f"Command: `{meta['command']}`", "",
             "## The accumulated gradient against the exact sum and the float32 sum (quick "
             f"preset's GPT, micro-batches of {meta['micro_batch']} sequences)", "",
             "`pair_step` and `plain_step` are the gradients the two optimizers' step() read "
             "(2 * exp_avg after one AdamW \"mixed\" step with beta1 = 0.5); `float32` is "
             "the sequential float32 sum of the same bf16 micro-batch gradients "
             "(`benchmarks/studies/grad_accum.py`'s docstring).", "",
             "| micro-batches | sum | edq (norm-relative error) | share of elements off by "
             "> 2^-16 | max relative error | vs float32 sum: norm-relative | "
             "vs float32 sum: max relative | vs float32 sum: share of elements not equal |",
             "|---|---|---|---|---|---|---|---|"]
    for n, per in result["gradient"].items():
        for name, e in per.items():
            lines.append(f"| {n} | {name} | {e['edq']:.3g} | {e['share_above_2^-16']:.3g} | "
                         f"{e['max_relative']:.3g} | {e['edq_vs_float32']:.3g} | "
                         f"{e['max_relative_vs_float32']:.3g} | "
                         f"{e['share_not_float32']:.3g} |")
    same = result["micro_batches_identical"]
    lines += ["", "The micro-batch gradients of the pair and the plain runs identical bit for "
              "bit: " + ", ".join(f"{n}: {v}" for n, v in same.items()) + "."]
    if result["loss"]:
        lines += ["", f"## Training loss after {meta['steps']} AdamW (plus) steps", "",
                  "| micro-batches | plain: train / val loss | pair: train / val loss | "
                  "weights' relative distance |", "|---|---|---|---|"]
    for n, r in result["loss"].items():
        lines.append(f"| {n} | {r['plain']['final_train_loss']:.4f} / "
                     f"{r['plain']['val_loss']:.4f} | {r['pair']['final_train_loss']:.4f} / "
                     f"{r['pair']['val_loss']:.4f} | {r['weights_relative_distance']:.3g} |")
    return "\n".join(lines) + "\n"


def _commit() -> str:
    """``git rev-parse HEAD`` of this checkout ("unknown" outside git)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head


def main() -> None:
    parser = record.parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args()
    commit = _commit()  # before the run: what it measures
    start = time.perf_counter()
    result = run(args.steps, args.micro_batch)
    meta = record.metadata(
        args.hardware, threads=torch.get_num_threads(), steps=args.steps,
        micro_batch=args.micro_batch, seconds=time.perf_counter() - start,
        python=platform.python_version(), commit=commit,
        command="python benchmarks/studies/grad_accum.py --out " + args.out
                + f" --hardware {shlex.quote(args.hardware)}"
                + f" --steps {args.steps} --micro-batch {args.micro_batch}")
    record.write(args.out, meta, result, markdown)


if __name__ == "__main__":
    main()
