"""Configuration: presets, validation with one-line errors, every field a CLI flag."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

import collage
from collage.errors import UsageError
from collage.train.config import Config, DataConfig, ModelConfig, OptimConfig, RunConfig
from collage.train.presets import PRESETS, get_preset
from collage.train.flags import add_config_flags, config_from_args


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_valid_configs(name):
    config = get_preset(name)
    assert isinstance(config, Config) and config.preset == name
    assert Config.from_dict(config.to_dict()) == config


def test_quick_is_the_default_and_paper_small_has_both_betas():
    assert dataclasses.replace(get_preset("quick"), preset="custom") == Config()
    assert get_preset("quick").optim.beta2 == 0.999
    paper = get_preset("paper-small")
    assert paper.run.beta2s == (0.95, 0.999) and paper.optim.weight_decay == 0.1
    assert paper.optim.schedule == "cosine" and paper.optim.min_lr_ratio == 0.1
    assert paper.optim.warmup_steps > 0
    bert = get_preset("bert-small")
    assert bert.model.family == "bert" and bert.optim.beta2 == 0.999


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: OptimConfig(strategy="fp16"), "--strategy: unknown strategy 'fp16'; valid: "
         + ", ".join(collage.STRATEGIES)),
        (lambda: RunConfig(strategies=("plus", "nope")), "--strategies: unknown strategy 'nope'"),
        (lambda: RunConfig(strategies=("plus", "plus")), "listed twice"),
        (lambda: RunConfig(beta2s=(0.95, 0.95)), "--beta2s: a beta2 is listed twice"),
        (lambda: RunConfig(lrs=(0.002, 0.002)), "--lrs: a learning rate is listed twice"),
        # two values one label: their runs shared a directory (audit, 2026-12-07)
        (lambda: RunConfig(lrs=(0.002, 0.0020000001)), "--lrs: two values print as 0.002"),
        (lambda: RunConfig(beta2s=(0.999, 0.9990000001)), "--beta2s: two values print as"),
        (lambda: ModelConfig(d_model=30, n_heads=4), "--n-heads: 4 heads do not divide d_model 30"),
        (lambda: ModelConfig(family="llama", d_model=36, n_heads=4), "even head size"),
        (lambda: ModelConfig(n_layers=0), "--n-layers: must be positive"),
        (lambda: ModelConfig(family="t5"), "--family: unknown family 't5'"),
        (lambda: ModelConfig(context=1), "--context: must be at least 2"),
        (lambda: DataConfig(path="/no/such/file.txt"), "--data: cannot read '/no/such/file.txt'"),
        (lambda: DataConfig(path="/"), "not a regular file"),
        (lambda: DataConfig(val_fraction=1.5), "--val-fraction: must be in (0, 1)"),
        (lambda: DataConfig(batch_size=-1), "--batch-size: must be positive"),
        (lambda: OptimConfig(beta2=1.0), "--beta2: must be in [0, 1)"),
        (lambda: OptimConfig(lr=float("nan")), "--lr: must be a finite number"),
        (lambda: OptimConfig(schedule="step"), "--schedule: unknown schedule"),
        (lambda: RunConfig(steps=0), "--steps: must be positive"),
        (lambda: RunConfig(device="tpu"), "--device: unknown device"),
        (lambda: Config(optim=OptimConfig(warmup_steps=50), run=RunConfig(steps=10)),
         "--warmup-steps 50 exceeds --steps 10"),
    ],
)
def test_validation_raises_one_clear_line(make, message):
    with pytest.raises(UsageError) as info:
        make()
    text = str(info.value)
    assert message in text and "\n" not in text


def _parse(*argv: str, command: str = "compare") -> Config:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, command)
    return config_from_args(parser.parse_args(list(argv)), command)


def test_every_field_is_a_flag_with_help():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, "compare")
    add_config_flags(train := argparse.ArgumentParser(), "train")
    flags = {o for a in parser._actions + train._actions for o in a.option_strings}
    for cls in (ModelConfig, DataConfig, OptimConfig, RunConfig):
        for f in dataclasses.fields(cls):
            flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            assert flag in flags, flag
            assert f.metadata["help"], f.name


def test_flags_override_the_preset():
    config = _parse("--preset", "paper-small", "--lr", "3e-4", "--steps", "7", "--no-isolate",
                    "--warmup-steps", "2",
                    "--strategies", "bf16,plus", "mixed", "--d-ff", "none", "--beta2s", "0.99")
    assert config.preset == "paper-small" and config.model.d_model == 128
    assert config.optim.lr == 3e-4 and config.run.steps == 7 and config.run.isolate is False
    assert config.run.strategies == ("bf16", "plus", "mixed") and config.run.beta2s == (0.99,)
    assert config.model.d_ff is None
    assert _parse().preset == "quick"
    assert _parse("--steps", "1e3", "--warmup-steps", "0").run.steps == 1000


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--lr", "fast"), "--lr: expected a number, got 'fast'"),
        (("--steps", "2.5"), "--steps: expected an integer, got '2.5'"),
        (("--foreach", "maybe"), "--foreach: expected true or false"),
        (("--preset", "huge"), "--preset: unknown preset 'huge'"),
        (("--strategies", "fp8"), "--strategies: unknown strategy 'fp8'"),
    ],
)
def test_malformed_flags(argv, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _parse(*argv)


def test_train_only_and_compare_only_flags():
    with pytest.raises(SystemExit):
        _parse("--strategy", "plus", command="compare")  # train's flag
    assert _parse("--strategy", "bf16", "--resume", command="train").optim.strategy == "bf16"
