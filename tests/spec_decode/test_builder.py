"""build_spec_worker's refusal of a target that is not batch-invariant, dtype='auto', and how options reach a
proposer (proposer_kwargs / make_proposer)."""

from __future__ import annotations

import logging

import pytest
import torch

from specdec.engine.loader import auto_dtype, load_engine
from specdec.spec_decode.builder import build_spec_worker, check_invariant, check_parts, make_proposer, proposer_kwargs
from specdec.spec_decode.config import parse_speculative_config
from specdec.spec_decode.proposer import Proposer
from specdec.spec_decode.registry import resolve


class _TorchPathEngine:  # what check_invariant reads of an engine on the torch reference path
    batch_invariant = False
    kernel_fallback_reason = "SPECDEC_NATIVE=0"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lossy_dtype_without_invariant_kernels_is_refused(dtype):
    with pytest.raises(ValueError, match=r"dtype=(bfloat16|float16) needs the batch-invariant native kernels.*SPECDEC_NATIVE=0"):
        check_invariant(_TorchPathEngine(dtype))


def test_fp32_torch_path_warns(caplog):
    with caplog.at_level(logging.WARNING):
        check_invariant(_TorchPathEngine(torch.float32))
    assert "not batch-invariant" in caplog.text


def test_refusal_comes_before_anything_is_built(monkeypatch):
    monkeypatch.setenv("SPECDEC_NATIVE", "0")
    target = load_engine("tiny-random-llama", num_slots=2, max_model_len=64, dtype="bfloat16")
    assert not target.batch_invariant and "SPECDEC_NATIVE=0" in target.describe()["kernels"]
    with pytest.raises(ValueError, match="needs the batch-invariant native kernels"):
        build_spec_worker(target, {"method": "ngram", "num_speculative_tokens": 3}, max_num_seqs=2, max_model_len=64)


def test_auto_dtype_follows_the_cpu(monkeypatch):
    monkeypatch.delenv("SPECDEC_AUTO_DTYPE", raising=False)  # the suite pins it (tests/conftest.py)
    dt, why = auto_dtype()
    assert dt in (torch.float32, torch.bfloat16)
    assert why.startswith(str(dt).removeprefix("torch.") + ":")
    assert (dt == torch.bfloat16) == ("avx512_bf16" in why or "amx_bf16" in why)
    engine = load_engine("tiny-random-llama", num_slots=1, max_model_len=16, dtype="auto")
    assert engine.dtype == dt
    info = engine.describe()
    assert info["dtype"] == str(dt).removeprefix("torch.") and info["cpu_capability"]


# ---------------------------------------------------------------------------------------------- check_parts
def _cfg(**kw):
    from specdec.spec_decode.config import parse_speculative_config

    return parse_speculative_config({"method": "ngram", **kw})


def test_check_parts_decides_the_fit_without_a_model():
    """The one fit check (build_spec_worker and specdec.experiment.compose both call it): pure, no model."""
    from proposers.ngram import NGramProposer
    from scorers.tree import TreeScorer
    from specdec.spec_decode.builder import check_parts
    from specdec.spec_decode.proposer import TreeProposer

    parts = check_parts(_cfg(num_speculative_tokens=3), NGramProposer, 64)
    assert parts.proposer is NGramProposer and parts.shape is None and parts.ops.name == "torch"
    # a name and an import path (either spelling) are the same part
    assert check_parts(_cfg(scorer="scorers.mqa.MQAScorer"), NGramProposer, 64).scorer is parts.scorer
    tree = check_parts(_cfg(scorer="tree", tree_depth=3, tree_budget=6), TreeProposer, 64)
    assert tree.scorer is TreeScorer and (tree.shape.depth, tree.shape.budget) == (3, 6)
    assert check_parts(_cfg(scorer="tree"), None, 64).proposer is None  # plain: what does not draft only


