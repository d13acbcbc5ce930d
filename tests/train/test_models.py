"""The three model families: shapes, gradients, dtypes, parameter names, tying, --hf."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from collage.metrics import module_family
from collage.train.config import ModelConfig
from collage.train.data import VOCAB_SIZE
from collage.train.models import build_model, is_causal, logits_of

FAMILIES = ("gpt", "llama", "bert")


def tiny(family: str, **kw) -> ModelConfig:
    return ModelConfig(family=family, d_model=32, n_layers=2, n_heads=4, context=16, **kw)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_backward_shapes(family, dtype):
    model = build_model(tiny(family), VOCAB_SIZE, seed=0).to(dtype)
    x = torch.randint(0, 256, (3, 16))
    logits = logits_of(model, x)
    assert logits.shape == (3, 16, VOCAB_SIZE) and logits.dtype == dtype
    logits.float().logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == dtype, name
        assert torch.isfinite(p.grad).all(), name
    # shorter sequences than the context work too
    assert logits_of(model, x[:, :5]).shape == (3, 5, VOCAB_SIZE)


@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_initialisation_is_reproducible(family):
    a = build_model(tiny(family), VOCAB_SIZE, seed=3).state_dict()
    b = build_model(tiny(family), VOCAB_SIZE, seed=3).state_dict()
    c = build_model(tiny(family), VOCAB_SIZE, seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    rng = torch.get_rng_state()
    build_model(tiny(family), VOCAB_SIZE, seed=5)
    assert torch.equal(rng, torch.get_rng_state()), "building must not touch the global RNG"


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_names_map_to_module_families(family):
    model = build_model(tiny(family), VOCAB_SIZE, seed=0)
    families = {name: module_family(name) for name, _ in model.named_parameters()}
    assert "other" not in families.values(), families
    assert {"embedding", "attention", "mlp", "norm", "head"} <= set(families.values())


def test_family_samples():
    gpt = dict(build_model(tiny("gpt"), VOCAB_SIZE).named_parameters())
    assert {"transformer.wte.weight", "transformer.wpe.weight",
            "transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_fc.weight",
            "transformer.h.1.ln_2.weight",
            "transformer.ln_f.bias", "lm_head.weight"} <= set(gpt)
    llama = dict(build_model(tiny("llama"), VOCAB_SIZE).named_parameters())
    assert {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.layers.1.input_layernorm.weight",
            "model.norm.weight", "lm_head.weight"} <= set(llama)
    assert not any(name.endswith(".bias") for name in llama), "LLaMA has no biases"
    bert = dict(build_model(tiny("bert"), VOCAB_SIZE).named_parameters())
    assert {"bert.embeddings.word_embeddings.weight",
            "bert.encoder.layer.0.attention.self.query.weight",
            "bert.encoder.layer.0.intermediate.dense.weight",
            "bert.encoder.layer.0.output.dense.weight",
            "cls.predictions.decoder.weight"} <= set(bert)
    assert module_family("bert.encoder.layer.0.output.dense.weight") == "mlp"
    assert module_family("bert.encoder.layer.0.attention.output.dense.weight") == "attention"


def test_causal_models_do_not_look_ahead():
    for family in ("gpt", "llama"):
        model = build_model(tiny(family), VOCAB_SIZE, seed=0).eval()
        x = torch.randint(0, 256, (1, 16))
        y = x.clone()
        y[0, 10:] = (y[0, 10:] + 1) % 256
        with torch.no_grad():
            assert torch.allclose(model(x)[0, :10], model(y)[0, :10], atol=1e-6), family
    assert is_causal("gpt") and is_causal("llama") and not is_causal("bert")
    bert = build_model(tiny("bert"), VOCAB_SIZE, seed=0).eval()
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 15] = (y[0, 15] + 1) % 256
    with torch.no_grad():
        assert not torch.allclose(bert(x)[0, 0], bert(y)[0, 0]), "BERT is bidirectional"


@pytest.mark.parametrize("family", FAMILIES)
def test_tied_weights_appear_once(family):
    model = build_model(tiny(family, tie_weights=True), VOCAB_SIZE, seed=0)
    untied = build_model(tiny(family), VOCAB_SIZE, seed=0)
    n_tied = sum(p.numel() for p in model.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == VOCAB_SIZE * 32
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == len(set(names)) == len(list(model.parameters()))


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_models_build_offline(family):
    pytest.importorskip("transformers")
    model = build_model(tiny(family, hf=True), VOCAB_SIZE, seed=0)
    assert type(model).__module__.startswith("transformers")
    logits = logits_of(model.to(torch.bfloat16), torch.randint(0, 256, (2, 16)))
    assert logits.shape == (2, 16, VOCAB_SIZE) and logits.dtype == torch.bfloat16
    families = {module_family(n) for n, _ in model.named_parameters()}
    assert {"embedding", "attention", "mlp", "norm"} <= families
    # transformers 5 renamed the property (the old name warns)
    name = ("is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing")
            else "is_gradient_checkpointing")
    assert not getattr(model, name)
    checkpointed = build_model(tiny(family, hf=True, checkpoint_activations=True), VOCAB_SIZE,
                               seed=0)
    assert getattr(checkpointed, name)


def _gradients(model, x, seed: int = 5, autocast: bool = False):
    torch.manual_seed(seed)  # dropout masks
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = logits_of(model, x)
    logits.float().logsumexp(-1).mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_checkpointing_gives_the_same_gradients_bit_for_bit(family, dtype):
    """Recomputing each block in backward (with dropout: the RNG state is restored, so the
    masks are the same) changes what is saved, not what is computed."""
    plain = build_model(tiny(family, dropout=0.1), VOCAB_SIZE, seed=0).to(dtype)
    checkpointed = build_model(tiny(family, dropout=0.1, checkpoint_activations=True),
                               VOCAB_SIZE, seed=0).to(dtype)
    x = torch.randint(0, 256, (3, 16))
    want, got = _gradients(plain, x, seed=5), _gradients(checkpointed, x, seed=5)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    # the dropout masks matter (another seed, other gradients): the RNG state was restored
    head = "cls.predictions.decoder.weight" if family == "bert" else "lm_head.weight"
    assert not torch.equal(want[head], _gradients(plain, x, seed=6)[head])


@pytest.mark.parametrize("family", FAMILIES)
def test_activation_checkpointing_saves_only_block_inputs(family):
    """Saved for backward: without checkpointing every block's activations; with it, the
    blocks' inputs (one (B, T, d) tensor each) and the layers outside the blocks."""
    def saved_bytes(cfg):
        model = build_model(cfg, VOCAB_SIZE, seed=0)
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits_of(model, torch.randint(0, 256, (4, 16)))
        return total[0]

    config = ModelConfig(family=family, d_model=64, n_layers=4, n_heads=4, context=16)
    plain = saved_bytes(config)
    checkpointed = saved_bytes(dataclasses.replace(config, checkpoint_activations=True))
    assert checkpointed < 0.5 * plain
    with torch.no_grad():  # no autograd: plain forward, same logits
        model = build_model(dataclasses.replace(config, checkpoint_activations=True),
                            VOCAB_SIZE, seed=0)
        reference = build_model(config, VOCAB_SIZE, seed=0)
        x = torch.randint(0, 256, (2, 16))
        assert torch.equal(logits_of(model, x), logits_of(reference, x))


