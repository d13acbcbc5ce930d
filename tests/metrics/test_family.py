"""module_family on parameter names of common architectures."""

from __future__ import annotations

import pytest

from collage.metrics import FAMILIES, module_family

NAMES = {
    # GPT-2 (Hugging Face) / nanoGPT
    "transformer.wte.weight": "embedding",
    "transformer.wpe.weight": "embedding",
    "transformer.h.0.ln_1.weight": "norm",
    "transformer.h.0.attn.c_attn.weight": "attention",
    "transformer.h.0.attn.c_proj.bias": "attention",
    "transformer.h.0.ln_2.bias": "norm",
    "transformer.h.0.mlp.c_fc.weight": "mlp",
    "transformer.h.11.mlp.c_proj.weight": "mlp",
    "transformer.ln_f.weight": "norm",
    "lm_head.weight": "head",
    # LLaMA (Hugging Face)
    "model.embed_tokens.weight": "embedding",
    "model.layers.0.self_attn.q_proj.weight": "attention",
    "model.layers.0.self_attn.k_proj.weight": "attention",
    "model.layers.0.self_attn.v_proj.weight": "attention",
    "model.layers.0.self_attn.o_proj.weight": "attention",
    "model.layers.0.mlp.gate_proj.weight": "mlp",
    "model.layers.0.mlp.up_proj.weight": "mlp",
    "model.layers.0.mlp.down_proj.weight": "mlp",
    "model.layers.0.input_layernorm.weight": "norm",
    "model.layers.0.post_attention_layernorm.weight": "norm",
    "model.norm.weight": "norm",
    # LLaMA (Meta checkpoint names)
    "tok_embeddings.weight": "embedding",
    "layers.0.attention.wq.weight": "attention",
    "layers.0.feed_forward.w1.weight": "mlp",
    "layers.0.attention_norm.weight": "norm",
    "layers.0.ffn_norm.weight": "norm",
    "output.weight": "head",
    # BERT
    "bert.embeddings.word_embeddings.weight": "embedding",
    "bert.embeddings.position_embeddings.weight": "embedding",
    "bert.embeddings.token_type_embeddings.weight": "embedding",
    "bert.embeddings.LayerNorm.weight": "norm",
    "bert.encoder.layer.0.attention.self.query.weight": "attention",
    "bert.encoder.layer.0.attention.self.key.bias": "attention",
    "bert.encoder.layer.0.attention.output.dense.weight": "attention",
    "bert.encoder.layer.0.attention.output.LayerNorm.bias": "norm",
    "bert.encoder.layer.0.intermediate.dense.weight": "mlp",
    "bert.encoder.layer.0.output.dense.weight": "mlp",
    "bert.encoder.layer.0.output.LayerNorm.weight": "norm",
    "bert.pooler.dense.weight": "head",
    "cls.predictions.transform.dense.weight": "head",
    "cls.predictions.transform.LayerNorm.weight": "norm",
    "classifier.weight": "head",
    # minGPT / nanoGPT-style
    "tok_emb.weight": "embedding",
    "pos_emb": "embedding",
    "blocks.0.ln1.weight": "norm",
    "blocks.0.attn.key.weight": "attention",
    "blocks.0.attn.proj.weight": "attention",
    "blocks.0.mlp.0.weight": "mlp",
    "ln_f.bias": "norm",
    "head.weight": "head",
    # other
    "conv1.weight": "other",
    "fc.bias": "other",
    "weight": "other",
}


@pytest.mark.parametrize(("name", "family"), sorted(NAMES.items()))
def test_module_family(name: str, family: str) -> None:
    assert module_family(name) == family


def test_every_family_is_covered_and_known() -> None:
    assert set(NAMES.values()) == set(FAMILIES)
