"""Proposer names -> classes: built-ins, `register_proposer`, "pkg.module:Class", and the
`specdec.proposers` entry-point group (a third-party package registers there; no change to specdec)."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from specdec.spec_decode.proposer import Proposer

BUILTIN = {
    "ngram": "proposers.ngram:NGramProposer",
    "draft_model": "proposers.draft_model:DraftModelProposer",
    "layer_skip": "proposers.layer_skip:LayerSkipProposer",
    "tree_draft": "proposers.tree_draft:TreeDraftProposer",
    "eagle": "proposers.eagle:EagleProposer",
    "eagle3": "proposers.eagle3:Eagle3Proposer",
    "medusa": "proposers.medusa:MedusaProposer",
    "mlp_speculator": "proposers.mlp_speculator:MLPSpeculatorProposer",
}
_registered: dict[str, type[Proposer]] = {}


def register_proposer(name: str, cls: type[Proposer] | None = None):
    """Register ``cls`` under ``name``; usable as a decorator: ``@register_proposer("mine")``."""

    def deco(c: type[Proposer]) -> type[Proposer]:
        if not (isinstance(c, type) and issubclass(c, Proposer)):
            raise TypeError(f"register_proposer({name!r}): {c!r} is not a subclass of specdec Proposer")
        _registered[name] = c
        return c

    return deco(cls) if cls is not None else deco


def _load(path: str) -> type:
    module, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"proposer path {path!r} must look like 'package.module:ClassName'")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"speculative method {path!r}: cannot import module {module!r} ({e}); check the "
                         "package is installed and on sys.path") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"speculative method {path!r}: module {module!r} has no attribute {part!r}; "
                             "give 'package.module:ClassName' of a Proposer subclass")
        obj = getattr(obj, part)
    return obj  # type: ignore[return-value]


def _entry_points() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group="specdec.proposers")}


def known_proposers() -> list[str]:
    return sorted({*BUILTIN, *_registered, *_entry_points()})


def resolve_proposer(method: str) -> type[Proposer]:
    if method in _registered:
        return _registered[method]
    if ":" in method:
        cls = _load(method)
    elif method in BUILTIN:
        cls = _load(BUILTIN[method])
    elif method in (eps := _entry_points()):
        cls = _load(eps[method])
    else:
        raise ValueError(f"unknown speculative method {method!r}; known: {known_proposers()}, or give "
                         "'package.module:Class' for your own Proposer subclass")
    if not (isinstance(cls, type) and issubclass(cls, Proposer)):
        raise TypeError(f"speculative method {method!r} resolved to {cls!r}, which is not a subclass of "
                        "specdec.spec_decode.proposer.Proposer")
    return cls
