"""Single-threaded, like tests/optim: tiny tensors on a shared machine."""

from __future__ import annotations

import pytest
import torch



@pytest.fixture(autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
