"""Sampling is lossless end to end: through ``LLM.generate`` on the tiny model, speculative sampling
produces tokens distributed exactly as the target's own sampling. (The verifier alone is proven on a
small vocabulary with >= 100k draws in tests/verify/test_chain.py; here the whole loop is: proposer's q,
scorer's positions, temperature/top-k on both sides, KV rollback, bonus and recovered tokens.)

Two checks, every threshold fixed in advance and every seed fixed (so the outcome is deterministic):

1. First two generated tokens, many short requests. Token 1 comes from the prefill (plain sampling),
   token 2 from the first speculative step (an accepted draft or the recovered token). Exact law:
   p(t1, t2) = p(t1 | prompt) p(t2 | prompt, t1), all 512 x 512 cells computed with a fresh target
   engine (one batched forward of the 512 one-token continuations). Tests:
   - Pearson chi-square over the joint, cells with expected count < 5 pooled (Cochran), p-value > 1e-3;
   - TV distance of the first-token marginal and of the joint, each over a partition into the 32 most
     probable cells + "everything else", below  0.5 * sum_c sqrt(p_c (1 - p_c) / N) + sqrt(ln(1e3) / (2N)):
     the first term bounds E[TV] (Jensen: E|p^_c - p_c| <= sd), the second is McDiarmid's deviation
     at delta = 1e-3 (one sample moves the TV by at most 1/N);
   - the randomised PIT of t2 under p(. | t1) (see 2.) is uniform: chi-square over 20 bins, p > 1e-3.
     Unlike the cell counts it uses every sample, so a bias spread thinly over the 512 x 512 cells shows:
     recovering from p instead of norm(max(p - q, 0)) fails it with p ~ 1e-26 (checked by hand);
   - power: the same speculative samples are rejected (p < 1e-6) against p(t1) q(t2 | t1), the law they
     would have if every draft were accepted.
2. Every token of long generations (randomised probability integral transform). For the i-th token x
   with exact conditional p_i (recomputed by a fresh target forward of the finished sequence, after
   temperature / top-k), u = F_i(x) - U * p_i(x), with F_i the cumulative mass in descending-probability
   order and U ~ Uniform(0, 1) independent. Lossless <=> each u is Uniform(0, 1) given the past, so the
   u's are i.i.d. uniform; chi-square over 20 equal bins, p-value > 1e-3. This covers every position of
   a step, the bonus token and steps after rejections. Power: the same tokens scored against the wrong
   law (temperature 1 instead of 0.7; or the draft's own law) are rejected with p < 1e-6; the wrong
   recovery above fails it with p ~ 1e-14.
"""

import math

import pytest
import torch

from specdec_kernels.testing import chi_square_pvalue, counts_of, tv_distance
from specdec import LLM, SamplingParams
from specdec.engine import ForwardBatch
from specdec.engine.testing import rand_tokens
from specdec.engine.tiny import tiny_random_llama
from tests.spec_decode.helpers import DELTA, ids, noisy_tiny_engine, pit_from_probs, target_forward, uniformity_pvalue

V = 512
PROMPT = [1, 17, 42, 99, 3]


