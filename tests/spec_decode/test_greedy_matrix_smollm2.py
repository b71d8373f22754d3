"""Greedy equality on the real model in fp32 and bf16 for every proposer family (issue #19), the short
version of experiments/bench/greedy_matrix.py: 4 Spec-Bench first turns of different categories, 4 at a time,
32 tokens. bf16 is lossless here only because the native kernels are batch-invariant."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec import LLM, SamplingParams
from specdec.experiment.data import load_spec_bench

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 10},
    "draft_model": {"method": "draft_model", "model": "smollm2-135m-instruct", "num_speculative_tokens": 3},
    "layer_skip": {"method": "layer_skip", "num_layers": 8, "num_speculative_tokens": 3},
    "eagle_chain": {"method": "eagle", "num_speculative_tokens": 4, "options": {"draft_vocab_size": 2048}},
    "eagle_tree": {"method": "eagle", "num_speculative_tokens": 4, "options": {"draft_vocab_size": 2048},
                   "scorer": "tree", "tree_depth": 4, "tree_topk": 4, "tree_budget": 12},
    "eagle_ngram": {"method": "eagle", "num_speculative_tokens": 3, "scorer": "tree", "tree_depth": 3, "tree_topk": 3,
                    "tree_budget": 6, "options": {"draft_vocab_size": 8192, "ngram_branch": 3}},
    "medusa": {"method": "medusa", "num_speculative_tokens": 3},
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 3},
    "eagle3_ngram": {"method": "eagle3", "num_speculative_tokens": 3, "scorer": "tree", "tree_depth": 3, "tree_topk": 3,
                     "tree_budget": 6, "options": {"ngram_branch": 2}},
    "mlp_speculator": {"method": "mlp_speculator", "model": str(ROOT / "checkpoints" / "smollm2-135m-instruct-mlp-speculator"),
                       "num_speculative_tokens": 3},
}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def plain(request):
    llm = LLM("smollm2-135m-instruct", max_num_seqs=4, max_model_len=1024, dtype=request.param)
    if not llm.engine.batch_invariant:
        pytest.skip(f"native kernels unavailable: {llm.engine.describe()['kernels']}")
    qs = [q for q in load_spec_bench(None, per_category=1)][::3][:4]  # writing, stem?, ... one of each
    prompts = [{"prompt_token_ids": llm.chat_prompt_ids([{"role": "user", "content": q.turns[0]}])} for q in qs]
    sp = SamplingParams(temperature=0.0, max_tokens=32)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    return llm, prompts, sp, ref


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equal_in_fp32_and_bf16(plain, name):
    llm, prompts, sp, ref = plain
    spec = llm.with_speculation(CONFIGS[name])
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)]
    assert got == ref, f"{name} ({llm.engine.dtype}): greedy output differs from plain decoding"
    assert spec.get_metrics().num_draft_tokens > 0
    assert llm.engine.num_free_slots() == llm.engine.num_slots
