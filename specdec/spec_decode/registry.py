"""The one registry of speculative parts: names -> classes, for proposers, scorers and verifiers.

Every way of naming a part goes through :func:`resolve`, so ``LLM(speculative_config={...})``, a Hydra
group's ``_target_`` (specdec.experiment.compose passes it here as it is) and a plug-in package build the
same class the same way:
- a built-in name (``BUILTIN``: import paths as strings, so this module imports no plug-in);
- a name given to :func:`register` (``register_proposer`` is its proposer form, usable as a decorator);
- a name in the entry-point group ``specdec.<kind>s`` (a third-party package registers there; no change
  to specdec);
- a path, ``"pkg.module:Class"`` or a Hydra ``_target_``, ``"pkg.module.Class"``.
Kernels keep their own registry of op tables (``specdec_kernels.register_ops`` / ``specdec_kernels.get_ops``), which the
parts built here look up by ``speculative_config.kernel``.
"""

from __future__ import annotations

import importlib
from functools import partial
from importlib.metadata import entry_points

from specdec.interfaces import SpeculativeScorer, SpeculativeVerifier
from specdec.spec_decode.proposer import Proposer

KINDS = ("proposer", "scorer", "verifier")
BUILTIN: dict[str, dict[str, str]] = {
    "proposer": {
        "ngram": "proposers.ngram:NGramProposer",
        "suffix": "proposers.suffix:SuffixProposer",
        "draft_model": "proposers.draft_model:DraftModelProposer",
        "layer_skip": "proposers.layer_skip:LayerSkipProposer",
        "tree_draft": "proposers.tree_draft:TreeDraftProposer",
        "eagle": "proposers.eagle:EagleProposer",
        "eagle3": "proposers.eagle3:Eagle3Proposer",
        "medusa": "proposers.medusa:MedusaProposer",
        "mlp_speculator": "proposers.mlp_speculator:MLPSpeculatorProposer",
    },
    "scorer": {
        "mqa": "scorers.mqa:MQAScorer",
        "batch_expansion": "scorers.batch_expansion:BatchExpansionScorer",
        "tree": "scorers.tree:TreeScorer",
    },
    "verifier": {
        "rejection_sampler": "specdec.verify.chain:RejectionSampler",
        "typical_acceptance": "specdec.verify.chain:TypicalAcceptanceSampler",
    },
}
BASES: dict[str, type] = {"proposer": Proposer, "scorer": SpeculativeScorer, "verifier": SpeculativeVerifier}
_registered: dict[str, dict[str, type]] = {kind: {} for kind in KINDS}


def _kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"registry: unknown kind {kind!r}; one of {KINDS}")
    return kind


def register(kind: str, name: str, cls: type | None = None):
    """Register ``cls`` under ``name``; usable as a decorator: ``@register("scorer", "mine")``."""
    base = BASES[_kind(kind)]

    def deco(c: type) -> type:
        if not (isinstance(c, type) and issubclass(c, base)):
            raise TypeError(f"register({kind!r}, {name!r}): {c!r} is not a subclass of specdec {base.__qualname__} "
                            f"({base.__module__})")
        _registered[kind][name] = c
        return c

    return deco(cls) if cls is not None else deco


def _entry_points(kind: str) -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=f"specdec.{kind}s")}


def known(kind: str) -> list[str]:
    return sorted({*BUILTIN[_kind(kind)], *_registered[kind], *_entry_points(kind)})


def _load(kind: str, path: str):
    module, sep, attr = path.partition(":")
    if not sep:  # Hydra's dotted form
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ValueError(f"{kind} {path!r} must look like 'package.module:ClassName' (or package.module.ClassName)")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{kind} {path!r}: cannot import module {module!r} ({e}); check the package is installed "
                         "and on sys.path") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{kind} {path!r}: module {module!r} has no attribute {part!r}; give "
                             f"'package.module:ClassName' of a {BASES[kind].__qualname__} subclass")
        obj = getattr(obj, part)
    return obj  # checked against the kind's base class by resolve()


def resolve(kind: str, name: str) -> type:
    """The class for a registered name or an import path (module docstring)."""
    _kind(kind)
    if name in _registered[kind]:
        return _registered[kind][name]
    if name in BUILTIN[kind]:
        cls = _load(kind, BUILTIN[kind][name])
    elif name in (eps := _entry_points(kind)):
        cls = _load(kind, eps[name])
    elif ":" in name or "." in name:
        cls = _load(kind, name)
    else:
        what = "speculative method" if kind == "proposer" else kind
        raise ValueError(f"unknown {what} {name!r}; known: {known(kind)}, or give 'package.module:Class' for your "
                         f"own {BASES[kind].__qualname__} subclass")
    base = BASES[kind]
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"{kind} {name!r} resolved to {cls!r}, which is not a subclass of "
                        f"{base.__module__}.{base.__qualname__}")
    return cls


# the proposer forms, the plug-in surface researchers already use
register_proposer = partial(register, "proposer")
resolve_proposer = partial(resolve, "proposer")
known_proposers = partial(known, "proposer")
