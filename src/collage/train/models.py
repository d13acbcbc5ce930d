"""Compact, randomly initialised language models for the experiments (nanoGPT style).

Three families, all built from size presets and never downloaded:

* ``gpt``   GPT-2-style decoder: learned positions, pre-LayerNorm, GELU MLP, biases.
* ``llama`` LLaMA-style decoder: RMSNorm, rotary positions (RoPE), SwiGLU MLP, no biases.
* ``bert``  BERT/RoBERTa-style masked LM: bidirectional post-LayerNorm encoder + MLM head.

Parameter names follow the Hugging Face conventions of each family (``transformer.h.0.attn.
c_attn``, ``model.layers.0.self_attn.q_proj``, ``bert.encoder.layer.0.attention.self.query``
...) so that :func:`collage.metrics.module_family` sorts them into embedding / attention /
mlp / norm / head. Every model maps token ids ``(B, T)`` to logits ``(B, T, vocab)``.
Normalisations and the softmax of attention compute internally in float32 (as PyTorch's own
kernels do), so the same code runs in float32 and in bfloat16. The linear layers and the
attention of a bf16 model multiply with torch's bf16 kernels, or as float32 GEMMs rounded
to bf16 where those are slow (``collage.train.gemm.set_mode``; ``--bf16-gemm``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from ..errors import UsageError
from .config import FAMILIES, ModelConfig
from .gemm import BF16, Linear, attention

__all__ = ["FAMILIES", "GPT", "Llama", "Bert", "build_model", "logits_of", "is_causal"]


class RMSNorm(nn.Module):
    """Root-mean-square norm (LLaMA); statistics in float32, output in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def _attention(q, k, v, causal: bool, dropout: float, training: bool,
               mode: str) -> torch.Tensor:
    """Scaled dot-product attention; ``mode`` is the module's ``bf16_gemm``
    (``collage.train.gemm``: torch's bf16 kernel, or float32 rounded to bf16)."""
    return attention(q, k, v, causal=causal, dropout=dropout if training else 0.0, mode=mode)


