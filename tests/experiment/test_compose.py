"""conf/ groups: every option composes and builds what its _target_ names; bad inputs fail clearly, early."""

import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException

from specdec.experiment.compose import locate, parse_config, speculative_config

CONF = Path(__file__).resolve().parents[2] / "conf"
GROUPS = ("model", "proposer", "scorer", "verifier", "kernel", "dataset", "logger")
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]
# what an option needs beside it to make a valid run (a speculative part needs a proposer, etc.)
NEEDS = {
    ("proposer", "draft_model"): ["proposer.model=tiny-random-llama"],
    ("proposer", "plugin"): ["proposer._target_=proposers.ngram.NGramProposer"],
    ("dataset", "jsonl"): ["dataset.path={jsonl}"],
}


def compose_cfg(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def test_every_group_has_its_options():
    assert {g for g, _ in OPTIONS} == set(GROUPS)
    assert {"ngram", "draft_model", "layer_skip", "none"} <= {o for g, o in OPTIONS if g == "proposer"}
    assert {"torch", "triton"} <= {o for g, o in OPTIONS if g == "kernel"}


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_builds_its_target(group, option, tmp_path, monkeypatch):
    from specdec.experiment.run import check_built, load_prompts, make_logger

    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "hi"}\n')
    base = [] if group in ("model", "proposer", "dataset", "logger") else ["proposer=ngram"]
    extra = [o.format(jsonl=jsonl) for o in NEEDS.get((group, option), [])]
    cfg = compose_cfg([f"{group}={option}", *base, *extra, "debug=true"])
    target = cfg[group].get("_target_")
    if option == "tree":  # refused with a chain proposer, by name; built with a tree proposer
        with pytest.raises(ValueError, match="chain-only"):
            parse_config(cfg)
        pytest.importorskip("proposers.tree_draft")
        cfg = compose_cfg(["scorer=tree", "proposer=plugin", "proposer._target_=proposers.tree_draft.TreeDraftProposer",
                           "+proposer.model=tiny-random-llama", "debug=true"])
    if option == "triton":
        try:
            parse_config(cfg)
        except ValueError as e:
            pytest.skip(f"triton unavailable here, refused as it should be: {e}")
    rc = parse_config(cfg)
    if group == "model":
        from specdec.entrypoints.llm import LLM

        assert issubclass(locate(target, "model._target_"), LLM)
    elif group == "dataset":
        prompts = load_prompts(rc.dataset)
        assert prompts and prompts[0].turns
    elif group == "logger":
        assert type(make_logger(rc.logger)) is locate(target, "logger._target_")
    if group in ("proposer", "scorer", "verifier", "kernel"):
        spec = speculative_config(rc)
        if option == "none":
            assert spec is None
            return
        llm = locate(rc.model.target, "model")(rc.model.name, max_num_seqs=1, max_model_len=128,
                                                speculative_config=spec)
        built = check_built(llm, rc)  # raises unless each part is an instance of its _target_
        assert built[group].startswith(str(target))


def test_a_target_goes_to_the_registry_as_it_is_and_a_name_too():
    """speculative_config carries the group's _target_ path (or the registry name given instead), and the
    registry builds the same class from either."""
    from specdec.spec_decode.registry import register_proposer, resolve
    from proposers.layer_skip import LayerSkipProposer
    from proposers.ngram import NGramProposer

    rc = parse_config(compose_cfg(["proposer=ngram"]))
    assert speculative_config(rc)["method"] == "proposers.ngram.NGramProposer"
    assert resolve("proposer", speculative_config(rc)["method"]) is resolve("proposer", "ngram") is NGramProposer
    rc = parse_config({"proposer": {"_target_": "proposers.layer_skip.LayerSkipProposer", "num_layers": 2}})
    assert resolve("proposer", speculative_config(rc)["method"]) is LayerSkipProposer
    assert speculative_config(parse_config({"proposer": {"method": "layer_skip"}}))["method"] == "layer_skip"

    class Mine(NGramProposer):  # not registered, no entry point: its path is enough
        pass

    Mine.__module__, Mine.__qualname__ = __name__, "Mine"
    globals()["Mine"] = Mine
    rc = parse_config({"proposer": {"_target_": f"{__name__}.Mine"}})
    assert speculative_config(rc)["method"] == f"{__name__}.Mine" and resolve("proposer", f"{__name__}.Mine") is Mine
    from specdec.spec_decode import registry

    register_proposer("mine_test", Mine)  # a registered name beside its _target_: the same class, accepted
    try:
        rc = parse_config({"proposer": {"_target_": f"{__name__}.Mine", "method": "mine_test"}})
        assert resolve("proposer", speculative_config(rc)["method"]) is Mine
    finally:
        registry._registered["proposer"].pop("mine_test")


