"""Fixtures and import path for the spec-decode proofs.

This directory goes on ``sys.path`` so its helper modules (``spec_helpers``, and ``my_proposer``, the
researcher's plug-in of test_plugins.py) import the same way under any pytest import mode.
"""

import sys
from pathlib import Path

import pytest
import torch

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)


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
