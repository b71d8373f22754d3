"""BatchExpansionScorer gives MQAScorer's scores (ragged proposal lengths, 0 included) on the tiny model."""

import torch

from scorers.batch_expansion import BatchExpansionScorer
from scorers.mqa import MQAScorer
from specdec.engine import ForwardBatch
from specdec.engine.loader import load_engine
from specdec.interfaces import SpeculativeProposals
from specdec.datamodel.sampling_params import SamplingParams
from specdec.datamodel.hidden_states import ExecuteModelRequest
from specdec.datamodel.sequence import SequenceData
from specdec.datamodel.metadata import SequenceGroupMetadata


def setup():
    eng = load_engine("tiny-random-llama", num_slots=4, max_model_len=64)
    # seq_id -> (prompt, output): ids are sparse so that fresh target ids must avoid them
    seqs = {3: ([1, 10, 11, 12], [13, 14]), 9: ([1, 7], []), 4: ([1, 2, 3, 4, 5, 6, 7, 8], [9]), 12: ([1, 30], [31])}
    slot_of, metas = {}, []
    for sid, (prompt, output) in seqs.items():
        slot_of[sid] = eng.allocate_slot()
        toks = prompt + output
        eng.forward(ForwardBatch(torch.tensor(toks[:-1]), [slot_of[sid]], [len(toks) - 1]))  # all but pending
        metas.append(SequenceGroupMetadata(request_id=f"r{sid}", is_prompt=False,
                                           seq_data={sid: SequenceData.from_seqs(prompt, output)},
                                           sampling_params=SamplingParams(temperature=0.0)))
    req = ExecuteModelRequest(seq_group_metadata_list=metas, num_lookahead_slots=3)
    k = 3
    lens = torch.tensor([3, 0, 1, 2])  # ragged, one sequence not speculating
    ids = torch.tensor([[40, 41, 42], [-1, -1, -1], [50, -1, -1], [60, 61, -1]])
    props = SpeculativeProposals.chain(ids, torch.zeros(4, k, eng.vocab_size), lens)
    return eng, slot_of, req, props


def test_same_scores_as_mqa():
    eng, slot_of, req, props = setup()
    held = {s: eng.seq_len(slot) for s, slot in slot_of.items()}
    mqa = MQAScorer(eng, slot_of).score_proposals(req, props)
    for s, slot in slot_of.items():  # undo the scoring forward, as the worker's rollback does
        eng.rollback(slot, held[s])
    be = BatchExpansionScorer(eng, slot_of).score_proposals(req, props)
    assert be.probs.shape == mqa.probs.shape == (4, 4, eng.vocab_size)
    assert torch.equal(be.token_ids, mqa.token_ids)
    for name in ("probs", "logprobs", "logits", "hidden_states"):
        torch.testing.assert_close(getattr(be, name), getattr(mqa, name), atol=1e-5, rtol=1e-5)
    assert {s: eng.seq_len(slot) for s, slot in slot_of.items()} == {3: 9, 9: 2, 4: 10, 12: 5}


def test_expansion_ids_and_positions():
    eng, slot_of, req, props = setup()
    seq_ids, virtual = BatchExpansionScorer(eng, slot_of).expand(req, props)
    assert seq_ids == [3, 9, 4, 12]
    # p+1 virtual queries per speculating sequence under fresh ids from max(seq ids)+1 = 13; p=0 keeps its id
    assert [(v.target_seq_id, v.parent, v.j, v.token_id, v.position) for v in virtual] == [
        (13, 0, 0, 14, 5), (14, 0, 1, 40, 6), (15, 0, 2, 41, 7), (16, 0, 3, 42, 8),
        (9, 1, 0, 7, 1),
        (17, 2, 0, 9, 8), (18, 2, 1, 50, 9),
        (19, 3, 0, 31, 2), (20, 3, 1, 60, 3), (21, 3, 2, 61, 4),
    ]
