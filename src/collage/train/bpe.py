"""A byte-level BPE tokenizer trained locally on the training text (``--tokenizer bpe``).

The ``tokenizers`` package (Hugging Face's Rust BPE) learns ``--vocab-size`` tokens from the
training side of the split only (the validation text stays unseen), starting from all 256
bytes, so every text encodes without an unknown token. Its training is deterministic (the
same merges from the same text, whatever the thread count: checked on the standard
library), so every process that loads the corpus gets the same ids. It reads text: a byte
sequence that is not UTF-8 (a Latin-1 file, a character the split cut in two) becomes
U+FFFD, one token for all of them, with one warning that counts them where they are more
than 1 in 10,000 bytes.

Training the tokenizer on the 28 MB training side of ``--data stdlib`` takes about 8 s and
encoding it about 20 s on 2 cores; ``collage compare`` loads the corpus once per process, so
the tokenizer and the token ids are cached under ``$COLLAGE_CACHE_DIR/tokens`` (default
``~/.cache/collage/tokens``), keyed by a SHA-256 of the training text, the vocabulary
size and the ``tokenizers`` version. A cache entry that does not load, or that holds
another key, is rebuilt.

An entry swapped by someone else would silently swap the training data, so the cache follows
the native library's rule (``docs/security.md``; the checks are
``collage/optim/native/cache.py``'s, imported, not copied):

* the directory is created with mode 0700 and used only if it is a real directory that we
  own and that neither group nor others can write, nor any directory above it unless
  sticky; otherwise one warning, and the ids are computed in memory, nothing read or
  written;
* an entry and its SHA-256 record (``<entry>.sha256``) must be regular files that we own and
  that neither group nor others can write; otherwise one warning and no caching for that
  key (the files are left alone);
* an entry is loaded only if its bytes have the SHA-256 recorded when it was written (hashed
  and loaded from the same bytes, so nothing can change between the two): a mismatch is a
  rebuild with one warning, a missing record (an entry from before records) a silent one.
  Entries are written under temporary names with mode 0600 and renamed, the record first.
"""

from __future__ import annotations

import hashlib
import io
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from ..errors import UsageError
from ..private_files import (cache_root, install, new_file, not_private_file,
                             private_dir_problem, record_of, warn_once)

__all__ = ["bpe_encode", "cache_dir"]

#: Texts are handed to the trainer and the encoder in pieces of this many bytes (one
#: piece per file of the standard library would also do; fixed pieces work for any text).
_PIECE = 1 << 16
_CACHE_FORMAT = 1
#: the prefix of the cache's temporary files (``.bpe-...``, renamed once complete)
_PREFIX = "bpe-"


def cache_dir() -> str:
    """Where token ids are cached: ``$COLLAGE_CACHE_DIR/tokens``, else the XDG cache."""
    return str(cache_root() / "tokens")


def _pieces(data: bytes) -> Iterator[str]:
    """``data`` as text in pieces cut at line ends (a cut inside a line would split words
    the tokenizer should see whole); undecodable bytes become U+FFFD."""
    start = 0
    while start < len(data):
        end = data.find(b"\n", start + _PIECE)
        end = len(data) if end < 0 else end + 1
        yield data[start:end].decode("utf-8", errors="replace")
        start = end


#: U+FFFD in UTF-8: a replacement character the text already holds is not a lost byte
_REPLACEMENT = "\ufffd".encode()


#: undecodable sequences per byte above which the tokenizer's reading is worth a warning:
#: 1 in 10,000 (a Latin-1 text has one per accented letter, about 1 in 50; the standard
#: library corpus 58 in 28 MB, from a few Latin-1 test files: no warning on every run)
_UNDECODABLE_WARNED = 1e-4


def _warn_undecodable(*sides: bytes) -> None:
    """One warning where much of the text is not UTF-8: the tokenizer reads text, so every
    undecodable sequence becomes U+FFFD, one token for all of them (a Latin-1 file's
    accented letters; a character the train/validation split's blocks cut in two)."""
    lost = sum(side.decode("utf-8", errors="replace").count("\ufffd")
               - side.count(_REPLACEMENT) for side in sides)
    if lost > _UNDECODABLE_WARNED * sum(len(side) for side in sides):
        warnings.warn(f"collage: --tokenizer bpe: {lost} byte sequences of the text are not "
                      "UTF-8 and are read as U+FFFD, one token for all of them (a character "
                      "cut by the train/validation split counts too); --tokenizer bytes "
                      "keeps every byte", UserWarning, stacklevel=3)


