"""Corpus, byte tokens, the fixed split and the deterministic batch stream."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from collage.errors import UsageError
from collage.train import bpe
from collage.train.config import Config, DataConfig, ModelConfig
from collage.train.data import (
    MASK_ID,
    SPLIT_CHUNK,
    VOCAB_SIZE,
    Batches,
    builtin_text,
    decode,
    encode,
    load_corpus,
    make_batches,
    split_tokens,
    stdlib_files,
    vocab_size,
)


def test_builtin_corpus_is_bundled_english_text():
    text = builtin_text()
    assert len(text) > 100_000 and "the" in text and text == builtin_text()
    tokens = encode(text)
    assert tokens.dtype == torch.uint8 and int(tokens.max()) < VOCAB_SIZE
    assert decode(tokens[:50]) == text.encode()[:50].decode("utf-8", "replace")
    assert MASK_ID == 256 and VOCAB_SIZE == 257


def test_split_is_deterministic_disjoint_and_spread():
    tokens = encode(builtin_text())
    train, val = split_tokens(tokens, 0.1)
    train2, val2 = split_tokens(tokens, 0.1)
    assert torch.equal(train, train2) and torch.equal(val, val2)
    assert len(train) + len(val) == len(tokens)
    assert abs(len(val) / len(tokens) - 0.1) < 0.01
    chunks = list(torch.split(tokens, SPLIT_CHUNK))
    picked = [i for i in range(len(chunks)) if int((i + 1) * 0.1) > int(i * 0.1)]
    assert torch.equal(val, torch.cat([chunks[i] for i in picked]))
    assert picked[0] < 0.2 * len(chunks) and picked[-1] > 0.8 * len(chunks)  # spread out


def _stream(seed=0, causal=True, n=20_000, unique=False):
    tokens = torch.arange(n) if unique else torch.arange(n) % 251
    return Batches(tokens, batch_size=4, context=16, causal=causal, seed=seed)


def test_batches_depend_only_on_seed_and_step():
    a, b = _stream(0), _stream(0)
    forward = [a.batch(s) for s in range(0, 700, 7)]
    backward = [b.batch(s) for s in reversed(range(0, 700, 7))][::-1]  # random access
    for (x1, y1), (x2, y2) in zip(forward, backward):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    x, y = a.batch(3)
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1]), "targets are inputs shifted by one"
    other = _stream(1)
    assert not torch.equal(other.batch(0)[0], a.batch(0)[0])


def test_epochs_visit_every_window_once():
    s = _stream(unique=True)
    starts = set()
    for step in range(s.per_epoch):
        x, _ = s.batch(step)
        starts.update(int(row[0]) for row in x)
    assert len(starts) == s.per_epoch * 4
    assert s.position(s.per_epoch + 2) == {"epoch": 1, "batch": 2}


def test_mlm_masking():
    s = _stream(causal=False)
    x, y = s.batch(5)
    x2, y2 = s.batch(5)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    picked = y != -100
    assert 0.05 < picked.float().mean() < 0.3
    assert (x[~picked] != MASK_ID).all()
    assert (x[picked] == MASK_ID).float().mean() > 0.5
    val = s.fixed(2)
    assert len(val) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(val, s.fixed(2)))


def test_local_text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("hello world, " * 5000, encoding="utf-8")
    corpus = load_corpus(DataConfig(path=str(path)))
    assert corpus.n_tokens == 13 * 5000 and "corpus.txt" in corpus.source
    corpus = load_corpus(DataConfig(path=str(path), max_bytes=10_000))
    assert corpus.n_tokens == 10_000


def test_max_bytes_reads_only_what_it_keeps(tmp_path, monkeypatch):
    """--max-bytes limits the read, not only what is kept (a file larger than memory was
    read whole, then cut)."""
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"x" * 50_000)
    reads = []
    real_open = open

    def spy(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        if str(file) == str(path):
            real_read = handle.read
            handle.read = lambda size=-1: reads.append(size) or real_read(size)
        return handle

    monkeypatch.setattr("builtins.open", spy)
    assert load_corpus(DataConfig(path=str(path), max_bytes=10_000)).n_tokens == 10_000
    assert reads == [10_000]


def test_too_short_text_is_a_usage_error(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("tiny", encoding="utf-8")
    cfg = DataConfig(path=str(path), batch_size=4)
    with pytest.raises(UsageError, match="too short"):
        make_batches(load_corpus(cfg), cfg, context=16, causal=True, seed=0)


def test_hf_dataset_from_local_json(tmp_path):
    pytest.importorskip("datasets")
    path = tmp_path / "data.jsonl"
    with open(path, "w") as handle:
        for i in range(200):
            handle.write(json.dumps({"text": f"line {i}: the quick brown fox " * 10}) + "\n")
    corpus = load_corpus(DataConfig(dataset=str(path)))
    assert corpus.n_tokens > 50_000 and "line 7" in decode(torch.cat([corpus.train, corpus.val]))
    with pytest.raises(UsageError, match="no column"):
        load_corpus(DataConfig(dataset=str(path), text_column="body"))


def test_hf_dataset_from_a_text_file_is_the_text_of_data(tmp_path):
    """A .txt file through --dataset is the same text as through --data: one document, its
    line breaks kept (by line, every row was joined by a blank line: each break doubled,
    7 % more tokens here, every one a newline)."""
    pytest.importorskip("datasets")
    path = tmp_path / "code.txt"
    path.write_text("def f(x):\n    return x\n\nclass A:\n    pass\n" * 2000,
                    encoding="utf-8")
    as_data, as_dataset = (load_corpus(DataConfig(**{key: str(path)}))
                           for key in ("path", "dataset"))
    assert torch.equal(torch.cat([as_dataset.train, as_dataset.val]),
                       torch.cat([as_data.train, as_data.val]))


def test_hf_dataset_errors_say_why(tmp_path):
    """The innermost cause, not datasets' "An error occurred while generating the
    dataset"; a split a saved DatasetDict lacks is named with the splits it has."""
    datasets = pytest.importorskip("datasets")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1") * 1000)
    with pytest.raises(UsageError, match="UnicodeDecodeError: 'utf-8' codec can't decode"):
        load_corpus(DataConfig(dataset=str(latin1)))
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a b c " * 100]})}
                         ).save_to_disk(str(saved))
    with pytest.raises(UsageError, match="has no split 'validation'; its splits: train"):
        load_corpus(DataConfig(dataset=str(saved), dataset_split="validation"))
    single = tmp_path / "single"
    datasets.Dataset.from_dict({"text": ["a b c " * 100]}).save_to_disk(str(single))
    with pytest.raises(UsageError, match="is one saved Dataset, without splits"):
        load_corpus(DataConfig(dataset=str(single), dataset_split="validation"))


