"""Text, tokens, a fixed train/validation split and deterministic batches.

The default corpus is the English text bundled with every Python installation
(``pydoc_data.topics``: the language reference behind ``help()``, about 0.46 MB), so nothing is
downloaded; ``--data stdlib`` is the larger one that also ships with every Python: the source
of its standard library (about 31 MB of ``.py`` files), split by file. Text is tokenised as
UTF-8 bytes (ids 0..255) plus one special ``[MASK]`` id (256) for masked-LM training, so every
corpus and model share one 257-token vocabulary; or, with ``--tokenizer bpe``, by a byte-level
BPE tokenizer trained on the training side (``collage.train.bpe``).

Determinism: the split is a pure function of the text and ``val_fraction``; the batch of step
``s`` is a pure function of ``(seed, s)``. Every strategy therefore sees the same data in the
same order, and a resumed run continues exactly where it stopped (the data position *is* the
step).
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass

import torch

from ..errors import UsageError
from .bpe import bpe_encode
from .config import STDLIB, DataConfig

__all__ = [
    "MASK_ID",
    "VOCAB_SIZE",
    "SPLIT_CHUNK",
    "Corpus",
    "Batches",
    "builtin_text",
    "stdlib_files",
    "vocab_size",
    "dataset_name",
    "encode",
    "decode",
    "load_corpus",
    "split_tokens",
]

MASK_ID = 256
VOCAB_SIZE = 257
SPLIT_CHUNK = 2048  # bytes per split unit: chunk i is validation iff it falls on the fraction


def builtin_text() -> str:
    """Python's bundled pydoc topics (English prose and code), in sorted topic order."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[key] for key in sorted(topics))


def stdlib_files() -> tuple[str, list[str]]:
    """``(root, paths)``: every ``.py`` file of this Python's standard library
    (``sysconfig.get_paths()["stdlib"]``), as sorted paths relative to the root; installed
    third-party packages (``site-packages``, ``dist-packages``) and caches are left out."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "__pycache__"}
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in skip]
        rel = os.path.relpath(directory, root)
        found += [os.path.normpath(os.path.join(rel, n)) for n in names if n.endswith(".py")]
    return root, sorted(found)


def vocab_size(cfg: DataConfig) -> int:
    """The model's vocabulary for ``cfg``: 257 for bytes, ``--vocab-size`` for BPE (the
    tokenizer may learn fewer tokens from a short text; the rows it leaves unused are never
    a target)."""
    return VOCAB_SIZE if cfg.tokenizer == "bytes" else cfg.vocab_size


def encode(text: str | bytes) -> torch.Tensor:
    """UTF-8 bytes as a uint8 tensor of token ids."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    if not data:  # (torch.frombuffer refuses an empty buffer)
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def decode(tokens: torch.Tensor) -> str:
    """Token ids back to text; ``[MASK]`` shows as ``_``, broken UTF-8 as U+FFFD."""
    ids = [b if b < 256 else ord("_") for b in tokens.tolist()]
    return bytes(ids).decode("utf-8", errors="replace")


