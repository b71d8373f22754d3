"""SpecDecodeWorker edge cases, end to end through LLM: k = 0 near max_model_len, disable_by_batch_size,
empty proposals, HiddenStates threading (bonus expansion, pruning), slot hygiene with aborts, NaN logits.
Every run is also checked token for token against plain greedy decoding."""

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.engine.testing import rand_tokens
from specdec.engine.tiny import tiny_random_llama
from specdec.spec_decode.proposer import DraftOutput, FeatureSpec, Proposer, ProposeBatch
from specdec.spec_decode.registry import register_proposer
from tests.spec_decode.helpers import (CorruptedGreedyProposer, assert_greedy_equal, ids, noisy_tiny_engine,
                                      target_forward)

DRAFT_SAME = {"method": "draft_model", "model": "tiny-random-llama"}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def plain(max_model_len: int = 256, max_num_seqs: int = 4) -> LLM:
    return LLM("tiny-random-llama", max_num_seqs=max_num_seqs, max_model_len=max_model_len)


def assert_all_free(llm: LLM) -> None:
    assert llm.engine.num_free_slots() == llm.engine.num_slots, "target slots leaked"
    assert not llm.worker.plain.slots.slot_of and not llm.worker.plain.slots.seqs_of
    prop = llm.worker.top1.proposer
    if hasattr(prop, "engine"):
        assert prop.engine.num_free_slots() == prop.engine.num_slots, "draft slots leaked"
        assert not prop.slot_of


def record_steps(llm: LLM) -> list[tuple[int, bool, list[int]]]:
    """Wrap the worker: per step (running_queue_size, is_prompt, num_proposed per group)."""
    log, inner = [], llm.worker.execute_model

    def execute_model(req):
        out = inner(req)
        log.append((req.running_queue_size, req.seq_group_metadata_list[0].is_prompt,
                    [g.num_proposed for g in out.outputs]))
        return out

    llm.worker.execute_model = execute_model
    llm.llm_engine.worker = llm.worker
    return log


# ------------------------------------------------------------------------------------- k per sequence


@pytest.mark.parametrize("scorer", ["mqa", "batch_expansion"])
def test_k_is_0_within_k_plus_1_tokens_of_max_model_len(scorer):
    k, max_len = 3, 40
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=max_len,
              speculative_config={**DRAFT_SAME, "num_speculative_tokens": k, "scorer": scorer})
    log = record_steps(llm)
    # 20-token prompt runs into max_model_len; the short one shares the batch and keeps speculating
    prompts = [rand_tokens(20, seed=1), [5, 6, 7]]
    sp = [greedy(100), greedy(30)]
    outs = llm.generate(ids(prompts), sp, use_tqdm=False)
    ref = plain(max_len).generate(ids(prompts), sp, use_tqdm=False)
    assert_greedy_equal(llm.engine, prompts, outs, ref, "near max_model_len")
    long = outs[0]
    assert len(long.prompt_token_ids) + len(long.outputs[0].token_ids) == max_len
    assert long.outputs[0].finish_reason == "length"
    # draft = target: 4 tokens per step from length 21 to 37, then k = 0 (37 + 4 > 40): 3 plain steps
    assert long.metrics.spec_token_acceptance_counts == [7, 4, 4, 4]
    assert any(0 in props and any(props) for _, prompt, props in log if not prompt)  # a mixed-k step ran
    assert_all_free(llm)


def test_disable_by_batch_size_turns_speculation_off_for_the_whole_batch():
    llm = LLM("tiny-random-llama", max_num_seqs=2, max_model_len=256,
              speculative_config={**DRAFT_SAME, "num_speculative_tokens": 3, "disable_by_batch_size": 2})
    log = record_steps(llm)
    prompts = [rand_tokens(5 + 3 * i, seed=20 + i) for i in range(6)]
    sp = [greedy(m) for m in (12, 30, 9, 17, 25, 14)]
    outs = llm.generate(ids(prompts), sp, use_tqdm=False)
    assert_greedy_equal(llm.engine, prompts, outs, plain(max_num_seqs=2).generate(ids(prompts), sp, use_tqdm=False),
                        "disable_by_batch_size")
    decode = [(q, props) for q, prompt, props in log if not prompt]
    off = [props for q, props in decode if q >= 2]
    on = [props for q, props in decode if q < 2]
    assert off and on, "both regimes must occur"
    assert all(p == 0 for props in off for p in props), "speculated while running_queue_size >= threshold"
    assert all(p == 3 for props in on for p in props)
    assert llm.get_metrics().num_draft_tokens == 3 * sum(len(props) for props in on)
    assert_all_free(llm)


