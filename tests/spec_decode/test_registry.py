"""specdec/spec_decode/registry.py. A researcher's proposer plugs in with no change to specdec: as
"module:Class", registered by name (function or decorator), or through the ``specdec.proposers``
entry-point group of an installed package. Scorers and verifiers resolve the same way (built-in names,
both path spellings, a Hydra ``_target_`` among them), and a class of the wrong kind or an unknown kind is refused."""

from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from specdec import LLM, SamplingParams
from specdec.spec_decode import registry
from specdec.spec_decode.proposer import Proposer
from specdec.spec_decode.registry import known, known_proposers, register, register_proposer, resolve
from tests.spec_decode.helpers import assert_greedy_equal, ids

PROMPTS = [[5, 6, 7], [40, 41, 42, 43] * 4, [9] * 6]
SP = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (24, 15, 30)]


@pytest.fixture
def on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # where the researcher's module lives


def run_and_check(llm: LLM, plain_tiny) -> None:
    outs = llm.generate(ids(PROMPTS), SP, use_tqdm=False)
    assert_greedy_equal(plain_tiny.engine, PROMPTS, outs, plain_tiny.generate(ids(PROMPTS), SP, use_tqdm=False),
                        "plug-in")
    m = llm.get_metrics()
    assert m.num_draft_tokens > 0 and m.num_accepted_tokens > 0


def test_module_colon_class(on_path, plain_tiny):
    import my_proposer

    before = my_proposer.EchoProposer.calls
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256,
              speculative_config={"method": "my_proposer:EchoProposer", "num_speculative_tokens": 3,
                                  "options": {"repeat_last": True}})
    assert llm.worker.top1.proposer.repeat is True  # options reach the plug-in untouched
    run_and_check(llm, plain_tiny)
    assert my_proposer.EchoProposer.calls > before


def test_registered_by_name_and_by_decorator(on_path, plain_tiny):
    from my_proposer import EchoProposer

    register_proposer("echo_test", EchoProposer)

    @register_proposer("echo_decorated_test")
    class Repeat(EchoProposer):
        pass

    assert {"echo_test", "echo_decorated_test"} <= set(known_proposers())
    for name in ("echo_test", "echo_decorated_test"):
        llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256, spec_method=name, spec_tokens=2)
        assert type(llm.worker.top1.proposer) is (EchoProposer if name == "echo_test" else Repeat)
        run_and_check(llm, plain_tiny)


def test_entry_point_of_an_installed_package(on_path, monkeypatch, plain_tiny):
    ep = EntryPoint(name="echo_ep_test", value="my_proposer:EchoProposer", group="specdec.proposers")
    monkeypatch.setattr(registry, "entry_points", lambda group: [ep] if group == "specdec.proposers" else [])
    assert "echo_ep_test" in known_proposers()
    run_and_check(LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256,
                      speculative_config={"method": "echo_ep_test", "num_speculative_tokens": 2}), plain_tiny)


def test_unknown_method_lists_the_known_ones():
    register_proposer("listed_test", type("Listed", (Proposer,), {"propose": lambda self, b: None}))
    with pytest.raises(ValueError, match=r"unknown speculative method 'eagle9'.*draft_model.*layer_skip.*listed_test.*"
                                         r"ngram.*package\.module:Class"):
        LLM("tiny-random-llama", max_num_seqs=2, max_model_len=64, spec_method="eagle9")


def test_a_class_that_is_not_a_proposer_is_refused(on_path):
    with pytest.raises(TypeError, match="my_proposer:NotAProposer.*not a subclass of .*Proposer"):
        LLM("tiny-random-llama", max_num_seqs=2, max_model_len=64, spec_method="my_proposer:NotAProposer")
    with pytest.raises(TypeError, match="'nope_test'.*not a subclass of specdec Proposer"):
        register_proposer("nope_test", dict)
    from my_proposer import NotAProposer

    with pytest.raises(TypeError, match="not a subclass"):
        register_proposer("nope_test")(NotAProposer)
    assert "nope_test" not in known_proposers()


def test_a_missing_module_or_class_is_a_clear_error(on_path):
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        LLM("tiny-random-llama", max_num_seqs=2, max_model_len=64, spec_method="no_such_module_xyz:Thing")
    with pytest.raises(ValueError, match="has no attribute 'NoSuchClass'"):
        LLM("tiny-random-llama", max_num_seqs=2, max_model_len=64, spec_method="my_proposer:NoSuchClass")


# ---------------------------------------------------------------------------------------------- every kind


def test_builtin_scorers_and_verifiers_resolve_by_name_and_by_either_path():
    from scorers.mqa import MQAScorer
    from scorers.tree import TreeScorer
    from specdec.verify.chain import RejectionSampler, TypicalAcceptanceSampler

    assert resolve("scorer", "mqa") is MQAScorer and resolve("scorer", "tree") is TreeScorer
    assert resolve("verifier", "typical_acceptance") is TypicalAcceptanceSampler
    assert resolve("scorer", "scorers.mqa:MQAScorer") is MQAScorer  # the "module:Class" spelling
    assert resolve("verifier", "specdec.verify.chain.RejectionSampler") is RejectionSampler  # Hydra's _target_
    assert {"mqa", "batch_expansion", "tree"} <= set(known("scorer"))
    assert {"rejection_sampler", "typical_acceptance"} <= set(known("verifier"))


def test_a_hydra_target_resolves_to_the_class_its_name_does():
    """specdec.experiment.compose passes a group's _target_ here as it is."""
    from proposers.ngram import NGramProposer

    assert resolve("proposer", "proposers.ngram.NGramProposer") is resolve("proposer", "ngram") is NGramProposer
    assert resolve("proposer", "proposers.ngram:NGramProposer") is NGramProposer


def test_a_class_of_another_kind_is_refused_and_unknown_kinds_are_named():
    with pytest.raises(TypeError, match="resolved to .*not a subclass of specdec.interfaces.SpeculativeScorer"):
        resolve("scorer", "specdec.verify.chain:RejectionSampler")  # a verifier where a scorer is wanted
    with pytest.raises(TypeError, match="not a subclass of specdec SpeculativeVerifier"):
        register("verifier", "nope_verifier_test", Proposer)
    with pytest.raises(ValueError, match="unknown kind 'kernel'; one of"):
        resolve("kernel", "torch")
    with pytest.raises(ValueError, match="unknown scorer 'mqa9'; known: .*give 'package.module:Class'"):
        resolve("scorer", "mqa9")
    with pytest.raises(ValueError, match="must look like 'package.module:ClassName'"):
        resolve("scorer", ":MQAScorer")