def split_tokens(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, val)``: chunks of :data:`SPLIT_CHUNK` tokens, every ``1/val_fraction``-th one
    (evenly spread through the text, so both sides cover every topic) goes to validation."""
    chunks = list(torch.split(tokens, SPLIT_CHUNK))
    is_val = [_held_out(i, val_fraction) for i in range(len(chunks))]
    train = [c for c, v in zip(chunks, is_val) if not v]
    val = [c for c, v in zip(chunks, is_val) if v]
    empty = tokens[:0]
    return (torch.cat(train) if train else empty), (torch.cat(val) if val else empty)


def _generator(*key: object) -> torch.Generator:
    """A CPU generator seeded by a hash of ``key`` (stable across processes and runs)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def _mask(x: torch.Tensor, p: float, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking: pick ``p`` of the tokens; 80 % become [MASK], 10 % a random byte, 10 %
    stay. Targets are the original ids at picked positions and -100 elsewhere."""
    picked = torch.rand(x.shape, generator=g) < p
    if not picked.any():
        picked.view(-1)[0] = True
    r = torch.rand(x.shape, generator=g)
    random_ids = torch.randint(0, 256, x.shape, generator=g)
    inputs = torch.where(picked & (r < 0.8), MASK_ID, x)
    inputs = torch.where(picked & (r >= 0.8) & (r < 0.9), random_ids, inputs)
    targets = torch.where(picked, x, -100)
    return inputs, targets


class Batches:
    """The deterministic batch stream of one split.

    Sequences are non-overlapping windows of ``context`` (+1 for next-token targets) tokens.
    Each epoch shifts the window grid by a seeded offset and visits the windows in a seeded
    permutation; the last incomplete batch of an epoch is dropped. ``batch(step)`` depends on
    ``(seed, step)`` only.
    """

    def __init__(self, tokens: torch.Tensor, *, batch_size: int, context: int, causal: bool,
                 seed: int, mlm_probability: float = 0.15) -> None:
        self.tokens = tokens  # as stored (uint8 bytes, int16 BPE ids): windows become long
        self.batch_size, self.context, self.causal = batch_size, context, causal
        self.seed, self.mlm_probability = seed, mlm_probability
        self.n_windows = max(len(tokens) // context - 1, 0)
        self.per_epoch = self.n_windows // batch_size
        self._epoch: int | None = None
        self._perm: torch.Tensor | None = None
        self._offset = 0

    def _windows(self, starts: torch.Tensor) -> torch.Tensor:
        length = self.context + (1 if self.causal else 0)
        index = starts[:, None] + torch.arange(length)[None, :]
        return self.tokens[index].long()

    def position(self, step: int) -> dict[str, int]:
        """Where step ``step`` reads: epoch and batch index within it."""
        return {"epoch": step // self.per_epoch, "batch": step % self.per_epoch}

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of the 0-based optimizer step ``step``."""
        pos = self.position(step)
        if pos["epoch"] != self._epoch:
            g = _generator("epoch", self.seed, pos["epoch"])
            self._offset = int(torch.randint(0, self.context, (1,), generator=g))
            self._perm = torch.randperm(self.n_windows, generator=g)
            self._epoch = pos["epoch"]
        assert self._perm is not None
        b = pos["batch"]
        chosen = self._perm[b * self.batch_size:(b + 1) * self.batch_size]
        seqs = self._windows(self._offset + chosen * self.context)
        if self.causal:
            return seqs[:, :-1], seqs[:, 1:]
        return _mask(seqs, self.mlm_probability, _generator("mask", self.seed, step))

    def fixed(self, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The validation set: the first windows in text order (no shuffling), ``n_batches``
        batches at most, masked with a fixed seed."""
        n = min(self.n_windows, n_batches * self.batch_size)
        starts = torch.arange(n) * self.context
        out = []
        for i in range(0, n, self.batch_size):
            seqs = self._windows(starts[i:i + self.batch_size])
            if self.causal:
                out.append((seqs[:, :-1], seqs[:, 1:]))
            else:
                out.append(_mask(seqs, self.mlm_probability, _generator("val", self.seed, i)))
        return out


@dataclass
class Corpus:
    """A tokenised text split into training and validation tokens."""

    train: torch.Tensor
    val: torch.Tensor
    source: str
    vocab_size: int = VOCAB_SIZE

    @property
    def n_tokens(self) -> int:
        return len(self.train) + len(self.val)


def _read_file(path: str, limit: int | None = None) -> bytes:
    """The file's bytes, its first ``limit`` only where given (--max-bytes: a file larger
    than memory is not read whole to be cut)."""
    try:
        with open(path, "rb") as handle:
            return handle.read() if limit is None else handle.read(limit)
    except OSError as error:
        raise UsageError(f"--data: cannot read {path!r}: {error.strerror}") from None


def _reason(error: BaseException) -> str:
    """The first line of what went wrong, from the innermost error: datasets wraps the
    cause (a UnicodeDecodeError of a file that is not UTF-8) in its own "An error occurred
    while generating the dataset"."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _load_dataset(cfg: DataConfig) -> bytes:
    """Text of a Hugging Face dataset (hub name, saved directory, or local data file)."""
    try:
        import datasets
    except ImportError:
        raise UsageError("--dataset needs the datasets package: pip install datasets") from None
    name = cfg.dataset
    assert name is not None
    builders = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json",
                ".csv": "csv", ".parquet": "parquet"}
    try:
        if os.path.isfile(name):
            ext = os.path.splitext(name)[1].lower()
            if ext not in builders:
                raise UsageError(f"--dataset: cannot tell the format of {name!r}; use one of "
                                 + ", ".join(builders))
            # a text file as one document, as --data reads it (by line, every line became
            # a row, and rows are joined by a blank line below: each line break doubled)
            extra = {"sample_by": "document"} if builders[ext] == "text" else {}
            ds = datasets.load_dataset(builders[ext], data_files=name, split=cfg.dataset_split,
                                       **extra)
        elif os.path.isdir(name) and os.path.exists(os.path.join(name, "dataset_dict.json")):
            splits = datasets.load_from_disk(name)
            if cfg.dataset_split not in splits:
                raise UsageError(f"--dataset-split: {name!r} has no split "
                                 f"{cfg.dataset_split!r}; its splits: " + ", ".join(splits))
            ds = splits[cfg.dataset_split]
        elif os.path.isdir(name) and os.path.exists(os.path.join(name, "dataset_info.json")):
            if cfg.dataset_split != DataConfig.dataset_split:  # (not the default: asked for)
                raise UsageError(f"--dataset-split {cfg.dataset_split}: {name!r} is one saved "
                                 "Dataset, without splits; leave --dataset-split out")
            ds = datasets.load_from_disk(name)
        else:
            ds = datasets.load_dataset(name, cfg.dataset_config, split=cfg.dataset_split)
    except UsageError:
        raise
    except Exception as error:  # datasets raises many types; the first line says why
        raise UsageError(f"--dataset: cannot load {name!r}: {_reason(error)}") from None
    if cfg.text_column not in ds.column_names:
        raise UsageError(f"--text-column: {name!r} has no column {cfg.text_column!r}; columns: "
                         + ", ".join(ds.column_names))
    parts, size = [], 0
    limit = cfg.max_bytes or float("inf")
    for text in ds[cfg.text_column] if len(ds) < 100_000 else _iter_column(ds, cfg.text_column):
        if not text:
            continue
        data = str(text).encode("utf-8")
        parts.append(data)
        size += len(data) + 2
        if size >= limit:
            break
    return b"\n\n".join(parts)


