"""Run the optimizer tests single-threaded.

Their tensors are tiny: with several intra-op threads on a shared, loaded machine every
small op pays a thread wake-up (measured: a 16-wide MLP step 100x slower). Restored after.
"""

from __future__ import annotations

import pytest
import torch

from collage.optim import native


@pytest.fixture(autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture
def inductor_only(monkeypatch):
    """The fused path with compiled (inductor) kernels on CPU too (not the native ones)."""
    monkeypatch.setattr(native, "covers", lambda *args, **kwargs: False)
