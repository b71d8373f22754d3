import os
import tempfile

import pytest
import torch

# Two cores on CI machines: keep torch from oversubscribing them when tests run.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TRITON_INTERPRET", "1")
# dtype "auto" is bf16 on AVX512-BF16 / AMX CPUs and fp32 elsewhere: the suite pins it to fp32 so that its references
# (transformers, the torch path) hold on every machine; bf16 is tested where a test asks for it by name (the kernels'
# builds, invariance, the draft call, test_dtype_auto), and test_auto_dtype_follows_the_cpu unpins it.
os.environ.setdefault("SPECDEC_AUTO_DTYPE", "float32")
# plain baselines cached by one test must not turn another's (or a later session's) decode into a cache hit
os.environ.setdefault("SPECDEC_BASELINE_CACHE", tempfile.mkdtemp(prefix="specdec-baselines-"))


@pytest.fixture(scope="session")
def tiny_llm():
    from specdec import LLM

    return LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256)


@pytest.fixture
def one_thread():
    """torch at 1 thread for the test, restored after: tiny-model ops are too small for intra-op threads, and on a
    shared 2-core box two threads wait on each other (tests/spec_decode/conftest.py has the measurements)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
