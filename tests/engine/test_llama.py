"""The native llama matches transformers on the same weights: logits, hidden states, truncation."""

from __future__ import annotations

import msgspec
import pytest
import torch

from specdec.engine.llama import Llama
from specdec.engine.native import NativeEngine
from specdec.engine.testing import hf_logits, rand_tokens, run
from specdec.engine.tiny import tiny_config, tiny_random_llama, tiny_random_weights, to_hf_model

TOL = 1e-3

# Variants the engine must get right; each changes a code path a bug could hide in.
VARIANTS = {
    "llama-tied": {},
    "llama-untied": {"tie_word_embeddings": False},
    "qwen2-qkv-bias-untied": {"model_type": "qwen2", "attention_bias": True, "tie_word_embeddings": False},
    "llama-attention-bias": {"attention_bias": True, "o_proj_bias": True},
    "mistral-mha": {"model_type": "mistral", "num_key_value_heads": 4, "sliding_window": 4096},
    "llama3-rope": {
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },  # fmt: skip
}


def _ragged_check(engine: NativeEngine, hf) -> None:
    """3 sequences of different prompt lengths on non-contiguous slots; prefill, then decode steps that
    mix 1- and multi-token appends and leave a sequence out; every row vs HF's no-cache forward."""
    slots = [engine.allocate_slot() for _ in range(5)]
    for s in (slots[1], slots[3]):
        engine.free_slot(s)
    a, b, c = slots[4], slots[0], slots[2]  # batch order differs from slot order
    full = {a: rand_tokens(30, 1), b: rand_tokens(30, 2), c: rand_tokens(30, 3)}
    ref = {s: hf_logits(hf, toks) for s, toks in full.items()}
    done = {a: 0, b: 0, c: 0}
    # uniform steps take the batched slot-range attention, the others the per-sequence one
    steps = [{a: 7, b: 3, c: 12}, {a: 1, b: 1, c: 1}, {a: 1, c: 4}, {b: 5, c: 1, a: 2}, {b: 1}, {a: 3, b: 3, c: 3}, {c: 1, a: 1}]
    for step in steps:
        out = run(engine, {s: full[s][done[s] : done[s] + n] for s, n in step.items()})
        row = 0
        for s, n in step.items():
            got = out.logits[row : row + n]
            want = ref[s][done[s] : done[s] + n]
            assert (got - want).abs().max() <= TOL, f"slot {s} positions {done[s]}..{done[s] + n - 1}"
            row += n
            done[s] += n
            assert engine.seq_len(s) == done[s]
    for s in (a, b, c):
        engine.free_slot(s)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ragged_batch_matches_transformers(variant):
    engine = tiny_random_llama(0, num_slots=5, max_model_len=64, **VARIANTS[variant])
    hf = to_hf_model(engine)
    assert type(hf).__name__.lower().startswith(engine.config.model_type)
    _ragged_check(engine, hf)


def test_logits_indices_selects_rows():
    engine = tiny_random_llama(0, max_model_len=64)
    toks = rand_tokens(10, 4)
    s = engine.allocate_slot()
    full = run(engine, {s: toks}).logits
    engine.rollback(s, 0)
    out = run(engine, {s: toks}, logits_indices=torch.tensor([9, 2]))
    assert out.logits.shape == (2, engine.vocab_size) and out.logits.dtype == torch.float32
    torch.testing.assert_close(out.logits, full[[9, 2]])
    assert out.hidden_states.shape == (10, engine.hidden_size)


def test_hidden_states_match_transformers_output_hidden_states():
    engine = tiny_random_llama(0, max_model_len=64)
    hf = to_hf_model(engine)
    toks = rand_tokens(12, 5)
    with torch.no_grad():
        hs = hf(torch.tensor([toks]), output_hidden_states=True).hidden_states  # embeddings, layer 0.., final norm
    n = engine.num_layers
    s = engine.allocate_slot()
    out = run(engine, {s: toks[:5]}, hidden_layers=(0, 2, n - 1))
    out2 = run(engine, {s: toks[5:]}, hidden_layers=(0, 2, n - 1))
    hidden = torch.cat([out.hidden_states, out2.hidden_states])
    assert (hidden - hs[-1][0]).abs().max() <= TOL  # HF's last entry is after the final norm
    for j, layer in enumerate((0, 2)):
        aux = torch.cat([out.aux_hidden_states[j], out2.aux_hidden_states[j]])
        assert (aux - hs[layer + 1][0]).abs().max() <= TOL, f"layer {layer}"
    # our last decoder-layer output is pre-norm: normalising it gives hidden_states
    last = torch.cat([out.aux_hidden_states[2], out2.aux_hidden_states[2]])
    normed = torch.nn.functional.rms_norm(last, (engine.hidden_size,), engine.model.norm, engine.config.rms_norm_eps)
    torch.testing.assert_close(normed, hidden)
    assert not torch.allclose(last, hidden)
    torch.testing.assert_close(engine.compute_logits(hidden[-1:]), out2.logits[-1:])


def test_embed_matches_transformers(tiny_hf_pair):
    engine, hf = tiny_hf_pair
    ids = torch.tensor(rand_tokens(6, 6))
    torch.testing.assert_close(engine.embed(ids), hf.get_input_embeddings()(ids).detach())


@pytest.fixture(scope="module")
def tiny_hf_pair():
    engine = tiny_random_llama(0, max_model_len=64)
    return engine, to_hf_model(engine)


def test_truncated_engine_equals_first_layers_and_shares_weights():
    engine = tiny_random_llama(0, max_model_len=64)
    draft = engine.truncated(2)
    assert draft.num_layers == 2 and engine.num_layers == 4
    assert draft.model.layers[1].wqkv is engine.model.layers[1].wqkv  # shared, not copied
    assert draft.model.lm_head is engine.model.lm_head and draft.model.embed_weight is engine.model.embed_weight
    # reference: transformers with num_hidden_layers=2 over the prefix of the same weights
    cfg4 = tiny_config()
    cfg2 = msgspec.structs.replace(cfg4, num_hidden_layers=2)
    sd = {k: v for k, v in tiny_random_weights(cfg4, 0).items() if not k.startswith(("model.layers.2.", "model.layers.3."))}
    hf2 = to_hf_model(Llama.from_hf_state_dict(cfg2, sd))
    toks = rand_tokens(9, 7)
    s = draft.allocate_slot()
    got = torch.cat([run(draft, {s: toks[:6]}).logits, run(draft, {s: toks[6:]}).logits])
    assert (got - hf_logits(hf2, toks)).abs().max() <= TOL
    # own cache: the full engine's slots are untouched and it still disagrees with the draft
    assert engine.num_free_slots() == engine.num_slots
    t = engine.allocate_slot()
    assert (run(engine, {t: toks}).logits - got).abs().max() > 1e-2


def test_truncated_rejects_bad_layer_count():
    engine = tiny_random_llama(0, max_model_len=64)
    with pytest.raises(ValueError, match="num_layers=5"):
        engine.truncated(5)


def test_bfloat16_engine_runs_close_to_float32():
    e32 = tiny_random_llama(0, max_model_len=64)
    e16 = tiny_random_llama(0, max_model_len=64, dtype=torch.bfloat16)
    toks = rand_tokens(8, 8)
    l32 = run(e32, {e32.allocate_slot(): toks}).logits
    l16 = run(e16, {e16.allocate_slot(): toks}).logits
    assert l16.dtype == torch.float32  # logits are float32 whatever the model dtype
    assert (l32 - l16).abs().max() < 0.1 * l32.abs().max()
