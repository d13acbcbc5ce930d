"""Before -> after tables of two runs of ``gpu_model.py --json`` (issue #44): for each
strategy, a rule's whole-block variant (its registers at the 100M launch, its overlap
window and loop as launched at 1B, its bytes in flight per SM, and the predicted
fractions), the default configuration's table with the check kernels' rows, then
``nonfinite="ignore"``'s. The tables of the gpu-model records and of docs/gpu.md "The
model" are this script's output (tests/test_docs_claims.py checks them). Reads JSON only:
no Triton, no GPU.

Usage:
    python benchmarks/gpu_compare.py BEFORE AFTER [--rule adamw]

BEFORE and AFTER: a ``--json`` output, or a record's JSON and its key after a colon
(``docs/benchmarks/amd-epyc-2c_2026-12-07_gpu-model.json:previous``). Rows are sm_90's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HEADER = ("| strategy | registers (100M launch) | window / loop, 1B | in flight per SM, 1B "
          "| 1B | 1B, host added | 100M, host added | 100M, host hidden |\n"
          "|---|---|---|---|---|---|---|---|")

Key = tuple[str, str, str, str]  # rule, strategy, configuration, variant


def load_rows(source: str) -> dict[Key, dict]:
    """sm_90's rows of ``source`` (``PATH`` or ``PATH:KEY``), by rule, strategy,
    configuration and variant."""
    path, _, key = source.partition(":")
    data = json.loads(Path(path).read_text())
    rows = data[key] if key else data
    return {(r["rule"], r["strategy"], r["configuration"], r["variant"]): r
            for r in rows if r["arch"] == 90}


def _percent(fraction: float) -> str:
    return f"{round(100 * fraction)} %"


def cells(row: dict) -> tuple[str, ...]:
    """One row's figures, as the tables show them."""
    return (str(row["at_100m"]["registers"]),
            f"{row['overlap_window']} / {row['instructions_per_tile']}",
            f"{row['bytes_in_flight_per_sm'] // 1024} KB", _percent(row["predicted_1b"]),
            _percent(row["predicted_1b_host_added"]),
            _percent(row["predicted_100m_host_added"]),
            _percent(row["predicted_100m_host_hidden"]))


def table(before: dict[Key, dict], after: dict[Key, dict], rule: str,
          configuration: str) -> str:
    """The markdown table of ``rule``'s whole-block variants in ``configuration`` (the
    default one: and the check kernels'), each figure ``before -> after``."""
    keys = [k for k in after if k[0] == rule and k[2] == configuration and k[3] == "whole"]
    if configuration == "default":
        keys += [k for k in after if k[0] == "-" and k[2] == "default" and k[3] == "whole"]
    lines = [HEADER]
    for key in keys:
        pairs = zip(cells(before[key]), cells(after[key]))
        lines.append(f"| `{key[1]}` | " + " | ".join(f"{b} -> {a}" for b, a in pairs) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="PATH or PATH:KEY")
    parser.add_argument("after", help="PATH or PATH:KEY")
    parser.add_argument("--rule", default="adamw")
    args = parser.parse_args(argv)
    before, after = load_rows(args.before), load_rows(args.after)
    print(table(before, after, args.rule, "default"))
    print()
    print(table(before, after, args.rule, "ignore"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
