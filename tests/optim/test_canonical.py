"""Every pair is kept in one canonical form on every path (issue #25): the leading part is
the nearest value of the pair's sum, ties to even (``strategies.strategy.normalize_pair``).
So a zero update leaves pairs alone bit for bit, even at exact ties, and a pair that is not
canonical when it arrives (a state written by hand, or by an older version) is made so by
the next step without changing the value it represents.

The expected values are written by hand in bf16 terms, not computed by the code under test.
"""

from __future__ import annotations

import pytest
import torch

import collage

from ._common import represented

BF16 = torch.bfloat16
#: (hi, lo) pairs: ties beside even weights (canonical: they stay), weights whose low part
#: is just below a tie, a zero low part
CANONICAL = [(1.0, 2.0**-8), (1.0 + 2.0**-6, -(2.0**-8)), (3.0, 2.0**-7 - 2.0**-15),
             (-2.5, 2.0**-8), (0.75, 0.0)]
#: (hi, lo) -> (hi', lo'): a tie beside an odd weight rounds to the even neighbour; a low
#: part that reaches the value below a power of two moves into the weight
NOT_CANONICAL = [((1.0 + 2.0**-7, 2.0**-8), (1.0 + 2.0**-6, -(2.0**-8))),
                 ((2.0, -(2.0**-7)), (2.0 - 2.0**-7, 0.0))]

PATHS = {"reference": {"reference": True}, "per_tensor": {"foreach": False},
         "foreach": {"foreach": True}, "default": {}}
CASES = [(cls, strategy) for cls in (collage.AdamW, collage.SGD, collage.Lion)
         for strategy in ("light", "plus", "kahan")] + [(collage.AdamW, "plus8")]


def _optimizer(cls, strategy, pairs, path):
    hi = torch.tensor([h for h, _ in pairs], dtype=BF16)
    param = torch.nn.Parameter(hi.clone())
    opt = cls([param], lr=0.0, weight_decay=0.1, strategy=strategy, **PATHS[path])
    param.grad = torch.zeros_like(param)
    opt.step()  # makes the state (zero moments), lr = 0 moves nothing
    assert torch.equal(param.detach(), hi)
    key = "compensation" if strategy == "kahan" else "weight_lo"
    # only the low part is written: a weight written since the last step would be taken as
    # the user's edit, its low part re-derived as 0 (optim/edits.py)
    with torch.no_grad():
        opt.state[param][key].copy_(torch.tensor([lo for _, lo in pairs], dtype=BF16))
    return param, opt, key


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("cls", "strategy"), CASES,
                         ids=lambda c: getattr(c, "__name__", c))
def test_canonical_ties_stay_at_lr_zero(cls, strategy, path):
    param, opt, key = _optimizer(cls, strategy, CANONICAL, path)
    for _ in range(3):
        param.grad = torch.randn(param.shape).to(BF16)
        opt.step()
    assert param.detach().tolist() == [h for h, _ in CANONICAL]
    assert opt.state[param][key].tolist() == [lo for _, lo in CANONICAL]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("cls", "strategy"), CASES,
                         ids=lambda c: getattr(c, "__name__", c))
def test_a_pair_that_is_not_canonical_is_made_so_keeping_its_value(cls, strategy, path):
    pairs = [before for before, _ in NOT_CANONICAL]
    param, opt, key = _optimizer(cls, strategy, pairs, path)
    value = represented(opt, param)
    param.grad = torch.randn(param.shape).to(BF16)
    opt.step()
    assert param.detach().tolist() == [h for _, (h, _) in NOT_CANONICAL]
    assert opt.state[param][key].tolist() == [lo for _, (_, lo) in NOT_CANONICAL]
    assert torch.equal(represented(opt, param), value)
