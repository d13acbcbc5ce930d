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

Usage: ``python benchmarks/research_plus.py [--steps 3000]``
"""

from __future__ import annotations

import argparse

import torch

from collage import mcf

BF16 = torch.bfloat16


def rn(x: torch.Tensor) -> torch.Tensor:
    return mcf.round_to(x.double(), BF16)


def collage_plus(v, v_lo, beta2, inc):
    beta_hi = rn(torch.tensor(beta2))
    beta_lo = rn(torch.tensor(beta2) - beta_hi.double())
    v, v_lo = mcf.mul(v, v_lo, beta_hi, beta_lo)
    return mcf.grow(v, v_lo, inc)


def research_plus(v, v_lo, beta2, inc, fixed_split=False):
    beta_hi = rn(torch.tensor(beta2))
    reference = beta_hi.double() if fixed_split else torch.tensor(beta2, dtype=torch.float32).double()
    beta_lo = rn(torch.tensor(beta2, dtype=torch.float64) - reference)
    product = rn(v.double() * beta_hi.double())  # v is overwritten by its product here ...
    error = rn(product.double() * beta_hi.double() - product.double())  # ... so this is not
    # the product's rounding error (it uses the new v): zero when beta_hi == 1.
    v_lo = rn(rn(rn(v_lo.double() * beta_hi.double()).double() + rn(product.double() * beta_lo.double()).double()).double() + error.double())
    # Renormalisation: hi = fl(product + lo), then lo -= (hi - product); but "product" is
    # the same tensor as hi by then, so the subtraction is of zero and lo is counted twice.
    hi = rn(product.double() + v_lo.double())
    return mcf.grow(hi, v_lo, inc)


def bf16_ema(v, beta2, inc):
    return rn(rn(v.double() * rn(torch.tensor(beta2)).double()).double() + inc.double())


def run(beta2: float, steps: int, g: float = 1.0) -> dict[str, list[float]]:
    grad = rn(torch.tensor(g))
    inc = rn(rn(torch.tensor(1 - beta2)).double() * rn(grad.double() * grad.double()).double())
    zero = torch.zeros((), dtype=BF16)
    state = {"collage plus": (zero, zero), "research plus": (zero, zero),
             "research plus, fixed split": (zero, zero), "bf16": zero}
    checkpoints = {10, 100, 1000, steps}
    out: dict[str, list[float]] = {name: [] for name in state}
    for t in range(1, steps + 1):
        state["collage plus"] = collage_plus(*state["collage plus"], beta2, inc)
        state["research plus"] = research_plus(*state["research plus"], beta2, inc)
        state["research plus, fixed split"] = research_plus(
            *state["research plus, fixed split"], beta2, inc, fixed_split=True)
        state["bf16"] = bf16_ema(state["bf16"], beta2, inc)
        if t in checkpoints:
            exact = (1 - beta2**t) * g * g
            for name, value in state.items():
                total = sum(x.double() for x in value) if isinstance(value, tuple) else value.double()
                out[name].append(float(total) / exact)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    columns = sorted({10, 100, 1000, args.steps})
    print("v / ((1 - beta2**t) g**2), constant g = 1, bf16 components")
    for beta2 in (0.95, 0.99, 0.999):
        print(f"\nbeta2 = {beta2}")
        print(f"{'':28s}" + "".join(f"t={t:<8d}" for t in columns))
        for name, values in run(beta2, args.steps).items():
            print(f"{name:28s}" + "".join(f"{v:<10.4f}" for v in values))


if __name__ == "__main__":
    main()
