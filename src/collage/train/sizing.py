"""How long a comparison will take, before it runs: ``collage compare --dry-run``.

The model's parameters are counted on the meta device (no memory, no initialisation); the
time comes from the training FLOPs per token and a *stated* throughput, not a measured one:

    FLOPs per token  = 6 N + 12 L d T    N parameters, L layers, width d, context T
                                         (6 N: forward and backward through every weight,
                                         Kaplan et al. 2020; 12 L d T: attention's scores and
                                         weighted values, PaLM's appendix B)
    train seconds    = steps x tokens per step x FLOPs per token / (peak x MFU)
    eval seconds     = evaluations x tokens per evaluation x FLOPs per token / 3 / (peak x MFU)
                       (forward only: a third of a training token)
    seconds per run  = train + eval + per-run overhead (process start, CUDA, compilation)
    total            = setup (install, corpus, BPE tokenizer) + runs x seconds per run

``6 N`` counts the embedding table as a matrix product, which it is not (a lookup): the
estimate errs long. A preset that must fit a time limit (``gpu-study``: 6 minutes on one
GPU, ``benchmarks/gpu_study.sh``) has a :class:`Budget` in :data:`BUDGETS`; the others get
the plan without a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import Config, DataConfig, ModelConfig
from .data import dataset_name, vocab_size
from .models import build_model
from .runs import Run, plan_runs

__all__ = ["Budget", "BUDGETS", "GPU_STUDY_BUDGET", "Plan", "count_params",
           "flops_per_token", "format_plan", "plan_of"]


@dataclass(frozen=True, kw_only=True)
class Budget:
    """A stated throughput and the time a preset must fit in (seconds)."""

    hardware: str
    peak_flops: float  # dense bf16 FLOP/s of the hardware
    mfu: float  # the fraction of peak_flops that training is assumed to sustain
    setup_s: float  # once: install, corpus read, BPE training and encoding
    per_run_s: float  # every run: process start, CUDA context, kernel compilation
    limit_s: float
    assumptions: str

    @property
    def sustained_flops(self) -> float:
        return self.peak_flops * self.mfu


#: ``gpu-study``'s sizing. Nothing here was measured on a GPU with this harness: every figure
#: is an assumption that the first run's report (tokens/s per strategy) replaces.
GPU_STUDY_BUDGET = Budget(
    hardware="one NVIDIA H100/H200 (dense bf16 peak 989 TFLOP/s, the datasheet's)",
    peak_flops=989e12,
    mfu=0.20,
    setup_s=45.0,
    per_run_s=25.0,
    limit_s=360.0,
    assumptions=(
        "MFU 20 %: an eager (not torch.compile'd) bf16 GPT of this size, with the harness's "
        "float32 loss, recomputed MLP activation and EDQ measured every 50 steps; an "
        "8192^3 bf16 matrix product reached about 790 TFLOP/s (80 %) on the lent H200, a "
        "whole eager training step reaches far less. Setup 45 s: install (no dependencies), "
        "reading the standard library and training and encoding the BPE tokenizer (8 s + "
        "20 s on 2 CPU cores here, on the GPU machine's 16 once; cached for every run). "
        "Per run 25 s: a fresh process (import torch, CUDA context), the Triton kernels' "
        "first compilation (1.5 s measured on the H200) and torch.compile's kernels for the "
        "measured (EDQ) steps, which on a GPU nobody has timed yet."),
)

#: The presets whose plan has a time limit.
BUDGETS: dict[str, Budget] = {"gpu-study": GPU_STUDY_BUDGET}


def count_params(model: ModelConfig, vocab: int) -> int:
    """The parameters of the model ``model`` describes, built on the meta device (no
    memory is allocated, no weight initialised; a tied head is counted once)."""
    with torch.device("meta"):
        built = build_model(model, vocab)
    return sum(p.numel() for p in built.parameters())


def flops_per_token(model: ModelConfig, params: int) -> float:
    """Training FLOPs (forward and backward) per token: ``6 N + 12 L d T``."""
    return 6.0 * params + 12.0 * model.n_layers * model.d_model * model.context


@dataclass(frozen=True)
class Plan:
    """What a comparison will train, and, with a budget, how long it is estimated to take."""

    config: Config
    runs: list[Run]
    params: int
    flops_per_token: float
    budget: Budget | None

    @property
    def tokens_per_step(self) -> int:
        return self.config.data.batch_size * self.config.model.context

    @property
    def tokens_per_run(self) -> int:
        return self.config.run.steps * self.tokens_per_step

    @property
    def evaluations(self) -> int:
        """Validation passes per run: one before the first step, every ``eval_every``
        steps, and after the last."""
        run = self.config.run
        return 1 + math.ceil(run.steps / run.eval_every)

    @property
    def eval_tokens_per_run(self) -> int:
        return self.evaluations * self.config.run.eval_batches * self.tokens_per_step

    def train_s(self) -> float:
        return self.tokens_per_run * self.flops_per_token / self._flops()

    def eval_s(self) -> float:
        return self.eval_tokens_per_run * self.flops_per_token / 3.0 / self._flops()

    def per_run_s(self) -> float:
        return self.train_s() + self.eval_s() + self._budget().per_run_s

    def total_s(self) -> float:
        return self._budget().setup_s + len(self.runs) * self.per_run_s()

    def fits(self) -> bool:
        return self.total_s() <= self._budget().limit_s

    def _budget(self) -> Budget:
        if self.budget is None:
            raise ValueError(f"preset {self.config.preset!r} has no time budget "
                             "(collage.train.sizing.BUDGETS)")
        return self.budget

    def _flops(self) -> float:
        return self._budget().sustained_flops


def plan_of(config: Config) -> Plan:
    """The plan of ``config``; timed when its preset has a budget in :data:`BUDGETS`."""
    params = count_params(config.model, vocab_size(config.data))
    return Plan(config, plan_runs(config), params, flops_per_token(config.model, params),
                BUDGETS.get(config.preset))


def _source(data: DataConfig) -> str:
    """Where the text comes from, as the flags name it."""
    return dataset_name(data) if data.dataset is not None else data.path or "built-in"


def format_plan(plan: Plan) -> str:
    """The plan as lines of text: what runs, and the time estimate with its arithmetic."""
    c = plan.config
    lines = [
        f"plan: preset {c.preset}, {len(plan.runs)} runs on {c.run.device}: "
        + ", ".join(r.label for r in plan.runs),
        f"model: {c.model.family}, {plan.params:,} parameters ({plan.params / 1e6:.1f}M; "
        f"d_model {c.model.d_model}, {c.model.n_layers} layers, {c.model.n_heads} heads, "
        f"context {c.model.context}, vocabulary {vocab_size(c.data):,})",
        f"data: {_source(c.data)}, tokenizer {c.data.tokenizer}; "
        f"{c.run.steps} steps x {c.data.batch_size} x {c.model.context} = "
        f"{plan.tokens_per_run:,} tokens per run; {plan.evaluations} evaluations of "
        f"{c.run.eval_batches} batches",
        f"FLOPs per token: 6 N + 12 L d T = {plan.flops_per_token:.4g}",
    ]
    if plan.budget is None:
        lines.append("time: no estimate (this preset has no budget in "
                     "collage.train.sizing.BUDGETS)")
        return "\n".join(lines)
    b = plan.budget
    verdict = "fits" if plan.fits() else "DOES NOT FIT"
    lines += [
        f"assumed: {b.hardware}, MFU {b.mfu:.0%} -> {b.sustained_flops / 1e12:.0f} TFLOP/s "
        f"= {b.sustained_flops / plan.flops_per_token:,.0f} tokens/s",
        f"per run: train {plan.train_s():.1f} s + eval {plan.eval_s():.1f} s + overhead "
        f"{b.per_run_s:.0f} s = {plan.per_run_s():.1f} s",
        f"total: setup {b.setup_s:.0f} s + {len(plan.runs)} x {plan.per_run_s():.1f} s = "
        f"{plan.total_s():.0f} s; limit {b.limit_s:.0f} s: {verdict}",
        f"assumptions: {b.assumptions}",
    ]
    return "\n".join(lines)