def test_groups_merge_into_one_speculative_config():
    rc = parse_config(compose_cfg(["proposer=ngram", "proposer.num_speculative_tokens=3", "scorer=batch_expansion",
                                   "verifier=typical_acceptance", "verifier.posterior_alpha=0.2"]))
    assert speculative_config(rc) == {
        "method": "proposers.ngram.NGramProposer", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1, "scorer": "scorers.batch_expansion.BatchExpansionScorer",
        "acceptance_method": "specdec.verify.chain.TypicalAcceptanceSampler", "posterior_threshold": 0.09,
        "posterior_alpha": 0.2, "kernel": "torch", "speculation_policy": "static", "policy_options": {}}
    plain = parse_config(compose_cfg(["proposer=ngram", "proposer.num_speculative_tokens=0"]))
    assert speculative_config(plain) is None  # k = 0 is plain decoding


def test_debug_points_the_draft_at_the_tiny_model_too():
    rc = parse_config(compose_cfg(["+experiment=draft_model", "debug=true"]))
    assert rc.model.name == rc.proposer["model"] == "tiny-random-llama"
    assert parse_config(compose_cfg(["+experiment=layer_skip", "debug=true"])).proposer["num_layers"] == 3


# ------------------------------------------------------------------------------------ bad inputs
def test_unknown_option_lists_the_available_ones():
    with pytest.raises(MissingConfigException,
                       match=r"(?s)Could not find 'proposer/fancy'.*Available options.*layer_skip.*ngram"):
        compose_cfg(["proposer=fancy"])