def _iter_column(ds, column: str):
    for row in ds:
        yield row[column]


def _stdlib_split(cfg: DataConfig) -> tuple[torch.Tensor, torch.Tensor, str]:
    """The standard library's source split by file: files in sorted path order, each
    ``1/val_fraction``-th one held out (as :func:`split_tokens` holds out chunks), each file
    followed by a newline; ``max_bytes`` keeps the first files of that order (the last one
    cut) so that a test can train on a slice."""
    root, paths = stdlib_files()
    sides: tuple[list[bytes], list[bytes]] = ([], [])
    total, limit = 0, cfg.max_bytes or sys.maxsize
    for i, path in enumerate(paths):
        if total >= limit:
            break
        data = (_read_file(os.path.join(root, path)) + b"\n")[: limit - total]
        sides[int(_held_out(i, cfg.val_fraction))].append(data)
        total += len(data)
    n_val = len(sides[1])
    source = (f"the Python {sys.version.split()[0]} standard library's source ({root}: "
              f"{n_val + len(sides[0])} .py files in sorted order, {n_val} of them, evenly "
              "spread, held out for validation)")
    return encode(b"".join(sides[0])), encode(b"".join(sides[1])), source


def _held_out(index: int, val_fraction: float) -> bool:
    """Whether unit ``index`` (a chunk, a file) is validation: every ``1/val_fraction``-th."""
    return int((index + 1) * val_fraction) > int(index * val_fraction)


def dataset_name(cfg: DataConfig) -> str:
    """``dataset NAME (CONFIG)``: --dataset and its --dataset-config, as the flags name them."""
    return f"dataset {cfg.dataset}" + (f" ({cfg.dataset_config})" if cfg.dataset_config else "")


def _byte_split(cfg: DataConfig) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``(train bytes, validation bytes, description)`` of the text named by ``cfg``."""
    if cfg.path == STDLIB:
        return _stdlib_split(cfg)
    if cfg.path is not None:
        data, source = _read_file(cfg.path, cfg.max_bytes), f"file {os.path.abspath(cfg.path)}"
    elif cfg.dataset is not None:
        data, source = _load_dataset(cfg), f"{dataset_name(cfg)} [{cfg.dataset_split}]"
    else:
        data, source = builtin_text().encode("utf-8"), "built-in: Python's pydoc_data.topics"
    if cfg.max_bytes is not None:
        data = data[: cfg.max_bytes]
    train, val = split_tokens(encode(data), cfg.val_fraction)
    return train, val, source


def load_corpus(cfg: DataConfig) -> Corpus:
    """Read, split and tokenise the text named by ``cfg`` (the built-in corpus by default)."""
    train, val, source = _byte_split(cfg)
    if cfg.tokenizer == "bytes":
        return Corpus(train=train, val=val, source=source)
    train, val, learned = bpe_encode(train.numpy().tobytes(), val.numpy().tobytes(),
                                     cfg.vocab_size)
    return Corpus(train=train, val=val, vocab_size=cfg.vocab_size,
                  source=f"{source}; byte-level BPE, {learned} tokens learned from the "
                  "training side")


def make_batches(corpus: Corpus, cfg: DataConfig, *, context: int, causal: bool,
                 seed: int) -> tuple[Batches, Batches]:
    """Training and validation batch streams; a one-line UsageError if the text is too short."""
    kw = dict(batch_size=cfg.batch_size, context=context, causal=causal, seed=seed,
              mlm_probability=cfg.mlm_probability)
    train, val = Batches(corpus.train, **kw), Batches(corpus.val, **kw)
    if train.per_epoch < 1:
        need = (cfg.batch_size + 1) * context
        raise UsageError(
            f"the training text ({len(corpus.train)} tokens from {corpus.source}) is too short "
            f"for --batch-size {cfg.batch_size} x --context {context} (needs {need} tokens)"
        )
    if val.n_windows < 1:
        raise UsageError(
            f"the validation text ({len(corpus.val)} tokens) is shorter than two --context "
            f"{context} windows; use more text or a larger --val-fraction"
        )
    return train, val
