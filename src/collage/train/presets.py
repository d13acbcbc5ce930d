"""The presets: plain functions returning a :class:`~collage.train.config.Config`, the
starting values of a command that explicit flags override (``collage.train.flags``)."""

from __future__ import annotations

from ..errors import UsageError
from ..optim.strategies import NAMES
from .config import (STDLIB, Config, DataConfig, ModelConfig, OptimConfig, RunConfig,
                     strategies)

__all__ = ["PRESETS", "get_preset", "STUDY_STRATEGIES", "GPU_STUDY_STRATEGIES"]


def quick() -> Config:
    """Tiny GPT, byte level, 400 steps at beta2 = 0.999: small enough to train every
    strategy on a laptop's CPU (its wall time: ``docs/reports/quick/report.md``); the
    dataclass defaults are exactly this preset."""
    return Config(preset="quick")


def micro() -> Config:
    """A few steps of a very small GPT: for tests and smoke runs."""
    return Config(
        model=ModelConfig(d_model=32, n_layers=1, n_heads=2, context=32),
        data=DataConfig(batch_size=4, max_bytes=100_000),
        optim=OptimConfig(warmup_steps=2),
        run=RunConfig(steps=6, eval_every=3, eval_batches=2, track_every=2),
        preset="micro",
    )


def paper_small() -> Config:
    """GPT-2 style with the paper's GPT recipe scaled down: AdamW betas (0.9, 0.95) and
    (0.9, 0.999), weight decay 0.1, warm-up then cosine decay to lr/10, clip 1.0."""
    return Config(
        model=ModelConfig(family="gpt", d_model=128, n_layers=4, n_heads=4, context=128),
        data=DataConfig(batch_size=16),
        optim=OptimConfig(lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1,
                          schedule="cosine", warmup_steps=80, min_lr_ratio=0.1, grad_clip=1.0),
        run=RunConfig(steps=800, eval_every=100, eval_batches=16, track_every=20,
                      beta2s=(0.95, 0.999)),
        preset="paper-small",
    )


def bert_small() -> Config:
    """BERT-style masked LM at beta2 = 0.999 (the setting where pure bf16 suffers)."""
    return Config(
        model=ModelConfig(family="bert", d_model=128, n_layers=4, n_heads=4, context=128),
        data=DataConfig(batch_size=16, mlm_probability=0.15),
        optim=OptimConfig(lr=1e-3, beta2=0.999, weight_decay=0.01, warmup_steps=60,
                          min_lr_ratio=0.1),
        run=RunConfig(steps=600, eval_every=100, eval_batches=16, track_every=20),
        preset="bert-small",
    )


#: The strategies of the study (docs/study.md), in its order; those this build of collage
#: does not register (``collage.STRATEGIES``) are left out of the preset.
STUDY_STRATEGIES = (NAMES.fp32, NAMES.mixed, NAMES.bf16, NAMES.stochastic, NAMES.kahan,
                    NAMES.light, NAMES.plus, NAMES.split, NAMES.feedback, NAMES.plus8)


def study() -> Config:
    """The study of docs/study.md: a LLaMA-style model on the standard library's source
    (BPE), every study strategy at beta2 0.95 and 0.999 from 3 seeds, ``stochastic`` also at
    half and twice the learning rate; resumable (``--resume`` on, a checkpoint every 100
    steps). Sized for about 3.5 hours on 2 CPU cores (the arithmetic: docs/study.md)."""
    return Config(
        model=ModelConfig(family="llama", d_model=192, n_layers=4, n_heads=4, context=256),
        data=DataConfig(path=STDLIB, tokenizer="bpe", vocab_size=4096, batch_size=8),
        optim=OptimConfig(lr=2e-3, beta2=0.95, weight_decay=0.1, warmup_steps=60,
                          min_lr_ratio=0.1, grad_clip=1.0),
        run=RunConfig(steps=600, eval_every=150, eval_batches=16, track_every=50, seeds=3,
                      beta2s=(0.95, 0.999), lrs=(1e-3, 2e-3, 4e-3),
                      lrs_strategies=(NAMES.stochastic,), resume=True, checkpoint_every=100,
                      strategies=tuple(s for s in STUDY_STRATEGIES if s in strategies())),
        preset="study",
    )


#: What ``gpu-study`` compares: pure bf16 against fp32 master weights and Collage's two.
GPU_STUDY_STRATEGIES = (NAMES.bf16, NAMES.mixed, NAMES.light, NAMES.plus)


def gpu_study() -> Config:
    """The paper's setting at the paper's scale, on one GPU in under 6 minutes
    (``benchmarks/gpu_study.sh``): a 112M-parameter GPT-2-style model (GPT-2 small's width
    and heads, 14 layers) on the standard library's source (BPE, 8,192 tokens), beta2 = 0.999,
    ``bf16``, ``mixed``, ``light`` and ``plus`` from one seed, one after another on the GPU.
    Its size and length come from ``collage.train.sizing.GPU_STUDY_BUDGET``'s arithmetic;
    ``collage compare --preset gpu-study --dry-run`` prints it."""
    return Config(
        model=ModelConfig(family="gpt", d_model=768, n_layers=14, n_heads=12, context=512),
        data=DataConfig(path=STDLIB, tokenizer="bpe", vocab_size=8192, batch_size=16),
        optim=OptimConfig(lr=6e-4, beta2=0.999, weight_decay=0.1, warmup_steps=100,
                          min_lr_ratio=0.1, grad_clip=1.0),
        run=RunConfig(steps=1000, eval_every=250, eval_batches=8, track_every=50,
                      device="cuda", strategies=GPU_STUDY_STRATEGIES, resume=True),
        preset="gpu-study",
    )


PRESETS = {"quick": quick, "paper-small": paper_small, "bert-small": bert_small,
           "micro": micro, "study": study, "gpu-study": gpu_study}


def get_preset(name: str) -> Config:
    if name not in PRESETS:
        raise UsageError(f"--preset: unknown preset {name!r}; valid: " + ", ".join(PRESETS))
    return PRESETS[name]()
