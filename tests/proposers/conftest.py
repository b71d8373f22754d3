"""Fixtures of the proposer tests (one module per proposers/*.py). Helpers they import by name
(LEN, the ragged batch, generate_and_assert_greedy_equal, simulate, ...) are in helpers.py."""

import pytest
import torch

from tests.proposers.helpers import LEN


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's ops are too small for intra-op threads
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny():
    """A plain LLM on the tiny target; each test derives its speculative LLM with ``with_speculation``."""
    from specdec import LLM

    return LLM("tiny-random-llama", max_num_seqs=4, max_model_len=LEN)
