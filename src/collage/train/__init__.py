"""Experiments: small language models trained under each precision strategy.

``collage compare`` trains one model under several strategies from identical initial weights
and data order and writes a report; ``collage train`` runs one strategy with atomic
checkpoints and ``--resume``; ``collage memory`` prints the bytes-per-parameter model.
``docs/compare.md`` describes the presets, the outputs and the memory model.
"""

from .config import Config, DataConfig, ModelConfig, OptimConfig, RunConfig
from .data import VOCAB_SIZE, load_corpus
from .memory import BytesPerParam, bytes_per_param, persistent_bytes
from .models import build_model
from .presets import PRESETS, get_preset

__all__ = [
    "PRESETS",
    "BytesPerParam",
    "Config",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "VOCAB_SIZE",
    "build_model",
    "bytes_per_param",
    "get_preset",
    "load_corpus",
    "persistent_bytes",
]
