"""Acceptance accounting matches theory.

- A synthetic proposer (helpers.CorruptedGreedyProposer, registered here by name) drafts the target's
  true greedy continuation and independently corrupts each position with probability 1 - alpha.
  Under greedy verification draft position i is accepted with probability alpha^(i+1), so the mean
  acceptance length (bonus included) is E[tau] = (1 - alpha^(k+1)) / (1 - alpha) (Leviathan et al. 2023).
  Over >= 4,000 decode steps the measured tau from ``LLM.get_metrics()`` must be within 3% of it (the
  standard error of tau here is ~0.6%), and ``acceptance_per_position[i]`` within 4 binomial standard
  errors of alpha^(i+1).
- Draft equals target: greedy tau is exactly k + 1 and every request's spec_token_acceptance_counts is
  [steps] * (k + 1) (the seed's convention: position 0 counts every step).
"""

import math

import pytest

from specdec import LLM, SamplingParams
from specdec.engine.testing import rand_tokens
from specdec.spec_decode.registry import register_proposer
from tests.spec_decode.helpers import CorruptedGreedyProposer, assert_greedy_equal, ids

register_proposer("corrupted_greedy_test", CorruptedGreedyProposer)

PROMPTS = [rand_tokens(4 + i % 5, seed=i) for i in range(48)]
MAX_TOKENS = 200  # 48 x 200 tokens -> 3,300-4,200 decode steps


@pytest.mark.parametrize("alpha,k", [(0.6, 4), (0.8, 3)])
def test_mean_acceptance_length_matches_theory(alpha, k):
    llm = LLM("tiny-random-llama", max_num_seqs=48, max_model_len=256, speculative_config={
        "method": "corrupted_greedy_test", "num_speculative_tokens": k, "options": {"alpha": alpha}})
    n = 2 if alpha == 0.8 else 1  # alpha = 0.8 emits more per step: run twice to pass 4,000 steps
    for _ in range(n):
        llm.generate(ids(PROMPTS), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                     use_tqdm=False)
    m = llm.get_metrics()
    assert m.num_steps >= 4000
    expected = (1 - alpha ** (k + 1)) / (1 - alpha)
    assert m.mean_acceptance_length == pytest.approx(expected, rel=0.03), (
        f"alpha={alpha}, k={k}: tau {m.mean_acceptance_length:.4f} vs theory {expected:.4f} over {m.num_steps} steps")
    assert len(m.acceptance_per_position) == k
    for i, rate in enumerate(m.acceptance_per_position):
        p = alpha ** (i + 1)
        tol = 4 * math.sqrt(p * (1 - p) / m.num_steps)
        assert abs(rate - p) <= tol, f"position {i}: {rate:.4f} vs alpha^{i + 1} = {p:.4f} (tol {tol:.4f})"
    assert m.acceptance_rate == pytest.approx(sum(alpha ** (i + 1) for i in range(k)) / k, rel=0.03)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_draft_equal_to_target_gives_tau_exactly_k_plus_1(k, plain_tiny):
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256, spec_method="draft_model",
              spec_model="tiny-random-llama", spec_tokens=k)
    prompts = [[5, 6, 7], rand_tokens(19, seed=7), rand_tokens(33, seed=8)]
    max_tokens = [30, 17, 1 + 3 * (k + 1)]  # the last one ends exactly on a step boundary
    sp = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(ids(prompts), sp, use_tqdm=False)
    assert_greedy_equal(plain_tiny.engine, prompts, outs, plain_tiny.generate(ids(prompts), sp, use_tqdm=False),
                        f"draft=target k={k}")
    for out, m in zip(outs, max_tokens):
        steps = math.ceil((m - 1) / (k + 1))  # token 1 comes from the prefill, then k+1 per step
        assert out.metrics.spec_token_acceptance_counts == [steps] * (k + 1), (m, out.metrics)
    met = llm.get_metrics()
    assert met.mean_acceptance_length == k + 1
    assert met.acceptance_rate == 1.0 and met.system_efficiency == 1.0
    assert met.acceptance_per_position == [1.0] * k
    assert met.num_draft_tokens == met.num_accepted_tokens == k * met.num_steps
