"""conf/serve.yaml composes with the run's groups and experiments into engine args and a serve config."""

import pytest

from specdec.spec_decode.registry import resolve

from specdec.serve import engine_args_from, split_config
from tests.serve.conftest import composed


def test_defaults_bind_loopback_and_plain_decoding():
    serve_cfg, run_cfg = split_config(composed("model=tiny"))
    assert serve_cfg.host == "127.0.0.1" and serve_cfg.api_key is None and serve_cfg.port == 8000
    args = engine_args_from(run_cfg, multiprocess=False)
    assert args.model == "tiny-random-llama" and args.speculative_config is None and args.max_num_seqs == 8


@pytest.mark.parametrize("experiment", ["ngram", "draft_model"])
def test_experiments_compose_into_a_speculative_engine(experiment):
    serve_cfg, run_cfg = split_config(composed(f"+experiment={experiment}", "model=tiny", "serve.port=8123",
                                               "serve.api_key=k", "proposer.model=tiny-random-llama"
                                               if experiment == "draft_model" else "seed=0"))
    assert serve_cfg.port == 8123 and serve_cfg.api_key == "k"
    args = engine_args_from(run_cfg, multiprocess=True)
    # compose passes the proposer's _target_ path; it names the same class as the experiment's registry name
    assert args.is_speculative
    assert resolve("proposer", args.speculative_config["method"]) is resolve("proposer", experiment)


def test_a_typo_fails_before_any_model_loads():
    with pytest.raises(ValueError, match="serve config"):
        split_config({"serve": {"prot": 1}})
    _, run_cfg = split_config(composed("model=tiny", "+proposer.prompt_lookup_mx=3", "proposer=ngram"))
    with pytest.raises(ValueError, match="prompt_lookup_mx"):
        engine_args_from(run_cfg, multiprocess=False)
