"""Shared fixtures: a micro configuration that trains in well under a second."""

from __future__ import annotations

import pytest

from collage.train.config import Config
from collage.train.presets import get_preset


def micro_config(**sections) -> Config:
    """The micro preset (a 1-layer d=32 GPT on 100 kB of text), with changes per section."""
    config = get_preset("micro")
    changes = {"run": {"quiet": True}}
    for name, values in sections.items():
        changes.setdefault(name, {}).update(values)
    return config.replace(**changes)


@pytest.fixture
def micro() -> Config:
    return micro_config()


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from more threads, and one thread is robust on a busy
    machine (OpenMP spinning makes oversubscribed multi-threaded runs many times slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
