"""Parameters that are views of one storage (``optim/edits.py``): a flat buffer's slices, a
fused weight cut in parts.

Views made from one tensor share its version counter, so a write to one moves the others'.
The optimizer's own writes must not read as edits: before this was handled (found by audit,
2026-12-07), the native path moved every view's counter once per view and step, the log
expected one, and every step re-derived the hidden components from the bf16 weight
(``mixed``'s master, the pair's low part): the strategies fell back to bf16 silently, on the
default path, under ``step_in_backward`` and ``grad_accumulation="pair"`` on every path.

Checked against the same run on separate tensors (the views' values, cloned): bit for bit,
with no re-derivation; for views sharing one counter and for views of one storage with a
counter each (slices of two ``.data`` aliases); in one group and across two; with a view
left without a gradient for a step. And a user's write to one view is still an edit.
"""

from __future__ import annotations

import pytest
import torch

import collage
from ._common import BF16, Rederivations, represented

HIDDEN = ("mixed", "light", "plus", "kahan", "split")
PATHS = {"default": {}, "foreach": {"foreach": True}, "reference": {"reference": True},
         "in_backward": {"step_in_backward": True},
         "in_backward_foreach": {"step_in_backward": True, "foreach": True},
         "pair": {"grad_accumulation": "pair"}}
STEPS = 5


@pytest.fixture
def rederivations(monkeypatch) -> Rederivations:
    """How many times the optimizer re-derived a weight's hidden components."""
    return Rederivations(monkeypatch)


def _weights(layout: str) -> list[torch.nn.Parameter]:
    """Three weights of 40, 24 and 64 elements: separate tensors, views of one buffer (one
    counter), or views of one storage through two ``.data`` aliases (two counters)."""
    base = torch.randn(128, generator=torch.Generator().manual_seed(0)).to(BF16)
    cuts = ((0, 40), (40, 64), (64, 128))
    if layout == "separate":
        return [torch.nn.Parameter(base[a:b].clone()) for a, b in cuts]
    if layout == "one_counter":
        return [torch.nn.Parameter(base[a:b]) for a, b in cuts]
    first, second = base.data, base.data  # two aliases of the storage, a counter each
    return [torch.nn.Parameter(first[0:40]), torch.nn.Parameter(first[40:64]),
            torch.nn.Parameter(second[64:128])]


def _run(layout: str, strategy: str, path: dict, *, two_groups: bool = False,
         skip: tuple[int, int] | None = None):
    """Train the three weights on a loss that uses each; ``skip``: (step, weight) left out of
    that step's loss (no gradient)."""
    ps = _weights(layout)
    groups = [{"params": ps[:1]}, {"params": ps[1:]}] if two_groups else [{"params": ps}]
    opt = collage.AdamW(groups, lr=1e-3, strategy=strategy, **path)
    in_backward = path.get("step_in_backward", False)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        xs = [torch.randn(p.numel(), generator=gen).to(BF16) for p in ps]
        used = [i for i in range(3) if skip != (step, i)]
        loss = sum((ps[i] * xs[i]).float().sum() ** 2 for i in used)
        loss.backward()
        if not in_backward:
            opt.step()
            opt.zero_grad()
    return ps, opt


def _assert_same_run(got, want) -> None:
    (ps, opt), (ref_ps, ref_opt) = got, want
    for p, q in zip(ps, ref_ps):
        assert torch.equal(represented(opt, p), represented(ref_opt, q))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("strategy", HIDDEN)
def test_views_of_one_buffer_train_as_separate_tensors(strategy, path, rederivations):
    want = _run("separate", strategy, PATHS[path])
    assert rederivations.count == 0
    got = _run("one_counter", strategy, PATHS[path])
    assert rederivations.count == 0
    _assert_same_run(got, want)


@pytest.mark.parametrize("path", ["default", "foreach", "in_backward"])
@pytest.mark.parametrize("layout", ["one_counter", "two_counters"])
def test_across_groups_with_a_view_left_out(layout, path, rederivations):
    """Two groups, and the third weight without a gradient at step 2: its counter moves with
    its neighbours' writes while it is not stepped."""
    kwargs = dict(two_groups=True, skip=(2, 2))
    want = _run("separate", "mixed", PATHS[path], **kwargs)
    got = _run(layout, "mixed", PATHS[path], **kwargs)
    assert rederivations.count == 0
    _assert_same_run(got, want)


@pytest.mark.parametrize("path", ["default", "foreach", "in_backward"])
def test_a_write_to_one_view_is_still_an_edit(path):
    """``w.zero_()`` on the first view between steps: the next step starts from the zeros
    (at lr = 0 the represented value stays exactly zero), as on separate tensors."""
    ps, opt = _run("one_counter", "plus", PATHS[path])
    with torch.no_grad():
        ps[0].zero_()
    for group in opt.param_groups:
        group["lr"] = 0.0
    loss = sum((p.float() * 1.5).sum() ** 2 for p in ps)
    loss.backward()
    if not PATHS[path].get("step_in_backward", False):
        opt.step()
    assert torch.equal(represented(opt, ps[0]), torch.zeros(40, dtype=torch.float64))
