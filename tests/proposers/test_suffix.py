"""Suffix decoding (proposers/suffix_tree.py, proposers/suffix.py).

- the trie's drafts (chain and tree, every match length, the min-probability and match-length caps) equal the
  brute-force reference's (proposers/suffix_reference.py) on seeded random sequences, built in one go or a token
  at a time, over the request's own tokens and over a global cache of other sequences;
- hand-written cases say why a draft is what it is;
- the global cache never holds more than ``cache_tokens`` tokens, and after evictions its trie is node for node
  the trie of the outputs it kept (no leaked node, no stale count); a finished request's trie is dropped;
- greedy output with method=suffix equals plain greedy on the tiny model: chains (mqa) and trees (tree scorer),
  at batch 1 and ragged 4; and as the branch grafted onto an EAGLE head's tree (``options.branch: suffix``);
- sampled output follows the target's law through suffix drafts (chi-square on the first two tokens).
"""

import random

import pytest
import torch

from specdec_kernels.testing import chi_square_pvalue, counts_of
from proposers.suffix import SuffixIndex, SuffixProposer
from proposers.suffix_reference import reference_draft
from proposers.suffix_tree import SuffixTrie
from specdec import LLM, SamplingParams
from specdec.spec_decode.config import SpeculativeConfig
from specdec.spec_decode.proposer import ProposeBatch, TreeShape
from tests.proposers.helpers import BATCHES, RAGGED, RAGGED_MAX, exact_first_two, generate_and_assert_greedy_equal, greedy

METHOD = "suffix"


def as_tuple(d):
    return d.token_ids, d.parents, d.probs, d.match_len


def random_case(rng: random.Random):
    V = rng.choice([2, 3, 5, 9])  # small vocabularies: many repeats, many ties
    seq = [rng.randrange(V) for _ in range(rng.randrange(1, 70))]
    tree_depth = rng.choice([None, 1, 2, 3, 6])
    return seq, dict(max_depth=rng.choice([2, 3, 4, 6, 24]), max_spec_tokens=rng.choice([1, 2, 4, 8]),
                     factor=rng.choice([0.5, 1.0, 2.0, 4.0]), offset=rng.choice([0.0, 1.0]),
                     min_prob=rng.choice([0.0, 0.1, 0.3, 0.6]), tree_depth=tree_depth)


# ---------------------------------------------------------------------------------------------- vs the reference
def test_drafts_equal_the_brute_force_reference_on_random_sequences():
    rng = random.Random(0)
    for case in range(300):
        seq, kw = random_case(rng)
        trie = SuffixTrie(kw["max_depth"])
        cut = rng.randrange(len(seq) + 1)  # built in two pieces: the incremental update is the one under test
        trie.extend(0, seq[:cut])
        trie.extend(0, seq[cut:])
        got = trie.best_draft(trie.own_matches(0), kw["max_spec_tokens"], kw["factor"], kw["offset"],
                              kw["min_prob"], kw["tree_depth"])
        want = reference_draft([seq], seq, kw["max_depth"], kw["max_spec_tokens"], kw["factor"], kw["offset"],
                               kw["min_prob"], kw["tree_depth"])
        assert as_tuple(got) == as_tuple(want), (case, seq, kw)


def test_step_by_step_drafts_equal_the_reference_at_every_step():
    """SuffixIndex as the proposer drives it: each step the sequence grows by 1..4 committed tokens."""
    rng = random.Random(1)
    for case in range(20):
        V, D = rng.choice([3, 6]), rng.choice([3, 8])
        index = SuffixIndex(max_depth=D, min_token_prob=0.1)
        seq = [rng.randrange(V) for _ in range(rng.randrange(1, 10))]
        for _ in range(15):
            for tree_depth in (None, 3):
                got = index.draft(7, seq, 5, tree_depth)
                want = reference_draft([seq], seq, D, 5, 1.0, 0.0, 0.1, tree_depth)
                assert as_tuple(got) == as_tuple(want), (case, seq)
            seq = seq + [rng.randrange(V) for _ in range(rng.randrange(1, 5))]


def test_matching_another_trie_equals_the_reference():
    """The global cache's path: the context is not in the trie, which holds several other sequences."""
    rng = random.Random(2)
    for case in range(150):
        seq, kw = random_case(rng)
        V = max(seq, default=1) + 1
        others = [[rng.randrange(V) for _ in range(rng.randrange(0, 40))] for _ in range(rng.randrange(1, 4))]
        trie = SuffixTrie(kw["max_depth"])
        for i, o in enumerate(others):
            trie.extend(i, o)
        got = trie.best_draft(trie.match(seq), kw["max_spec_tokens"], kw["factor"], kw["offset"], kw["min_prob"],
                              kw["tree_depth"])
        want = reference_draft(others, seq, kw["max_depth"], kw["max_spec_tokens"], kw["factor"], kw["offset"],
                               kw["min_prob"], kw["tree_depth"])
        assert as_tuple(got) == as_tuple(want), (case, seq, others, kw)


