"""specdec/spec_decode/config.py: speculative_config's typo'd keys, aliases and their clashes, and value
errors, each naming the key and the way out. (The consistency of ``LLM.get_metrics()`` is in
tests/datamodel/test_metrics.py.)"""

import pytest

from specdec import LLM


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
