"""LayerSkipProposer: num_layers validation and drafts from the target's first layers."""

import pytest
import torch

from proposers.layer_skip import LayerSkipProposer
from specdec.engine import ForwardBatch
from specdec.engine.loader import load_engine
from specdec.datamodel.sampling_params import SamplingParams
from specdec.spec_decode.config import SpeculativeConfig
from specdec.spec_decode.proposer import ProposeBatch


def target():
    return load_engine("tiny-random-llama", num_slots=2, max_model_len=64)  # 4 layers


@pytest.mark.parametrize("n", [None, 0, 4, 5, -1])
def test_bad_num_layers_names_value_and_range(n):
    with pytest.raises(ValueError, match=rf"num_layers={n}.*1\.\.3"):
        LayerSkipProposer(target(), SpeculativeConfig(method="layer_skip", num_layers=n))


def test_truncated_drafts_run_and_share_weights():
    t = target()
    prop = LayerSkipProposer(t, SpeculativeConfig(method="layer_skip", num_layers=2))
    assert prop.engine.num_layers == 2 and prop.engine.num_slots == t.num_slots
    assert prop.engine.model.embed_weight is t.model.embed_weight  # shared weights, own KV cache
    assert prop.engine.cache is not t.cache

    prompt = [1, 40, 41, 42, 43]
    out = prop.propose(ProposeBatch(seq_ids=[5], token_ids=[prompt], k=3,
                                    sampling_params=[SamplingParams(temperature=0.0)], generators=[None]))
    assert out.token_ids.shape == (1, 3)
    # the drafts are the greedy continuation of an independent 2-layer truncation of the target
    ref = t.truncated(2)
    slot = ref.allocate_slot()
    logits = ref.forward(ForwardBatch(torch.tensor(prompt), [slot], [len(prompt)])).logits[-1]
    want = []
    for _ in range(3):
        want.append(int(logits.argmax()))
        logits = ref.forward(ForwardBatch(torch.tensor(want[-1:]), [slot], [1])).logits[-1]
    assert out.token_ids[0].tolist() == want
    prop.verified(5, len(prompt) + 1)
    prop.free(5)
    assert prop.engine.num_free_slots() == 2
