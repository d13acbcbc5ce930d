"""Why the research code's Collage-plus second moment is wrong, with numbers.

Runs Adam's second-moment EMA ``v = beta2 * v + (1 - beta2) * g**2`` under a constant
gradient in bf16 four ways and prints ``v / ((1 - beta2**t) * g**2)`` (1.0 is exact):

* ``collage plus``: ``collage.mcf``'s pair arithmetic (``mcf.mul`` + ``grow``, beta2 split
  against its bf16 rounding);
* ``research plus``: the published algorithm as we read it (re-implemented here from its
  description, not copied). Three defects: (1) beta2 is split against its *float32*
  rounding, so the residual is ~1e-8 instead of ~-1e-3 (at beta2 = 0.999 nothing decays);
  (2) the product's "error" is taken after the product overwrote its input, so it is
  ``v' * (bf16(beta2) - 1)`` (zero at 0.999, -5% of v at 0.95) instead of the rounding
  error; (3) the renormalisation subtracts a tensor from itself, so lo is counted twice;
* ``research plus, fixed split``: the same with only the split fixed (isolates defect 2);
* ``bf16``: a plain bf16 EMA (beta2 rounds to bf16 first, as a bf16 multiply does).

Usage: ``python benchmarks/studies/research_plus.py [--steps 3000] [--check]`` (``--check``: exit 1
if the table in docs/research_plus.md differs; tests/test_docs_claims.py runs it)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from collage import mcf

BF16 = torch.bfloat16


def rn(x: torch.Tensor) -> torch.Tensor:
    return mcf.round_to(x.double(), BF16)


def collage_plus(v, v_lo, beta2, inc):
    beta_hi = rn(beta2)
    beta_lo = rn(torch.tensor(beta2) - beta_hi.double())
    v, v_lo = mcf.mul(v, v_lo, beta_hi, beta_lo)
    return mcf.grow(v, v_lo, inc)


def research_plus(v, v_lo, beta2, inc, fixed_split=False):
    beta_hi = rn(beta2)
    reference = beta_hi.double() if fixed_split else beta2.float().double()
    beta_lo = rn(beta2 - reference)
    product = rn(v.double() * beta_hi.double())  # v is overwritten by its product here ...
    error = rn(product.double() * beta_hi.double() - product.double())  # ... so this is not
    # the product's rounding error (it uses the new v): zero when beta_hi == 1.
    v_lo = rn(rn(rn(v_lo.double() * beta_hi.double()).double() + rn(product.double() * beta_lo.double()).double()).double() + error.double())
    # Renormalisation: hi = fl(product + lo), then lo -= (hi - product); but "product" is
    # the same tensor as hi by then, so the subtraction is of zero and lo is counted twice.
    hi = rn(product.double() + v_lo.double())
    return mcf.grow(hi, v_lo, inc)


def bf16_ema(v, beta2, inc):
    return rn(rn(v.double() * rn(beta2).double()).double() + inc.double())


def run(betas: tuple[float, ...], steps: int, g: float = 1.0
        ) -> dict[float, dict[str, list[float]]]:
    """For each beta2: each variant's v / ((1 - beta2**t) g**2) at t = 10, 100, 1000 and
    ``steps`` (every beta2 at once: the arithmetic is elementwise)."""
    beta2 = torch.tensor(betas, dtype=torch.float64)
    grad = rn(torch.tensor(g))
    inc = rn(rn(1 - beta2).double() * rn(grad.double() * grad.double()).double())
    zero = torch.zeros(len(betas), dtype=BF16)
    state = {"collage plus": (zero, zero), "research plus": (zero, zero),
             "research plus, fixed split": (zero, zero), "bf16": zero}
    checkpoints = {10, 100, 1000, steps}
    out = {b: {name: [] for name in state} for b in betas}
    for t in range(1, steps + 1):
        state["collage plus"] = collage_plus(*state["collage plus"], beta2, inc)
        state["research plus"] = research_plus(*state["research plus"], beta2, inc)
        state["research plus, fixed split"] = research_plus(
            *state["research plus, fixed split"], beta2, inc, fixed_split=True)
        state["bf16"] = bf16_ema(state["bf16"], beta2, inc)
        if t in checkpoints:
            exact = (1 - beta2**t) * g * g
            for name, value in state.items():
                total = sum(x.double() for x in value) if isinstance(value, tuple) \
                    else value.double()
                for i, b in enumerate(betas):
                    out[b][name].append(float(total[i] / exact[i]))
    return out


def report(steps: int) -> str:
    columns = sorted({10, 100, 1000, steps})
    lines = ["v / ((1 - beta2**t) g**2), constant g = 1, bf16 components"]
    results = run((0.95, 0.99, 0.999), steps)
    for beta2, variants in results.items():
        lines += ["", f"beta2 = {beta2}",
                  f"{'':28s}" + "".join(f"t={t:<8d}" for t in columns)]
        for name, values in variants.items():
            lines.append(f"{name:28s}" + "".join(f"{v:<10.4f}" for v in values))
    return "\n".join(line.rstrip() for line in lines)


def _documented() -> str:
    """The table in docs/research_plus.md: the first fenced block after "## The numbers"."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "research_plus.md").read_text()
    block = text[text.index("## The numbers"):]
    start = block.index("```\n") + 4
    return "\n".join(line.rstrip() for line in block[start:block.index("```", start)]
                     .strip().splitlines())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if docs/research_plus.md's table differs")
    args = parser.parse_args(argv)
    measured = report(args.steps)
    if args.check and measured != _documented():
        print("docs/research_plus.md's table differs from:\n" + measured, file=sys.stderr)
        return 1
    print(measured)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
