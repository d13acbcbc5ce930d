"""Do two ``collage compare`` outputs hold the same numbers? (A refactor's check.)

Compares, run by run (matched by label), every loss and every EDQ / imprecision figure
(whole model and per module family) of two ``results.json`` files for exact equality;
timings and memory measurements are left out (they vary from run to run). Exit status 0
when all agree, 1 otherwise, with one line per difference.

    collage compare --preset quick --out /tmp/q --quiet
    python benchmarks/same_results.py docs/reports/quick/results.json /tmp/q/results.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

#: The numbers a change of the harness must not move (bit for bit).
EXACT = ("strategy", "beta2", "steps", "final_train_loss", "final_val_loss", "final_val_ppl",
         "best_val_loss", "val_loss_vs_fp32", "edq_mean", "imprecision_mean",
         "edq_visible_mean", "imprecision_visible_mean", "family", "init_checksum",
         "n_params", "persistent_bytes", "bytes_per_param_model")


def _by_label(path: str) -> dict[str, dict[str, Any]]:
    with open(path) as handle:
        return {r["label"]: r for r in json.load(handle)}


def differences(expected: dict[str, dict[str, Any]], actual: dict[str, dict[str, Any]]
                ) -> list[str]:
    """One line per run missing on either side or per field whose value differs."""
    lines = [f"{label}: missing" for label in expected if label not in actual]
    lines += [f"{label}: unexpected run" for label in actual if label not in expected]
    for label in (x for x in expected if x in actual):
        for key in EXACT:
            a, b = expected[label].get(key), actual[label].get(key)
            if a != b:
                lines.append(f"{label}: {key} {a!r} != {b!r}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("expected", help="results.json of the reference run")
    parser.add_argument("actual", help="results.json of the run to check")
    args = parser.parse_args()
    expected, actual = _by_label(args.expected), _by_label(args.actual)
    lines = differences(expected, actual)
    for line in lines:
        print(line)
    if not lines:
        print(f"same: {len(expected)} runs, {len(EXACT)} fields each")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
