"""The BPE token cache loads nothing another user could have written (issue #30, item 15;
``collage/train/bpe.py``, ``docs/security.md``).

How the tests can fail: each planted entry holds the right key and swapped token ids (all
zeros), under the name the loader looks for, so a missing check trains on it and the
returned ids are zeros instead of the tokenizer's.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import pytest
import torch

from collage.optim.native import cache as native_cache
from collage.train import bpe

pytest.importorskip("tokenizers")

TRAIN = b"".join(b"def f%d(x):\n    return x * %d + 1\n" % (i, i) for i in range(300))
VAL = b"def g(y):\n    return y - 1\n"
VOCAB = 300


@pytest.fixture
def cache_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("COLLAGE_CACHE_DIR", str(root))
    native_cache.reset()  # warnings are given once per process: start afresh
    return root


def _entry_path(root: Path) -> Path:
    return root / "tokens" / f"bpe-{bpe._key(TRAIN, VAL, VOCAB)[:24]}.pt"


def _fresh() -> tuple[torch.Tensor, torch.Tensor, int]:
    """What the tokenizer gives, no cache involved."""
    tokenizer = bpe._train(TRAIN, VOCAB)
    return (bpe._encode(tokenizer, TRAIN, VOCAB), bpe._encode(tokenizer, VAL, VOCAB),
            tokenizer.get_vocab_size())


def _plant(path: Path, *, record: bool) -> bytes:
    """A swapped entry with the right key at ``path`` (and its true SHA-256 record)."""
    good_train, good_val, vocab = _fresh()
    swapped = {"key": bpe._key(TRAIN, VAL, VOCAB), "vocab": vocab, "tokenizer": "",
               "train": torch.zeros_like(good_train), "val": torch.zeros_like(good_val)}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(swapped, path)
    data = path.read_bytes()
    if record:
        Path(str(path) + ".sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
    return data


def _encode_warnings() -> tuple[tuple, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = bpe.bpe_encode(TRAIN, VAL, VOCAB)
    return out, [str(w.message) for w in caught if "BPE" in str(w.message)]


def _assert_fresh(out) -> None:
    want = _fresh()
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]) and out[2] == want[2]
    assert int(out[0].max()) > 0  # not the planted zeros


def test_private_cache_is_written_with_a_record_and_reused(cache_root, monkeypatch):
    first, messages = _encode_warnings()
    _assert_fresh(first)
    assert messages == []
    path = _entry_path(cache_root)
    record = Path(str(path) + ".sha256")
    assert record.read_text().strip() == hashlib.sha256(path.read_bytes()).hexdigest()
    for file in (path, record, path.parent):
        mode = os.stat(file).st_mode & 0o777
        assert mode == (0o700 if file == path.parent else 0o600), (file, oct(mode))

    def no_training(*args):
        raise AssertionError("the cached ids should have been used")

    monkeypatch.setattr(bpe, "_train", no_training)
    again, messages = _encode_warnings()
    assert torch.equal(again[0], first[0]) and messages == []


def test_a_directory_others_can_write_is_not_used(cache_root):
    tokens = cache_root / "tokens"
    tokens.mkdir(parents=True)
    os.chmod(tokens, 0o777)
    planted = _plant(_entry_path(cache_root), record=True)
    out, messages = _encode_warnings()
    _assert_fresh(out)
    assert len(messages) == 1 and "writable by group or others" in messages[0], messages
    assert str(tokens) in messages[0]
    assert _entry_path(cache_root).read_bytes() == planted  # left alone, nothing written


def test_an_entry_others_can_write_is_not_used(cache_root):
    path = _entry_path(cache_root)
    _plant(path, record=True)
    os.chmod(path.parent, 0o700)
    os.chmod(path, 0o666)
    out, messages = _encode_warnings()
    _assert_fresh(out)
    assert len(messages) == 1 and str(path) in messages[0], messages
    assert "writable by group or others" in messages[0]


def test_a_planted_entry_without_a_record_is_rebuilt(cache_root):
    path = _entry_path(cache_root)
    _plant(path, record=False)
    os.chmod(path.parent, 0o700)
    out, messages = _encode_warnings()
    _assert_fresh(out)
    assert messages == []  # as an entry written before records: silently rebuilt
    assert torch.equal(torch.load(path, weights_only=True)["train"], out[0])


def test_a_tampered_entry_is_rebuilt_with_one_warning(cache_root):
    bpe.bpe_encode(TRAIN, VAL, VOCAB)  # a good entry and its record
    path = _entry_path(cache_root)
    record = Path(str(path) + ".sha256").read_text()
    _plant(path, record=False)  # the bytes change, the record stays
    out, messages = _encode_warnings()
    _assert_fresh(out)
    assert len(messages) == 1 and "SHA-256" in messages[0] and str(path) in messages[0]
    rewritten = Path(str(path) + ".sha256").read_text().strip()
    assert rewritten == hashlib.sha256(path.read_bytes()).hexdigest() == record.strip()
    again, messages = _encode_warnings()  # rewritten: used again without a warning
    assert torch.equal(again[0], out[0]) and messages == []
