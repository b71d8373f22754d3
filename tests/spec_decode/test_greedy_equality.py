"""Greedy equality: for every proposer x scorer, speculative greedy output is token-identical to plain
greedy output on the tiny model, at batch 1, in a ragged batch of 4 (different prompt lengths and
max_tokens, max_num_seqs=4) and with a queue of 6 (prefills interleaved with speculative steps).

Proposers cover the three acceptance regimes: a draft equal to the target (everything accepted), a
different-seed draft (almost nothing accepted), a noisy copy of the target and layer_skip (partly
accepted), and ngram (one-hot drafts of variable length, often none). A mismatch fails with the target's
top-2 logit gap at the first differing token (helpers.assert_greedy_equal), never silently.
"""

import pytest

from specdec import LLM, SamplingParams
from specdec.engine.testing import rand_tokens
from tests.spec_decode.helpers import assert_greedy_equal, ids, noisy_tiny_engine

# Ragged: prompt lengths 3..50, max_tokens 9..45, so requests finish at different steps mid-batch.
RAGGED = [[5, 6, 7], rand_tokens(12, seed=1), [40, 41, 42, 43] * 6 + [7, 8, 9], rand_tokens(50, seed=2)]
RAGGED_MAX = [37, 20, 45, 9]
SINGLE = [[1, 17, 42, 99, 3]]
QUEUE = RAGGED + [rand_tokens(8, seed=3), [9] * 15]  # 6 requests for 4 slots
QUEUE_MAX = RAGGED_MAX + [25, 14]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


SCENARIOS = {  # name -> (prompts, per-request params)
    "batch1": (SINGLE, [greedy(40)]),
    "ragged4": (RAGGED, [greedy(m) for m in RAGGED_MAX]),
    "queue6": (QUEUE, [greedy(m) for m in QUEUE_MAX]),
}

# name -> (speculative_config factory, acceptance-rate range the config must land in, so each one
# really exercises the regime it claims)
PROPOSERS = {
    "ngram": (lambda: {"method": "ngram", "num_speculative_tokens": 4}, (0.05, 0.95)),
    "draft_same": (lambda: {"method": "draft_model", "model": "tiny-random-llama", "num_speculative_tokens": 3},
                   (1.0, 1.0)),
    "draft_other_seed": (lambda: {"method": "draft_model", "model": "tiny-random-llama",
                                  "num_speculative_tokens": 2, "options": {"seed": 1}}, (0.0, 0.2)),
    "draft_noisy": (lambda: {"method": "draft_model", "num_speculative_tokens": 3,
                             "options": {"engine": noisy_tiny_engine(0.15)}}, (0.1, 0.9)),
    "layer_skip": (lambda: {"method": "layer_skip", "num_layers": 2, "num_speculative_tokens": 4}, (0.1, 0.95)),
}


@pytest.fixture(scope="module")
def refs(plain_tiny):
    return {name: plain_tiny.generate(ids(p), sp, use_tqdm=False) for name, (p, sp) in SCENARIOS.items()}


def spec_llm(cfg: dict, max_num_seqs: int = 4) -> LLM:
    return LLM("tiny-random-llama", max_num_seqs=max_num_seqs, max_model_len=256, speculative_config=cfg)


def assert_no_leak(llm: LLM) -> None:
    assert llm.engine.num_free_slots() == llm.engine.num_slots, "target KV slots leaked"
    draft = getattr(llm.worker.top1.proposer, "engine", None)
    if draft is not None:
        assert draft.num_free_slots() == draft.num_slots, "draft KV slots leaked"


@pytest.mark.parametrize("scorer", ["mqa", "batch_expansion"])
@pytest.mark.parametrize("proposer", list(PROPOSERS))
def test_greedy_equal_to_plain(proposer, scorer, refs, plain_tiny):
    make, (lo, hi) = PROPOSERS[proposer]
    llm = spec_llm({**make(), "scorer": scorer})
    for name, (prompts, sp) in SCENARIOS.items():
        outs = llm.generate(ids(prompts), sp, use_tqdm=False)
        assert_greedy_equal(plain_tiny.engine, prompts, outs, refs[name], f"{proposer}/{scorer}/{name}")
        assert_no_leak(llm)
    m = llm.get_metrics()
    assert m.num_draft_tokens > 0
    assert lo <= m.acceptance_rate <= hi, f"{proposer}: acceptance rate {m.acceptance_rate:.3f} not in [{lo}, {hi}]"


@pytest.mark.parametrize("lookup", [(1, 1), (2, 2), (1, 3), (3, 5)])
def test_ngram_prompt_lookup_variants(lookup, refs, plain_tiny):
    lo, hi = lookup
    llm = spec_llm({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": lo,
                    "prompt_lookup_max": hi})
    prompts, sp = SCENARIOS["ragged4"]
    outs = llm.generate(ids(prompts), sp, use_tqdm=False)
    assert_greedy_equal(plain_tiny.engine, prompts, outs, refs["ragged4"], f"ngram{lookup}")
    assert llm.get_metrics().num_draft_tokens > 0


