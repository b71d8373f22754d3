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


def test_a_server_writes_no_log_file_where_it_starts():
    from hydra import compose, initialize_config_dir

    from tests.serve.conftest import CONF

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="serve", overrides=["model=tiny"], return_hydra_config=True)
    assert list(cfg.hydra.job_logging.handlers) == ["console"] and cfg.hydra.run.dir == "."


def test_limits_compose_and_a_zero_limit_is_refused():
    serve_cfg, _ = split_config(composed("model=tiny", "serve.limits.max_n=64", "serve.limits.request_timeout_s=null"))
    assert serve_cfg.limits.max_n == 64 and serve_cfg.limits.request_timeout_s is None
    assert serve_cfg.limits.max_body_bytes == 2 * 1024 * 1024  # the documented default
    with pytest.raises(ValueError, match="max_n"):
        split_config({"serve": {"limits": {"max_n": 0}}})


def test_the_api_key_comes_from_config_file_or_env_and_the_command_line_is_warned(tmp_path, monkeypatch, caplog):
    from specdec.serve import ServeCfg, resolve_api_key

    monkeypatch.setenv("SPECDEC_API_KEY", "from-env")
    assert resolve_api_key(ServeCfg(), ["serve"]) == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert resolve_api_key(ServeCfg(api_key_file=str(key_file)), ["serve"]) == "from-file"
    with pytest.raises(ValueError, match="api_key_file"):
        resolve_api_key(ServeCfg(api_key_file=str(tmp_path / "missing")), ["serve"])
    assert not caplog.records
    assert resolve_api_key(ServeCfg(api_key="cli"), ["serve", "serve.api_key=cli"]) == "cli"
    assert "command line" in caplog.text and "SPECDEC_API_KEY" in caplog.text


def test_host_names_accepted_on_loopback_and_elsewhere():
    from specdec.serve.guard import allowed_hosts_for, host_name

    assert [host_name(h) for h in ("127.0.0.1:8000", "LOCALHOST", "[::1]:80", "evil.example:8000")] == [
        "127.0.0.1", "localhost", "::1", "evil.example"]
    loop = allowed_hosts_for("127.0.0.1", None)
    assert {"127.0.0.1", "localhost", "::1"} <= loop and "evil.example" not in loop
    assert "myhost" in allowed_hosts_for("::1", ["MyHost"])
    assert allowed_hosts_for("0.0.0.0", None) is None  # a network bind: any Host, unless names are given
    assert allowed_hosts_for("0.0.0.0", ["api.example"]) == {"api.example"}
