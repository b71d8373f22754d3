"""specdec/core/plain_worker.py on the tiny model: greedy tokens are the argmax of the engine's logits for
the whole sequence so far, one KV slot per sequence (allocated on prefill, freed with the request), and
snapshot/restore puts KV lengths back so a rolled-back step runs again to the same token."""

from __future__ import annotations

import pytest

from specdec.core.plain_worker import PlainWorker
from specdec.datamodel.hidden_states import ExecuteModelRequest
from specdec.datamodel.metadata import SequenceGroupMetadata
from specdec.datamodel.sampling_params import SamplingParams
from specdec.datamodel.sequence import Sequence
from specdec.engine import load_engine
from specdec.engine.testing import rand_tokens
from tests.spec_decode.helpers import target_forward

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# two prompts of different lengths, so a ragged batch; seeded random ids avoid the tokenizer's specials
PROMPTS = [rand_tokens(5, seed=3), rand_tokens(9, seed=4)]


@pytest.fixture
def engine():
    return load_engine("tiny-random-llama", num_slots=4, max_model_len=64, seed=0)


def meta(rid: str, seq: Sequence, is_prompt: bool, params: SamplingParams = GREEDY) -> SequenceGroupMetadata:
    return SequenceGroupMetadata(request_id=rid, is_prompt=is_prompt, seq_data={seq.seq_id: seq.data},
                                 sampling_params=params)


def step(worker: PlainWorker, seqs: list[Sequence], is_prompt: bool, finished=()) -> list[int]:
    """One worker step over ``seqs`` (request id = "r<seq_id>"); appends and returns the emitted tokens."""
    out = worker.execute_model(ExecuteModelRequest(
        seq_group_metadata_list=[meta(f"r{s.seq_id}", s, is_prompt) for s in seqs],
        finished_requests_ids=list(finished)))
    toks = []
    for s, g in zip(seqs, out.outputs):
        assert g.error is None and len(g.token_ids) == 1
        s.append_token_id(g.token_ids[0], g.logprobs[0])
        toks.append(g.token_ids[0])
    return toks


def reference_argmax(engine, tokens: list[int]) -> int:
    """The engine's greedy next token for ``tokens``, computed in a fresh slot from scratch."""
    return int(target_forward(engine, tokens).logits[-1].argmax())


def kv_lens(worker: PlainWorker, seqs: list[Sequence]) -> list[int | None]:
    return [n for _, _, n in worker.snapshot([meta(f"r{s.seq_id}", s, False) for s in seqs])]


def test_greedy_tokens_are_the_argmax_of_the_engines_logits(engine):
    worker = PlainWorker(engine)
    seqs = [Sequence(i, p) for i, p in enumerate(PROMPTS)]
    step(worker, seqs, is_prompt=True)
    for _ in range(4):
        step(worker, seqs, is_prompt=False)
    for s in seqs:
        toks = s.get_token_ids()
        want = [reference_argmax(engine, toks[:n]) for n in range(s.get_prompt_len(), len(toks))]
        assert s.get_output_token_ids() == want
    assert len({tuple(s.get_output_token_ids()) for s in seqs}) == 2  # the two prompts are told apart


def test_one_slot_per_sequence_allocated_on_prefill_and_freed_with_the_request(engine):
    worker = PlainWorker(engine)
    full = engine.num_slots
    seqs = [Sequence(i, p) for i, p in enumerate(PROMPTS)]
    assert worker.num_free_slots() == full and kv_lens(worker, seqs) == [None, None]
    step(worker, seqs, is_prompt=True)
    assert worker.num_free_slots() == engine.num_free_slots() == full - 2
    # the slot holds every token but the last, which is the next step's input
    assert kv_lens(worker, seqs) == [s.get_len() - 1 for s in seqs] == [5, 9]
    step(worker, seqs, is_prompt=False)
    assert worker.num_free_slots() == full - 2  # a decode allocates nothing
    assert kv_lens(worker, seqs) == [6, 10]

    worker.free_requests(["r0"])
    assert worker.num_free_slots() == full - 1 and kv_lens(worker, seqs) == [None, 10]
    worker.free_requests(["r0", "unknown"])  # freeing twice, or a request never seen, is a no-op
    assert worker.num_free_slots() == full - 1
    # the step loop passes the requests finished since the last step: freed before the step runs
    lone = Sequence(5, PROMPTS[0])
    step(worker, [lone], is_prompt=True)
    assert worker.num_free_slots() == full - 2
    step(worker, [lone], is_prompt=False, finished=["r1"])
    assert worker.num_free_slots() == full - 1 and kv_lens(worker, seqs) == [None, None]
    worker.free_requests(["r5"])
    assert worker.num_free_slots() == full


def test_identical_prompts_in_one_prefill_each_get_a_slot(engine):
    """Shared prefill: the second copy is not fed, but gets the first's KV in a slot of its own, and both
    decode on from there exactly as a lone sequence would."""
    worker = PlainWorker(engine)
    seqs = [Sequence(0, PROMPTS[0]), Sequence(1, PROMPTS[0])]
    step(worker, seqs, is_prompt=True)
    assert worker.num_free_slots() == engine.num_slots - 2 and kv_lens(worker, seqs) == [5, 5]
    for _ in range(3):
        step(worker, seqs, is_prompt=False)
    lone = Sequence(2, PROMPTS[0])
    step(worker, [lone], is_prompt=True)
    for _ in range(3):
        step(worker, [lone], is_prompt=False)
    assert seqs[0].get_output_token_ids() == seqs[1].get_output_token_ids() == lone.get_output_token_ids()


def test_restore_puts_kv_lengths_back_and_the_step_reruns_to_the_same_token(engine):
    worker = PlainWorker(engine)
    seqs = [Sequence(i, p) for i, p in enumerate(PROMPTS)]
    step(worker, seqs, is_prompt=True)
    step(worker, seqs, is_prompt=False)
    metas = [meta(f"r{s.seq_id}", s, False) for s in seqs]
    snap = worker.snapshot(metas)
    checkpoints = [s.checkpoint() for s in seqs]
    first = step(worker, seqs, is_prompt=False)
    step(worker, seqs, is_prompt=False)
    assert kv_lens(worker, seqs) == [8, 12]
    worker.restore(snap)
    for s, cp in zip(seqs, checkpoints):
        s.restore(cp)
    assert kv_lens(worker, seqs) == [6, 10]
    assert worker.num_free_slots() == engine.num_slots - 2  # a rollback frees no slot it did not allocate
    assert step(worker, seqs, is_prompt=False) == first


def test_restore_of_a_prefill_frees_the_slot_it_allocated(engine):
    worker = PlainWorker(engine)
    seq = Sequence(0, PROMPTS[1])
    snap = worker.snapshot([meta("r0", seq, True)])
    assert snap == [("r0", 0, None)]  # no slot yet
    cp = seq.checkpoint()
    first = step(worker, [seq], is_prompt=True)
    assert worker.num_free_slots() == engine.num_slots - 1
    worker.restore(snap)
    seq.restore(cp)
    assert worker.num_free_slots() == engine.num_slots and kv_lens(worker, [seq]) == [None]
    assert step(worker, [seq], is_prompt=True) == first  # the prefill runs again from a clean slot
    worker.free_requests(["r0"])
    assert worker.num_free_slots() == engine.num_slots
