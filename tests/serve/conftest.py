"""Serving tests run tiny steps: one thread avoids thread hand-off costs (and oversubscription on a shared box)."""

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every serving test on one thread (`one_thread`, tests/conftest.py)."""