@pytest.mark.parametrize("overrides,match", [
    (["proposer=ngram", "+proposer.prompt_lookup_mx=3"], r"proposer\.prompt_lookup_mx.*unknown field"),
    (["proposer=ngram", "+scorer.depth=3"], r"scorer\.depth.*unknown field"),
    (["proposer=ngram", "verifier._target_=greedy"], r"verifier\._target_.*acceptance_method='greedy'.*rejection_sampler"),
    (["proposer=ngram", "+verifier.name=greedy"], r"verifier\.name: unknown verifier 'greedy'.*rejection_sampler"),
    (["proposer=ngram", "+proposer.scorer=mqa"], r"scorer\._target_ and proposer\.scorer both set"),
    (["logger=wandb", "+logger.projct=x"], r"logger: \['projct'\].*WandbLogger.*project"),
    (["+max_num_seq=2"], r"max_num_seq"),
    (["proposer=plugin"], r"no proposer is named.*proposer\.method"),
    (["proposer=plugin", "proposer.method=nope"], r"unknown speculative method 'nope'.*ngram"),
    (["proposer=plugin", "proposer._target_=proposers.ngram.Nope"], r"proposer\._target_: .*has no attribute 'Nope'"),
    (["proposer=plugin", "proposer._target_=no_such_pkg_xyz.Thing"], r"proposer\._target_: .*cannot import module"),
    (["proposer=plugin", "proposer._target_=specdec.entrypoints.llm.LLM"], r"not a subclass of .*Proposer"),
    (["proposer=plugin", "proposer.method=layer_skip", "proposer._target_=proposers.ngram.NGramProposer"],
     r"method='layer_skip'.*LayerSkipProposer.*_target_"),
    (["proposer=draft_model"], r"proposer\.model.*mandatory"),
    (["dataset=jsonl"], r"dataset\.path.*mandatory"),
    (["proposer=ngram", "scorer=tree"], r"scorer=scorers.tree.TreeScorer needs a tree-capable proposer; .*NGramProposer "
                                        r"is chain-only.*scorer='mqa'"),
    (["proposer=layer_skip", "scorer=tree"], r"scorer=.*TreeScorer needs a tree-capable proposer.*LayerSkipProposer"),
    (["proposer=ngram", "scorer=tree", "verifier=typical_acceptance"], r"acceptance_method=.*TypicalAcceptance.*chain-only"),
    (["proposer=ngram", "proposer.num_speculative_tokens=100"], r"proposer\.num_speculative_tokens: .*=100 is too large"),
    (["proposer=ngram", "max_model_len=16"], r"num_speculative_tokens=10 is too large for max_model_len=16"),
    # keys that would do nothing beside the others (they used to run, recorded, with no effect)
    (["+experiment=eagle", "proposer.num_speculative_tokens=8"],
     r"proposer\.num_speculative_tokens=8 with scorer\.tree_depth=3: a tree drafts tree_depth levels"),
    (["proposer=ngram", "turns=0"], r"turns=0 must be >= 1"),
    (["proposer=ngram", "baseline_remeasure_tokens=0"], r"baseline_remeasure_tokens=0 must be >= 1"),
    (["proposer=none", "baseline=/nonexistent"], r"baseline='/nonexistent' has no effect on a plain run"),
    (["+experiment=ngram", "++proposer.model=foo"], r"proposer\.model='foo': NGramProposer does not read it \(of model, "
                                                    r"num_layers, prompt_lookup_max, prompt_lookup_min it reads "
                                                    r"prompt_lookup_max, prompt_lookup_min\)"),
    (["proposer=layer_skip", "proposer.num_layers=2", "++proposer.model=x"], r"proposer\.model='x': LayerSkipProposer"),
    (["+experiment=eagle3", "+proposer.prompt_lookup_max=7"], r"proposer\.prompt_lookup_max=7: Eagle3Proposer does not"),
    (["+experiment=eagle", "++proposer.options.branch=suffix", "proposer.prompt_lookup_max=1"],
     r"proposer\.prompt_lookup_max=1: Eagle3Proposer does not read it"),
    (["+experiment=ngram", "+scorer.tree_budget=3"], r"scorer\.tree_budget=3: only a tree scorer reads them"),
    (["proposer=ngram", "trace_top_n=-3", "trace_features=true"],
     r"trace_features=True, trace_top_n=-3 have no effect without trace=true"),
])
def test_bad_config_fails_naming_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        parse_config(compose_cfg(overrides))


@pytest.mark.parametrize("overrides,match", [
    (["proposer=ngram", "dataset.per_category=abc"], r"dataset\.per_category='abc' is invalid: Expected `int \| null`"),
    (["proposer=ngram", "dataset.per_category=1.5"], r"dataset\.per_category=1\.5 is invalid"),
    (["proposer=ngram", "dataset.categories=5"], r"dataset\.categories=5 is invalid"),
    (["proposer=ngram", "logger=wandb", "logger.tags=5"], r"logger\.tags=5 is invalid"),
])
def test_a_value_of_the_wrong_type_is_refused_naming_the_key(overrides, match):
    """They reached the dataset loader or the logger and failed there with a TypeError naming neither."""
    with pytest.raises(TypeError, match=match):
        parse_config(compose_cfg(overrides))


def test_a_policy_option_of_the_wrong_type_is_refused_naming_it():
    from specdec.spec_decode.policy import make_policy

    with pytest.raises(TypeError, match=r"policy_options\.ema='abc' is invalid"):
        make_policy("acceptance_ema", {"ema": "abc"})


def test_override_of_a_key_the_option_lacks_is_refused_by_hydra():
    with pytest.raises(ConfigCompositionException, match="prompt_lookup_mx"):
        compose_cfg(["proposer=ngram", "proposer.prompt_lookup_mx=3"])


