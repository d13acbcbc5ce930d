"""Compare two `collage compare` output folders run without and with --step-in-backward: are
the loss curves identical, bit for bit? (issue #32; a markdown table on stdout)

Usage: python benchmarks/studies/same_loss_in_backward.py NORMAL_DIR IN_BACKWARD_DIR
"""

from __future__ import annotations

import json
import sys


def _read(folder: str) -> tuple[dict, dict]:
    with open(folder + "/history.json") as f:
        history = json.load(f)
    with open(folder + "/results.json") as f:
        results = {r["strategy"]: r for r in json.load(f)}
    return history, results


def main(normal: str, in_backward: str) -> None:
    (a, ra), (b, rb) = _read(normal), _read(in_backward)
    print("| strategy | train losses (20 steps) identical | final val loss, normal step | "
          "final val loss, in backward | peak MB normal / in backward |")
    print("|---|---|---|---|---|")
    for s in a:
        same = a[s]["train_loss"] == b[s]["train_loss"] and a[s]["val_loss"] == b[s]["val_loss"]
        print(f"| {s} | {'yes' if same else 'NO'} | {ra[s]['final_val_loss']!r} | "
              f"{rb[s]['final_val_loss']!r} | {ra[s]['peak_memory_bytes'] / 1e6:.3f} / "
              f"{rb[s]['peak_memory_bytes'] / 1e6:.3f} |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
