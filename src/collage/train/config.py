"""Experiment configuration: nested keyword-only dataclasses.

Every field is a command-line flag (``collage.train.flags``) whose help text is the field's
``help`` metadata; a preset (``collage.train.presets``: a plain function returning a
:class:`Config`) sets the starting values and explicit flags override it. Validation
happens in ``__post_init__`` and raises :class:`collage.errors.UsageError` with one line
naming the flag and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from ..errors import UsageError
from ..optim import AUTO, STRATEGIES
from ..optim.backward import GRAD_ACCUMULATIONS
from ..optim.strategies import DEFAULT_STRATEGY, MAIN_STRATEGIES
from . import gemm
from .gemm import MODES as GEMM_MODES

__all__ = [
    "Config",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "SECTIONS",
    "flag_name",
    "strategies",
]

#: The model families of ``collage.train.models`` (which builds each from a ModelConfig).
FAMILIES = ("gpt", "llama", "bert")
#: ``--data stdlib``: the source of Python's standard library (``collage.train.data``).
STDLIB = "stdlib"
TOKENIZERS = ("bytes", "bpe")
SCHEDULES = ("constant", "cosine", "linear")
DEVICES = ("cpu", "cuda", "auto")


#: Baselines that are not collage strategies, run by name (``build.make_optimizer``).
BASELINES = ("torchao-adamw8bit",)
#: What ``collage compare`` runs without ``--strategies`` (the committed reports' set); the
#: ``opt_in`` strategies and the baselines are asked for by name.
DEFAULT_COMPARE = MAIN_STRATEGIES


def strategies() -> tuple[str, ...]:
    """Every name the harness accepts: ``collage.STRATEGIES``, ``auto`` (the autopilot,
    ``docs/autopilot.md``) and :data:`BASELINES`."""
    return (*STRATEGIES, AUTO, *BASELINES)


def _opt(default: Any, help: str, *, flag: str | None = None, commands: tuple[str, ...] = (),
         choices: tuple[str, ...] | None = None, metavar: str | None = None) -> Any:
    """A dataclass field whose metadata becomes a CLI flag (``commands``: only those)."""
    meta = {"help": help, "flag": flag, "commands": commands, "choices": choices,
            "metavar": metavar}
    if isinstance(default, (list, dict)):
        raise TypeError("mutable defaults are not allowed")
    return field(default=default, metadata=meta)


def flag_name(f: dataclasses.Field) -> str:
    """The command-line flag of a config field (``--d-model`` for ``d_model``)."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _fail(section: str, name: str, message: str) -> typing.NoReturn:
    f = {x.name: x for x in dataclasses.fields(SECTIONS[section])}[name]
    raise UsageError(f"{flag_name(f)}: {message}")


def _check_distinct(name: str, what: str, values: tuple[float, ...]) -> None:
    """Each value once, and no two that print the same: a run's label and its directory
    name give each with ``:g`` (6 significant digits), so such two would share both."""
    if len(set(values)) != len(values):
        _fail("run", name, f"{what} is listed twice")
    printed = [f"{v:g}" for v in values]
    if len(set(printed)) != len(printed):
        same = next(p for p in printed if printed.count(p) > 1)
        _fail("run", name, f"two values print as {same} (6 significant digits): their runs "
              "would share a label and a directory; give values that differ in those digits")


def _positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and not value > 0:
            _fail(section, name, f"must be positive, got {value}")


def _finite(section: str, obj: Any) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            _fail(section, f.name, f"must be a finite number, got {value}")


