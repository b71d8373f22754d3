"""Fixtures of the spec-decode tests. Helpers they import by name are in helpers.py
(``from tests.spec_decode.helpers import ...``); ``my_proposer.py`` is a researcher's plug-in module that
test_registry.py puts on ``sys.path`` itself, as a user would.
"""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # The tiny model's ops are far too small for intra-op threads: with 2 threads on 2 shared cores the
    # per-sequence attention calls run up to 10x slower (measured: 1,024 speculative samples in 1.9 s
    # on 1 thread, 23 s on 2 with other jobs running). Restored after each test.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def plain_tiny():
    """The reference: a fresh plain-decoding LLM on the tiny target (seed 0)."""
    from specdec import LLM

    return LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256)