def _heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    b, t, c = x.shape
    return x.view(b, t, n_heads, c // n_heads).transpose(1, 2)  # (B, H, T, hd)


def _merge(x: torch.Tensor) -> torch.Tensor:
    b, h, t, hd = x.shape
    return x.transpose(1, 2).reshape(b, t, h * hd)


def _run_blocks(blocks: nn.ModuleList, x: torch.Tensor, checkpointed: bool) -> torch.Tensor:
    """``x`` through every block; with ``checkpointed`` (while autograd records), each
    block keeps only its input for backward and runs its forward again there (non-reentrant
    torch.utils.checkpoint, which restores the RNG state: dropout draws the same masks, and
    the gradients are those of the plain run)."""
    recompute = checkpointed and torch.is_grad_enabled()
    for block in blocks:
        x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if recompute \
            else block(x)
    return x


def _saved_tensors_hooks_active() -> bool:
    """Whether some saved-tensor hooks (a checkpoint, ``save_on_cpu``) are installed already.
    Ours would replace them for the tensors we save (only the innermost hooks act), so the
    recomputing path stands aside; torch's own checkpoint asks the same question. If a torch
    release drops the query, we answer yes: the plain path is always correct."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


class _Recipe(NamedTuple):
    """Where a saved view of a recomputed tensor sat: rebuilt on unpack."""

    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def _recomputed_input_linear(linear: nn.Module, fn, *inputs: torch.Tensor) -> torch.Tensor:
    """``linear(fn(*inputs))``, but autograd keeps ``inputs`` instead of ``fn(*inputs)``.

    A linear layer saves its input for the weight's gradient. When that input is an
    activation (GELU, SwiGLU) whose own inputs are saved anyway, keeping it costs a (tokens,
    d_ff) tensor per layer for nothing: backward can compute it again. The saved-tensor hook
    swaps what the layer saves of that tensor (a view of its storage) for a recipe and
    recomputes it, without grad, under the autocast state of the forward. ``fn`` is
    deterministic and elementwise, so the recomputed tensor is bit for bit the one forward
    made, and the gradients are those of the plain path (tested). Where autograd is off,
    other saved-tensor hooks are active or ``torch.compile`` traces (its partitioner decides
    what to recompute), this is the plain ``linear(fn(*inputs))``."""
    hidden = fn(*inputs)
    if (not torch.is_grad_enabled() or not hidden.requires_grad or hidden.numel() == 0
            or type(hidden) is not torch.Tensor  # subclasses (DTensor) may have no storage
            or torch.compiler.is_compiling() or _saved_tensors_hooks_active()):
        return linear(hidden)
    device = hidden.device.type
    autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
    # the hooks live as long as the graph: they must not hold ``hidden`` itself
    storage, dtype, stride = hidden.untyped_storage().data_ptr(), hidden.dtype, hidden.stride()

    def pack(tensor: torch.Tensor):
        # The linear layer saves a view of ``hidden`` (folded to 2-D), not ``hidden``
        # itself: what is ours is told by its storage, and its view is rebuilt on unpack.
        if (type(tensor) is not torch.Tensor or tensor.dtype != dtype
                or tensor.untyped_storage().data_ptr() != storage):
            return tensor
        return _Recipe(tensor.size(), tensor.stride(), tensor.storage_offset())

    def unpack(packed):
        if not isinstance(packed, _Recipe):
            return packed
        with torch.no_grad(), torch.autocast(device, dtype=autocast[1], enabled=autocast[0]):
            again = fn(*inputs)
        # elementwise ops on the same inputs give the same layout; a view of another
        # layout would read the wrong elements, so that is checked, not assumed
        if again.stride() != stride:
            raise RuntimeError(f"recomputed MLP activation has strides {again.stride()}, "
                               f"forward's had {stride}; build the model with "
                               "recompute_mlp=False")
        return again.as_strided(packed.size, packed.stride, packed.offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return linear(hidden)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` saving only ``gate`` and ``up``: plain autograd also keeps
    ``silu(gate)`` for the product's backward. The backward is autograd's own, op for op
    (``grad * up`` into ``silu_backward``, ``grad * silu(gate)``), so it is bit for bit the
    same, with ``silu(gate)`` computed again."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) \
            if ctx.needs_input_grad[0] else None
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _SwiGLU.apply(gate, up)


# --------------------------------------------------------------------------------------------
# GPT-2
# --------------------------------------------------------------------------------------------


class GPTAttention(nn.Module):
    bf16_gemm = BF16  # collage.train.gemm.set_mode

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.dropout = cfg.n_heads, cfg.dropout
        self.c_attn = Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(x.shape[-1], dim=2)
        q, k, v = (_heads(t, self.n_heads) for t in (q, k, v))
        a = _attention(q, k, v, True, self.dropout, self.training, self.bf16_gemm)
        return self.c_proj(_merge(a))


class GPTMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = Linear(cfg.d_model, cfg.ffn_dim)
        self.c_proj = Linear(cfg.ffn_dim, cfg.d_model)
        self.recompute = cfg.recompute_mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute:
            return _recomputed_input_linear(self.c_proj, _gelu_tanh, self.c_fc(x))
        return self.c_proj(_gelu_tanh(self.c_fc(x)))


class GPTBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = GPTAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = GPTMLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """GPT-2: ``transformer.{wte,wpe,h.N,ln_f}`` and ``lm_head``."""

    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab_size, cfg.d_model),
                "wpe": nn.Embedding(cfg.context, cfg.d_model),
                "drop": nn.Dropout(cfg.dropout),
                "h": nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layers)),
                "ln_f": nn.LayerNorm(cfg.d_model),
            }
        )
        self.lm_head = Linear(cfg.d_model, vocab_size, bias=False)
        self.checkpoint_activations = cfg.checkpoint_activations
        if cfg.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight
        _init_weights(self, cfg.init_std, cfg.n_layers, residual_names=("c_proj",))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = t.drop(t.wte(idx) + t.wpe(pos))
        x = _run_blocks(t.h, x, self.checkpoint_activations)
        return self.lm_head(t.ln_f(x))


# --------------------------------------------------------------------------------------------
# LLaMA
# --------------------------------------------------------------------------------------------


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x`` (B, H, T, hd), rotate-half convention, angles in float32."""
    t, hd = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv_freq)
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(x.dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class LlamaAttention(nn.Module):
    bf16_gemm = BF16  # collage.train.gemm.set_mode

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads, self.dropout, self.theta = cfg.n_heads, cfg.dropout, cfg.rope_theta
        self.q_proj = Linear(d, d, bias=False)
        self.k_proj = Linear(d, d, bias=False)
        self.v_proj = Linear(d, d, bias=False)
        self.o_proj = Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = _rope(_heads(self.q_proj(x), self.n_heads), self.theta)
        k = _rope(_heads(self.k_proj(x), self.n_heads), self.theta)
        v = _heads(self.v_proj(x), self.n_heads)
        a = _attention(q, k, v, True, self.dropout, self.training, self.bf16_gemm)
        return self.o_proj(_merge(a))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = Linear(cfg.ffn_dim, cfg.d_model, bias=False)
        self.recompute = cfg.recompute_mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.recompute:
            return _recomputed_input_linear(self.down_proj, _swiglu, gate, up)
        return self.down_proj(F.silu(gate) * up)


class LlamaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """LLaMA: ``model.{embed_tokens,layers.N,norm}`` and ``lm_head``."""

    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab_size, cfg.d_model)
        self.model.layers = nn.ModuleList(LlamaLayer(cfg) for _ in range(cfg.n_layers))
        self.model.norm = RMSNorm(cfg.d_model)
        self.lm_head = Linear(cfg.d_model, vocab_size, bias=False)
        self.checkpoint_activations = cfg.checkpoint_activations
        if cfg.tie_weights:
            self.lm_head.weight = self.model.embed_tokens.weight
        _init_weights(self, cfg.init_std, cfg.n_layers, residual_names=("o_proj", "down_proj"))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = _run_blocks(self.model.layers, self.model.embed_tokens(idx),
                        self.checkpoint_activations)
        return self.lm_head(self.model.norm(x))


