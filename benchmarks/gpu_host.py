"""The host's time per optimizer step, the term ``benchmarks/gpu_model.py`` adds to (or
hides under) the kernels' time: measured on this CPU with the Triton launches stubbed
(``host_seconds``) or on a GPU's host, nothing stubbed (``host_seconds_on_gpu``).
``benchmarks/host_time.py`` runs ``host_seconds`` on two source trees to compare them.
"""

from __future__ import annotations

import time

import torch

import collage
from collage.bench.common import gpt_shapes
from collage.optim import nonfinite as nonfinite_policy
from collage.optim.triton import launch as launches


def _check_as_on_a_gpu(grads: list[torch.Tensor]) -> torch.Tensor:
    """``nonfinite.nonfinite_flag``'s GPU form (one multi-tensor max-norm), whatever the
    device: the CPU's per-tensor form is not what a GPU's host runs. (A planned default
    step does not call it: its plan's check kernels read the gradients.)
    ``benchmarks/host_time.py --check-as-two-launches`` replaces it here."""
    extremes = torch.stack(torch._foreach_norm(grads, float("inf")))
    return (~torch.isfinite(extremes).all()).to(torch.float32)


#: The host time of one Triton kernel launch (the Python launcher: binding ~30 arguments,
#: the specialization key, the driver call): an estimate, not measured (no GPU here); the
#: stubbed launches of :func:`host_seconds` are counted and priced at it.
#: ``benchmarks/gpu_check.sh`` measures a step's host time on a GPU.
LAUNCH_HOST_S = 20e-6


def _kernel_launches(size: str) -> int:
    """The kernels one ``launch.launch`` or ``launch.check`` call runs for a bucket of
    ``size``'s tensors at their real sizes: one (whole blocks and tails share a launch)."""
    return int(any(torch.Size(shape).numel() for _, shape in gpt_shapes(size)))


def host_seconds_on_gpu(size: str, device: str = "cuda", repeats: int = 30
                        ) -> dict[str, float]:
    """:func:`host_seconds` measured on a GPU's host, nothing stubbed: ``plus`` (the default
    path there: the Triton kernels) over ``size``'s tensors at their real shapes, the
    thread CPU time of ``step()`` alone (the device synchronised before each step, so that
    a full launch queue never blocks it), least of ``repeats``; and torch's fused AdamW on
    float32 weights, the same way (``torch_fused``). Launches included (``*_launches``: 0,
    nothing to add)."""
    shapes = [shape for _, shape in gpt_shapes(size)]

    def least(opt: torch.optim.Optimizer) -> float:
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            start = time.thread_time()
            opt.step()
            times.append(time.thread_time() - start)
        torch.cuda.synchronize(device)
        return min(times[2:])

    def params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
        made = [torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
                for shape in shapes]
        for p in made:
            p.grad = torch.full_like(p, 1e-3)
        return made

    out: dict[str, float] = {}
    for policy in ("skip", "ignore"):
        python = least(collage.AdamW(params(torch.bfloat16), lr=1e-4, strategy="plus",
                                     nonfinite=policy))
        out.update({policy: python, f"{policy}_python": python, f"{policy}_launches": 0})
    out["torch_fused"] = least(torch.optim.AdamW(params(torch.float32), lr=1e-4,
                                                 fused=True))
    out["measured_on"] = torch.cuda.get_device_name(device)
    return out


def host_seconds(size: str, repeats: int = 40) -> dict[str, float]:
    """Host time of one default step (``nonfinite="skip"``: verdict on the device) and one
    planned ``nonfinite="ignore"`` step of ``plus`` over ``size``'s tensors (shapes kept,
    4 elements each, so that no data work is timed), on this machine's CPU with the Triton
    launches stubbed (counted, and priced at :data:`LAUNCH_HOST_S` each) and the per-tensor
    check in its GPU form: the Python and the small torch operations a GPU's host would run
    (each a launch there; here a CPU operation on a 0-d or small tensor, of about the same
    host cost). The least thread CPU time of ``repeats`` steps: what the step costs this
    CPU, not the other processes sharing its two cores (wall-clock medians on a busy
    machine vary by 2x). Keys: ``skip`` and ``ignore`` (Python and launches, seconds),
    ``<policy>_python`` and ``<policy>_launches`` (kernel launches per step)."""
    import os  # noqa: PLC0415 - the interpreter flag, read when the path is chosen

    saved_flag = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors take the Triton path (not run)
    params = [torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
              for _ in gpt_shapes(size)]
    saved = launches.launch, launches.check, nonfinite_policy.nonfinite_flag
    counted, per_call = [0], _kernel_launches(size)

    def count(*args, **kwargs) -> None:
        counted[0] += per_call

    launches.launch = launches.check = count
    nonfinite_policy.nonfinite_flag = _check_as_on_a_gpu
    try:
        out = {}
        for policy in ("skip", "ignore"):
            opt = collage.AdamW(params, lr=1e-4, strategy="plus", fused="triton",
                                nonfinite=policy)
            times = []
            for _ in range(repeats):
                for p in params:
                    p.grad = torch.ones_like(p)
                counted[0] = 0
                start = time.thread_time()
                opt.step()
                times.append(time.thread_time() - start)
            out[f"{policy}_python"] = min(times[2:])
            out[f"{policy}_launches"] = counted[0]  # the last (planned) step's
            out[policy] = out[f"{policy}_python"] + counted[0] * LAUNCH_HOST_S
        return out
    finally:
        launches.launch, launches.check, nonfinite_policy.nonfinite_flag = saved
        if saved_flag is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_flag
