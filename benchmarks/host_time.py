"""The host time of a GPU step, measured on this CPU (``gpu_model.host_seconds``: launches
stubbed), for the source tree at TREE: run once per tree, interleaved, to compare two
commits on one machine (issue #29; docs/benchmarks/intel-xeon-2c_2026-12-05_gpu-model.md).

Usage:
    git worktree add /tmp/before <commit>
    for i in 1 2 3; do for t in /tmp/before .; do python benchmarks/host_time.py $t; done; done

``--check-as-two-launches``: the per-tensor check's GPU form priced as two launches (its
multi-tensor max-norm over two tensors) instead of run over every tensor, which this CPU
does tensor by tensor (a GPU fuses it): the fairer "before" for a GPU's host.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree", help="the repository checkout to measure")
    parser.add_argument("--size", default="100m")
    parser.add_argument("--check-as-two-launches", action="store_true")
    args = parser.parse_args(argv)
    tree = Path(args.tree).resolve()
    sys.path[:0] = [str(tree / "src"), str(tree / "benchmarks")]
    import collage  # noqa: PLC0415 - the tree's, after its path is set
    import gpu_model  # noqa: PLC0415
    import torch  # noqa: PLC0415

    if not Path(collage.__file__).resolve().is_relative_to(tree):
        raise SystemExit(f"imported collage from {collage.__file__}, not {tree}")
    if args.check_as_two_launches:
        def two_launches(grads: list[torch.Tensor]) -> torch.Tensor:
            extremes = torch.stack(torch._foreach_norm(grads[:2], float("inf")))
            return (~torch.isfinite(extremes).all()).to(torch.float32)

        # where ``host_seconds`` looks the check up: gpu_host.py since gpu_model.py's
        # split, gpu_model.py itself in older trees
        sys.modules[gpu_model.host_seconds.__module__]._check_as_on_a_gpu = two_launches
    print(json.dumps({"tree": str(tree), **gpu_model.host_seconds(args.size)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
