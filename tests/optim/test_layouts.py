"""Layouts and devices a group may mix (issue #42, items 11 and 13).

* ``reference=True`` computes op by op in bf16, and torch rounds some bf16 operations
  differently in its vectorized and scalar loops (``add_`` with ``alpha``); it takes the scalar
  loop where the operands' layouts differ. A channels_last gradient of a contiguous weight must
  step the weight as the same values laid out as the weight do.
* A group may hold tensors of several devices (torch.optim groups by device): a ``meta``
  parameter beside CPU ones must leave the CPU ones stepped exactly as a group of them alone.
"""

from __future__ import annotations

import pytest
import torch

import collage

from ._common import assert_bitwise_equal, weight_dtype

def _stepped(strategy: str, grads: list[torch.Tensor], **flags) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    weight = torch.nn.Parameter(torch.randn(2, 3, 4, 5, generator=g).to(weight_dtype(strategy)))
    opt = collage.AdamW([weight], lr=1e-2, weight_decay=0.1, strategy=strategy, **flags)
    for grad in grads:
        weight.grad = grad
        opt.step()
    state = {k: v.clone() for k, v in opt.state[weight].items() if torch.is_tensor(v)}
    return {"weight": weight.detach().clone(), **state}


@pytest.mark.parametrize("strategy", collage.STRATEGIES)
def test_reference_step_does_not_depend_on_the_gradients_layout(strategy):
    g = torch.Generator().manual_seed(4)
    dtype = weight_dtype(strategy)
    values = [torch.randn(2, 3, 4, 5, generator=g).to(dtype) for _ in range(3)]
    contiguous = _stepped(strategy, [v.clone() for v in values], reference=True)
    channels_last = _stepped(
        strategy, [v.contiguous(memory_format=torch.channels_last) for v in values],
        reference=True)
    assert_bitwise_equal(channels_last, contiguous)


FLAGS = [{}, {"foreach": True}, {"foreach": False}, {"reference": True},
         {"track_updates": True}, {"foreach": True, "track_updates": True}]


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items())
                         or "default")
@pytest.mark.parametrize("strategy", ["bf16", "plus", "stochastic", "fp32", "plus8"])
def test_a_meta_parameter_beside_cpu_ones_changes_nothing_they_get(strategy, flags):
    dtype = weight_dtype(strategy)
    g = torch.Generator().manual_seed(5)
    # two small tensors (concatenated by foreach) and one large one (stepped in ranges)
    shapes = [(7,), (3, 5), (40_000,)]
    weights = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=g).to(dtype) for s in shapes] for _ in range(2)]

    def run(with_meta: bool, flags: dict) -> dict[str, torch.Tensor]:
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        members = list(params)
        if with_meta:
            meta = torch.nn.Parameter(torch.empty(9, dtype=dtype, device="meta"))
            members = [*params, meta]  # last: the others keep their positions (draw keys)
        opt = collage.AdamW(members, lr=1e-2, strategy=strategy, **flags)
        for step_grads in grads:
            for p, grad in zip(params, step_grads):
                p.grad = grad.clone()
            if with_meta:
                meta.grad = torch.empty(9, dtype=dtype, device="meta")
            opt.step()
        if with_meta:
            assert meta.device.type == "meta" and opt.state[meta]["step"] == 2
            if not flags:
                assert opt.last_paths == {0: "foreach"}
        return {f"param{i}": p.detach() for i, p in enumerate(params)}

    # The native kernels step CPU tensors only: by default a group holding a meta tensor
    # takes the foreach path (as one holding a non-contiguous tensor does), and the fp32
    # strategy's foreach path is torch's single-tensor arithmetic, which differs from its
    # fused kernel in the last bit on some CPUs (an AVX2 EPYC: 369 of 40,000 weights).
    alone_flags = flags if "foreach" in flags else {"foreach": True, **flags}
    assert_bitwise_equal(run(True, flags), run(False, alone_flags))