def exact_first_two(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(p1 [V], joint [V*V]) of the tiny model with ``seed`` (the target: 0) after PROMPT, temperature 1."""
    engine = tiny_random_llama(seed, num_slots=V, max_model_len=8)
    p1 = torch.softmax(target_forward(engine, PROMPT).logits[-1].double(), -1)
    slots = [engine.allocate_slot() for _ in range(V)]
    n = len(PROMPT) + 1
    out = engine.forward(ForwardBatch(
        token_ids=torch.tensor([t for x in range(V) for t in PROMPT + [x]]), slots=slots, query_lens=[n] * V,
        logits_indices=torch.arange(V) * n + n - 1))  # logits [V, V]: row x = p(. | PROMPT, x)
    p2 = torch.softmax(out.logits.double(), -1)
    return p1, (p1[:, None] * p2).reshape(-1)


def tv_bound(probs: torch.Tensor, n: int) -> float:
    return 0.5 * float((probs * (1 - probs) / n).sqrt().sum()) + math.sqrt(math.log(1 / DELTA) / (2 * n))


def top_partition(counts: torch.Tensor, probs: torch.Tensor, m: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts and probs over the m most probable cells + one 'everything else' cell."""
    top = probs.topk(m).indices
    rest_p, rest_c = 1 - probs[top].sum(), counts.sum() - counts[top].sum()
    return torch.cat([counts[top], rest_c.reshape(1)]), torch.cat([probs[top], rest_p.reshape(1)])


@pytest.fixture(scope="module")
def exact():
    return exact_first_two(0)


FIRST_TWO = {  # name -> (speculative_config or None, number of samples)
    "plain": (None, 2048),
    "draft_other_seed_k2": ({"method": "draft_model", "model": "tiny-random-llama", "num_speculative_tokens": 2,
                             "options": {"seed": 1}}, 4096),
    "draft_equals_target_k2": ({"method": "draft_model", "model": "tiny-random-llama",
                                "num_speculative_tokens": 2}, 2048),
}


@pytest.mark.parametrize("name", list(FIRST_TWO))
def test_first_two_tokens_follow_the_target(name, exact):
    spec, n = FIRST_TWO[name]
    p1, joint = exact
    llm = LLM("tiny-random-llama", max_num_seqs=256, max_model_len=16, speculative_config=spec)
    outs = llm.generate(ids([PROMPT] * n), SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True),
                        use_tqdm=False)
    toks = torch.tensor([o.outputs[0].token_ids for o in outs])  # [n, 2]
    cells = counts_of(toks[:, 0] * V + toks[:, 1], V * V)
    first = counts_of(toks[:, 0], V)
    pval = chi_square_pvalue(cells, joint)
    assert pval > DELTA, f"{name}: joint (t1, t2) chi-square p-value {pval:.2e}"
    for what, c, p in (("first token", first, p1), ("joint", cells, joint)):
        c, p = top_partition(c, p)
        tv, bound = tv_distance(c, p), tv_bound(p, n)
        assert tv <= bound, f"{name}: TV of the {what} = {tv:.4f} > bound {bound:.4f} (N={n})"
    # the 2nd token given the 1st through the randomised PIT (see check 2): uses every sample, not only
    # the frequent cells, so it sees a bias spread thinly over many cells
    p2 = joint.reshape(V, V) / p1[:, None]  # [V, V] p(t2 | t1)
    u = pit_from_probs(p2[toks[:, 0]], toks[:, 1], torch.Generator().manual_seed(0))
    pval = uniformity_pvalue(u)
    assert pval > DELTA, f"{name}: PIT of t2 given t1, chi-square p-value {pval:.2e}"
    if spec is not None:
        m = llm.get_metrics()
        assert m.num_draft_tokens == n * 2  # every request speculated once
        if name == "draft_equals_target_k2":
            assert m.acceptance_rate > 0.999  # p == q: min(1, p/q) = 1 (up to float rounding)
        else:
            assert 0.05 < m.acceptance_rate < 0.9
            _, draft_joint = exact_first_two(1)
            wrong = (p1[:, None] * (draft_joint.reshape(V, V) / draft_joint.reshape(V, V).sum(1, keepdim=True)))
            assert chi_square_pvalue(cells, wrong.reshape(-1)) < 1e-6, "the check has no power"


# ----------------------------------------------------------------------------------- every token (PIT)


def processed_probs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """[n, V] raw logits -> the sampling law: softmax(logits / T) restricted to the top_k, renormalised."""
    logits = logits.double() / temperature
    if top_k > 0:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.softmax(logits, -1)


def pit_values(engine, prompts, outputs, temperature, top_k, gen) -> torch.Tensor:
    """Randomised PIT of every generated token under the exact conditional law."""
    us = []
    for prompt, out in zip(prompts, outputs):
        logits = target_forward(engine, (prompt + out)[:-1]).logits[len(prompt) - 1:]  # [len(out), V]
        us.append(pit_from_probs(processed_probs(logits, temperature, top_k), torch.tensor(out), gen))
    return torch.cat(us)


PIT = {  # name -> (speculative_config factory, temperature, top_k)
    "draft_other_seed_k3": (lambda: {"method": "draft_model", "model": "tiny-random-llama",
                                     "num_speculative_tokens": 3, "options": {"seed": 1}}, 1.0, -1),
    "layer_skip_k3": (lambda: {"method": "layer_skip", "num_layers": 2, "num_speculative_tokens": 3}, 1.0, -1),
    "ngram_k3_batch_expansion": (lambda: {"method": "ngram", "num_speculative_tokens": 3,
                                          "scorer": "batch_expansion"}, 1.0, -1),
    "draft_noisy_k3_t0.7_topk50": (lambda: {"method": "draft_model", "num_speculative_tokens": 3, "options": {
        "engine": noisy_tiny_engine(0.15, num_slots=32)}}, 0.7, 50),
    # EAGLE-2's deterministic tree of a seeded random head with a prompt-lookup branch grafted on, the head giving
    # up its worst-ranked nodes to make room (proposers/ngram_branch.py graft_within_budget): sibling one-hot
    # drafts verified against the residual, from whichever drafter they came
    "eagle_tree_ngram_branch_t0.7_topk50": (lambda: {
        "method": "eagle", "model": "tiny-random-llama", "num_speculative_tokens": 3, "scorer": "tree",
        "tree_depth": 3, "tree_topk": 3, "tree_budget": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 4,
        "options": {"ngram_branch": 3}}, 0.7, 50),
}
PIT_PROMPTS = [rand_tokens(3 + 5 * (i % 7), seed=100 + i) for i in range(32)]
PIT_TOKENS = 64  # 32 x 64 = 2,048 tokens per configuration