PRECISIONS = [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype,autocast", PRECISIONS, ids=["fp32", "bf16", "autocast"])
def test_recomputed_mlp_gives_the_same_gradients_bit_for_bit(family, dtype, autocast):
    """Recomputing the MLP's activation in backward (GELU; SwiGLU's silu and product)
    changes what is saved, not what is computed: the activation is elementwise and
    deterministic, and autocast's state is the forward's."""
    config = tiny(family, dropout=0.1)
    assert config.recompute_mlp  # the default
    plain = build_model(dataclasses.replace(config, recompute_mlp=False), VOCAB_SIZE,
                        seed=0).to(dtype)
    lean = build_model(config, VOCAB_SIZE, seed=0).to(dtype)
    x = torch.randint(0, 256, (3, 16))
    want = _gradients(plain, x, autocast=autocast)
    got = _gradients(lean, x, autocast=autocast)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def _peak_bytes(cfg, dtype, autocast, tokens):
    from collage.train.memory import TensorMemoryProbe

    model = build_model(cfg, VOCAB_SIZE, seed=0).to(dtype)
    x = torch.randint(0, 256, tokens)
    probe = TensorMemoryProbe(torch.device("cpu"))
    with probe:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = logits_of(model, x)
        logits.float().logsumexp(-1).mean().backward()
    return probe.peak_bytes


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype,autocast", PRECISIONS[1:], ids=["bf16", "autocast"])
def test_recomputed_mlp_drops_exactly_the_activations(family, dtype, autocast):
    """The step's peak (at the start of backward, with every activation saved) falls by
    the tensors no longer kept, counted by the allocator: per layer one (tokens, d_ff) bf16
    tensor, the activation's output; for llama two, silu(gate) too."""
    config = ModelConfig(family=family, d_model=64, n_layers=3, n_heads=4, context=64)
    tokens = (4, 64)
    plain = _peak_bytes(dataclasses.replace(config, recompute_mlp=False), dtype, autocast,
                        tokens)
    lean = _peak_bytes(config, dtype, autocast, tokens)
    per_layer = (2 if family == "llama" else 1) * 4 * 64 * config.ffn_dim * 2  # bf16 bytes
    # Tolerance 1 KiB: a 128-byte allocation sometimes is and sometimes is not alive at the
    # peak (in both models, from run to run of the same one, with the GC off too); one
    # layer's tensor is 128 KiB or more, so no other count of tensors fits.
    assert abs((plain - lean) - config.n_layers * per_layer) <= 1024, (plain, lean)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_recomputed_mlp_stands_aside_under_other_saved_tensor_hooks(family):
    """Inside someone else's saved-tensor hooks (here save_on_cpu; also torch's checkpoint)
    ours would replace theirs for the linear layer's tensors, so the plain path runs:
    the same gradients, and every saved tensor goes through their hooks."""
    config = tiny(family)
    model = build_model(config, VOCAB_SIZE, seed=0)
    x = torch.randint(0, 256, (3, 16))
    want = _gradients(model, x)
    seen = []

    def pack(tensor):
        seen.append(tensor.shape)
        return tensor

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = logits_of(model, x)
    logits.float().logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        assert torch.equal(want[name], p.grad), name
    # the MLP's activation output (48 tokens x d_ff) was handed to the outer hook
    assert torch.Size([48, config.ffn_dim]) in seen
