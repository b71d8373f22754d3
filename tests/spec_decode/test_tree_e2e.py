"""Tree speculation end to end: ``LLM(..., speculative_config={"scorer": "tree", ...})`` with
proposers/tree_draft.py is token-identical to plain greedy decoding (batch 1, a ragged batch of 4, a
queue of 6 for 4 slots), leaks no KV slot, refuses chain-only proposers, and samples reproducibly.

Regimes: draft = target with topk=1 (the tree is the draft's greedy path: every draft accepted, tau =
depth + 1 exactly), draft = target with a bushy tree (the first draft always accepted), a different-seed
draft (almost nothing accepted) and a noisy copy of the target (partly accepted, paths through later
siblings: the KV compaction is exercised with gaps).
"""

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.engine.testing import rand_tokens
from tests.spec_decode.helpers import assert_greedy_equal, ids, noisy_tiny_engine, target_forward

TREE = "proposers.tree_draft:TreeDraftProposer"
RAGGED = [[5, 6, 7], rand_tokens(12, seed=1), [40, 41, 42, 43] * 6 + [7, 8, 9], rand_tokens(50, seed=2)]
RAGGED_MAX = [37, 20, 45, 9]
QUEUE = RAGGED + [rand_tokens(8, seed=3), [9] * 15]
QUEUE_MAX = RAGGED_MAX + [25, 14]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


SCENARIOS = {
    "batch1": ([[1, 17, 42, 99, 3]], [greedy(40)]),
    "ragged4": (RAGGED, [greedy(m) for m in RAGGED_MAX]),
    "queue6": (QUEUE, [greedy(m) for m in QUEUE_MAX]),
}

CONFIGS = {  # name -> (speculative_config factory, acceptance check on the metrics)
    "same_chain": (lambda: {"model": "tiny-random-llama", "tree_depth": 4, "tree_topk": 1, "tree_budget": 4},
                   lambda m: m.mean_acceptance_length == 5.0),  # tau = depth + 1: the whole path
    "same_bushy": (lambda: {"model": "tiny-random-llama", "tree_depth": 4, "tree_topk": 3, "tree_budget": 12},
                   lambda m: m.acceptance_counts[1] == m.acceptance_counts[0] and m.mean_acceptance_length > 3),
    "other_seed": (lambda: {"model": "tiny-random-llama", "options": {"seed": 1}, "tree_depth": 3, "tree_topk": 3,
                    "tree_budget": 8}, lambda m: m.mean_acceptance_length < 1.3),
    "noisy": (lambda: {"options": {"engine": noisy_tiny_engine(0.15)}, "tree_depth": 4, "tree_topk": 2,
               "tree_budget": 8}, lambda m: 1.3 < m.mean_acceptance_length < 4.5),
}


@pytest.fixture(scope="module")
def refs(plain_tiny):
    return {name: plain_tiny.generate(ids(p), sp, use_tqdm=False) for name, (p, sp) in SCENARIOS.items()}


def tree_llm(cfg: dict, max_model_len: int = 256) -> LLM:
    return LLM("tiny-random-llama", max_num_seqs=4, max_model_len=max_model_len,
               speculative_config={"method": TREE, "scorer": "tree", **cfg})


def assert_no_leak(llm: LLM) -> None:
    assert llm.engine.num_free_slots() == llm.engine.num_slots, "target KV slots leaked"
    draft = llm.worker.top1.proposer.engine
    assert draft.num_free_slots() == draft.num_slots, "draft KV slots leaked"
    assert not llm.worker.top1.proposer._drafted, "tree state of finished sequences leaked"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equal_to_plain(name, refs, plain_tiny):
    make, check = CONFIGS[name]
    llm = tree_llm(make())
    for scen, (prompts, sp) in SCENARIOS.items():
        outs = llm.generate(ids(prompts), sp, use_tqdm=False)
        assert_greedy_equal(plain_tiny.engine, prompts, outs, refs[scen], f"tree/{name}/{scen}")
        assert_no_leak(llm)
    m = llm.get_metrics()
    why = f"{name}: tau {m.mean_acceptance_length:.3f}, counts {m.acceptance_counts}"
    assert m.num_draft_tokens > 0 and check(m), why


def test_near_max_model_len_rows_fall_back_to_plain(monkeypatch):
    """A row whose tree would not fit in max_model_len=48 decodes plainly (0 nodes) in the same step as a
    row that speculates, and stops at the length cap exactly as plain decoding does."""
    from specdec.spec_decode.spec_decode_worker import SpecDecodeWorker

    steps = []
    verify = SpecDecodeWorker._verify

    def spy(self, metas, proposals, scores):
        steps.append(proposals.num_nodes.tolist())
        return verify(self, metas, proposals, scores)

    monkeypatch.setattr(SpecDecodeWorker, "_verify", spy)
    prompts = [rand_tokens(30, seed=7), [3, 4, 5]]
    sp = [greedy(40), greedy(30)]
    ref = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=48).generate(ids(prompts), sp, use_tqdm=False)
    llm = tree_llm({"model": "tiny-random-llama", "tree_depth": 3, "tree_topk": 2, "tree_budget": 6}, max_model_len=48)
    outs = llm.generate(ids(prompts), sp, use_tqdm=False)
    assert_greedy_equal(llm.engine, prompts, outs, ref, "near max_model_len")
    out = outs[0].outputs[0]
    assert out.finish_reason == "length" and len(prompts[0]) + len(out.token_ids) == 48
    assert [0, 6] in steps and [6, 6] in steps, steps  # row 0 stopped speculating while row 1 went on
    assert_no_leak(llm)


