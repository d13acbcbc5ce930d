"""The kernels that write weights through pointers (native C, Triton) move each weight's
version counter, as torch's in-place operations do (issue #42, item 8): autograd refuses a
backward through a graph that saved the weights before the step, as after torch.optim; and
the optimizer's record of what it left in the weights (``edits.WriteLog``) moves with them,
so a step never mistakes its own write for a user's edit (which would reset the low parts).
"""

from __future__ import annotations

import pytest
import torch

import collage

from ._common import assert_bitwise_equal

BF16 = torch.bfloat16


@pytest.mark.parametrize("strategy", ["plus", "light", "mixed", "bf16", "stochastic"])
def test_a_backward_through_weights_stepped_since_is_refused(strategy):
    w = torch.nn.Parameter(torch.linspace(-1, 1, 8, dtype=BF16))
    opt = collage.AdamW([w], lr=0.1, strategy=strategy)
    x = torch.linspace(0, 1, 8, dtype=BF16, requires_grad=True)
    loss = (w * x).sum().float()
    loss.backward(retain_graph=True)
    before = w._version
    opt.step()
    assert opt.last_paths == {0: "native"}
    assert w._version == before + 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _train(strategy: str, steps: int, trust: bool = False) -> dict[str, torch.Tensor]:
    """Many steps on the native plan (past the log's bound on pending bumps), with
    state_dict() reads in between. ``trust``: the log forgets its records after every
    step, so that nothing can ever be re-derived: the reference."""
    g = torch.Generator().manual_seed(11)
    params = [torch.nn.Parameter(torch.randn(n, generator=g).to(BF16)) for n in (5, 300)]
    opt = collage.AdamW(params, lr=1e-3, strategy=strategy)
    for step in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(BF16)
        opt.step()
        if trust:
            opt._writes.forget()
        if step in (30, 90):
            opt.state_dict()
    assert opt.last_paths == {0: "native"}
    return {f"p{i}": p.detach() for i, p in enumerate(params)} | {
        f"s{i}/{k}": v for i, p in enumerate(params) for k, v in opt.state[p].items()
        if torch.is_tensor(v)}


@pytest.mark.parametrize("strategy", ["plus", "light", "kahan", "split", "mixed"])
def test_its_own_writes_are_never_taken_for_edits(strategy):
    """150 steps give the bits of the same steps by an optimizer that never re-derives: a
    step that took its own write for an edit would have reset the hidden components (set
    them from the weight)."""
    assert_bitwise_equal(_train(strategy, 150), _train(strategy, 150, trust=True))


def test_an_edit_after_many_planned_steps_is_still_seen():
    w = torch.nn.Parameter(torch.full((16,), 1.0, dtype=BF16))
    opt = collage.AdamW([w], lr=1e-3, strategy="plus", weight_decay=0.0)
    for _ in range(70):
        w.grad = torch.full((16,), 1e-3, dtype=BF16)
        opt.step()
    assert opt.state[w]["weight_lo"].abs().sum() > 0
    with torch.no_grad():
        w.fill_(2.0)  # a user's edit: the next step starts from 2 exactly (lo = 0)
    w.grad = torch.zeros(16, dtype=BF16)
    opt.param_groups[0]["lr"] = 0.0
    opt.step()
    assert torch.equal(w.detach(), torch.full((16,), 2.0, dtype=BF16))
    assert opt.state[w]["weight_lo"].abs().sum() == 0