# --------------------------------------------------------------------------------------------
# BERT
# --------------------------------------------------------------------------------------------


class BertLayer(nn.Module):
    """Post-LN encoder layer with BERT's module names."""

    bf16_gemm = BF16  # its attention's (collage.train.gemm.set_mode)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads, self.p = cfg.n_heads, cfg.dropout
        self.attention = nn.Module()
        self.attention.self = nn.Module()
        self.attention.self.query = Linear(d, d)
        self.attention.self.key = Linear(d, d)
        self.attention.self.value = Linear(d, d)
        self.attention.output = nn.Module()
        self.attention.output.dense = Linear(d, d)
        self.attention.output.LayerNorm = nn.LayerNorm(d, eps=1e-12)
        self.intermediate = nn.Module()
        self.intermediate.dense = Linear(d, cfg.ffn_dim)
        self.output = nn.Module()
        self.output.dense = Linear(cfg.ffn_dim, d)
        self.output.LayerNorm = nn.LayerNorm(d, eps=1e-12)
        self.recompute = cfg.recompute_mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, o = self.attention.self, self.attention.output
        q, k, v = (_heads(m(x), self.n_heads) for m in (s.query, s.key, s.value))
        a = _merge(_attention(q, k, v, False, self.p, self.training, self.bf16_gemm))
        x = o.LayerNorm(x + F.dropout(o.dense(a), self.p, self.training))
        pre = self.intermediate.dense(x)
        h = _recomputed_input_linear(self.output.dense, F.gelu, pre) if self.recompute \
            else self.output.dense(F.gelu(pre))
        return self.output.LayerNorm(x + F.dropout(h, self.p, self.training))


