"""How Adam's second moment tracks its target under each low-precision strategy, per path.

Runs ``collage.AdamW`` at ``lr = 0`` with a constant gradient ``g = 1`` (so the weights stay
put and only the moments move) and prints ``v / (1 - beta2**t)``, the second moment over the
value an exact EMA has (1.0 is exact), for every strategy that keeps ``v`` in 16 bits or
fewer, on the default path (native on CPU), the foreach path and the reference path (the
research algorithm).

Usage::

    python benchmarks/studies/second_moment.py            # print the table
    python benchmarks/studies/second_moment.py --write    # rewrite it in docs/strategies.md
    python benchmarks/studies/second_moment.py --check    # exit 1 if docs/strategies.md differs

``tests/test_docs_claims.py`` runs ``--check``: the documented table is what the code does.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

import collage
from collage.optim import get_strategy
from collage.optim.rules import ADAMW

BETA2 = 0.999
STEPS = (10, 100, 1000, 3000)
PATHS = {"default": {}, "foreach": {"foreach": True}, "reference": {"reference": True}}
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "strategies.md"
BEGIN = "<!-- second-moment table: python benchmarks/studies/second_moment.py --write -->"
END = "<!-- end of the second-moment table -->"


def strategies() -> list[str]:
    """The strategies whose second moment is not float32."""
    return [name for name in collage.STRATEGIES
            if next(c.dtype for c in get_strategy(name).components(ADAMW)
                    if c.key == "exp_avg_sq") != torch.float32]


def track(strategy: str, flags: dict) -> list[float]:
    """v / (1 - beta2**t) at each of STEPS."""
    param = torch.nn.Parameter(torch.ones(16, dtype=torch.bfloat16))
    opt = collage.AdamW([param], lr=0.0, betas=(0.9, BETA2), weight_decay=0.0,
                        strategy=strategy, **flags)
    out = []
    for t in range(1, STEPS[-1] + 1):
        param.grad = torch.ones_like(param)
        opt.step()
        if t in STEPS:
            v = get_strategy(strategy).moment_value(ADAMW, opt.state[param], "exp_avg_sq")
            out.append(float(v[0]) / (1 - BETA2**t))
    return out


def table() -> str:
    header = "| strategy | path | " + " | ".join(f"t = {t}" for t in STEPS) + " |"
    lines = [header, "|" + "---|" * (len(STEPS) + 2)]
    for strategy in strategies():
        for path, flags in PATHS.items():
            values = " | ".join(f"{x:.4f}" for x in track(strategy, flags))
            lines.append(f"| `{strategy}` | {path} | {values} |")
    return "\n".join(lines)


def _documented() -> str:
    text = DOC.read_text()
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite docs/strategies.md")
    mode.add_argument("--check", action="store_true", help="compare with docs/strategies.md")
    args = parser.parse_args(argv)
    measured = table()
    if args.check:
        if measured != _documented():
            print("docs/strategies.md's second-moment table differs from the code's:\n"
                  f"{measured}", file=sys.stderr)
            return 1
        return 0
    if args.write:
        text = DOC.read_text()
        start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
        DOC.write_text(text[:start] + "\n" + measured + "\n" + text[stop:])
    print(measured)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