# ---------------------------------------------------------------------------------------------- hand-written
def draft(seq, k=8, tree_depth=None, D=24, factor=1.0, min_prob=0.1):
    t = SuffixTrie(D)
    t.extend(0, seq)
    return t.best_draft(t.own_matches(0), k, factor, 0.0, min_prob, tree_depth)


def test_a_repeated_passage_is_drafted_whole():
    # the context [1, 2, 3, 4] ended the first copy of 1..8: its continuation 5..8 follows. Each of the four
    # matched strings occurs twice (once continued, once at the end), so every token has probability 1/2.
    d = draft([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4])
    assert d.token_ids == [5, 6, 7, 8] and d.match_len == 4 and d.probs == [0.5] * 4


def test_the_match_length_caps_the_draft():
    # only [9] matches (once): factor 1.0 lets a 1-token match draft 1 token, factor 3.0 three
    seq = [9, 1, 2, 3, 7, 9]
    assert draft(seq).token_ids == [1]
    assert draft(seq, factor=3.0).token_ids == [1, 2, 3]


def test_the_most_frequent_continuation_wins_and_a_tree_holds_the_others():
    # after [5]: 6 twice, 7 once (and the context's own [5] once): p(6) = 2/4, p(7) = 1/4
    seq = [5, 6, 5, 6, 5, 7, 5]
    assert draft(seq, factor=1.0).token_ids == [6]
    t = draft(seq, k=2, tree_depth=1, factor=2.0)
    assert t.token_ids == [6, 7] and t.parents == [-1, -1] and t.probs == [0.5, 0.25]
    assert draft(seq, k=2, tree_depth=1, factor=2.0, min_prob=0.3).token_ids == [6]  # 7 is below 0.3


def test_nothing_matches_nothing_is_drafted():
    assert draft([1, 2, 3, 4]).token_ids == []
    assert draft([4]).token_ids == []


# ---------------------------------------------------------------------------------------------- state, cache
def rebuilt(seqs: list[list[int]], D: int) -> dict[tuple[int, ...], int]:
    t = SuffixTrie(D)
    for i, s in enumerate(seqs):
        t.extend(i, s)
    return strings(t)