def test_sampling_is_seeded_and_greedy_rows_stay_exact(refs):
    """A mixed batch: greedy rows equal plain greedy; seeded random rows give the same tokens twice."""
    prompts, greedy_sp = SCENARIOS["ragged4"]
    sp = [greedy_sp[0], SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=20, ignore_eos=True),
          greedy_sp[2], SamplingParams(temperature=1.2, seed=6, max_tokens=9, ignore_eos=True)]
    cfg = {"options": {"engine": noisy_tiny_engine(0.15)}, "tree_depth": 3, "tree_topk": 2, "tree_budget": 6}
    runs = [tree_llm(dict(cfg)).generate(ids(prompts), sp, use_tqdm=False) for _ in range(2)]
    for i in (0, 2):
        assert runs[0][i].outputs[0].token_ids == refs["ragged4"][i].outputs[0].token_ids
    for i in (1, 3):
        assert runs[0][i].outputs[0].token_ids == runs[1][i].outputs[0].token_ids
        assert len(runs[0][i].outputs[0].token_ids) == sp[i].max_tokens


def test_a_seeded_request_samples_the_same_alone_or_in_a_batch():
    """Its draws come from its own generator in a fixed amount per step, whatever the other rows' trees.
    The seeded row runs into max_model_len (its last steps draft no tree), alone (then the batch has no
    tree at all) and beside rows that still draft full trees."""
    cfg = {"options": {"engine": noisy_tiny_engine(0.15)}, "tree_depth": 3, "tree_topk": 2, "tree_budget": 6}
    prompt = rand_tokens(44, seed=8)
    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=30, ignore_eos=True)  # capped at 64 - 44
    alone = tree_llm(dict(cfg), max_model_len=64).generate(ids([prompt]), seeded, use_tqdm=False)
    batch = tree_llm(dict(cfg), max_model_len=64).generate(
        ids([prompt, [5, 6, 7], rand_tokens(9, seed=9)]),
        [seeded, greedy(40), SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)], use_tqdm=False)
    assert len(alone[0].outputs[0].token_ids) == 20
    assert batch[0].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_chain_only_proposer_is_refused():
    with pytest.raises(ValueError, match="scorer=tree needs a tree-capable proposer; ngram is chain-only"):
        LLM("tiny-random-llama", max_num_seqs=2, max_model_len=64,
            speculative_config={"method": "ngram", "scorer": "tree"})
    with pytest.raises(ValueError, match="acceptance_method='typical_acceptance' is chain-only"):
        tree_llm({"model": "tiny-random-llama", "acceptance_method": "typical_acceptance"})


def test_logprobs_follow_the_accepted_path(plain_tiny):
    """The chosen-token logprobs of tree steps (read at the accepted nodes' rows) equal plain decoding's."""
    prompt = [[1, 17, 42, 99, 3]]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    ref = plain_tiny.generate(ids(prompt), sp, use_tqdm=False)[0].outputs[0]
    llm = tree_llm({"model": "tiny-random-llama", "tree_depth": 3, "tree_topk": 2, "tree_budget": 6})
    out = llm.generate(ids(prompt), sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref.token_ids
    for t, a, b in zip(out.token_ids, out.logprobs, ref.logprobs):
        assert abs(a[t].logprob - b[t].logprob) < 1e-4


def test_hidden_states_are_the_targets_at_the_accepted_path():
    """After each tree step, a proposer that reads features (an EAGLE head) has one HiddenStates row per
    committed token since it last read: the target's states at the pending token and each accepted node,
    which are the states of the tokens before the new pending one."""
    from specdec.heads import HeadConfig, build_head
    from specdec.engine.tiny import tiny_config

    torch.manual_seed(0)
    head = build_head(HeadConfig.for_target(tiny_config(), "eagle"))
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256, speculative_config={
        "method": "eagle", "num_speculative_tokens": 3, "scorer": "tree", "tree_depth": 3, "tree_topk": 2,
        "tree_budget": 6, "options": {"head_module": head}})
    rid = llm.add_request({"prompt_token_ids": [1, 17, 42, 99, 3]},
                          SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    llm.step()  # prefill: every prompt token's row
    seq = llm.llm_engine.groups[rid].first_seq
    hidden = target_forward(llm.engine, seq.data.get_token_ids()[:-1]).hidden_states
    torch.testing.assert_close(llm.worker.hidden_states.hidden_states, hidden, atol=1e-4, rtol=1e-4)
    for _ in range(6):
        before = seq.get_len()
        llm.step()
        toks = seq.data.get_token_ids()
        n_acc = seq.get_len() - before - 1
        hidden = target_forward(llm.engine, toks[:-1]).hidden_states  # [len-1, D]
        hs = llm.worker.hidden_states
        assert hs.seq_ids == [seq.seq_id] * (n_acc + 1)
        torch.testing.assert_close(hs.hidden_states, hidden[-(n_acc + 1):], atol=1e-4, rtol=1e-4)
