"""Fixtures of the head tests; helpers they import by name are in helpers.py."""

import pytest

from specdec.engine.tiny import tiny_random_llama


@pytest.fixture(scope="module")
def target():
    """The tiny target (hidden size 64, vocabulary 512) the heads must fit."""
    return tiny_random_llama(0, num_slots=2, max_model_len=64)
