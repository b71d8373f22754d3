"""scorers/mqa.py: one target forward of [pending token, drafts] per sequence. On the tiny model each row's
logits and features equal a fresh forward of the sequence plus its drafts (ragged lengths, 0 included;
rows past a sequence's drafts repeat its last); the requested layers come back fused; branching proposals
are refused; pad_rows on hand-written rows."""

import pytest
import torch

from scorers.mqa import MQAScorer, pad_rows
from specdec.engine import ForwardBatch
from specdec.engine.loader import load_engine
from specdec.datamodel.hidden_states import ExecuteModelRequest
from specdec.interfaces import SpeculativeProposals
from specdec.datamodel.sampling_params import SamplingParams
from specdec.datamodel.sequence import SequenceData
from specdec.datamodel.metadata import SequenceGroupMetadata

T = torch.tensor
SEQS = {3: [1, 10, 11, 12, 13, 14], 9: [1, 7], 4: [1, 2, 3, 4, 5, 6, 7, 8, 9]}  # seq_id -> tokens (last: pending)
DRAFTS = T([[40, 41, 42], [-1, -1, -1], [50, -1, -1]])  # ragged: 3, 0 and 1 drafts
LENS = T([3, 0, 1])


def setup(hidden_layers=()):
    eng = load_engine("tiny-random-llama", num_slots=4, max_model_len=64)
    slot_of, metas = {}, []
    for sid, toks in SEQS.items():
        slot_of[sid] = eng.allocate_slot()
        eng.forward(ForwardBatch(T(toks[:-1]), [slot_of[sid]], [len(toks) - 1]))  # all but the pending token
        metas.append(SequenceGroupMetadata(request_id=f"r{sid}", is_prompt=False,
                                           seq_data={sid: SequenceData.from_seqs(toks[:2], toks[2:])},
                                           sampling_params=SamplingParams(temperature=0.0)))
    req = ExecuteModelRequest(seq_group_metadata_list=metas, num_lookahead_slots=3)
    return eng, slot_of, req, MQAScorer(eng, slot_of, hidden_layers=hidden_layers)


def fresh(eng, tokens: list[int], layers=()):
    slot = eng.allocate_slot()
    try:
        out = eng.forward(ForwardBatch(T(tokens), [slot], [len(tokens)], hidden_layers=layers))
        return out.logits.float(), out.features
    finally:
        eng.free_slot(slot)


def test_each_row_equals_a_fresh_forward_of_the_sequence_and_its_drafts():
    eng, slot_of, req, scorer = setup()
    scores = scorer.score_proposals(req, SpeculativeProposals.chain(DRAFTS, None, LENS))
    assert scores.logits.shape == (3, 4, eng.vocab_size) and scores.logits.dtype == torch.float32
    for b, (sid, toks) in enumerate(SEQS.items()):
        n = int(LENS[b])
        logits, feats = fresh(eng, toks + DRAFTS[b, :n].tolist())
        rows = list(range(len(toks) - 1, len(toks) + n))  # the pending token's row, then each draft's
        torch.testing.assert_close(scores.logits[b, : n + 1], logits[rows], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(scores.hidden_states[b, : n + 1], feats[rows], atol=1e-4, rtol=1e-4)
        for j in range(n + 1, 4):  # past the drafts: the last row again
            assert torch.equal(scores.logits[b, j], scores.logits[b, n])
        assert eng.seq_len(slot_of[sid]) == len(toks) + n  # the pending token and every draft went in


def test_requested_layers_come_back_fused():
    eng, _, req, scorer = setup(hidden_layers=(0, 2))
    scores = scorer.score_proposals(req, SpeculativeProposals.chain(DRAFTS, None, LENS))
    assert scores.hidden_states.shape == (3, 4, 2 * eng.hidden_size)
    toks = SEQS[3] + DRAFTS[0].tolist()
    _, feats = fresh(eng, toks, (0, 2))
    torch.testing.assert_close(scores.hidden_states[0], feats[len(SEQS[3]) - 1:], atol=1e-4, rtol=1e-4)


def test_branching_proposals_are_refused():
    _, _, req, scorer = setup()
    tree = SpeculativeProposals(T([[40, 41], [5, 6], [7, 8]]), T([[-1, -1]] * 3), T([2, 2, 2]))
    with pytest.raises(ValueError, match="MQAScorer scores chains; these proposals branch: use scorer='tree'"):
        scorer.score_proposals(req, tree)


def test_pad_rows_hand_written():
    flat = T([[1.0], [2.0], [3.0], [4.0], [5.0], [6.0]])  # rows of 3 sequences: 2, 1 and 3 rows
    out = pad_rows(flat, [2, 1, 3], 3)
    assert out[..., 0].tolist() == [[1, 2, 2], [3, 3, 3], [4, 5, 6]]  # short sequences repeat their last row