def test_draft_model_without_model_in_a_plain_dict():
    with pytest.raises(ValueError, match="needs a draft model.*proposer.model"):
        parse_config({"proposer": {"method": "draft_model", "num_speculative_tokens": 2}})


def test_triton_kernel_refused_where_triton_does_not_import(monkeypatch):
    """kernel=triton's _target_ (specdec_kernels.get_ops) loads the backend at composition, so it fails there."""
    import specdec_kernels

    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    for name in [m for m in sys.modules if m.startswith("specdec_kernels.triton_ops")]:
        monkeypatch.delitem(sys.modules, name)  # loaded by an earlier test: load it again
    monkeypatch.delitem(specdec_kernels._CACHE, "triton", raising=False)
    with pytest.raises(ValueError, match=r"kernel=triton: .*needs the triton package.*pip install triton.*kernel='torch'"):
        parse_config(compose_cfg(["proposer=ngram", "kernel=triton"]))
    with pytest.raises(ValueError, match=r"kernel=triton: .*needs the triton package"):  # plain runs too
        parse_config(compose_cfg(["kernel=triton"]))


def test_the_kernel_target_is_what_loads_the_ops(monkeypatch):
    import specdec_kernels

    calls = []
    monkeypatch.setattr(specdec_kernels, "get_ops", lambda name="torch": calls.append(name) or specdec_kernels._load_torch())
    parse_config(compose_cfg(["proposer=ngram"]))
    assert calls == ["torch"]


def test_unregistered_kernel_backend_is_refused():
    with pytest.raises(ValueError, match=r"kernel=cuda_graph: no 'cuda_graph' backend is registered.*torch"):
        parse_config(compose_cfg(["proposer=ngram", "kernel.name=cuda_graph"]))


def test_cluster_launcher_configs_compose_when_their_plugin_is_installed():
    from hydra import compose as hcompose

    for launcher, plugin in (("slurm", "hydra_plugins.hydra_submitit_launcher"),
                             ("ray_cluster", "hydra_plugins.hydra_ray_launcher")):
        try:
            __import__(plugin)
        except ImportError:
            continue  # optional extras ([cluster], [ray]); not installed by default
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = hcompose(config_name="config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
        assert "Launcher" in cfg.hydra.launcher._target_


@pytest.mark.parametrize("experiment", ["eagle", "eagle3", "eagle_chain", "medusa", "mlp_speculator"])
def test_an_experiments_dataset_swaps_for_a_jsonl_without_leftover_keys(experiment, tmp_path):
    """Experiments pick a dataset option as a whole (dataset=mt_bench), so dataset=jsonl replaces it."""
    rc = parse_config(compose_cfg([f"+experiment={experiment}", "dataset=jsonl", f"dataset.path={tmp_path}/p.jsonl"]))
    assert rc.dataset["_target_"] == "specdec.experiment.data.load_jsonl_prompts" and "categories" not in rc.dataset


def test_scorer_and_verifier_come_from_their_target_through_the_registry():
    """A group's _target_ is what gets built: it goes to speculative_config as it is; a registry name instead
    works too, and one beside a _target_ must name the same class."""
    rc = parse_config(compose_cfg(["proposer=ngram", "scorer=batch_expansion"]))
    spec = speculative_config(rc)
    assert spec["scorer"] == "scorers.batch_expansion.BatchExpansionScorer"
    assert spec["acceptance_method"] == "specdec.verify.chain.RejectionSampler"
    rc = parse_config(compose_cfg(["proposer=ngram", "~scorer._target_", "+scorer.name=batch_expansion"]))
    assert speculative_config(rc)["scorer"] == "batch_expansion"
    rc = parse_config(compose_cfg(["proposer=ngram", "+scorer.name=mqa"]))  # the same class: accepted
    assert speculative_config(rc)["scorer"] == "scorers.mqa.MQAScorer"
    with pytest.raises(ValueError, match=r"scorer.name='tree' is scorers.tree.TreeScorer but scorer._target_ is"):
        parse_config(compose_cfg(["proposer=ngram", "scorer._target_=scorers.mqa.MQAScorer", "+scorer.name=tree"]))