def test_typical_acceptance_at_temperature_0_is_greedy(refs, plain_tiny):
    llm = spec_llm({"method": "draft_model", "num_speculative_tokens": 3, "acceptance_method": "typical_acceptance",
                    "options": {"engine": noisy_tiny_engine(0.15)}})
    prompts, sp = SCENARIOS["ragged4"]
    assert_greedy_equal(plain_tiny.engine, prompts, llm.generate(ids(prompts), sp, use_tqdm=False),
                        refs["ragged4"], "typical_acceptance")


def test_without_speculation_is_the_plain_baseline(refs, plain_tiny):
    llm = spec_llm(PROPOSERS["ngram"][0]())
    prompts, sp = SCENARIOS["ragged4"]
    base = llm.without_speculation()
    assert_greedy_equal(plain_tiny.engine, prompts, base.generate(ids(prompts), sp, use_tqdm=False),
                        refs["ragged4"], "without_speculation")
    assert base.get_metrics().num_draft_tokens == 0


def mid_step_positions(out: list[int], k: int, n: int = 3) -> list[int]:
    """Output indices i whose token first occurs at i and is not the last token of its speculative step
    when every draft is accepted (token 0 comes from the prefill, then steps emit k+1 tokens each)."""
    found = []
    for i in range(2, len(out)):
        if out[i] not in out[:i] and (i - 1) % (k + 1) != k:
            found.append(i)
    return found[:n]


@pytest.mark.parametrize("scorer", ["mqa", "batch_expansion"])
@pytest.mark.parametrize("proposer", ["draft_same", "ngram"])
def test_stop_token_and_max_tokens_inside_a_multi_token_step(proposer, scorer, plain_tiny):
    k = 3
    cfg = {**PROPOSERS[proposer][0](), "num_speculative_tokens": k, "scorer": scorer}
    llm = spec_llm(cfg)
    prompt, other = [5, 6, 7], rand_tokens(10, seed=4)
    full = plain_tiny.generate(ids([prompt]), greedy(30), use_tqdm=False)[0].outputs[0].token_ids
    positions = mid_step_positions(full, k)
    assert positions, f"no usable stop position in {full}"
    for i in positions:
        # the stopping request shares the batch with one that keeps going after it stops
        sp = [greedy(30, stop_token_ids=[full[i]]), greedy(30)]
        outs = llm.generate(ids([prompt, other]), sp, use_tqdm=False)
        ref = plain_tiny.generate(ids([prompt, other]), sp, use_tqdm=False)
        assert_greedy_equal(plain_tiny.engine, [prompt, other], outs, ref, f"stop at {i}")
        assert outs[0].outputs[0].token_ids == full[: i + 1]
        assert (outs[0].outputs[0].finish_reason, outs[0].outputs[0].stop_reason) == ("stop", full[i])
    for max_tokens in range(1, 10):  # every offset of max_tokens inside a step of k+1 = 4 tokens
        out = llm.generate(ids([prompt]), greedy(max_tokens), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == full[:max_tokens] and out.finish_reason == "length"
    assert_no_leak(llm)
    if proposer == "draft_same":  # the steps really were multi-token
        assert llm.get_metrics().mean_acceptance_length > 3.0


def test_a_mismatch_is_reported_with_its_logit_gap(plain_tiny):
    """The checker itself: a wrong token fails with the top-2 gap, a near-tie is named as one."""
    from types import SimpleNamespace

    import torch

    from specdec.engine import ForwardOutput

    def out(tokens, reason="length"):
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, finish_reason=reason, stop_reason=None)])

    prompt = [5, 6, 7]
    ref = plain_tiny.generate(ids([prompt]), greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    bad = ref[:4] + [(ref[4] + 1) % 512] + ref[5:]
    with pytest.raises(pytest.fail.Exception, match=r"output token 4: .*logit gap .*NOT a near-tie"):
        assert_greedy_equal(plain_tiny.engine, [prompt], [out(bad)], [out(ref)], "fabricated")
    with pytest.raises(pytest.fail.Exception, match="speculative output has 7 tokens, plain has 8"):
        assert_greedy_equal(plain_tiny.engine, [prompt], [out(ref[:7])], [out(ref)], "fabricated")

    class TiedEngine:  # logits with an exact top-2 tie between tokens 3 and 9
        device = "cpu"

        def allocate_slot(self):
            return 0

        def free_slot(self, slot):
            pass

        def forward(self, batch):
            logits = torch.zeros(len(batch.token_ids), 16)
            logits[:, 3] = logits[:, 9] = 5.0
            return ForwardOutput(logits=logits, hidden_states=torch.zeros(len(batch.token_ids), 4))

    with pytest.raises(pytest.fail.Exception, match=r"logit gap 0;.*a float near-tie"):
        assert_greedy_equal(TiedEngine(), [[1, 2]], [out([3, 9])], [out([3, 3])], "tie")
