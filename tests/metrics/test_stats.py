"""Update-quality statistics against an independent brute-force reference and analytic cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collage.mcf import grow, round_to
from collage.metrics import FIELDS, UpdateStats, edq, imprecision

from ._reference import (
    Update,
    as_floats,
    assert_metrics_close,
    random_update,
    reference_dict,
    reference_metrics,
)

BF16 = torch.bfloat16


def _stats_of(by_key_updates: list[tuple[list[str], Update]]) -> UpdateStats:
    stats = UpdateStats()
    for keys, u in by_key_updates:
        stats.add(keys, u.intended, u.before, u.after, **u.kwargs())
    return stats


# ------------------------------------------------------------------------------------------
# Stateless functions
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("visible", [False, True])
def test_edq_and_imprecision_match_bruteforce(seed: int, visible: bool) -> None:
    u = random_update(257, seed, visible=visible)
    ref = reference_metrics([u])
    got_edq = edq(u.intended, u.before, u.after)
    got_imp = imprecision(u.intended, u.before, u.after)
    assert got_edq.dtype == got_imp.dtype == torch.float64
    assert got_edq.shape == got_imp.shape == ()
    assert math.isclose(float(got_edq), ref["edq"], rel_tol=1e-12)
    assert float(got_imp) == ref["imprecision"]
    # the data exercise both lost and kept elements (in hi + lo nothing is lost)
    assert 0.0 < ref["imprecision_visible"] < 1.0
    assert (ref["imprecision"] == 0.0) if visible else (ref["imprecision"] > 0.0)


def test_functions_accept_any_shapes_with_equal_numel() -> None:
    d = torch.full((2, 3), 0.5)
    before = torch.zeros(6, dtype=torch.float64)
    after = torch.full((3, 2), 0.25, dtype=BF16)
    assert float(edq(d, before, after)) == 0.5
    assert float(imprecision(d, before, after)) == 0.0


def test_undefined_when_nothing_intended_is_nan() -> None:
    d = torch.zeros(5)
    before, after = torch.ones(5), torch.ones(5) * 2
    assert math.isnan(float(edq(d, before, after)))
    assert math.isnan(float(imprecision(d, before, after)))
    stats = UpdateStats()
    stats.add(["", "frozen"], d, before, after)
    out = stats.to_dict()
    for name in ("edq", "imprecision", "edq_visible", "imprecision_visible"):
        assert math.isnan(out[name]) and math.isnan(out[f"{name}/frozen"])
    assert out["update_norm"] == 0.0
    assert out["effective_norm"] == math.sqrt(5.0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(-1e3, 1e3, width=32),
            st.floats(-1e3, 1e3, width=32),
            st.sampled_from([0.0, 1e-6, -1e-3, 0.5, 3.0]),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_functions_match_bruteforce_on_arbitrary_values(
    rows: list[tuple[float, float, float]],
) -> None:
    d = torch.tensor([r[0] for r in rows], dtype=torch.float32)
    before = torch.tensor([r[1] for r in rows], dtype=torch.float32).to(BF16)
    after = (before.double() + d.double() * torch.tensor([r[2] for r in rows])).to(BF16)
    ref = reference_metrics([Update(d, before, after)])
    pairs = (
        (edq(d, before, after), ref["edq"]),
        (imprecision(d, before, after), ref["imprecision"]),
    )
    for got, want in pairs:
        if math.isnan(want):
            assert math.isnan(float(got))
        else:
            assert math.isclose(float(got), want, rel_tol=1e-9, abs_tol=1e-12)


# ------------------------------------------------------------------------------------------
# Analytic cases
# ------------------------------------------------------------------------------------------


def _small_update(n: int = 1000, seed: int = 0) -> torch.Tensor:
    """|d| in [2**-14, 2**-10]: below half an ulp of 1.0 in bf16 on both sides.

    ulp(1.0) is 2**-7 above 1 and 2**-8 below, so anything with |d| < 2**-9 rounds back to 1.
    """
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(-14 + 4 * torch.rand(n, generator=g, dtype=torch.float64))
    return (torch.randn(n, generator=g, dtype=torch.float64).sign() * mag).float()


def test_plain_bf16_loses_an_update_below_half_an_ulp() -> None:
    d = _small_update()
    w = torch.ones(d.numel(), dtype=BF16)
    w_new = round_to(w.double() + d.double(), BF16)
    assert torch.equal(w_new, w)  # every element rounded back to 1.0
    assert float(edq(d, w, w_new)) == 0.0
    assert float(imprecision(d, w, w_new)) == 1.0
    stats = UpdateStats()
    stats.add("", d, w, w_new)
    out = stats.to_dict()
    assert out["edq"] == out["edq_visible"] == 0.0
    assert out["imprecision"] == out["imprecision_visible"] == 1.0
    assert out["effective_norm"] == 0.0
    assert "compensation_norm" not in out


def test_two_component_representation_keeps_the_same_update() -> None:
    """hi + lo keeps d: edq ~ 1 although the visible weight (hi) does not move at all.

    grow(1, 0, fl(d)) gives hi' = 1 and lo' = fl(d) exactly, so e = fl_bf16(d) and
    |edq - 1| = |<fl(d) - d, d>| / ||d||^2 <= 2**-9 (bf16's unit roundoff, the worst case
    if every rounding error had the sign of d). Rounding errors of these random d have random
    signs, so the deterministic (seeded) value is far inside the 1e-3 asked for.
    """
    d = _small_update()
    hi, lo = torch.ones(d.numel(), dtype=BF16), torch.zeros(d.numel(), dtype=BF16)
    new_hi, new_lo = grow(hi, lo, round_to(d.double(), BF16))
    assert torch.equal(new_hi, hi)
    before, after = hi.double() + lo.double(), new_hi.double() + new_lo.double()
    stats = UpdateStats()
    stats.add("", d, before, after, visible_before=hi, visible_after=new_hi, compensation=new_lo)
    out = stats.to_dict()
    assert abs(out["edq"] - 1.0) < 1e-3
    assert abs(out["edq"] - 1.0) <= 2.0**-9
    assert out["imprecision"] == 0.0
    assert out["edq_visible"] == 0.0
    assert out["imprecision_visible"] == 1.0
    lo_norm = math.sqrt(math.fsum(x * x for x in as_floats(new_lo)))
    assert math.isclose(out["compensation_norm"], lo_norm)


def test_fp32_update_has_edq_one_up_to_fp32_rounding() -> None:
    """w in [1, 2), |d| in [1e-3, 1e-2]: e = fl32(w + d) - w = d + delta, |delta| <= 2**-24.

    (half an ulp of fp32 in [1, 2); the float64 subtraction is exact by Sterbenz's lemma.)
    By Cauchy-Schwarz |edq - 1| = |<delta, d>| / ||d||^2 <= ||delta|| / ||d||
    <= 2**-24 / min|d| = 2**-24 / 1e-3 ~ 6e-5: that is the tolerance, and it is a property
    of the fp32 weight, not an error of the metric (which is float64 throughout).
    """
    g = torch.Generator().manual_seed(3)
    n = 2000
    w = 1.0 + torch.rand(n, generator=g) * 0.9
    mag = 1e-3 + 9e-3 * torch.rand(n, generator=g)
    d = (torch.randn(n, generator=g).sign() * mag).float()
    w_new = w + d  # fp32 arithmetic: one rounding per element
    tol = 2.0**-24 / 1e-3
    value = float(edq(d, w, w_new))
    assert abs(value - 1.0) <= tol
    assert value != 0.0
    assert float(imprecision(d, w, w_new)) == 0.0


# ------------------------------------------------------------------------------------------
# UpdateStats
# ------------------------------------------------------------------------------------------


def test_update_stats_rollups_and_named_keys_match_bruteforce() -> None:
    params = {
        "blocks.0.attn.weight": (
            ["group0"],
            random_update(300, 1, visible=True, compensation=True),
        ),
        "blocks.0.mlp.weight": (["group0"], random_update(200, 2)),
        "blocks.0.ln.weight": (["group1"], random_update(50, 3, scale=1e-4)),
        "head.weight": (["group1"], random_update(120, 4, visible=True)),
    }
    by_key: dict[str, list[Update]] = {"": []}
    stats = UpdateStats()
    for name, (groups, u) in params.items():
        keys = ["", *groups, name]
        stats.add(keys, u.intended, u.before, u.after, **u.kwargs())
        for key in keys:
            by_key.setdefault(key, []).append(u)
    got = stats.to_dict()
    assert_metrics_close(got, reference_dict(by_key))
    assert "compensation_norm" in got and "compensation_norm/blocks.0.attn.weight" in got
    assert "compensation_norm/group1" not in got and "compensation_norm/head.weight" not in got
    assert list(got)[:7] == [  # the overall key comes first
        "edq", "imprecision", "update_norm", "effective_norm",
        "edq_visible", "imprecision_visible", "effective_norm_visible",
    ]
    assert stats.keys() == sorted(by_key)


def test_accumulating_steps_equals_pooling_them() -> None:
    steps = [random_update(64, seed, visible=True) for seed in range(5)]
    stats = _stats_of([([""], u) for u in steps])
    assert_metrics_close(stats.to_dict(), reference_dict({"": steps}))
    assert stats.sums()[""][FIELDS.index("n_elements")].item() == 5 * 64


def test_visible_defaults_to_represented() -> None:
    u = random_update(100, 7)
    a, b = UpdateStats(), UpdateStats()
    a.add("", u.intended, u.before, u.after)
    b.add("", u.intended, u.before, u.after, visible_before=u.before, visible_after=u.after)
    assert torch.equal(a.sums()[""], b.sums()[""])


def test_keys_as_str_and_duplicate_keys_count_once() -> None:
    u = random_update(40, 8)
    a, b = UpdateStats(), UpdateStats()
    a.add("", u.intended, u.before, u.after)
    b.add(["", "", "x", "x"], u.intended, u.before, u.after)
    assert torch.equal(a.sums()[""], b.sums()[""])
    assert torch.equal(b.sums()[""], b.sums()["x"])
    assert len(b) == 2 and "x" in b


def test_add_does_not_sync_and_to_dict_syncs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """No .item()/.tolist()/bool()/float() in add; exactly one .tolist() in to_dict."""
    u = random_update(100, 9, visible=True, compensation=True)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("host sync in UpdateStats.add")

    stats = UpdateStats()
    with monkeypatch.context() as m:
        for attr in ("item", "tolist", "__bool__", "__float__", "__int__", "numpy", "cpu"):
            m.setattr(torch.Tensor, attr, forbidden)
        for keys in (["", "g"], ["", "g", "p"]):
            stats.add(keys, u.intended, u.before, u.after, **u.kwargs())
    calls = []
    original = torch.Tensor.tolist

    def counting(self: torch.Tensor) -> object:
        calls.append(self.shape)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    stats.to_dict()
    assert calls == [torch.Size([3, len(FIELDS)])]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA to detect host syncs")
def test_add_does_not_sync_on_cuda() -> None:
    u = random_update(4096, 10, visible=True, compensation=True)
    tensors = {k: (v.cuda() if v is not None else None) for k, v in vars(u).items()}
    stats = UpdateStats()
    stats.add("", tensors["intended"], tensors["before"], tensors["after"])  # warm-up allocs
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats.add(
            ["", "g"],
            tensors["intended"],
            tensors["before"],
            tensors["after"],
            visible_before=tensors["visible_before"],
            visible_after=tensors["visible_after"],
            compensation=tensors["compensation"],
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert stats.sums()["g"].device.type == "cuda"


def test_reduce_without_distributed_is_a_noop_and_guards_reuse() -> None:
    u = random_update(30, 11)
    stats = _stats_of([([""], u)])
    before = stats.sums()[""].clone()
    stats.reduce_()
    assert torch.equal(stats.sums()[""], before)
    with pytest.raises(RuntimeError, match="already reduced"):
        stats.reduce_()
    with pytest.raises(RuntimeError, match="reset"):
        stats.add("", u.intended, u.before, u.after)
    stats.reset()
    assert len(stats) == 0 and stats.to_dict() == {}
    stats.add("", u.intended, u.before, u.after)
    assert torch.equal(stats.sums()[""], before)


def test_input_validation() -> None:
    d, w = torch.ones(4), torch.zeros(4)
    stats = UpdateStats()
    with pytest.raises(ValueError, match="after has 3 elements"):
        stats.add("", d, w, torch.zeros(3))
    with pytest.raises(ValueError, match="both visible_before and visible_after"):
        stats.add("", d, w, w, visible_before=w)
    with pytest.raises(ValueError, match="keys is empty"):
        stats.add([], d, w, w)
    with pytest.raises(TypeError, match="intended must be a torch.Tensor"):
        stats.add("", [1.0], w, w)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="keys must be strings"):
        stats.add(["", 0], d, w, w)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="keys must be a str or an iterable of str, got NoneType"):
        stats.add(None, d, w, w)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="visible_before has 2 elements"):
        stats.add("", d, w, w, visible_before=torch.zeros(2), visible_after=w)
    assert len(stats) == 0