class Bert(nn.Module):
    """BERT masked LM: ``bert.{embeddings,encoder.layer.N}`` and ``cls.predictions``."""

    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        d = cfg.d_model
        self.p, self.checkpoint_activations = cfg.dropout, cfg.checkpoint_activations
        self.bert = nn.Module()
        self.bert.embeddings = nn.Module()
        self.bert.embeddings.word_embeddings = nn.Embedding(vocab_size, d)
        self.bert.embeddings.position_embeddings = nn.Embedding(cfg.context, d)
        self.bert.embeddings.LayerNorm = nn.LayerNorm(d, eps=1e-12)
        self.bert.encoder = nn.Module()
        self.bert.encoder.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.n_layers))
        self.cls = nn.Module()
        self.cls.predictions = nn.Module()
        self.cls.predictions.transform = nn.Module()
        self.cls.predictions.transform.dense = Linear(d, d)
        self.cls.predictions.transform.LayerNorm = nn.LayerNorm(d, eps=1e-12)
        self.cls.predictions.decoder = Linear(d, vocab_size)
        if cfg.tie_weights:
            self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight
        _init_weights(self, cfg.init_std, cfg.n_layers, residual_names=())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        e = self.bert.embeddings
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = e.LayerNorm(e.word_embeddings(idx) + e.position_embeddings(pos))
        x = F.dropout(x, self.p, self.training)
        x = _run_blocks(self.bert.encoder.layer, x, self.checkpoint_activations)
        t = self.cls.predictions.transform
        return self.cls.predictions.decoder(t.LayerNorm(F.gelu(t.dense(x))))


# --------------------------------------------------------------------------------------------
# Construction
# --------------------------------------------------------------------------------------------


def _init_weights(model: nn.Module, std: float, n_layers: int, residual_names) -> None:
    """GPT-2 initialisation: N(0, std) matrices and embeddings, zero biases, unit norms;
    residual output projections scaled by 1/sqrt(2 * n_layers)."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            scale = std
            if name.rsplit(".", 1)[-1] in residual_names:
                scale = std / math.sqrt(2 * n_layers)
            nn.init.normal_(module.weight, mean=0.0, std=scale)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.LayerNorm, RMSNorm)):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


def _build_hf(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    """The same architecture from ``transformers`` (``--hf``): built from a config, offline."""
    try:
        import transformers
    except ImportError as error:
        raise UsageError("--hf needs transformers: pip install 'torch-collage[hf]'") from error
    common = dict(vocab_size=vocab_size, tie_word_embeddings=cfg.tie_weights)
    if cfg.family == "gpt":
        config = transformers.GPT2Config(
            n_positions=cfg.context, n_embd=cfg.d_model, n_layer=cfg.n_layers,
            n_head=cfg.n_heads, n_inner=cfg.ffn_dim, resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, initializer_range=cfg.init_std,
            bos_token_id=None, eos_token_id=None, **common,  # GPT-2's 50256 is not ours
        )
        model = transformers.GPT2LMHeadModel(config)
    elif cfg.family == "llama":
        config = transformers.LlamaConfig(
            hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
            num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.n_heads, max_position_embeddings=cfg.context,
            rope_theta=cfg.rope_theta, attention_dropout=cfg.dropout,
            initializer_range=cfg.init_std, **common,
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.BertConfig(
            hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads, intermediate_size=cfg.ffn_dim,
            max_position_embeddings=cfg.context, type_vocab_size=1,
            hidden_dropout_prob=cfg.dropout, attention_probs_dropout_prob=cfg.dropout,
            initializer_range=cfg.init_std, **common,
        )
        model = transformers.BertForMaskedLM(config)
    if cfg.checkpoint_activations:  # transformers 5 renamed the method (the old name warns)
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model.float()


def build_model(cfg: ModelConfig, vocab_size: int, *, seed: int | None = None) -> nn.Module:
    """A freshly initialised float32 model of ``cfg.family``; ``seed`` fixes the weights."""
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        if cfg.hf:
            return _build_hf(cfg, vocab_size)
        cls = {"gpt": GPT, "llama": Llama, "bert": Bert}[cfg.family]
        return cls(cfg, vocab_size)


def is_causal(family: str) -> bool:
    """Whether ``family`` is trained on next-token prediction (else masked LM)."""
    return family != "bert"


def logits_of(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """Logits ``(B, T, V)`` from one of our models or a ``transformers`` model."""
    out = model(idx) if not _is_hf(model) else model(input_ids=idx)
    return out if isinstance(out, torch.Tensor) else out.logits


def _is_hf(model: nn.Module) -> bool:
    return type(model).__module__.startswith("transformers")
