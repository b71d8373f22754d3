"""specdec/datamodel/metrics.py: the consistency of ``LLM.get_metrics()`` after a speculative run: every derived
figure (tau, acceptance rate and per position, system efficiency, emitted tokens, step times) agrees with
the counters it comes from and with each request's own acceptance counts; reset_metrics clears them."""

import math

import pytest

from specdec import LLM, SamplingParams
from specdec.datamodel.metrics import record_acceptance
from specdec.engine.testing import rand_tokens
from tests.spec_decode.helpers import ids, noisy_tiny_engine


def make(**kw) -> LLM:
    return LLM("tiny-random-llama", max_num_seqs=4, max_model_len=128, **kw)


def test_metrics_are_consistent_with_each_other():
    k = 3
    llm = make(speculative_config={"method": "draft_model", "num_speculative_tokens": k,
                                   "options": {"engine": noisy_tiny_engine(0.15, max_model_len=128)}})
    prompts = [[5, 6, 7], rand_tokens(12, seed=1), rand_tokens(30, seed=2)]
    sp = [SamplingParams(temperature=t, max_tokens=m, ignore_eos=True) for t, m in ((0, 40), (1.0, 25), (0, 33))]
    outs = llm.generate(ids(prompts), sp, use_tqdm=False)
    m = llm.get_metrics()
    per_req = [o.metrics.spec_token_acceptance_counts for o in outs]
    assert m.acceptance_counts == [sum(c[i] for c in per_req) for i in range(k + 1)]
    steps, accepted = m.acceptance_counts[0], sum(m.acceptance_counts[1:])
    assert m.num_steps == steps and m.num_accepted_tokens == accepted
    assert m.num_emitted_tokens == steps + accepted
    assert m.num_draft_tokens == k * steps  # every step speculated (far from max_model_len)
    assert m.acceptance_rate == pytest.approx(accepted / m.num_draft_tokens)
    assert m.mean_acceptance_length == pytest.approx(m.num_emitted_tokens / steps)  # tau, bonus included
    assert m.system_efficiency == pytest.approx(m.num_emitted_tokens / (steps * (k + 1)))
    assert m.acceptance_per_position == pytest.approx([c / steps for c in m.acceptance_counts[1:]])
    assert sum(m.acceptance_per_position) == pytest.approx(m.mean_acceptance_length - 1)
    assert all(a >= b for a, b in zip(m.acceptance_per_position, m.acceptance_per_position[1:]))  # prefixes
    assert 0 < m.acceptance_rate < 1 and 1 < m.mean_acceptance_length < k + 1
    # tokens: the first of each request comes from its prefill; a step's tokens past max_tokens are dropped
    decoded = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    assert decoded <= m.num_emitted_tokens <= decoded + k * len(outs)
    assert {"propose", "score", "verify", "step"} <= set(m.mean_step_time_s)
    assert all(v >= 0 for v in m.mean_step_time_s.values())
    llm.reset_metrics()
    assert math.isnan(llm.get_metrics().mean_acceptance_length) and llm.get_metrics().num_draft_tokens == 0


def test_record_acceptance_counts_every_step_and_each_accepted_position():
    counts = [0, 0, 0, 0]  # k = 3
    record_acceptance(counts, 2)  # drafts 1 and 2 accepted
    record_acceptance(counts, 0)  # nothing accepted: still a step
    assert counts == [2, 1, 1, 0]
    record_acceptance(counts, 5)  # a path past k (a proposer that under-reported its longest path): counted, not dropped
    assert counts == [3, 2, 2, 1, 1, 1]
