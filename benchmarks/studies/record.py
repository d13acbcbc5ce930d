"""What the single-result benchmark scripts share (``grad_accum.py``,
``memory_in_backward.py``): the ``--out`` and ``--hardware`` arguments, the record's common
metadata, and writing the record as ``OUT.json`` and ``OUT.md`` (the markdown also printed).
Imported by the scripts run as ``python benchmarks/studies/NAME.py``, whose folder is on
the path."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from collections.abc import Callable

import torch


def parser(description: str) -> argparse.ArgumentParser:
    """A parser with the record's ``--out`` and ``--hardware``."""
    made = argparse.ArgumentParser(description=description)
    made.add_argument("--out", required=True, help="path without extension")
    made.add_argument("--hardware", default=platform.processor() or platform.machine())
    return made


def metadata(hardware: str, **fields) -> dict:
    """The date, the hardware and torch's version, then ``fields``."""
    return {"date": datetime.date.today().isoformat(), "hardware": hardware,
            "torch": torch.__version__, **fields}


def write(out: str, meta: dict, result: dict, markdown: Callable[[dict, dict], str]) -> None:
    """``OUT.json`` (the metadata and the result) and ``OUT.md``; the markdown printed."""
    text = markdown(meta, result)
    with open(out + ".json", "w") as f:
        json.dump({"meta": meta, **result}, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(text)
    print(text)