@pytest.mark.parametrize("name", list(PIT))
def test_every_generated_token_follows_the_target(name, plain_tiny):
    make, temperature, top_k = PIT[name]
    llm = LLM("tiny-random-llama", max_num_seqs=32, max_model_len=128, speculative_config=make())
    sp = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=PIT_TOKENS, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(ids(PIT_PROMPTS), sp, use_tqdm=False)]
    assert all(len(o) == PIT_TOKENS for o in outs)
    m = llm.get_metrics()
    assert m.num_draft_tokens > 0 and m.num_accepted_tokens > 0, "nothing was speculated or accepted"
    u = pit_values(plain_tiny.engine, PIT_PROMPTS, outs, temperature, top_k, torch.Generator().manual_seed(0))
    pval = uniformity_pvalue(u)
    assert pval > DELTA, (f"{name}: PIT chi-square p-value {pval:.2e} over {u.numel()} tokens "
                          f"(tau {m.mean_acceptance_length:.2f})")
    # power: the same tokens scored against a wrong law must fail: the target without temperature /
    # top-k, or the draft model's own law (what "accept every draft" would give)
    if temperature != 1.0:
        wrong_engine = plain_tiny.engine
    else:
        wrong_engine = getattr(llm.worker.top1.proposer, "engine", None)  # ngram has no law of its own
    if wrong_engine is not None:
        wrong = pit_values(wrong_engine, PIT_PROMPTS, outs, 1.0, -1, torch.Generator().manual_seed(0))
        assert uniformity_pvalue(wrong) < 1e-6, "the check has no power"


# ----------------------------------------------------------------------------------- seeded requests


SEEDED = {  # name -> speculative_config factory for max_num_seqs slots
    "draft_noisy": lambda slots: {"method": "draft_model", "num_speculative_tokens": 3,
                                  "options": {"engine": noisy_tiny_engine(0.15, num_slots=slots)}},
    "ngram": lambda slots: {"method": "ngram", "num_speculative_tokens": 3, "scorer": "batch_expansion"},
}


@pytest.mark.parametrize("name", [
    "draft_noisy",
    # Regression: when no sequence of a step had a proposal, SpecDecodeWorker fell back to the plain
    # sampler, which draws only the [V] exponential race from a seeded request's generator, while a
    # length-0 row inside a batch with proposals went through the verifier (k uniforms first). A seeded
    # ngram request then depended on the rest of the batch. The worker now always verifies.
    "ngram",
])
def test_seeded_requests_reproduce_whatever_the_batch(name):
    def make(max_num_seqs):
        return LLM("tiny-random-llama", max_num_seqs=max_num_seqs, max_model_len=128,
                   speculative_config=SEEDED[name](max_num_seqs))

    prompt = {"prompt_token_ids": [4, 5, 6, 4, 5, 6]}
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    llm = make(4)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)]
    batch = llm.generate([{"prompt_token_ids": [9, 9]}, prompt, {"prompt_token_ids": [1] * 20},
                          {"prompt_token_ids": [3, 1, 4]}], [others[0], seeded, others[1], others[2]],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    # a fresh LLM where the request waits for a slot and then joins a running batch
    late = make(2).generate([{"prompt_token_ids": [9, 9]}, {"prompt_token_ids": [1] * 20}, prompt],
                            [others[0], others[1], seeded], use_tqdm=False)
    assert late[2].outputs[0].token_ids == alone
    assert llm.get_metrics().num_accepted_tokens > 0  # the seeded path really went through verification
    different = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=24, ignore_eos=True)
    assert llm.generate([prompt], different, use_tqdm=False)[0].outputs[0].token_ids != alone


@pytest.mark.parametrize("name", ["draft_other_seed_k3", "layer_skip_k3"])
def test_every_generated_token_follows_the_target_in_bf16(name):
    """The PIT check with a bf16 target (issue #19): the verifier sees the same target law whether a row is
    scored alone or among k+1 rows only because the kernels are batch-invariant in bf16 too."""
    make, temperature, top_k = PIT[name]
    ref = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256, dtype="bfloat16")
    if not ref.engine.batch_invariant:
        pytest.skip("native kernels unavailable: bf16 speculation is refused on the torch path")
    llm = LLM("tiny-random-llama", max_num_seqs=32, max_model_len=128, dtype="bfloat16", speculative_config=make())
    sp = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=PIT_TOKENS, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(ids(PIT_PROMPTS), sp, use_tqdm=False)]
    m = llm.get_metrics()
    assert m.num_draft_tokens > 0 and m.num_accepted_tokens > 0, "nothing was speculated or accepted"
    u = pit_values(ref.engine, PIT_PROMPTS, outs, temperature, top_k, torch.Generator().manual_seed(0))
    pval = uniformity_pvalue(u)
    assert pval > DELTA, f"{name} bf16: PIT chi-square p-value {pval:.2e} over {u.numel()} tokens"
    wrong = pit_values(llm.worker.top1.proposer.engine, PIT_PROMPTS, outs, 1.0, -1, torch.Generator().manual_seed(0))
    assert uniformity_pvalue(wrong) < 1e-6, "the check has no power"
