"""DraftModelProposer on the tiny random llama: vocabulary check, lazy catch-up + rollback, greedy drafts."""

import random

import pytest
import torch

from proposers.draft_model import DraftModelProposer
from specdec.engine import ForwardBatch
from specdec.engine.loader import load_engine
from specdec.engine.tiny import tiny_random_llama
from specdec.datamodel.sampling_params import SamplingParams
from specdec.spec_decode.config import SpeculativeConfig
from specdec.spec_decode.proposer import ProposeBatch

LEN = 128


def engine(seed=0, **kw):
    return load_engine("tiny-random-llama", num_slots=4, max_model_len=LEN, seed=seed, **kw)


def batch(seq_ids, token_ids, k, params=None, gens=None):
    n = len(seq_ids)
    return ProposeBatch(seq_ids=seq_ids, token_ids=token_ids, k=k,
                        sampling_params=params or [SamplingParams(temperature=0.0)] * n,
                        generators=gens or [None] * n)


def greedy_continuation(eng, prompt, n):
    """Plain greedy decoding: ``n`` tokens after ``prompt`` (a fresh slot, freed afterwards)."""
    slot = eng.allocate_slot()
    logits = eng.forward(ForwardBatch(torch.tensor(prompt), [slot], [len(prompt)])).logits[-1]
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = eng.forward(ForwardBatch(torch.tensor(out[-1:]), [slot], [1])).logits[-1]
    eng.free_slot(slot)
    return out


def test_vocab_mismatch_names_both_sizes():
    target = engine()
    draft = tiny_random_llama(1, num_slots=4, max_model_len=LEN, vocab_size=256)
    cfg = SpeculativeConfig(method="draft_model", options={"engine": draft})
    with pytest.raises(ValueError, match=r"vocab_size=256.*vocab_size=512.*tokenizer"):
        DraftModelProposer(target, cfg)


def test_missing_model_is_a_clear_error():
    with pytest.raises(ValueError, match="model is not set"):
        DraftModelProposer(engine(), SpeculativeConfig(method="draft_model"))


def test_greedy_drafts_of_the_target_itself_are_its_greedy_continuation():
    target = engine()
    cfg = SpeculativeConfig(method="draft_model", model="tiny-random-llama", num_speculative_tokens=5)
    prop = DraftModelProposer(target, cfg)  # loads the same seeded weights as the target
    assert prop.engine is not target and prop.engine.num_slots == target.num_slots
    prompts = [[1, 50, 60, 70], [1, 9, 8, 7, 6, 5, 4, 3]]
    out = prop.propose(batch([10, 11], prompts, k=5))
    assert out.probs is None  # all greedy: the wrapper makes q one-hot
    for b, p in enumerate(prompts):
        assert out.token_ids[b].tolist() == greedy_continuation(target, p, 5)


def test_catch_up_and_rollback_keep_the_draft_kv_exact():
    """Simulated verification with random acceptance (bonus steps and plain steps included): the draft
    slot always holds exactly the first seq_len tokens, checked against a fresh engine's logits."""
    rng = random.Random(0)
    k = 3
    prop = DraftModelProposer(engine(), SpeculativeConfig(method="draft_model", options={"engine": engine()}))
    seqs = {0: [1, 20, 30, 40, 50], 7: [1, 99], 3: list(range(3, 40))}
    for step in range(8):
        ids = [s for s in seqs if not (step == 4 and s == 7)]  # seq 7 skips a step (decoded plainly)
        if step == 4:
            seqs[7].append(rng.randrange(3, 512))
        out = prop.propose(batch(ids, [list(seqs[s]) for s in ids], k))
        for b, s in enumerate(ids):
            a = rng.choice([0, 1, k, k])  # all-accepted (bonus) often: it exercises the back-fill
            old = len(seqs[s])
            seqs[s] += out.token_ids[b, :a].tolist() + [rng.randrange(3, 512)]
            prop.verified(s, old + a)
    prop.free(3)  # a finished sequence gives its slot back
    assert 3 not in prop.slot_of and prop.engine.num_free_slots() == 4 - 2

    fresh = engine()
    for s in (0, 7):
        slot, n = prop.slot_of[s], prop.engine.seq_len(prop.slot_of[s])
        assert n <= len(seqs[s]) - 1  # never past the pending token
        probe = seqs[s][n:]  # what the next catch-up would feed
        got = prop.engine.forward(ForwardBatch(torch.tensor(probe), [slot], [len(probe)])).logits
        ref_slot = fresh.allocate_slot()
        want = fresh.forward(ForwardBatch(torch.tensor(seqs[s]), [ref_slot], [len(seqs[s])])).logits[n:]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_resyncs_when_verified_is_missed():
    # The proposer remembers its slot's tokens: re-proposing from a different history recomputes.
    prop = DraftModelProposer(engine(), SpeculativeConfig(method="draft_model", options={"engine": engine()}))
    prop.propose(batch([0], [[1, 5, 6, 7]], k=4))  # slot: [1, 5, 6, 7, d1, d2, d3]
    out = prop.propose(batch([0], [[1, 5, 6, 8]], k=2))  # no verified(): history changed at index 3
    assert out.token_ids[0].tolist() == greedy_continuation(engine(), [1, 5, 6, 8], 2)


def test_sampled_drafts_come_with_their_q_and_follow_the_seed():
    target = engine()
    params = [SamplingParams(temperature=0.8, top_k=20, seed=1), SamplingParams(temperature=0.0)]

    def run():
        prop = DraftModelProposer(target, SpeculativeConfig(method="draft_model", options={"engine": engine()}))
        gens = [torch.Generator().manual_seed(1), None]
        return prop.propose(batch([0, 1], [[1, 5, 6], [1, 2, 3]], 4, params, gens))

    out = run()
    q = out.probs
    assert q.shape == (2, 4, 512) and q.dtype == torch.float32
    torch.testing.assert_close(q.sum(-1), torch.ones(2, 4))
    picked = q.gather(2, out.token_ids[..., None])[..., 0]
    assert (picked > 0).all()  # each draft was drawn from its own q
    assert ((q[0] > 0).sum(-1) <= 20).all()  # top-k applied to q
    assert (picked[1] == 1).all()  # the greedy row's q is one-hot at its draft
    assert torch.equal(run().token_ids, out.token_ids)  # same seed, same drafts
