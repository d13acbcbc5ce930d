"""bf16 matrix multiplies as float32 GEMMs: for CPUs without a fast bf16 GEMM.

A bf16 model multiplies bf16 matrices, and torch computes each output element with float32
accumulation, rounded once to bf16. On a CPU with bf16 instructions (AVX512-BF16, AMX)
that is fast; without them (an AVX2 x86 machine) torch falls back to a loop that runs
about 100x slower than a float32 GEMM (a 512x512 by 512x2048 product: 3.76 s in bf16,
25 ms in float32 on a 2-vCPU AMD EPYC), and a small model's training step is almost all
GEMM.

``fp32`` mode computes the same products as float32 GEMMs on the upcast operands, the
result rounded once to bf16: every product of two bf16 values is exact in float32 (8 + 8
significant bits), so each output is a float32 sum of exact products rounded once, which
is what a bf16 GEMM with float32 accumulation computes, up to the order of the sums. The
bias is added in float32 before that rounding. Backward computes the input's and the
weight's gradients the same way (float32 GEMMs of the upcast bf16 gradient and operands,
each result rounded once to bf16; the bias's gradient a float32 sum rounded once) and
saves only what the bf16 layer saves, the bf16 input and weight. Gradients reach the
parameters in their own dtype.

Memory: no float32 tensor is held between forward and backward, and the float32 copies
made inside one layer are bounded: the GEMMs run over chunks of rows of at most
:data:`CHUNK_ELEMENTS` float32 values each (the weight's gradient summed in float32 over the
chunks, then rounded), so a float32 copy of one weight and of one chunk exist at a time,
never of a whole activation or of the logits (whose loss avoids exactly that:
``collage.train.losses``). The step's measured peak does not rise (tested at
1,024 tokens).

Attention (``scaled_dot_product_attention``) in ``fp32`` mode is the float32 attention of
the upcast bf16 ``q``, ``k``, ``v``, its output rounded once to bf16. It saves the three
bf16 inputs only; backward runs the float32 forward again (deterministic: the same bits)
to take its gradient, each rounded once to bf16; both go over chunks of sequences.
torch's bf16 kernel on CPU also computes the scores and the softmax in float32, but rounds
the softmax's exponentials to bf16 before their product with ``v`` (its outputs match that
rounding in 96 % of elements, float32 attention's in 67 %; 8x4 heads of 64 tokens); ``fp32``
mode keeps them in float32. With dropout active the attention stays torch's bf16 kernel.

``auto`` picks per process with :func:`probe`: one bf16 GEMM against its ``fp32``-mode
equivalent, timed; ``fp32`` when the bf16 GEMM is more than :data:`THRESHOLD` times
slower. ``bf16`` mode is torch's own bf16 kernels, exactly what the models did before
this module existed.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..optim.strategies.strategy import dtype_name

__all__ = ["BF16", "FP32", "MODES", "THRESHOLD", "Bf16Gemm", "Linear", "attention", "choose",
           "linear", "probe", "set_mode"]

#: the forced modes, named by the dtype their GEMMs compute in (``dtype_name``)
BF16, FP32 = dtype_name(torch.bfloat16), dtype_name(torch.float32)
#: ``--bf16-gemm``: auto (probe), bf16 (torch's bf16 GEMM), fp32 (float32 GEMM, rounded).
MODES = ("auto", BF16, FP32)

#: The probe's GEMM, (M, K, N): small enough for a few milliseconds where bf16 GEMMs are
#: slow (about 14 ms a call at the EPYC's 0.3 GFLOP/s), large enough that call overheads
#: do not decide (at 64 the fast path's ratio measured 1.6 on AMX, at 128 0.7).
PROBE_SHAPE = (128, 128, 128)

#: ``fp32`` when the bf16 GEMM takes more than this many times the fp32 mode's GEMM
#: (its upcasts and rounding included). Measured ratios at PROBE_SHAPE, one thread, on
#: the Xeon (AMX, AVX512-BF16): 0.7-0.9 natively; 6-9 with torch's own bf16 loop (the path
#: of an AVX2 CPU; mkldnn off), 6-11 with oneDNN limited to AVX2, 3.7 with oneDNN limited
#: to AVX-512 without bf16 (a Skylake-class CPU, where the fp32 mode's quick-preset step
#: was 2x faster). 2 sits a factor of about 2 or more from each, so that a busy machine
#: does not flip the decision. Below it torch's kernels are kept even where the fp32 mode
#: is faster (natively here too, by about 1.7x: torch's bf16 attention backward is slow on
#: CPU), so that machines with bf16 instructions keep torch's own bf16 arithmetic.
THRESHOLD = 2.0


# --------------------------------------------------------------------------------------------
# The fp32-GEMM linear layer
# --------------------------------------------------------------------------------------------


#: float32 elements per temporary: the fp32 mode's GEMMs run over chunks of rows (of tokens;
#: attention: of sequences) so that no float32 copy of a whole activation, gradient or
#: logits tensor exists, only of one chunk (256 KiB) and of one weight at a time.
CHUNK_ELEMENTS = 1 << 16


def _chunks(count: int, row_elements: int):
    size = max(1, CHUNK_ELEMENTS // max(1, row_elements))
    for start in range(0, count, size):
        yield slice(start, min(start + size, count))


class _Fp32Linear(torch.autograd.Function):
    """``F.linear`` of bf16 operands as float32 GEMMs, each result rounded once to bf16."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(x, weight)  # bf16: what the bf16 layer keeps
        ctx.has_bias = bias is not None
        rows = x.reshape(-1, x.shape[-1])
        w32, b32 = weight.float(), None if bias is None else bias.float()
        out = rows.new_empty(rows.shape[0], weight.shape[0])
        for part in _chunks(rows.shape[0], max(weight.shape)):
            out[part] = F.linear(rows[part].float(), w32, b32)  # rounded once, to nearest
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grads = grad.reshape(-1, grad.shape[-1])  # (tokens, out)
        rows = x.reshape(-1, x.shape[-1])  # (tokens, in)
        need_x, need_w, need_b = ctx.needs_input_grad
        w32 = weight.float() if need_x else None
        grad_x = rows.new_empty(rows.shape) if need_x else None
        grad_w32 = weight.new_zeros(weight.shape, dtype=torch.float32) if need_w else None
        need_b = need_b and ctx.has_bias
        grad_b32 = weight.new_zeros(weight.shape[0], dtype=torch.float32) if need_b else None
        for part in _chunks(rows.shape[0], max(weight.shape)):
            g32 = grads[part].float()
            if need_x:
                grad_x[part] = g32 @ w32
            if need_w:  # the float32 sum runs on over the chunks: one rounding at the end
                grad_w32.addmm_(g32.t(), rows[part].float())
            if need_b:
                grad_b32 += g32.sum(0)
        return (None if grad_x is None else grad_x.reshape(x.shape),
                None if grad_w32 is None else grad_w32.to(weight.dtype),
                None if grad_b32 is None else grad_b32.to(weight.dtype))


