"""bf16 matrix multiplies as float32 GEMMs (``collage.train.gemm``): the arithmetic against
exact references, what backward keeps, the models' ``bf16`` mode unchanged, the choice
(flag or probe) and its record in runs and reports."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from collage.errors import UsageError
from collage.mcf import round_to
from collage.train import gemm, models, runner
from collage.train.compare import compare
from collage.train.config import Config
from collage.train.distributed import Ranks
from collage.train.flags import add_config_flags, config_from_args
from collage.train.gemm import Bf16Gemm, attention, choose, linear
from collage.train.runner import train_strategy

from .conftest import micro_config

BF16 = torch.bfloat16
U32 = 2.0**-24  # float32's unit roundoff
U16 = 2.0**-8   # bf16's: half an ulp, relative


def _bf16(*shape, scale=1.0, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(BF16)


def _bound(exact: torch.Tensor, magnitude: torch.Tensor, terms: int) -> torch.Tensor:
    """How far a float32-accumulated sum of ``terms`` exact products, rounded once to bf16,
    may be from the exact sum: one bf16 rounding (half an ulp, at most 2^-8 of the value
    rounded) of a float32 sum whose error is at most (terms - 1) u32 times the sum of the
    terms' magnitudes (recursive summation, any order; Higham 4.2), 1.01 covering the
    second-order terms."""
    accumulation = 1.01 * terms * U32 * magnitude
    return U16 * (exact.abs() + accumulation) + accumulation


def _exact_linear(x, w, b=None):
    """Every product of two bf16 values is exact in float64, and so, here, are the sums
    (at most 2^10 terms whose exponents span far less than float64's 53 bits)."""
    out = x.double() @ w.double().t()
    magnitude = x.double().abs() @ w.double().abs().t()
    if b is not None:
        out, magnitude = out + b.double(), magnitude + b.double().abs()
    return out, magnitude


# --------------------------------------------------------------------------------------------
# The arithmetic
# --------------------------------------------------------------------------------------------


@pytest.fixture(params=[gemm.CHUNK_ELEMENTS, 300], ids=["one-chunk", "chunked"])
def chunk(request, monkeypatch):
    """The default float32 budget (one chunk at these sizes), and one that cuts every GEMM
    into chunks of rows (the weight's gradient then sums over chunks)."""
    monkeypatch.setattr(gemm, "CHUNK_ELEMENTS", request.param)
    return request.param


def test_forward_is_one_rounding_of_a_float32_sum(chunk):
    x, w, b = _bf16(256, 96, seed=1), _bf16(80, 96, seed=2), _bf16(80, seed=3)
    out = linear(x, w, b, mode="fp32")
    assert out.dtype == BF16
    exact, magnitude = _exact_linear(x, w, b)
    assert ((out.double() - exact).abs() <= _bound(exact, magnitude, 97)).all()
    # positive operands: no cancellation, the float32 sum is within ~97 u32 relative of the
    # exact one, so it rounds to the exact sum's correctly rounded bf16 value except where
    # the exact sum lies within that distance of a rounding boundary (about 97 u32 / u16 =
    # 1.5 % of outputs at most); rounding twice (via float16, say) or truncating would
    # disagree on about half of them
    xp, wp = x.abs(), w.abs()
    agree = linear(xp, wp, None, mode="fp32") == round_to(_exact_linear(xp, wp)[0], BF16)
    assert agree.float().mean() > 0.98


def test_backward_is_one_rounding_of_float32_gemms(chunk):
    x = _bf16(4, 32, 48, seed=4).requires_grad_()
    w, b = _bf16(24, 48, seed=5).requires_grad_(), _bf16(24, seed=6).requires_grad_()
    grad = _bf16(4, 32, 24, seed=7)
    linear(x, w, b, mode="fp32").backward(grad)
    assert x.grad.dtype == w.grad.dtype == b.grad.dtype == BF16
    g, xs = grad.double().reshape(-1, 24), x.detach().double().reshape(-1, 48)
    wd = w.detach().double()
    cases = [  # (gradient, exact value, sum of the terms' magnitudes, terms)
        (x.grad.reshape(-1, 48), g @ wd, g.abs() @ wd.abs(), 24),
        (w.grad, g.t() @ xs, g.abs().t() @ xs.abs(), 128),
        (b.grad, g.sum(0), g.abs().sum(0), 128),
    ]
    for got, exact, magnitude, terms in cases:
        assert ((got.double() - exact).abs() <= _bound(exact, magnitude, terms)).all()


def test_hard_cases_zeros_inf_nan_and_wide_gaps():
    # signed zeros: every product is a zero, every output zero (never nan)
    x = torch.tensor([[0.0, -0.0, 0.0], [-0.0, -0.0, -0.0]], dtype=BF16)
    w = torch.tensor([[-0.0, 0.0, 5.0], [1.0, -2.0, 0.0]], dtype=BF16)
    out = linear(x, w, mode="fp32")
    assert (out == 0).all()
    # inf and nan propagate as IEEE arithmetic says: float64 shows where
    x = torch.tensor([[float("inf"), 1.0], [float("nan"), 1.0], [float("-inf"), 2.0],
                      [3.0, 4.0]], dtype=BF16)
    w = torch.tensor([[1.0, 1.0], [0.0, 1.0], [-1.0, 0.5], [2.0, float("inf")]], dtype=BF16)
    out, exact = linear(x, w, mode="fp32").double(), x.double() @ w.double().t()
    assert torch.equal(out.isnan(), exact.isnan())
    finite = ~exact.isnan()
    assert torch.equal(out[finite], exact[finite].to(BF16).double())  # inf, -inf, exact
    # magnitudes 2^-60 .. 2^60 side by side, cancellation included: within the bound
    # (which charges the float32 sum with the largest terms' rounding errors)
    g = torch.Generator().manual_seed(8)
    exponents = torch.randint(-60, 61, (64, 40), generator=g).double()
    signs = torch.where(torch.rand(64, 40, generator=g) < 0.5, -1.0, 1.0).double()
    x = (signs * 2.0**exponents).to(BF16)
    w = _bf16(16, 40, seed=9)
    out = linear(x, w, mode="fp32")
    exact, magnitude = _exact_linear(x, w)
    assert ((out.double() - exact).abs() <= _bound(exact, magnitude, 40)).all()


def test_attention_is_float32_attention_rounded_once(chunk):
    q, k, v = (_bf16(2, 3, 16, 8, seed=s).requires_grad_() for s in (10, 11, 12))
    grad = _bf16(2, 3, 16, 8, seed=13)
    out = attention(q, k, v, causal=True, mode="fp32")
    out.backward(grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
    ref.backward(grad.double())
    # the float32 attention differs from float64 by a few float32 roundings of sums of at
    # most 16 terms and of exp: 2^-16 of the largest value allows 256 u32 for that; then
    # one bf16 rounding of the output (half an ulp, at most 2^-8 of it)
    def close(got, exact):
        slack = 2.0**-16 * exact.abs().max()
        return ((got.double() - exact).abs() <= U16 * exact.abs() + 2 * slack).all()

    assert out.dtype == BF16 and close(out, ref.detach())
    for got, exact in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert got.dtype == BF16 and close(got, exact)
    # without grad: the same forward
    with torch.no_grad():
        assert torch.equal(attention(q, k, v, causal=True, mode="fp32"), out.detach())


def test_backward_keeps_only_the_bf16_operands():
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    x, w = _bf16(64, 32, seed=14).requires_grad_(), _bf16(48, 32, seed=15).requires_grad_()
    q, k, v = (_bf16(2, 2, 8, 16, seed=s).requires_grad_() for s in (16, 17, 18))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        linear(x, w, _bf16(48, seed=19).requires_grad_(), mode="fp32")
        attention(q, k, v, causal=True, mode="fp32")
    assert [t.dtype for t in saved] == [BF16] * 5
    assert all(a is b for a, b in zip(saved, (x, w, q, k, v)))


def _saved_bytes(mode: str) -> dict[torch.dtype, int]:
    """Bytes autograd keeps for backward, by dtype, over a forward of the micro GPT."""
    config = micro_config()
    model = models.build_model(config.model, 257, seed=0).to(BF16)
    gemm.set_mode(model, mode)
    kept: dict[torch.dtype, int] = {}

    def pack(t):
        kept[t.dtype] = kept.get(t.dtype, 0) + t.numel() * t.element_size()
        return t

    idx = torch.randint(0, 257, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx)
    return kept


def test_fp32_mode_keeps_no_more_for_backward_than_bf16_mode():
    fp32, bf16 = _saved_bytes("fp32"), _saved_bytes("bf16")
    # attention keeps q, k, v instead of q, k, v, its output and a float32 log-sum-exp
    assert fp32.get(torch.float32, 0) < bf16[torch.float32]
    assert fp32[BF16] <= bf16[BF16]


def test_fp32_mode_does_not_raise_the_steps_memory_peak():
    # 1,024 tokens: the head's float32 logits and their gradient would be 1 MiB each, four
    # times the float32 budget; the GEMMs run in chunks of rows instead
    peaks = {}
    for mode in ("bf16", "fp32"):
        config = micro_config(model={"d_model": 64, "n_heads": 4, "context": 64},
                              data={"batch_size": 16},
                              run={"steps": 3, "eval_batches": 1, "bf16_gemm": mode})
        summary = train_strategy(config, "plus")["summary"]
        assert summary["peak_memory_measured"] == "cpu_allocator_events, step 2"
        peaks[mode] = summary["peak_memory_bytes"]
    assert peaks["fp32"] <= peaks["bf16"]


# --------------------------------------------------------------------------------------------
# The models
# --------------------------------------------------------------------------------------------


def _torch_attention(q, k, v, causal, dropout, training, mode):
    """The models' attention as it was before the GEMM modes (mode ignored)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                          dropout_p=dropout if training else 0.0)


@pytest.mark.parametrize("family", ["gpt", "llama", "bert"])
def test_bf16_mode_is_torchs_own_kernels_bit_for_bit(monkeypatch, family):
    config = micro_config(model={"family": family}, run={"bf16_gemm": "bf16", "steps": 4})
    ours = train_strategy(config, "plus")
    assert ours["summary"]["bf16_gemm"] == "bf16"
    # the same run with plain nn.Linear modules and torch's attention call
    monkeypatch.setattr(models, "_attention", _torch_attention)
    monkeypatch.setattr(models, "Linear", nn.Linear)
    plain = train_strategy(config, "plus")
    assert not any(isinstance(m, gemm.Linear) for m in plain["model"].modules())
    assert plain["history"]["train_loss"] == ours["history"]["train_loss"]
    assert plain["history"]["val_loss"] == ours["history"]["val_loss"]


@pytest.mark.parametrize("family", ["gpt", "llama", "bert"])
def test_fp32_mode_trains_reproducibly(family):
    config = micro_config(model={"family": family}, run={"bf16_gemm": "fp32", "steps": 4})
    a, b = train_strategy(config, "plus"), train_strategy(config, "plus")
    assert a["summary"]["bf16_gemm"] == "fp32"
    modes = {m.bf16_gemm for m in a["model"].modules() if hasattr(m, "bf16_gemm")}
    assert modes == {"fp32"}
    for p in a["model"].parameters():
        assert p.dtype == BF16
    assert a["history"]["train_loss"] == b["history"]["train_loss"]
    assert a["history"]["val_loss"] == b["history"]["val_loss"]
    for (name, p), q in zip(a["model"].named_parameters(), b["model"].parameters()):
        assert torch.equal(p, q), name


def test_float32_weights_do_not_choose(monkeypatch):
    monkeypatch.setattr(gemm, "probe", lambda: pytest.fail("probed for a float32 model"))
    s = train_strategy(micro_config(run={"steps": 2}), "fp32")["summary"]
    assert s["bf16_gemm"] is None and s["bf16_gemm_requested"] == "auto"


# --------------------------------------------------------------------------------------------
# Choosing and recording
# --------------------------------------------------------------------------------------------


def _probe(ratio: float):
    return lambda: {"shape": [128, 128, 128], "bf16_ms": ratio, "fp32_ms": 1.0,
                    "ratio": ratio, "threshold": gemm.THRESHOLD}


@pytest.mark.parametrize("ratio, mode", [(50.0, "fp32"), (0.6, "bf16")])
def test_auto_follows_the_probe(monkeypatch, ratio, mode):
    monkeypatch.setattr(gemm, "probe", _probe(ratio))
    assert choose("auto") == Bf16Gemm(mode, "auto", _probe(ratio)())
    s = train_strategy(micro_config(run={"steps": 2}), "plus")["summary"]
    assert (s["bf16_gemm"], s["bf16_gemm_probe"]["ratio"]) == (mode, ratio)
    # a forced mode does not probe
    monkeypatch.setattr(gemm, "probe", lambda: pytest.fail("probed a forced mode"))
    assert choose("bf16") == Bf16Gemm("bf16", "bf16")
    assert choose("fp32").mode == "fp32" and choose("auto", "cuda").mode == "bf16"


@pytest.mark.parametrize("rank", [0, 1])
def test_the_ranks_of_a_distributed_run_take_rank_0s_decision(monkeypatch, rank):
    """``--nproc 2`` with ``--bf16-gemm auto``: rank 0 probes and every rank takes its
    decision (a probe per rank could decide differently on a busy machine); the other
    ranks never probe."""
    decided = Bf16Gemm("fp32", "auto", _probe(50.0)())
    sent = []

    def broadcast(objects, src):
        sent.append((list(objects), src))
        objects[0] = decided  # what rank 0's list holds after its own broadcast

    monkeypatch.setattr(runner.dist, "broadcast_object_list", broadcast)
    monkeypatch.setattr(gemm, "probe", _probe(50.0) if rank == 0
                        else lambda: pytest.fail("rank 1 probed"))
    got = runner._bf16_gemm(micro_config(), "plus", torch.device("cpu"), None,
                            Ranks(rank=rank, world_size=2))
    assert got == decided
    assert sent == [([decided if rank == 0 else None], 0)]


def test_the_probe_times_both_and_leaves_the_threads():
    torch.set_num_threads(1)
    measured = gemm.probe.__wrapped__()  # not the process's cached answer
    assert measured["bf16_ms"] > 0 and measured["fp32_ms"] > 0
    assert measured["ratio"] == pytest.approx(measured["bf16_ms"] / measured["fp32_ms"])
    assert torch.get_num_threads() == 1


def test_the_flag_and_its_checks():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, "compare")
    assert config_from_args(parser.parse_args(["--bf16-gemm", "fp32"]), "compare") \
        .run.bf16_gemm == "fp32"
    assert config_from_args(parser.parse_args([]), "compare").run.bf16_gemm == "auto"
    with pytest.raises(UsageError, match="--bf16-gemm"):
        config_from_args(parser.parse_args(["--bf16-gemm", "fast"]), "compare")
    with pytest.raises(UsageError, match="--hf"):
        Config().replace(model={"hf": True}, run={"bf16_gemm": "fp32"})


def test_a_resumed_auto_run_keeps_its_mode(monkeypatch, tmp_path):
    config = micro_config(run={"steps": 6})
    monkeypatch.setattr(gemm, "probe", _probe(50.0))
    full = train_strategy(config, "plus")
    train_strategy(config, "plus", out_dir=str(tmp_path), checkpoint_every=2, stop_after=3)
    monkeypatch.setattr(gemm, "probe", _probe(0.5))  # the probe now says otherwise
    resumed = train_strategy(config, "plus", out_dir=str(tmp_path), checkpoint_every=2,
                             resume=True)
    assert resumed["summary"]["bf16_gemm"] == "fp32"
    assert resumed["history"]["train_loss"] == full["history"]["train_loss"]


def test_the_mode_and_the_machine_are_in_records_and_report(monkeypatch, tmp_path):
    monkeypatch.setattr(gemm, "probe", _probe(40.0))
    config = micro_config(run={"steps": 2, "isolate": False, "strategies": ("fp32", "plus")})
    compare(config, str(tmp_path), log=None)
    with open(os.path.join(tmp_path, "results.json")) as handle:
        records = {r["strategy"]: r for r in json.load(handle)}
    assert records["plus"]["bf16_gemm"] == "fp32"
    assert records["plus"]["bf16_gemm_probe"]["ratio"] == 40.0
    assert records["fp32"]["bf16_gemm"] is None
    machine = records["plus"]["machine"]
    assert machine["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert machine["torch"] == torch.__version__ and machine["cpu"]
    with open(os.path.join(tmp_path, "report.md")) as handle:
        report = handle.read()
    assert f"Machine: {machine['cpu']}, torch {torch.__version__} (CPU capability " \
        f"{machine['cpu_capability']})." in report
    assert ("bf16 matrix multiplies: float32 GEMMs on the upcast bf16 operands, rounded once "
            "to bf16 (--bf16-gemm auto: a 128x128x128 bf16 GEMM took 40 ms, in float32 1 "
            "ms, 40x, above the threshold 2x).") in report
    with open(os.path.join(tmp_path, "results.csv")) as handle:
        assert "bf16_gemm" in handle.readline()
