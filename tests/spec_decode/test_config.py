"""speculative_config: typo'd keys, aliases and their clashes, value errors, and the consistency of
``LLM.get_metrics()`` (every derived figure agrees with the counters it comes from)."""

import math

import pytest

from specdec import LLM, SamplingParams
from specdec.engine.testing import rand_tokens
from tests.spec_decode.helpers import ids, noisy_tiny_engine


def make(**kw) -> LLM:
    return LLM("tiny-random-llama", max_num_seqs=4, max_model_len=128, **kw)


def test_typo_key_lists_the_valid_keys():
    with pytest.raises(ValueError, match=r"num_speculative_token\b.*Valid keys: method, ") as e:
        make(speculative_config={"method": "ngram", "num_speculative_token": 3})
    valid = str(e.value).split("Valid keys: ")[1]
    for key in ("num_speculative_tokens", "model", "num_layers", "prompt_lookup_max", "prompt_lookup_min", "scorer",
                "acceptance_method", "posterior_threshold", "posterior_alpha", "kernel", "disable_by_batch_size"):
        assert key in [v.strip() for v in valid.split(",")], key


@pytest.mark.parametrize("cfg,match", [
    ({"num_speculative_tokens": 3}, "has no 'method'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0 must be >= 1"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "Valid keys"),  # a wrong type names the field
    ({"method": "ngram", "scorer": "tree9"}, r"scorer='tree9' is unknown.*known: \['batch_expansion', 'mqa', 'tree'\]"),
    ({"method": "ngram", "acceptance_method": "greedy"}, "acceptance_method='greedy' is unknown"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "need 1 <= min <= max"),
    ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size=0 must be >= 1"),
    ({"method": "layer_skip", "num_layers": 9}, r"num_layers=9 is invalid; the target has 4 layers"),
    ({"method": "draft_model"}, "model is not set"),
    ({"method": "ngram", "kernel": "cuda9"}, "cuda9"),
])
def test_bad_values_name_the_key_and_the_way_out(cfg, match):
    with pytest.raises(ValueError, match=match):
        make(speculative_config=cfg)


def test_aliases_fold_into_speculative_config():
    llm = make(spec_method="draft_model", spec_model="tiny-random-llama", spec_tokens=2)
    assert llm.speculative_config == {"method": "draft_model", "model": "tiny-random-llama",
                                      "num_speculative_tokens": 2}
    assert llm.llm_engine.num_speculative_tokens == 2 and llm.worker.top1.k == 2
    # an alias equal to the config's value is not a clash; aliases combine with other keys
    llm = make(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
               spec_method="ngram")
    assert llm.worker.top1.proposer.max_n == 2 and llm.worker.top1.k == 3


@pytest.mark.parametrize("alias,key", [("spec_method", "method"), ("spec_model", "model"),
                                       ("spec_tokens", "num_speculative_tokens")])
def test_alias_clash_names_both_values(alias, key):
    cfg = {"method": "draft_model", "model": "tiny-random-llama", "num_speculative_tokens": 3}
    other = {"spec_method": "ngram", "spec_model": "other-model", "spec_tokens": 5}[alias]
    with pytest.raises(ValueError, match=rf"speculative_config\['{key}'\]=.* clashes with the alias value "
                                         rf"'?{other}'?; give it once"):
        make(speculative_config=cfg, **{alias: other})


def test_no_config_is_plain_decoding():
    llm = make()
    assert llm.speculative_config is None and llm.llm_engine.num_speculative_tokens == 0


def test_metrics_are_consistent_with_each_other():
    k = 3
    llm = make(speculative_config={"method": "draft_model", "num_speculative_tokens": k,
                                   "options": {"engine": noisy_tiny_engine(0.15, max_model_len=128)}})
    prompts = [[5, 6, 7], rand_tokens(12, seed=1), rand_tokens(30, seed=2)]
    sp = [SamplingParams(temperature=t, max_tokens=m, ignore_eos=True) for t, m in ((0, 40), (1.0, 25), (0, 33))]
    outs = llm.generate(ids(prompts), sp, use_tqdm=False)
    m = llm.get_metrics()
    per_req = [o.metrics.spec_token_acceptance_counts for o in outs]
    assert m.acceptance_counts == [sum(c[i] for c in per_req) for i in range(k + 1)]
    steps, accepted = m.acceptance_counts[0], sum(m.acceptance_counts[1:])
    assert m.num_steps == steps and m.num_accepted_tokens == accepted
    assert m.num_emitted_tokens == steps + accepted
    assert m.num_draft_tokens == k * steps  # every step speculated (far from max_model_len)
    assert m.acceptance_rate == pytest.approx(accepted / m.num_draft_tokens)
    assert m.mean_acceptance_length == pytest.approx(m.num_emitted_tokens / steps)  # tau, bonus included
    assert m.system_efficiency == pytest.approx(m.num_emitted_tokens / (steps * (k + 1)))
    assert m.acceptance_per_position == pytest.approx([c / steps for c in m.acceptance_counts[1:]])
    assert sum(m.acceptance_per_position) == pytest.approx(m.mean_acceptance_length - 1)
    assert all(a >= b for a, b in zip(m.acceptance_per_position, m.acceptance_per_position[1:]))  # prefixes
    assert 0 < m.acceptance_rate < 1 and 1 < m.mean_acceptance_length < k + 1
    # tokens: the first of each request comes from its prefill; a step's tokens past max_tokens are dropped
    decoded = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    assert decoded <= m.num_emitted_tokens <= decoded + k * len(outs)
    assert {"propose", "score", "verify", "step"} <= set(m.mean_step_time_s)
    assert all(v >= 0 for v in m.mean_step_time_s.values())
    llm.reset_metrics()
    assert math.isnan(llm.get_metrics().mean_acceptance_length) and llm.get_metrics().num_draft_tokens == 0