def _upcast_pays(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.dtype == torch.bfloat16 for t in tensors)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           mode: str = BF16) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; in ``fp32`` mode with bf16 operands, as float32 GEMMs
    rounded once to bf16 (forward and backward; see the module's docstring)."""
    if mode == FP32 and _upcast_pays(x, weight, bias):
        return _Fp32Linear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose bf16 products follow ``bf16_gemm`` (:func:`set_mode`): the same
    parameters, names and state dict; ``bf16`` (the default) is ``nn.Linear`` itself."""

    bf16_gemm = BF16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, mode=self.bf16_gemm)


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


def _sequences(q: torch.Tensor, k: torch.Tensor):
    """Chunks of the batch (dim 0) whose float32 scores (``heads x T x S``) fit the budget."""
    return _chunks(q.shape[0], q[0].numel() // q.shape[-1] * max(k.shape[-2], q.shape[-1]))


class _Fp32Attention(torch.autograd.Function):
    """Attention of bf16 ``q, k, v`` computed in float32, rounded once to bf16; saves the
    bf16 inputs and recomputes the float32 forward in backward."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
        ctx.save_for_backward(q, k, v)
        ctx.causal = causal
        return _attention_forward(q, k, v, causal)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        q, k, v = ctx.saved_tensors
        grads = [torch.empty_like(t) for t in (q, k, v)]
        for part in _sequences(q, k):
            inputs = [t[part].float().requires_grad_() for t in (q, k, v)]
            with torch.enable_grad():
                out = F.scaled_dot_product_attention(*inputs, is_causal=ctx.causal)
            for into, g in zip(grads, torch.autograd.grad(out, inputs, grad[part].float())):
                into[part] = g
        return (*grads, None)


def _attention_forward(q, k, v, causal: bool) -> torch.Tensor:
    """The float32 attention of bf16 inputs, chunk by chunk, each output rounded once."""
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    for part in _sequences(q, k):
        out[part] = F.scaled_dot_product_attention(q[part].float(), k[part].float(),
                                                   v[part].float(), is_causal=causal)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
              dropout: float = 0.0, mode: str = BF16) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (default scale); in ``fp32`` mode with bf16
    inputs and no dropout, computed in float32 and rounded once to bf16."""
    if mode == FP32 and dropout == 0.0 and _upcast_pays(q, k, v):
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return _Fp32Attention.apply(q, k, v, causal)
        return _attention_forward(q, k, v, causal)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout)


def set_mode(model: nn.Module, mode: str) -> int:
    """Set ``bf16`` or ``fp32`` on every module of ``model`` that has ``bf16_gemm`` (our
    :class:`Linear` and attention modules); returns how many. A ``transformers`` model has
    none and keeps torch's kernels."""
    if mode not in MODES[1:]:
        raise ValueError(f"bf16 GEMM mode must be one of {MODES[1:]}, got {mode!r}")
    count = 0
    for module in model.modules():
        if hasattr(module, "bf16_gemm"):
            module.bf16_gemm = mode
            count += 1
    return count