def strings(t: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every node's string -> count, walking from the root (what the trie holds, reachable nodes only)."""
    out, stack = {}, [(0, ())]
    while stack:
        n, s = stack.pop()
        for tok, c in (t.kids[n] or {}).items():
            out[s + (tok,)] = t.count[c]
            stack.append((c, s + (tok,)))
    return out


def test_the_global_cache_keeps_its_bound_and_no_stale_node():
    rng = random.Random(3)
    index = SuffixIndex(max_depth=5, cache_tokens=60)
    kept: dict[int, list[int]] = {}
    for r in range(40):
        prompt = [rng.randrange(6) for _ in range(rng.randrange(1, 8))]
        out = [rng.randrange(6) for _ in range(rng.randrange(1, 30))]
        index.draft(r, prompt + out[:1], 4)  # first seen with its first output token
        index.draft(r, prompt + out, 4)
        index.free(r)
        assert r not in index.local and r not in index.start, "a finished request's trie must be dropped"
        assert index.cached_total == index.glob.num_tokens <= 60
        kept = {g: index.glob.seqs[g] for g in index.cached}
        assert kept[max(kept)] == out[-60:], "the newest output is cached (its last 60 tokens at most)"
        assert strings(index.glob) == rebuilt(list(kept.values()), 5)
        assert index.glob.num_nodes == len(strings(index.glob)) + 1, "freed nodes must not stay reachable or leak"
    assert len(kept) > 1


def test_the_global_cache_drafts_for_a_new_request():
    index = SuffixIndex(max_depth=8, cache_tokens=100)
    index.draft(0, [1, 2, 3], 4)
    index.draft(0, [1, 2, 3, 40, 41, 42, 43, 44, 45], 4)
    index.free(0)
    # a new request whose context ends in [41, 42]: its own tokens know nothing; the cache drafts 43, 44
    assert index.draft(1, [7, 41, 42], 4).token_ids == [43, 44]
    assert SuffixIndex(max_depth=8).draft(1, [7, 41, 42], 4).token_ids == []  # no cache: no draft


def test_a_cut_back_sequence_is_reindexed():
    index = SuffixIndex(max_depth=6)
    index.draft(0, [1, 2, 3, 1, 2, 3, 1, 2], 4)
    got = index.draft(0, [1, 2, 3, 1, 9], 4)  # not an extension of what the trie holds
    assert as_tuple(got) == as_tuple(reference_draft([[1, 2, 3, 1, 9]], [1, 2, 3, 1, 9], 6, 4, 1.0, 0.0, 0.1))
    assert index.local[0].seqs[0] == [1, 2, 3, 1, 9]


def test_proposer_pads_chains_and_trees():
    prop = SuffixProposer(None, SpeculativeConfig(method=METHOD, num_speculative_tokens=3), max_spec_factor=2.0)
    toks = [[1, 2, 3, 1, 2], [4, 5, 6]]
    batch = ProposeBatch(seq_ids=[0, 1], token_ids=toks, k=3, sampling_params=[SamplingParams(temperature=0.0)] * 2,
                         generators=[None] * 2)
    out = prop.propose(batch)
    assert out.probs is None and out.lens.tolist() == [3, 0]
    assert out.token_ids.tolist() == [[3, 1, 2], [-1, -1, -1]]
    tree = prop.propose_tree(batch, TreeShape(depth=2, topk=1, budget=4))
    assert tree.num_nodes.tolist() == [2, 0] and tree.token_ids[0].tolist() == [3, 1]
    prop.free(0)
    prop.free(1)
    assert not prop.index.local


# ---------------------------------------------------------------------------------------------- greedy equality
def spec(k: int = 4, **options) -> dict:
    return {"method": METHOD, "num_speculative_tokens": k, "options": options}


@pytest.mark.parametrize("batch", ["batch1", "ragged4"])
def test_chain_is_greedy_equal(tiny, batch):
    prompts, max_tokens = BATCHES[batch]
    spec_llm = generate_and_assert_greedy_equal(tiny, spec(4, max_spec_factor=2.0), prompts, max_tokens)
    assert not spec_llm.worker.top1.proposer.index.local, "every request's trie must be freed"


def test_chain_on_a_repeating_prompt_accepts_and_stays_greedy_equal(tiny):
    """RAGGED[2] repeats [40, 41, 42, 43]: the tiny model's greedy output falls into loops the trie learns."""
    spec_llm = generate_and_assert_greedy_equal(tiny, spec(6, max_spec_factor=2.0, cache_tokens=256),
                                                [RAGGED[2]], [greedy(60)])
    assert spec_llm.get_metrics().mean_acceptance_length > 1.5


@pytest.mark.parametrize("batch", ["batch1", "ragged4"])
def test_tree_is_greedy_equal(tiny, batch):
    prompts, max_tokens = BATCHES[batch]
    cfg = {**spec(4, max_spec_factor=2.0, min_token_prob=0.05), "scorer": "tree", "tree_depth": 4, "tree_budget": 8}
    generate_and_assert_greedy_equal(tiny, cfg, prompts, max_tokens)


@pytest.mark.parametrize("batch", ["batch1", "ragged4"])
def test_suffix_branch_in_an_eagle_tree_is_greedy_equal(tiny, batch):
    """options.branch=suffix: the random head's tree (which accepts next to nothing) plus the suffix draft."""
    from tests.proposers.test_eagle import random_head, tree_spec

    prompts, params = (([RAGGED[2]], [greedy(40)]) if batch == "batch1"
                       else (RAGGED, [greedy(m) for m in RAGGED_MAX]))
    plain_tree = generate_and_assert_greedy_equal(tiny, tree_spec(random_head(), 3, 3, 6), prompts, params)
    hybrid = generate_and_assert_greedy_equal(tiny, tree_spec(random_head(), 3, 3, 6, ngram_branch=3, branch="suffix"),
                                              prompts, params)
    prop = hybrid.worker.top1.proposer
    assert not prop.branch.index.local, "the branch's tries must be freed with their requests"
    assert hybrid.get_metrics().mean_acceptance_length > plain_tree.get_metrics().mean_acceptance_length


def test_a_misspelt_branch_is_refused(tiny):
    from proposers.eagle import EagleProposer
    from tests.proposers.test_eagle import random_head, tree_spec

    with pytest.raises(ValueError, match=r"options.branch='sufix' is not a branch drafter; one of \['ngram', 'suffix'\]"):
        EagleProposer.check_config(tree_spec(random_head(), 3, 3, 6, ngram_branch=3, branch="sufix"))


def test_sampled_first_two_tokens_follow_the_target():
    """Sampling (temperature 1) through suffix drafts, chain and tree: the joint law of (t1, t2) over 2048 requests
    is the target's (chi-square p > 1e-3). The prompt holds the tiny target's likeliest first tokens (31% of p1's
    mass, as in test_eagle.py), so for about a third of the requests t1 recurs and the trie drafts after it."""
    V, prompt, n = 512, [418, 457, 390, 459, 388, 476], 2048
    _, joint = exact_first_two(prompt)
    for extra in ({}, {"scorer": "tree", "tree_depth": 2, "tree_budget": 3}):
        llm = LLM("tiny-random-llama", max_num_seqs=256, max_model_len=24,
                  speculative_config={**spec(2, max_spec_factor=2.0, min_token_prob=0.0), **extra})
        outs = llm.generate([{"prompt_token_ids": prompt}] * n,
                            SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
        toks = torch.tensor([o.outputs[0].token_ids for o in outs])
        pval = chi_square_pvalue(counts_of(toks[:, 0] * V + toks[:, 1], V * V), joint)
        assert pval > 1e-3, f"{extra or 'chain'}: joint (t1, t2) chi-square p-value {pval:.2e}"
        assert llm.get_metrics().num_draft_tokens > n // 5, "the trie must draft for the requests whose t1 recurs"
