"""``kernel="triton"`` end to end: the statistical losslessness check of tests/verify/test_chain.py through the
Triton kernels, and greedy equality of ``LLM(..., speculative_config={"kernel": "triton"})`` with plain
decoding on the tiny model.

Statistical design (as tests/verify/test_chain.py, whose docstring explains it): target and draft are Markov
chains over V = 8 tokens; N = 100,000 independent rows per case (k = 1 and 2, and k = 1 with one-hot
n-gram-style drafts: 300,000 draws), verified in one call each; the joint law of the first two generated
tokens must be P[ctx][x0] * P[x0][x1] (chi-square p > 1e-3, TV < 0.02; first token TV < 0.01). Fixed
seeds: deterministic, cannot flake.
"""

import pytest
import torch

from specdec_kernels.testing import chi_square_pvalue, counts_of, tv_distance
from specdec import LLM, SamplingParams
from specdec.verify.chain import RejectionSampler

V = 8
N = 100_000
CTX = 0


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def chain(seed: int) -> torch.Tensor:
    return torch.softmax(torch.randn(V, V, generator=gen(seed)), dim=-1)  # [V, V], row = previous token


def propose(P: torch.Tensor, Q: torch.Tensor, k: int, n: int):
    """Draft k tokens from Q: target_probs [n, k+1, V], draft_probs [n, k, V], drafts [n, k]."""
    prev = torch.full((n,), CTX)
    drafts, q_rows, p_rows = [], [], []
    for _ in range(k):
        q = Q[prev]
        d = torch.multinomial(q, 1)[:, 0]
        p_rows.append(P[prev])
        q_rows.append(q)
        drafts.append(d)
        prev = d
    p_rows.append(P[prev])
    return torch.stack(p_rows, 1), torch.stack(q_rows, 1), torch.stack(drafts, 1)


def first_two(out: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """[n] joint cell x0 * V + x1 of the first two generated tokens (x1 by plain sampling if needed)."""
    x0 = out[:, 0]
    assert bool((x0 >= 0).all())
    next_step = torch.multinomial(P[x0], 1)[:, 0]
    return x0 * V + torch.where(out[:, 1] >= 0, out[:, 1], next_step)


@pytest.mark.parametrize("k,one_hot", [(1, False), (2, False), (1, True)])
def test_lossless_with_triton_kernels(k, one_hot):
    P, Q = chain(1), chain(2)
    torch.manual_seed(200 + k)
    target, draft_probs, drafts = propose(P, Q, k, N)
    bonus = torch.multinomial(target[:, k], 1)
    out = RejectionSampler(kernel="triton")(target, bonus, None if one_hot else draft_probs, drafts)
    cells = counts_of(first_two(out, P), V * V)
    law = (P[CTX][:, None] * P).reshape(-1)
    assert chi_square_pvalue(cells, law) > 1e-3
    assert tv_distance(cells, law) < 0.02
    assert tv_distance(counts_of(out[:, 0], V), P[CTX]) < 0.01


def test_p_equals_q_and_disjoint_supports():
    P = chain(3)
    target, _, drafts = propose(P, P, 2, 2000)
    sampler = RejectionSampler(kernel="triton")
    out = sampler(target, torch.zeros(2000, 1, dtype=torch.int64), target[:, :2], drafts)
    assert bool((out[:, :2] == drafts).all())  # q == p: every draft accepted
    # draft mass only where the target has none: nothing accepted, recovered from p
    p = torch.zeros(2000, 2, V)
    p[..., :4] = 0.25
    q = torch.zeros(2000, 1, V)
    q[..., 4:] = 0.25
    out = sampler(p, torch.zeros(2000, 1, dtype=torch.int64), q, torch.full((2000, 1), 5))
    assert bool((out[:, 0] < 4).all()) and bool((out[:, 1] == -1).all())


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43] * 4]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_outputs():
    plain = LLM("tiny-random-llama", max_num_seqs=2, max_model_len=128)
    return [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                             use_tqdm=False)]


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3},  # chain verification: greedy_verify
    # tree speculation (draft = target: deep accepted paths, few steps): build_tree_mask in the draft and
    # the scorer, tree_greedy_accept in the verifier
    {"method": "proposers.tree_draft:TreeDraftProposer", "scorer": "tree", "model": "tiny-random-llama",
     "tree_depth": 3, "tree_topk": 2, "tree_budget": 5},
], ids=["ngram", "tree"])
def test_llm_greedy_equal_to_plain_with_triton_kernels(spec, plain_outputs):
    llm = LLM("tiny-random-llama", max_num_seqs=2, max_model_len=128, speculative_config={**spec, "kernel": "triton"})
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == plain_outputs
    assert llm.get_metrics().num_draft_tokens > 0
