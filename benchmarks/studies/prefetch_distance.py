"""The native kernels' software prefetch distance (#31): the library built without
prefetching (``-DCOLLAGE_PREFETCH_BYTES=0``) against builds that prefetch each stream D
bytes ahead, with ``native_ab.py`` (the same bits checked first, then interleaved timings
of ``collage_adamw_threads``).

    python benchmarks/studies/prefetch_distance.py --size 16m --threads 2 --distances 512,1024,2048

Each build is the library's own command (``build.UNITS``, the first of its flag sets: the
OpenMP build) with one ``-D`` more, written to a temporary directory.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from collage.optim import get_strategy
from collage.optim.native import build

# native_ab.py is a tool of benchmarks/, one folder up from this study: put it on the path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import native_ab  # noqa: E402 - after its folder is on the path


def compile_with(distance: int, directory: Path) -> Path:
    """The library built with ``-DCOLLAGE_PREFETCH_BYTES=distance``."""
    target = directory / f"prefetch{distance}.so"
    cc = shutil.which("cc") or shutil.which("gcc") or "cc"
    subprocess.run([cc, *build._FLAGS[0], f"-DCOLLAGE_PREFETCH_BYTES={distance}", "-o",
                    str(target), *map(str, build.UNITS), "-lm"], check=True)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="16m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--distances", default="512,1024,2048")
    parser.add_argument("--strategies", default="bf16,stochastic,kahan,light,plus,split")
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="collage-prefetch-") as tmp:
        none = native_ab._library(str(compile_with(0, Path(tmp))))
        print("| distance | strategy | no prefetch ms | prefetch ms | speed-up (per round, "
              "median) | range |")
        print("|---:|---|---:|---:|---:|---|")
        for distance in map(int, args.distances.split(",")):
            libs = {"before": none,
                    "after": native_ab._library(str(compile_with(distance, Path(tmp))))}
            for name in args.strategies.split(","):
                strategy = get_strategy(name)
                native_ab.same_bits(libs, strategy, args.size, args.threads)
                t = native_ab.timings(libs, strategy, args.size, args.threads, args.rounds)
                lo, hi = t["ratio_range"]
                print(f"| {distance} | {name} | {t['before']:.2f} | {t['after']:.2f} | "
                      f"{t['ratio']:.2f} | {lo:.2f}-{hi:.2f} |", flush=True)


if __name__ == "__main__":
    main()
