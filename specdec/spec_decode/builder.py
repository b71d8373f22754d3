"""Build a SpecDecodeWorker from `speculative_config`: proposer, scorer and verifier through the registry.

No part is picked by an if/else over names: each is ``registry.resolve(kind, name_or_path)``, and a scorer
that drafts trees (``drafts_trees``) makes the proposer draft trees of the configured shape.

Whether the parts fit is decided here, once, by :func:`check_parts`, a pure function of the config and the
classes (it loads no model): ``build_spec_worker`` calls it, and so does specdec.experiment.compose, so a
composed run fails on a clash before any model loads, with the same message ``LLM(speculative_config=...)``
gives.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable

import msgspec
import torch

import specdec_kernels
from specdec.engine import ModelEngine
from specdec.sampling.sampler import Sampler
from specdec.spec_decode.config import SpeculativeConfig, check_sizes, parse_speculative_config
from specdec.spec_decode.policy import SpeculationPolicy, make_policy
from specdec.spec_decode.registry import resolve
from specdec.spec_decode.top1_proposer import Top1Proposer
from specdec.spec_decode.spec_decode_worker import SpecDecodeWorker
from specdec.spec_decode.proposer import TreeProposer, TreeShape
from specdec.core.plain_worker import PlainWorker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Parts:
    """What a speculative_config builds, checked to fit (:func:`check_parts`)."""

    proposer: type | None  # a Proposer subclass; None: nothing drafts (a plain run's unused groups)
    scorer: type  # a SpeculativeScorer subclass
    verifier: type  # a SpeculativeVerifier subclass
    ops: specdec_kernels.KernelOps  # the kernel backend's op table
    shape: TreeShape | None  # the tree every step drafts; None: chains of k
    policy: SpeculationPolicy | None = None  # how much each request drafts each step (None: plain decoding)


def resolve_part(kind: str, key: str, value: str) -> type:
    """A scorer / verifier class from its speculative_config value (a registered name or an import path)."""
    try:
        return resolve(kind, value)
    except (ValueError, TypeError) as e:
        raise ValueError(f"speculative_config {key}={value!r} is unknown or invalid: {e}") from None


def check_kernel(name: str, get_ops: Callable[[str], specdec_kernels.KernelOps] = specdec_kernels.get_ops) -> specdec_kernels.KernelOps:
    """The ops of backend ``name``, loaded by ``get_ops`` (the kernel group's ``_target_``): a backend that is
    not registered, or whose package does not import (triton), fails here naming it and the way out."""
    if name not in specdec_kernels.available_kernels():
        raise ValueError(f"kernel={name}: no {name!r} backend is registered in kernels (registered: "
                         f"{specdec_kernels.available_kernels()}); use kernel=torch, or register one with specdec_kernels.register_ops")
    try:
        return get_ops(name)
    except ImportError as e:  # a backend whose loader does not wrap its own import
        raise ValueError(f"kernel={name}: `import {e.name or name}` fails ({e}); install it (pip install "
                         f"{e.name or name}) or use kernel=torch") from e
    except ValueError as e:  # kernels' own message names the package and kernel='torch'
        raise ValueError(f"kernel={name}: {e}") from e


def proposer_kwargs(proposer_cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``options`` give ``proposer_cls.__init__``: each key its ``__init__`` declares after
    (target, config) goes there; the keys it reads from ``config.options`` itself (``option_keys``) stay there.
    Refuses, naming them, an unknown key and a required ``__init__`` argument that no option gives (a proposer
    whose ``__init__`` takes ``**kwargs`` gets every key that is not one of its option_keys)."""
    params = list(inspect.signature(proposer_cls.__init__).parameters.values())[3:]  # after self, target, config
    named = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    anything = any(p.kind is p.VAR_KEYWORD for p in params)
    own = set(proposer_cls.option_keys)
    name = f"{proposer_cls.__module__}.{proposer_cls.__qualname__}"
    unknown = sorted(k for k in options if k not in named and k not in own and not anything)
    if unknown:
        takes = sorted(set(named) | own)
        raise ValueError(f"speculative_config options {unknown} are not options of {name}: it takes "
                         f"{takes or 'none'} (proposer.options.<key>=...); check the spelling, or declare the "
                         "argument in its __init__")
    missing = sorted(n for n, p in named.items() if p.default is p.empty and n not in options)
    if missing:
        raise ValueError(f"{name} needs options {missing} (__init__ arguments without a default): give "
                         f"proposer.options.{missing[0]}=...")
    return {k: v for k, v in options.items() if k in named or (anything and k not in own)}


def make_proposer(proposer_cls: type, target: ModelEngine, cfg: SpeculativeConfig):
    """``proposer_cls(target, cfg, **the options its __init__ declares)``: how every proposer is built."""
    return proposer_cls(target, cfg, **proposer_kwargs(proposer_cls, cfg.options))


def check_parts(cfg: SpeculativeConfig, proposer_cls: type | None, max_model_len: int,
                get_ops: Callable[[str], specdec_kernels.KernelOps] = specdec_kernels.get_ops) -> Parts:
    """Do the parts of ``cfg`` fit? The one place that decides: the scorer and verifier resolve, a tree
    scorer has a tree verifier and a tree proposer, k (a tree's depth and budget) fits in max_model_len,
    the kernel backend loads. ``proposer_cls`` None (plain decoding) checks only what does not draft.
    Pure: builds no model. Raises ValueError naming the key, the value and the way out."""
    scorer_cls = resolve_part("scorer", "scorer", cfg.scorer)
    verifier_cls = resolve_part("verifier", "acceptance_method", cfg.acceptance_method)
    if scorer_cls.drafts_trees and not verifier_cls.verifies_trees:
        raise ValueError(f"speculative_config scorer={cfg.scorer!r} verifies token trees; acceptance_method="
                         f"{cfg.acceptance_method!r} is chain-only: use 'rejection_sampler'")
    shape = None
    if proposer_cls is not None:
        if scorer_cls.drafts_trees:
            if not issubclass(proposer_cls, TreeProposer):
                raise ValueError(f"scorer={cfg.scorer} needs a tree-capable proposer; {cfg.method} is chain-only "
                                 f"({proposer_cls.__module__}.{proposer_cls.__qualname__} does not subclass "
                                 "specdec.spec_decode.proposer.TreeProposer). Use scorer='mqa', or a tree proposer "
                                 "such as 'proposers.tree_draft:TreeDraftProposer'")
            shape = TreeShape(depth=cfg.tree_depth or cfg.num_speculative_tokens, topk=cfg.tree_topk,
                              budget=cfg.tree_budget)
        check_sizes(cfg, scorer_cls.drafts_trees, max_model_len)
        proposer_kwargs(proposer_cls, cfg.options)  # every option reaches the proposer, or is refused here
    policy = make_policy(cfg.speculation_policy, cfg.policy_options) if proposer_cls is not None else None
    return Parts(proposer_cls, scorer_cls, verifier_cls, check_kernel(cfg.kernel, get_ops), shape, policy)


def check_invariant(target: ModelEngine) -> None:
    """Greedy speculation is lossless only if the target scores a row the same alone and among k+1 rows.
    The native kernels guarantee it; the torch reference path does not. In fp32 its one-row and M-row
    products differ only in the last bits (0 greedy mismatches measured on 130 Spec-Bench prompts), so it
    is allowed with a warning; in bf16/fp16 they flip argmaxes (15 of 26 prompts differed), so it is refused."""
    if target.batch_invariant:
        return
    why = target.kernel_fallback_reason or "torch path"
    if target.dtype != torch.float32:
        raise ValueError(
            f"speculative decoding with dtype={str(target.dtype).removeprefix('torch.')} needs the batch-invariant "
            f"native kernels, which are unavailable here ({why}); without them greedy output would differ from plain "
            f"decoding. Install g++ and rerun `bash scripts/install.sh`, unset SPECDEC_NATIVE=0, or use dtype='float32'"
        )
    log.warning("target runs the torch reference path (%s): not batch-invariant, so greedy speculation matches plain "
                "decoding only up to last-bit ties; build the native kernels (bash scripts/install.sh)", why)


TREE_KEYS = ("tree_depth", "tree_topk", "tree_budget")  # read by a tree scorer only


def unread_keys(cfg: SpeculativeConfig, proposer_cls: type, spec: dict[str, Any],
                parts: Parts) -> list[tuple[str, Any, str]]:
    """(key, value, why) for the keys of ``cfg`` set away from their defaults that nothing built from it reads: a
    proposer-specific key the proposer does not declare (Proposer.config_keys), a tree key on a chain, typical
    acceptance's thresholds under another verifier."""
    from specdec.spec_decode.proposer import PROPOSER_KEYS

    default, why = SpeculativeConfig(method="-"), {}
    reads = proposer_cls.config_keys(spec)
    for k in PROPOSER_KEYS if reads is not None else ():
        if k not in reads:
            why[k] = f"{proposer_cls.__name__} does not read it"
    if parts.shape is None:
        why.update(dict.fromkeys(TREE_KEYS, "only a tree scorer reads it"))
    if not issubclass(parts.verifier, resolve("verifier", "typical_acceptance")):
        why.update(dict.fromkeys(("posterior_threshold", "posterior_alpha"), "only typical acceptance reads it"))
    now, default = msgspec.structs.asdict(cfg), msgspec.structs.asdict(default)
    return [(k, now[k], w) for k, w in why.items() if now[k] != default[k]]


def build_spec_worker(target: ModelEngine, spec: dict[str, Any], *, max_num_seqs: int, max_model_len: int,
                      dtype: str = "float32", seed: int = 0) -> tuple[SpecDecodeWorker, int]:
    """(worker, k): k = the chain length, or a tree's longest path (Top1Proposer.max_path: positions 0..k of the
    acceptance counters)."""
    cfg = parse_speculative_config(spec)
    proposer_cls = resolve("proposer", cfg.method)
    parts = check_parts(cfg, proposer_cls, max_model_len)
    check_invariant(target)
    scorer_cls, verifier_cls, shape = parts.scorer, parts.verifier, parts.shape
    log.info("speculation: proposer %s.%s, %s, scorer=%s, verifier=%s, kernel=%s%s", proposer_cls.__module__,
             proposer_cls.__qualname__, f"k={cfg.num_speculative_tokens}" if shape is None else "a tree", cfg.scorer,
             cfg.acceptance_method, cfg.kernel,
             "" if shape is None else f", tree depth={shape.depth} topk={shape.topk} budget={shape.budget}")
    for key, value, why in unread_keys(cfg, proposer_cls, spec, parts):  # specdec.run refuses most (compose.py)
        log.warning("speculative_config %s=%r does nothing here: %s; drop it", key, value, why)
    proposer = make_proposer(proposer_cls, target, cfg)
    plain = PlainWorker(target, Sampler(kernel=cfg.kernel))
    target.use_kernel(cfg.kernel)  # a tree's KV compaction runs on the chosen kernel too
    top1 = Top1Proposer(proposer, cfg.num_speculative_tokens, max_model_len, target.vocab_size,
                        cfg.disable_by_batch_size, shape)
    layers = proposer.features.layers if proposer.features is not None else ()
    scorer = scorer_cls(target, plain.slots.slot_of, kernel=cfg.kernel, hidden_layers=layers)
    return SpecDecodeWorker(plain, top1, scorer, verifier_cls.from_config(cfg), parts.policy), top1.max_path