class NothingProposer(Proposer):
    """Returns no draft at all: [B, 0] token ids."""

    def propose(self, batch: ProposeBatch) -> DraftOutput:
        return DraftOutput(token_ids=torch.empty(len(batch.seq_ids), 0, dtype=torch.long), probs=None)


class SomeNothingProposer(Proposer):
    """Length 0 for even seq ids; two wrong-ish tokens (shorter than k) for odd ones."""

    def propose(self, batch: ProposeBatch) -> DraftOutput:
        B, k = len(batch.seq_ids), batch.k
        toks = torch.full((B, k), -1, dtype=torch.long)
        lens = torch.tensor([0 if s % 2 == 0 else 2 for s in batch.seq_ids])
        for b, t in enumerate(batch.token_ids):
            toks[b, :2] = torch.tensor([t[-1], t[-2]])  # echo the context backwards: sometimes right
        return DraftOutput(token_ids=toks, probs=None, lens=lens)


register_proposer("nothing_test", NothingProposer)
register_proposer("some_nothing_test", SomeNothingProposer)


@pytest.mark.parametrize("method", ["nothing_test", "some_nothing_test"])
def test_empty_proposals_fall_back_to_plain_decoding(method, plain_tiny):
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256,
              speculative_config={"method": method, "num_speculative_tokens": 3})
    prompts = [[5, 6, 7], rand_tokens(12, seed=1), [9] * 7]
    sp = [greedy(m) for m in (20, 11, 16)]
    outs = llm.generate(ids(prompts), sp, use_tqdm=False)
    assert_greedy_equal(plain_tiny.engine, prompts, outs, plain_tiny.generate(ids(prompts), sp, use_tqdm=False), method)
    m = llm.get_metrics()
    if method == "nothing_test":
        assert m.num_draft_tokens == 0 and m.mean_acceptance_length == 1.0 and m.num_accepted_tokens == 0
    else:
        assert m.num_draft_tokens > 0
    assert_all_free(llm)


# ------------------------------------------------------------------------------------- HiddenStates


class RecordingProposer(CorruptedGreedyProposer):
    """Greedy target drafts, corrupted w.p. 1 - alpha (so some steps end in a bonus, some do not); records
    what the worker threads to it each step."""

    features = FeatureSpec(history=None)
    records: list = []

    def propose(self, batch: ProposeBatch) -> DraftOutput:
        hs = batch.hidden_states
        type(self).records.append(dict(
            seq_ids=list(batch.seq_ids), tokens=[list(t) for t in batch.token_ids],
            bonus=set(batch.seq_ids_with_bonus_token_in_last_step),
            hs_ids=None if hs is None else hs.seq_ids, hs=None if hs is None else hs.hidden_states.clone()))
        return super().propose(batch)


class LastTwoProposer(RecordingProposer):
    features = FeatureSpec(history=2)  # the seed's rows: at most the last two (second-last, last)


register_proposer("recording_test", RecordingProposer)
register_proposer("last_two_test", LastTwoProposer)


