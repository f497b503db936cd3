"""Serving tests run tiny steps: one thread avoids thread hand-off costs (and oversubscription on a shared box)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