@pytest.mark.parametrize("kw,max_len,match", [
    ({"scorer": "tree"}, 64, r"scorer=tree needs a tree-capable proposer; ngram is chain-only .*NGramProposer.*"
                             r"Use scorer='mqa'"),
    ({"scorer": "tree", "acceptance_method": "typical_acceptance"}, 64,
     r"scorer='tree' verifies token trees; acceptance_method='typical_acceptance' is chain-only: use 'rejection_sampler'"),
    ({"scorer": "tree9"}, 64, r"speculative_config scorer='tree9' is unknown or invalid: .*known: \['batch_expansion'"),
    ({"acceptance_method": "scorers.mqa:MQAScorer"}, 64, r"acceptance_method='scorers.mqa:MQAScorer' is unknown or "
                                                         r"invalid: .*not a subclass of .*SpeculativeVerifier"),
    ({"num_speculative_tokens": 65}, 4096, r"num_speculative_tokens=65 is too large: at most 64"),
    ({"num_speculative_tokens": 40}, 64, r"num_speculative_tokens=40 is too large for max_model_len=64: .* = 32"),
    ({"kernel": "cuda9"}, 64, r"kernel=cuda9: no 'cuda9' backend is registered .*use kernel=torch"),
])
def test_check_parts_refuses_naming_the_value_and_the_way_out(kw, max_len, match):
    from proposers.ngram import NGramProposer
    from specdec.spec_decode.builder import check_parts

    with pytest.raises(ValueError, match=match):
        check_parts(_cfg(**kw), NGramProposer, max_len)


def test_a_backend_that_does_not_import_is_refused_by_name():
    from specdec.spec_decode.builder import check_kernel

    def no_pkg(name):
        import no_such_backend_pkg_xyz  # noqa: F401

    with pytest.raises(ValueError, match=r"kernel=torch: `import no_such_backend_pkg_xyz` fails.*use kernel=torch"):
        check_kernel("torch", no_pkg)


# ---- options reach the proposer (issue #45): keyword arguments of __init__, or the keys it declares it reads
class _WithArgs(Proposer):
    def __init__(self, target, config, nmax: int = 3, *, width: int) -> None:
        super().__init__(target, config)
        self.nmax, self.width = nmax, width

    def propose(self, batch):
        raise NotImplementedError


class _ReadsOptions(Proposer):
    option_keys = frozenset({"depth"})

    def propose(self, batch):
        raise NotImplementedError


def test_options_become_init_arguments_and_are_validated_against_the_signature():
    assert proposer_kwargs(_WithArgs, {"nmax": 1, "width": 2}) == {"nmax": 1, "width": 2}
    built = make_proposer(_WithArgs, None, parse_speculative_config({"method": "ngram", "options": {"width": 5}}))
    assert (built.nmax, built.width) == (3, 5)  # the default where no option is given
    with pytest.raises(ValueError, match=r"options \['nmx'\] are not options of .*_WithArgs: it takes \['nmax', 'width'\]"):
        proposer_kwargs(_WithArgs, {"nmx": 1, "width": 2})
    with pytest.raises(ValueError, match=r"needs options \['width'\].*proposer.options.width="):
        proposer_kwargs(_WithArgs, {"nmax": 1})


def test_declared_option_keys_stay_in_the_config_and_others_are_refused():
    assert proposer_kwargs(_ReadsOptions, {"depth": 2}) == {}
    with pytest.raises(ValueError, match=r"options \['dpeth'\] are not options of .*_ReadsOptions: it takes \['depth'\]"):
        proposer_kwargs(_ReadsOptions, {"dpeth": 2})


def test_a_misspelt_option_of_a_builtin_fails_before_any_model_loads():
    cfg = parse_speculative_config({"method": "ngram", "options": {"prompt_lookup": 2}})
    with pytest.raises(ValueError, match=r"options \['prompt_lookup'\] are not options of proposers.ngram.NGramProposer"):
        check_parts(cfg, resolve("proposer", "ngram"), 256)


def test_keys_that_nothing_reads_are_warned_about(caplog):
    """A library user's speculative_config key that the built parts never read (specdec.run refuses them)."""
    import logging

    from specdec import LLM

    with caplog.at_level(logging.WARNING, logger="specdec.spec_decode.builder"):
        LLM("tiny-random-llama", max_model_len=64, speculative_config={
            "method": "ngram", "num_speculative_tokens": 3, "model": "tiny-random-llama", "tree_budget": 5,
            "posterior_threshold": 0.5})
    said = " ".join(r.getMessage() for r in caplog.records)
    for words in ("model='tiny-random-llama' does nothing here: NGramProposer does not read it",
                  "tree_budget=5 does nothing here: only a tree scorer reads it",
                  "posterior_threshold=0.5 does nothing here: only typical acceptance reads it"):
        assert words in said, said