@dataclass(kw_only=True)
class ModelConfig:
    """The model: family and size (randomly initialised, never downloaded)."""

    family: str = _opt("gpt", "model family: gpt (GPT-2 style), llama (RMSNorm, RoPE, SwiGLU), "
                       "bert (masked LM)", choices=FAMILIES)
    d_model: int = _opt(64, "width (embedding size)")
    n_layers: int = _opt(2, "number of transformer blocks")
    n_heads: int = _opt(4, "attention heads (must divide --d-model)")
    d_ff: int | None = _opt(None, "MLP hidden size (none: 4*d_model; llama: about 8/3*d_model)")
    context: int = _opt(64, "sequence length in tokens (also the number of learned positions)")
    dropout: float = _opt(0.0, "dropout probability")
    tie_weights: bool = _opt(False, "tie the output head to the token embedding")
    init_std: float = _opt(0.02, "standard deviation of the N(0, std) weight initialisation")
    rope_theta: float = _opt(10000.0, "RoPE base (llama)")
    checkpoint_activations: bool = _opt(
        False, "recompute each block's activations during backward (torch.utils.checkpoint): "
        "the saved activations shrink to the blocks' inputs, for one more forward pass")
    recompute_mlp: bool = _opt(
        True, "keep only the inputs of the MLP's activation (GELU, SwiGLU) for backward and "
        "compute the activation again there: one (tokens x d_ff) tensor less per layer (two "
        "for llama), the same gradients bit for bit (our models; not --hf)")
    hf: bool = _opt(False, "build the transformers model (GPT2LMHeadModel, LlamaForCausalLM, "
                    "BertForMaskedLM) from a config instead of our own modules")

    def __post_init__(self) -> None:
        _finite("model", self)
        if self.family not in FAMILIES:
            _fail("model", "family", f"unknown family {self.family!r}; valid: "
                  + ", ".join(FAMILIES))
        _positive("model", self, "d_model", "n_layers", "n_heads", "d_ff", "init_std",
                  "rope_theta")
        if self.d_model % self.n_heads:
            _fail("model", "n_heads", f"{self.n_heads} heads do not divide d_model "
                  f"{self.d_model}")
        if self.family == "llama" and (self.d_model // self.n_heads) % 2:
            _fail("model", "n_heads", f"RoPE needs an even head size, got "
                  f"{self.d_model}/{self.n_heads} = {self.d_model // self.n_heads}")
        if self.context < 2:
            _fail("model", "context", f"must be at least 2 tokens, got {self.context}")
        if not 0.0 <= self.dropout < 1.0:
            _fail("model", "dropout", f"must be in [0, 1), got {self.dropout}")

    @property
    def ffn_dim(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.family == "llama":
            return -(-8 * self.d_model // 3 // 16) * 16  # 8/3 d rounded up to 16
        return 4 * self.d_model


@dataclass(kw_only=True)
class DataConfig:
    """The text: built-in corpus, a local file, or a Hugging Face dataset."""

    path: str | None = _opt(None, "local text file to train on, or 'stdlib': the source of "
                            "Python's standard library, split by file (default: the built-in "
                            "corpus, Python's pydoc topics)", flag="--data", metavar="PATH")
    dataset: str | None = _opt(None, "Hugging Face dataset name or local data file/directory "
                               "(needs the datasets package)", metavar="NAME|PATH")
    dataset_config: str | None = _opt(None, "configuration name of --dataset "
                                      "(e.g. wikitext-2-raw-v1)")
    dataset_split: str = _opt("train", "split of --dataset to read")
    text_column: str = _opt("text", "column of --dataset holding the text")
    max_bytes: int | None = _opt(None, "use at most this many bytes of text (none: all)")
    val_fraction: float = _opt(0.1, "fraction of the text held out for validation")
    batch_size: int = _opt(16, "sequences per optimizer step")
    mlm_probability: float = _opt(0.15, "fraction of tokens masked (bert)")
    tokenizer: str = _opt("bytes", "bytes (UTF-8 bytes, 257 ids) or bpe (a byte-level BPE "
                          "tokenizer trained on the training text; needs tokenizers)",
                          choices=TOKENIZERS)
    vocab_size: int = _opt(4096, "vocabulary size of --tokenizer bpe")

    def __post_init__(self) -> None:
        _finite("data", self)
        if self.path is not None and self.dataset is not None:
            _fail("data", "path", "give either --data or --dataset, not both")
        if self.tokenizer not in TOKENIZERS:
            _fail("data", "tokenizer", f"unknown tokenizer {self.tokenizer!r}; valid: "
                  + ", ".join(TOKENIZERS))
        if self.tokenizer == "bpe" and self.vocab_size < 512:  # 256 bytes and some merges
            _fail("data", "vocab_size", f"must be at least 512, got {self.vocab_size}")
        if self.path is not None and self.path != STDLIB:
            if not os.path.exists(self.path):
                _fail("data", "path", f"cannot read {self.path!r}: no such file")
            if not os.path.isfile(self.path):
                _fail("data", "path", f"cannot read {self.path!r}: not a regular file")
            if not os.access(self.path, os.R_OK):
                _fail("data", "path", f"cannot read {self.path!r}: permission denied")
        _positive("data", self, "max_bytes", "batch_size")
        if not 0.0 < self.val_fraction < 1.0:
            _fail("data", "val_fraction", f"must be in (0, 1), got {self.val_fraction}")
        if not 0.0 < self.mlm_probability < 1.0:
            _fail("data", "mlm_probability", f"must be in (0, 1), got {self.mlm_probability}")


@dataclass(kw_only=True)
class OptimConfig:
    """collage.AdamW and its learning-rate schedule."""

    strategy: str = _opt(DEFAULT_STRATEGY, "precision strategy (train)", commands=("train",))
    lr: float = _opt(2e-3, "peak learning rate")
    beta1: float = _opt(0.9, "AdamW beta1")
    beta2: float = _opt(0.999, "AdamW beta2")
    eps: float = _opt(1e-8, "AdamW epsilon")
    weight_decay: float = _opt(0.1, "decoupled weight decay of matrices and embeddings "
                               "(biases and norms get none)")
    schedule: str = _opt("cosine", "learning-rate schedule after warm-up", choices=SCHEDULES)
    warmup_steps: int = _opt(20, "linear warm-up steps")
    min_lr_ratio: float = _opt(0.1, "final learning rate as a fraction of --lr")
    grad_clip: float = _opt(1.0, "clip the global gradient norm to this (0: off)")
    foreach: bool | None = _opt(None, "use the foreach (multi-tensor) kernels (none: automatic)")
    grad_accum: int = _opt(1, "micro-batches per optimizer step: each batch is split into this "
                           "many (--batch-size divisible by it), one backward each")
    grad_accumulation: str = _opt("plain", "how the micro-batches' gradients add up: plain "
                                  "(autograd, in the weight dtype) or pair (a float32 sum "
                                  "kept by the optimizer; docs/memory.md)",
                                  choices=GRAD_ACCUMULATIONS)
    step_in_backward: bool = _opt(False, "step each parameter in backward as soon as its "
                                  "gradient is complete, and free it (needs --grad-clip 0 "
                                  "and --grad-accum 1; docs/memory.md)")
    auto_threshold: float = _opt(0.5, "strategy auto: lost-update fraction above which a "
                                 "tensor moves up a rung (docs/autopilot.md)")
    auto_every: int = _opt(50, "strategy auto: measure and decide every k-th step")

    def __post_init__(self) -> None:
        _finite("optim", self)
        self._check_backward()
        valid = strategies()
        if self.strategy not in valid:
            _fail("optim", "strategy", f"unknown strategy {self.strategy!r}; valid: "
                  + ", ".join(valid))
        _positive("optim", self, "lr", "eps")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                _fail("optim", name, f"must be in [0, 1), got {getattr(self, name)}")
        if self.schedule not in SCHEDULES:
            _fail("optim", "schedule", f"unknown schedule {self.schedule!r}; valid: "
                  + ", ".join(SCHEDULES))
        for name in ("weight_decay", "warmup_steps", "grad_clip"):
            if getattr(self, name) < 0:
                _fail("optim", name, f"must not be negative, got {getattr(self, name)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            _fail("optim", "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        # the autopilot's own bounds (collage.Autopilot), said as the flags
        if not 0.0 <= self.auto_threshold < 1.0:
            _fail("optim", "auto_threshold", f"must be a fraction in [0, 1), got "
                  f"{self.auto_threshold}")
        if not isinstance(self.auto_every, int) or self.auto_every < 1:
            _fail("optim", "auto_every", f"must be an integer >= 1, got {self.auto_every!r}")

    def _check_backward(self) -> None:
        """--grad-accum, --grad-accumulation and --step-in-backward, and what the step in
        backward cannot do: clip by the global norm (unknown until backward ends) or add up
        several backward passes (each one steps)."""
        if not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            _fail("optim", "grad_accum", f"must be an integer >= 1, got {self.grad_accum!r}")
        if self.grad_accumulation not in GRAD_ACCUMULATIONS:
            _fail("optim", "grad_accumulation", f"unknown {self.grad_accumulation!r}; valid: "
                  + ", ".join(GRAD_ACCUMULATIONS))
        if not self.step_in_backward:
            return
        if self.grad_clip > 0:
            _fail("optim", "step_in_backward", "each parameter is stepped before the global "
                  "gradient norm exists, so it cannot be clipped: add --grad-clip 0")
        if self.grad_accum > 1 or self.grad_accumulation != "plain":
            _fail("optim", "step_in_backward", "every backward steps, so nothing accumulates: "
                  "use --grad-accum 1 --grad-accumulation plain")


@dataclass(kw_only=True)
class RunConfig:
    """Length, evaluation, measurement, output."""

    steps: int = _opt(400, "optimizer steps")
    eval_every: int = _opt(50, "evaluate the validation loss every this many steps")
    eval_batches: int = _opt(8, "validation batches per evaluation (a fixed set)")
    track_every: int = _opt(10, "measure EDQ and imprecision every this many steps (0: never)")
    seed: int = _opt(0, "seed of the initial weights, the data order and the masking")
    device: str = _opt("cpu", "cpu, cuda, or auto (cuda when available)", choices=DEVICES)
    threads: int | None = _opt(None, "torch CPU threads per process (none: compare uses "
                               "cores / jobs, train torch's default)")
    bf16_gemm: str = _opt("auto", "how a bf16 model multiplies matrices: bf16 (torch's bf16 "
                          "GEMM), fp32 (float32 GEMMs on the upcast operands, each result "
                          "rounded to bf16: the same values up to the order of the sums, "
                          "many times faster on CPUs without bf16 instructions), auto (fp32 "
                          "when a timed probe finds bf16 GEMMs slow; docs/compare.md)",
                          choices=GEMM_MODES, commands=("train", "compare"))
    out: str | None = _opt(None, "output directory (none: runs/<command>-<preset>, and "
                           "-<strategy> for train)", metavar="DIR")
    quiet: bool = _opt(False, "no progress bar")
    strategies: tuple[str, ...] = _opt((), "strategies to compare (none: the eight of the "
                                       "main report; 'plus8' and 'torchao-adamw8bit' are opt-in)",
                                       commands=("compare",))
    beta2s: tuple[float, ...] = _opt((), "run every strategy once per beta2 value given here "
                                     "(overrides --beta2)", commands=("compare",))
    isolate: bool = _opt(True, "run each strategy in a fresh process (exact peak RSS per "
                         "strategy)", commands=("compare",))
    jobs: int | None = _opt(None, "strategies trained at the same time, each in its own "
                            "process (none: one per CPU core on CPU, 1 on CUDA; needs "
                            "--isolate)", commands=("compare",))
    seeds: int = _opt(1, "train every run from this many seeds: --seed, --seed + 1, ... "
                      "(initial weights and data order; the same seeds for every strategy, so "
                      "that comparisons are paired); the report gives mean ± Student t "
                      "interval and paired tests", commands=("compare",))
    lrs: tuple[float, ...] = _opt((), "run at each of these peak learning rates (overrides "
                                  "--lr); the report gives each strategy's best",
                                  commands=("compare",))
    lrs_strategies: tuple[str, ...] = _opt((), "the strategies run at every --lrs value "
                                           "(none: all); the others run at --lr alone",
                                           commands=("compare",))
    checkpoint_every: int = _opt(0, "write a checkpoint every this many steps (0: only at "
                                 "the end; compare: with --resume)", commands=("train", "compare"))
    resume: bool = _opt(False, "continue from the checkpoint in --out if there is one "
                        "(compare: each run keeps its own in --out/runs/, finished runs are "
                        "skipped, so the same command continues an interrupted comparison)",
                        commands=("train", "compare"))
    report_only: bool = _opt(False, "train nothing: write the outputs from the runs finished "
                             "in --out/runs/ (those of --resume)", commands=("compare",))
    stop_after: int | None = _opt(None, "stop (with a checkpoint) after this step, as if "
                                  "interrupted; --resume continues", commands=("train",))
    nproc: int = _opt(1, "processes to train with: data parallel under torchrun (DDP; gloo "
                      "on CPU, NCCL on CUDA, one GPU per process); --batch-size is the "
                      "global batch, split equally", commands=("train",))

    def __post_init__(self) -> None:
        self.strategies = tuple(self.strategies)
        self.beta2s = tuple(float(b) for b in self.beta2s)
        self.lrs = tuple(float(lr) for lr in self.lrs)
        self.lrs_strategies = tuple(self.lrs_strategies)
        _finite("run", self)
        _positive("run", self, "steps", "eval_every", "eval_batches", "threads", "stop_after",
                  "jobs", "nproc", "seeds")
        self._check_sweeps()
        # the optimizer's seed is a 64-bit word (collage.AdamW's seed=): every seed of
        # --seeds too
        if not 0 <= self.seed <= 2**64 - self.seeds:
            last = f" (and --seeds {self.seeds}'s last, --seed + {self.seeds - 1})" \
                if self.seeds > 1 else ""
            _fail("run", "seed", f"must be in [0, 2**64){last}: the optimizer's seed is a "
                  f"64-bit word, got {self.seed}")
        if self.jobs is not None and not self.isolate:
            _fail("run", "jobs", "needs --isolate (with --no-isolate the runs train one after "
                  "the other in this process)")
        for name in ("track_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                _fail("run", name, f"must not be negative, got {getattr(self, name)}")
        if self.device not in DEVICES:
            _fail("run", "device", f"unknown device {self.device!r}; valid: "
                  + ", ".join(DEVICES))
        if self.bf16_gemm not in GEMM_MODES:
            _fail("run", "bf16_gemm", f"unknown mode {self.bf16_gemm!r}; valid: "
                  + ", ".join(GEMM_MODES))
        valid = strategies()
        for name in self.strategies:
            if name not in valid:
                _fail("run", "strategies", f"unknown strategy {name!r}; valid: "
                      + ", ".join(valid))
        if len(set(self.strategies)) != len(self.strategies):
            _fail("run", "strategies", "a strategy is listed twice")
        for b in self.beta2s:
            if not (math.isfinite(b) and 0.0 <= b < 1.0):
                _fail("run", "beta2s", f"every beta2 must be in [0, 1), got {b}")
        _check_distinct("beta2s", "a beta2", self.beta2s)

    def _check_sweeps(self) -> None:
        """--lrs and --lrs-strategies: positive, finite, distinct, strategies compared."""
        for lr in self.lrs:
            if not (math.isfinite(lr) and lr > 0):
                _fail("run", "lrs", f"every learning rate must be positive, got {lr}")
        _check_distinct("lrs", "a learning rate", self.lrs)
        if self.lrs_strategies and not self.lrs:
            _fail("run", "lrs_strategies", "names the strategies of --lrs, which is not given")
        for name in self.lrs_strategies:  # one not compared is not run (a preset's list
            if name not in strategies():    # stays valid under --strategies)
                _fail("run", "lrs_strategies", f"unknown strategy {name!r}")

    def strategy_list(self) -> tuple[str, ...]:
        return self.strategies or DEFAULT_COMPARE

    def resolved_jobs(self, n_runs: int) -> int:
        """Processes at once: ``jobs``, else one per usable core on CPU (1 on CUDA)."""
        if not self.isolate:
            return 1
        if self.jobs is not None:
            return max(1, min(self.jobs, n_runs))
        if self.device != "cpu":
            return 1
        return max(1, min(_usable_cores(), n_runs))

    def threads_per_run(self, n_runs: int) -> int | None:
        """Torch threads of each run of a comparison of ``n_runs`` runs: from the whole
        comparison, never from the runs still to train, since a run's numbers depend on
        its thread count and a resumed comparison continues each run bit for bit (3 runs
        on 2 cores: 1 thread each, the last one alone too)."""
        if not self.isolate:
            return self.threads
        return self.resolved_threads(self.resolved_jobs(n_runs))

    def resolved_threads(self, jobs: int) -> int | None:
        """Torch threads per compare process: ``threads``, else usable cores / jobs."""
        if self.threads is not None:
            return self.threads
        if self.device != "cpu":
            return None
        return max(1, _usable_cores() // jobs)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(kw_only=True)
class Config:
    """One experiment."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    preset: str = "custom"

    def __post_init__(self) -> None:
        if self.optim.warmup_steps > self.run.steps:
            raise UsageError(f"--warmup-steps {self.optim.warmup_steps} exceeds --steps "
                             f"{self.run.steps}")
        if self.run.stop_after is not None and self.run.stop_after > self.run.steps:
            raise UsageError(f"--stop-after {self.run.stop_after} exceeds --steps "
                             f"{self.run.steps}")
        if self.data.batch_size % self.optim.grad_accum:
            raise UsageError(f"--grad-accum {self.optim.grad_accum}: --batch-size "
                             f"{self.data.batch_size} must be divisible by it (equal "
                             "micro-batches)")
        if self.optim.grad_accum > 1 and self.run.nproc > 1:
            # each rank steps its slice of the batch in one backward (runner._backward):
            # micro-batches there would need DDP's no_sync, not written
            raise UsageError(f"--grad-accum {self.optim.grad_accum} with --nproc "
                             f"{self.run.nproc}: each rank runs its slice of the batch in one "
                             "backward; use --nproc 1 for micro-batches, or more ranks "
                             "(each a smaller slice)")
        hooked = self.optim.step_in_backward or self.optim.grad_accumulation != "plain"
        if hooked and self.run.nproc > 1:
            raise UsageError("--step-in-backward and --grad-accumulation pair run before "
                             "DDP's all-reduce (docs/memory.md): use --nproc 1")
        if self.model.hf and self.run.bf16_gemm == gemm.FP32:
            raise UsageError("--bf16-gemm fp32: transformers' modules (--hf) multiply with "
                             "torch's kernels; use --bf16-gemm auto or bf16")
        if self.data.tokenizer != "bytes" and self.model.family == "bert":
            raise UsageError("--tokenizer bpe: the masked LM (bert) masks with the byte "
                             "vocabulary's [MASK] id; use --tokenizer bytes")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        return cls(
            model=ModelConfig(**d["model"]), data=DataConfig(**d["data"]),
            optim=OptimConfig(**d["optim"]), run=RunConfig(**d["run"]),
            preset=d.get("preset", "custom"),
        )

    def replace(self, **sections: dict[str, Any]) -> Config:
        """A copy with fields changed per section: ``cfg.replace(run={"steps": 5})``."""
        for name in sections:
            if name not in SECTIONS:
                raise TypeError(f"unknown config section {name!r}")
        changed = {
            name: dataclasses.replace(getattr(self, name), **values)
            for name, values in sections.items()
        }
        return dataclasses.replace(self, **changed)


SECTIONS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "run": RunConfig,
}