# --------------------------------------------------------------------------------------------
# Choosing: the flag, or the probe
# --------------------------------------------------------------------------------------------


@functools.cache
def probe() -> dict[str, Any]:
    """Time one bf16 GEMM of :data:`PROBE_SHAPE` against the ``fp32`` mode's (upcasts,
    float32 GEMM, rounding), each warmed up once then the best of three, interleaved; once
    per process. A few milliseconds; it draws no number from torch's global generator.
    One thread: on a busy machine a multi-threaded GEMM can wait for a core (we saw a
    two-thread 128^3 float32 GEMM take 7.8 ms against its usual 0.05), and the ratio of
    two one-thread times is what decides."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _timed()
    finally:
        torch.set_num_threads(threads)


def _timed() -> dict[str, Any]:
    m, k, n = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=generator).bfloat16()
    b = torch.randn(n, k, generator=generator).bfloat16()
    candidates = {BF16: lambda: F.linear(a, b),
                  FP32: lambda: F.linear(a.float(), b.float()).bfloat16()}
    best = {}
    for name, fn in candidates.items():
        fn()  # a first call may build kernels or pack weights
        best[name] = float("inf")
    for _ in range(3):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    ratio = best[BF16] / max(best[FP32], 1e-9)
    return {"shape": list(PROBE_SHAPE), "bf16_ms": best[BF16] * 1e3,
            "fp32_ms": best[FP32] * 1e3, "ratio": ratio, "threshold": THRESHOLD}


@dataclass(frozen=True)
class Bf16Gemm:
    """How a run's bf16 matrix products are computed: ``mode`` (``bf16`` or ``fp32``; None
    for a model without bf16 weights), the ``requested`` flag, and in ``auto`` mode on CPU
    the ``probe`` that decided."""

    mode: str | None
    requested: str
    probe: dict[str, Any] | None = None

    def record(self) -> dict[str, Any]:
        """The run record's fields."""
        return {"bf16_gemm": self.mode, "bf16_gemm_requested": self.requested,
                "bf16_gemm_probe": self.probe}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Bf16Gemm:
        return cls(record["bf16_gemm"], record["bf16_gemm_requested"],
                   record.get("bf16_gemm_probe"))

    def describe(self) -> str:
        """One line: what was computed, and why (the flag, or the probe's timings)."""
        what = {BF16: "torch's bf16 GEMM",
                FP32: "float32 GEMMs on the upcast bf16 operands, rounded once to bf16"}
        line = f"{what[self.mode]} (--bf16-gemm {self.requested}"
        if self.probe is not None:
            p = self.probe
            side = "above" if p["ratio"] > p["threshold"] else "not above"
            line += (f": a {'x'.join(map(str, p['shape']))} bf16 GEMM took "
                     f"{p['bf16_ms']:.3g} ms, in float32 {p['fp32_ms']:.3g} ms, "
                     f"{p['ratio']:.3g}x, {side} the threshold {p['threshold']:g}x")
        return line + ")"


def choose(requested: str, device: torch.device | str = "cpu") -> Bf16Gemm:
    """The mode of ``--bf16-gemm requested`` on ``device``: a forced mode as given; ``auto``
    is ``bf16`` off the CPU (GPUs multiply bf16 at full speed) and the probe's decision on
    it."""
    if requested not in MODES:
        raise ValueError(f"bf16 GEMM mode must be one of {MODES}, got {requested!r}")
    if requested != "auto":
        return Bf16Gemm(requested, requested)
    if torch.device(device).type != "cpu":
        return Bf16Gemm(BF16, requested)
    measured = probe()
    return Bf16Gemm(FP32 if measured["ratio"] > THRESHOLD else BF16, requested, measured)