def test_missing_datasets_package_is_a_usage_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("no datasets")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(UsageError, match="needs the datasets package"):
        load_corpus(DataConfig(dataset="wikitext"))


def test_stdlib_corpus_is_the_standard_library_split_by_file():
    root, paths = stdlib_files()
    assert paths == sorted(paths) and "os.py" in paths and "json/__init__.py" in paths
    assert not [p for p in paths if "site-packages" in p or "__pycache__" in p]
    assert sum(os.path.getsize(os.path.join(root, p)) for p in paths) > 5_000_000

    def read(path):
        with open(os.path.join(root, path), "rb") as handle:
            return handle.read() + b"\n"

    cfg = DataConfig(path="stdlib", max_bytes=400_000)
    corpus = load_corpus(cfg)
    assert len(corpus.train) + len(corpus.val) == 400_000
    assert torch.equal(corpus.val, load_corpus(cfg).val)  # a pure function of the files
    # files 0-8 are training text, file 9 (the 10th) opens the validation text
    head = b"".join(read(p) for p in paths[:9])
    assert corpus.train[:len(head)].numpy().tobytes() == head
    assert corpus.val[:len(read(paths[9]))].numpy().tobytes() == read(paths[9])
    assert "standard library" in corpus.source and corpus.vocab_size == VOCAB_SIZE


def test_bpe_tokenizer_is_trained_on_the_training_side_and_cached(tmp_path, monkeypatch):
    tokenizers = pytest.importorskip("tokenizers")
    monkeypatch.setenv("COLLAGE_CACHE_DIR", str(tmp_path))
    cfg = DataConfig(path="stdlib", max_bytes=300_000, tokenizer="bpe", vocab_size=1000)
    raw = load_corpus(DataConfig(path="stdlib", max_bytes=300_000))
    corpus = load_corpus(cfg)
    assert corpus.vocab_size == vocab_size(cfg) == 1000
    assert corpus.train.dtype == torch.int16 and 256 <= int(corpus.train.max()) < 1000
    assert len(raw.train) / len(corpus.train) > 2  # merges make tokens of several bytes
    (entry,) = [torch.load(p, weights_only=True) for p in (tmp_path / "tokens").glob("*.pt")]
    tokenizer = tokenizers.Tokenizer.from_str(entry["tokenizer"])
    for ids, text in ((corpus.train, raw.train), (corpus.val, raw.val)):
        original = text.numpy().tobytes().decode("utf-8", "replace")
        assert tokenizer.decode(ids.tolist()) == original

    def no_training(*args):
        raise AssertionError("the cached ids should have been used")

    monkeypatch.setattr(bpe, "_train", no_training)
    again = load_corpus(cfg)
    assert torch.equal(again.train, corpus.train) and torch.equal(again.val, corpus.val)


def test_bpe_says_when_much_of_the_text_is_not_utf8(tmp_path, monkeypatch):
    """The tokenizer reads text: a Latin-1 file's accented letters all become U+FFFD, one
    token. Said once, with the count (two per line here); a replacement character the text
    itself holds is not counted."""
    pytest.importorskip("tokenizers")
    monkeypatch.setenv("COLLAGE_CACHE_DIR", str(tmp_path / "cache"))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 cr\u00e8me br\u00fbl\u00e9e\n".encode("latin-1") * 3000)
    with pytest.warns(UserWarning, match=r"12000 byte sequences of the text are not UTF-8"):
        load_corpus(DataConfig(path=str(latin1), tokenizer="bpe", vocab_size=512))
    utf8 = tmp_path / "utf8.txt"
    utf8.write_text("caf\u00e9 \ufffd cr\u00e8me\n" * 3000, encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_corpus(DataConfig(path=str(utf8), tokenizer="bpe", vocab_size=512))


def test_tokenizer_settings_are_checked():
    with pytest.raises(UsageError, match="--vocab-size: must be at least 512"):
        DataConfig(tokenizer="bpe", vocab_size=300)
    with pytest.raises(UsageError, match="--tokenizer: unknown tokenizer 'words'"):
        DataConfig(tokenizer="words")
    with pytest.raises(UsageError, match="masked LM"):
        Config(model=ModelConfig(family="bert"), data=DataConfig(tokenizer="bpe"))
    assert DataConfig(path="stdlib").path == "stdlib"  # a corpus name, not a file
