"""collage.integrations: param groups as transformers.Trainer builds them, and the
TrainingArguments helper."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import collage
from collage import integrations


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.group_norm = nn.GroupNorm(2, 8)
        self.q_norm = nn.Linear(8, 8, bias=False)  # a "_norm" name: excluded by pattern
        self.head = nn.Linear(8, 10, bias=False)
        self.scale = nn.Parameter(torch.ones(8))  # a plain 1-D parameter: decayed (as HF)


def names(group) -> list[str]:
    return list(group["param_names"])


def test_module_import_does_not_import_frameworks():
    code = ("import sys, collage.integrations; "
            "print([m for m in ('transformers', 'accelerate', 'lightning') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_decay_names_exclude_norm_layers_biases_and_norm_names():
    got = integrations.decay_parameter_names(Toy())
    assert got == ["scale", "embed.weight", "proj.weight", "head.weight"]  # module order


def test_param_groups_split_and_settings():
    model = Toy()
    groups = integrations.param_groups(model, 0.1, no_decay_strategy="mixed")
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert "strategy" not in groups[0] and groups[1]["strategy"] == "mixed"
    decay = [n for n, _ in groups[0]["params"]]
    other = [n for n, _ in groups[1]["params"]]
    assert decay == ["scale", "embed.weight", "proj.weight", "head.weight"]
    assert other == ["proj.bias", "norm.weight", "norm.bias", "group_norm.weight",
                     "group_norm.bias", "q_norm.weight"]


def test_groups_feed_a_collage_optimizer_with_names_and_strategies():
    model = Toy().to(torch.bfloat16)
    opt = collage.AdamW(integrations.param_groups(model, 0.1, no_decay_strategy="mixed"),
                        lr=1e-2, strategy="plus", track_updates=True)
    assert [g["strategy"] for g in opt.param_groups] == ["plus", "mixed"]
    assert opt.param_groups[0]["param_names"][:2] == ["scale", "embed.weight"]
    x = torch.randint(0, 10, (4,))
    loss = model.head(model.q_norm(model.norm(model.proj(model.embed(x))))).float().sum()
    loss = loss + model.group_norm(model.embed(x).unsqueeze(-1)).float().sum()
    loss = loss + model.scale.float().sum()
    loss.backward()
    opt.step()
    state = opt.state[model.norm.weight]
    assert state["master"].dtype == torch.float32  # the mixed group
    assert "weight_lo" in opt.state[model.proj.weight]  # the plus group
    assert "edq/proj.weight" in opt.update_stats  # metrics keyed by parameter name


def test_custom_patterns_unnamed_frozen_and_tied():
    model = Toy()
    model.head.weight = model.embed.weight  # tied: appears once, under its first name
    model.proj.weight.requires_grad_(False)
    groups = integrations.param_groups(model, 0.5, no_decay=("bias", "LayerNorm.weight"),
                                       norm_types=(), named=False)
    params = [p for g in groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params})
    assert all(isinstance(p, torch.Tensor) for p in params)
    assert not any(p is model.proj.weight for p in params)  # frozen
    decay_ids = {id(p) for p in groups[0]["params"]}
    # norm_types=() and patterns that do not match "norm.weight": the LayerNorm scale decays
    assert id(model.norm.weight) in decay_ids and id(model.group_norm.weight) in decay_ids
    assert id(model.norm.bias) not in decay_ids
    assert sum(p is model.embed.weight for p in params) == 1


def test_a_string_pattern_and_errors():
    model = Toy()
    assert "scale" not in integrations.decay_parameter_names(model, no_decay="scale|bias")
    with pytest.raises(ValueError, match="strategy 'nope' is unknown"):
        integrations.param_groups(model, no_decay_strategy="nope")
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        integrations.param_groups(model)
    with pytest.raises(TypeError, match="patterns must be strings"):
        integrations.decay_parameter_names(model, no_decay=[3])


# ----------------------------------------------------------------------- transformers


@pytest.fixture
def hf():
    return pytest.importorskip("transformers")


def _hf_models():
    from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel,
                              LlamaConfig, LlamaForCausalLM)

    torch.manual_seed(0)
    yield "gpt2", GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16,
                                             n_layer=2, n_head=2))
    yield "llama", LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16))
    yield "bert", BertForMaskedLM(BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16))


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_same_names_as_trainer(hf, name):
    from transformers import Trainer

    model = dict(_hf_models())[name]
    want = Trainer.get_decay_parameter_names(None, model)  # does not use self
    trainable = {n for n, _ in model.named_parameters()}
    got = integrations.decay_parameter_names(model)
    assert set(got) == set(want) & trainable
    assert got  # matrices decay
    assert len(got) < len(trainable)  # norms and biases do not


def test_adamw_for_trainer_reads_the_arguments(hf, tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=3e-4, adam_beta1=0.8,
                             adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.05,
                             use_cpu=True, report_to=[])
    model = Toy().to(torch.bfloat16)
    opt = integrations.adamw_for_trainer(model, args, strategy="split", seed=3)
    assert isinstance(opt, collage.AdamW) and opt.seed == 3
    first, second = opt.param_groups
    assert (first["lr"], first["betas"], first["eps"]) == (3e-4, (0.8, 0.95), 1e-6)
    assert (first["weight_decay"], second["weight_decay"]) == (0.05, 0.0)
    assert first["strategy"] == second["strategy"] == "split"


def test_adamw_for_trainer_refuses_fp16_and_warns_on_bf16(hf, tmp_path):
    from transformers import TrainingArguments

    model = Toy().to(torch.bfloat16)
    fp16 = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    fp16.fp16 = True  # TrainingArguments refuses fp16 on CPU at construction
    with pytest.raises(ValueError, match="fp16=True"):
        integrations.adamw_for_trainer(model, fp16)
    bf16 = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    bf16.bf16 = True
    with pytest.warns(UserWarning, match="bf16=True"):
        integrations.adamw_for_trainer(model, bf16)