@pytest.mark.parametrize("method", ["recording_test", "last_two_test"])
@pytest.mark.parametrize("scorer", ["mqa", "batch_expansion"])
def test_hidden_states_threading_matches_the_target(scorer, method, plain_tiny):
    """Each sequence gets the target's states of the tokens committed since its proposer last read (the
    prompt's on the first step), in order, ending at the token before the pending one; at most
    FeatureSpec.history of them. A bonus step threads the last accepted draft's state, which the
    proposer never ran, before the bonus-producing one: the seed's bonus expansion."""
    RecordingProposer.records = []
    history = {"recording_test": None, "last_two_test": 2}[method]
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256, speculative_config={
        "method": method, "num_speculative_tokens": 2, "scorer": scorer, "options": {"alpha": 0.6}})
    prompts = [[5, 6, 7], rand_tokens(12, seed=1), rand_tokens(25, seed=2), [9] * 7, rand_tokens(4, seed=3)]
    max_tokens = [40, 12, 25, 6, 20]  # ragged: requests finish mid-run; the 5th waits for a slot
    sp = [greedy(m) for m in max_tokens]
    outs = llm.generate(ids(prompts), sp, use_tqdm=False)
    assert_greedy_equal(plain_tiny.engine, prompts, outs, plain_tiny.generate(ids(prompts), sp, use_tqdm=False),
                        "recording")
    ref = tiny_random_llama(0, num_slots=1, max_model_len=256)
    finished: set[int] = set()
    seen_bonus = 0
    prev: set[int] = set()
    read_at: dict[int, int] = {}  # seq -> its length when the proposer last read it
    for rec in RecordingProposer.records:
        assert rec["hs"] is not None, "a proposer with a FeatureSpec got no hidden states"
        live = set(rec["seq_ids"])
        finished |= prev - live
        assert set(rec["hs_ids"]) == live, "hidden states not pruned to the live batch"
        assert not finished & set(rec["hs_ids"]), "rows of a finished request survived"
        for s, toks in zip(rec["seq_ids"], rec["tokens"]):
            rows = [i for i, x in enumerate(rec["hs_ids"]) if x == s]
            h = target_forward(ref, toks[:-1]).hidden_states  # [L-1, D] every token the target has seen
            new = len(toks) - read_at.get(s, 1)  # tokens committed since the last read (a prompt: all but one)
            want = new if history is None else min(new, history)
            assert len(rows) == want, f"seq {s}: {len(rows)} rows, expected {want}"
            if s in rec["bonus"]:
                seen_bonus += 1
                assert len(rows) >= 2, "a bonus step must thread the last accepted draft's state too"
            torch.testing.assert_close(rec["hs"][rows], h[-len(rows):], atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"seq {s} at length {len(toks)}: {m}")
            read_at[s] = len(toks)
        prev = live
    assert seen_bonus >= 5, seen_bonus
    assert_all_free(llm)


# ------------------------------------------------------------------------------------- hygiene, errors


def test_no_slot_leak_with_aborts_and_mixed_sampling():
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=96, speculative_config={
        "method": "draft_model", "num_speculative_tokens": 3,
        "options": {"engine": noisy_tiny_engine(0.15, num_slots=4, max_model_len=96)}})
    gen = torch.Generator().manual_seed(0)
    for i in range(40):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        sp = SamplingParams(temperature=float(i % 2), max_tokens=1 + i % 9, ignore_eos=True,
                            seed=i if i % 3 == 0 else None)
        llm.add_request({"prompt_token_ids": rand_tokens(n, seed=i)}, sp, request_id=f"q{i}")
        if i % 7 == 0:
            llm.abort(f"q{i}")  # while waiting
        if i % 2 == 0:
            llm.step()
            running = llm.llm_engine.scheduler.running
            if i % 6 == 0 and running:
                llm.abort(running[-1].request_id)  # while running, between speculative steps
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.get_metrics().num_draft_tokens > 0
    assert_all_free(llm)


@pytest.mark.parametrize("scorer", ["mqa", "batch_expansion"])
def test_nan_target_logits_stop_one_request_others_equal_plain(scorer, monkeypatch, plain_tiny):
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256, speculative_config={
        "method": "draft_model", "num_speculative_tokens": 3, "scorer": scorer,
        "options": {"engine": noisy_tiny_engine(0.15)}})
    real_forward, calls = llm.engine.forward, {"n": 0}

    def forward(batch):
        out = real_forward(batch)
        calls["n"] += 1
        slot = llm.worker.plain.slots.slot_of.get(0)  # request 0's sequence
        if calls["n"] > 4 and slot in batch.slots:  # from the 4th decode step on: a speculative step
            b = batch.slots.index(slot)
            start = sum(batch.query_lens[:b])
            rows = torch.arange(start, start + batch.query_lens[b])
            if batch.logits_indices is not None:
                rows = torch.nonzero(torch.isin(batch.logits_indices, rows))[:, 0]
            out.logits = out.logits.clone()
            out.logits[rows] = float("nan")
        return out

    monkeypatch.setattr(llm.engine, "forward", forward)
    log = record_steps(llm)
    prompts = [[3, 4, 5], [9, 8], rand_tokens(14, seed=5)]
    sp = [greedy(30), greedy(25), greedy(20)]
    outs = llm.generate(ids(prompts), sp, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "NaN" in outs[0].error
    assert 0 < len(outs[0].outputs[0].token_ids) < 30
    ref = plain_tiny.generate(ids(prompts[1:]), sp[1:], use_tqdm=False)
    assert_greedy_equal(plain_tiny.engine, prompts[1:], outs[1:], ref, "beside a NaN request")
    assert any(all(p > 0 for p in props) and len(props) == 3 for _, prompt, props in log[:5] if not prompt)
    assert_all_free(llm)