def _train(train: bytes, vocab_size: int):
    """A byte-level BPE tokenizer of ``vocab_size`` tokens learned from ``train``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_pieces(train), trainer=trainer)
    return tokenizer


def _encode(tokenizer, data: bytes, vocab_size: int) -> torch.Tensor:
    dtype = torch.int16 if vocab_size <= torch.iinfo(torch.int16).max else torch.int32
    ids = [i for e in tokenizer.encode_batch(list(_pieces(data))) for i in e.ids]
    return torch.tensor(ids, dtype=dtype)


def _tokenizers_version() -> str:
    try:
        import tokenizers
    except ImportError:
        raise UsageError("--tokenizer bpe needs the tokenizers package: "
                         "pip install tokenizers") from None
    return tokenizers.__version__


def _key(train: bytes, val: bytes, vocab_size: int) -> str:
    """What the cached ids depend on: both texts, the vocabulary size, the trainer."""
    h = hashlib.sha256()
    for part in (hashlib.sha256(train).digest(), hashlib.sha256(val).digest(),
                 f"|{vocab_size}|{_tokenizers_version()}|{_CACHE_FORMAT}".encode()):
        h.update(part)
    return h.hexdigest()


def _private_dir() -> Path | None:
    """:func:`cache_dir`, created 0700, if no one else can write it; else None (one
    warning naming it and why)."""
    path = Path(cache_dir())
    reason = private_dir_problem(path)
    if reason is None:
        return path
    warn_once(f"not caching BPE token ids in {path}: {reason}; tokenizing without the "
               "cache instead (to cache again, fix that, e.g. chmod 700, or set "
               "COLLAGE_CACHE_DIR to a private directory)")
    return None


def _ours(path: Path) -> bool:
    """Whether the entry ``path`` and its record, where they exist, are files no one else can
    write (else one warning: they are left alone and not used)."""
    for file in (path, record_of(path)):
        reason = not_private_file(file)
        if reason is not None:
            warn_once(f"not loading the BPE token cache {path}: {reason}; tokenizing without "
                       "the cache instead (remove the file to cache again)")
            return False
    return True


def _cached(path: Path, key: str) -> dict | None:
    """The cache entry at ``path`` if its bytes have the recorded SHA-256, it loads and it
    holds ``key``; None otherwise (a digest mismatch warns once)."""
    try:
        recorded = record_of(path).read_text().strip()
        data = path.read_bytes()
    except FileNotFoundError:  # no entry, or one written before records: rebuilt silently
        return None
    actual = hashlib.sha256(data).hexdigest()
    if actual != recorded:
        warn_once(f"rebuilding the BPE token cache {path}: its SHA-256 {actual[:12]}... is "
                   f"not the {recorded[:12]}... recorded when it was written")
        return None
    try:  # the bytes just hashed: nothing can change between the check and the load
        entry = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception:  # truncated, foreign: rebuild
        return None
    return entry if isinstance(entry, dict) and entry.get("key") == key else None


def _store(entry: dict, path: Path) -> None:
    """Write ``entry`` to a new 0600 file beside ``path``, record its SHA-256, rename."""
    built = new_file(path.parent, _PREFIX)
    try:
        with open(built, "wb") as handle:
            torch.save(entry, handle)
            handle.flush()
            os.fsync(handle.fileno())
        install(built, path, _PREFIX)
    finally:
        if built.exists():
            built.unlink()


def bpe_encode(train: bytes, val: bytes, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(train ids, val ids, vocabulary size learned)``: a tokenizer trained on ``train``
    encodes both sides; cached (see the module's docstring)."""
    _warn_undecodable(train, val)
    key = _key(train, val, vocab_size)
    directory = _private_dir()
    path = directory / f"bpe-{key[:24]}.pt" if directory is not None else None
    cacheable = path is not None and _ours(path)
    entry = _cached(path, key) if cacheable else None
    if entry is None:
        tokenizer = _train(train, vocab_size)
        entry = {"key": key, "vocab": tokenizer.get_vocab_size(),
                 "tokenizer": tokenizer.to_str(),
                 "train": _encode(tokenizer, train, vocab_size),
                 "val": _encode(tokenizer, val, vocab_size)}
        if cacheable:
            _store(entry, path)
    return entry["train"], entry["val"], int(entry["vocab"])
