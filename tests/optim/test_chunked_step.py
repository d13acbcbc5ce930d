"""The eager (foreach) step runs a large parameter in ranges of ``EAGER_CHUNK`` elements so
that its float32 temporaries stay a few MB: the results must be bit for bit those of one
whole-tensor call, and the step's peak memory must stay bounded."""

from __future__ import annotations

import pytest
import torch

import collage
from collage.optim import eager

from ._common import weight_dtype

# three ranges, the last partial and not a multiple of plus8's 128-element block
NUMEL = 2 * eager.EAGER_CHUNK + 1000


def _run(strategy: str, *, chunk: int, monkeypatch, rule=collage.AdamW, **kwargs):
    monkeypatch.setattr(eager, "EAGER_CHUNK", chunk)
    g = torch.Generator().manual_seed(3)
    dtype = weight_dtype(strategy)
    w = torch.randn(NUMEL, generator=g) * torch.logspace(-6, 2, NUMEL)
    p = torch.nn.Parameter(w.to(dtype))
    opt = rule([p], lr=1e-3, strategy=strategy, foreach=True, **kwargs)
    for step in range(3):
        grad = torch.randn(NUMEL, generator=g) * 10.0 ** (step - 4)
        grad[::97] = 0.0
        grad[5] = -0.0
        p.grad = grad.to(dtype)
        opt.step()
    return p.detach(), opt.state[p]


@pytest.mark.parametrize("strategy", collage.STRATEGIES)
def test_chunked_equals_one_call(strategy, monkeypatch):
    kwargs = {"weight_decay": 0.1}
    chunked, chunked_state = _run(strategy, chunk=eager.EAGER_CHUNK, monkeypatch=monkeypatch,
                                  **kwargs)
    whole, whole_state = _run(strategy, chunk=1 << 40, monkeypatch=monkeypatch, **kwargs)
    assert torch.equal(chunked.view(torch.uint8), whole.view(torch.uint8))
    assert chunked_state.keys() == whole_state.keys()
    for key, value in chunked_state.items():
        assert torch.equal(value.view(torch.uint8) if value.dim() else value,
                           whole_state[key].view(torch.uint8) if value.dim()
                           else whole_state[key]), key


@pytest.mark.parametrize("rule", [collage.SGD, collage.Lion])
def test_chunked_equals_one_call_other_rules(rule, monkeypatch):
    kwargs = {"momentum": 0.9} if rule is collage.SGD else {}
    a, sa = _run("plus", chunk=eager.EAGER_CHUNK, monkeypatch=monkeypatch, rule=rule, **kwargs)
    b, sb = _run("plus", chunk=1 << 40, monkeypatch=monkeypatch, rule=rule, **kwargs)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("strategy", ["plus8", "plus", "mixed"])
def test_a_step_adds_at_most_a_few_mb(strategy):
    """A 4M-element parameter: one eager step holds at most 4 MB beyond the persistent
    weight, gradient and states (whole-tensor float32 temporaries would be ~60 MB)."""
    from collage.train.memory import TensorMemoryProbe

    n = 1 << 22
    dtype = weight_dtype(strategy)
    p = torch.nn.Parameter(torch.randn(n).to(dtype))
    opt = collage.AdamW([p], lr=1e-3, strategy=strategy, foreach=True)
    p.grad = torch.randn(n).to(dtype)
    opt.step()  # creates the states
    held = sum(t.untyped_storage().nbytes() for t in [p, p.grad, *opt.state[p].values()])
    probe = TensorMemoryProbe(torch.device("cpu"), base_bytes=held)
    with probe:
        opt.step()
    assert probe.peak_bytes - held <= 4 * 2**20, (probe.peak_bytes - held) / 2**20
