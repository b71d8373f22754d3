"""Build a SpecDecodeWorker from `speculative_config`: proposer, scorer and verifier through the registry.

No part is picked by an if/else over names: each is ``registry.resolve(kind, name_or_path)``, and a scorer
that drafts trees (``drafts_trees``) makes the proposer draft trees of the configured shape.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from specdec.engine import ModelEngine
from specdec.sampling.sampler import Sampler
from specdec.spec_decode.config import check_fits, parse_speculative_config
from specdec.spec_decode.registry import resolve
from specdec.spec_decode.top1_proposer import Top1Proposer
from specdec.spec_decode.spec_decode_worker import SpecDecodeWorker
from specdec.spec_decode.proposer import TreeProposer, TreeShape
from specdec.core.plain_worker import PlainWorker

log = logging.getLogger(__name__)


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


def build_spec_worker(target: ModelEngine, spec: dict[str, Any], *, max_num_seqs: int, max_model_len: int,
                      dtype: str = "float32", seed: int = 0) -> tuple[SpecDecodeWorker, int]:
    """(worker, k): k = the chain length, or a tree's depth."""
    cfg = parse_speculative_config(spec)
    check_fits(cfg, max_model_len)
    check_invariant(target)
    proposer_cls = resolve("proposer", cfg.method)
    scorer_cls = resolve("scorer", cfg.scorer)
    verifier_cls = resolve("verifier", cfg.acceptance_method)
    shape = None
    if scorer_cls.drafts_trees:
        if not issubclass(proposer_cls, TreeProposer):
            raise ValueError(f"scorer={cfg.scorer} needs a tree-capable proposer; {cfg.method} is chain-only "
                             f"({proposer_cls.__module__}.{proposer_cls.__qualname__} does not subclass "
                             "specdec.spec_decode.proposer.TreeProposer). Use scorer='mqa', or a tree proposer such as "
                             "'proposers.tree_draft:TreeDraftProposer'")
        shape = TreeShape(depth=cfg.tree_depth or cfg.num_speculative_tokens, topk=cfg.tree_topk,
                          budget=cfg.tree_budget)
    log.info("speculation: proposer %s.%s, k=%d, scorer=%s, verifier=%s, kernel=%s%s", proposer_cls.__module__,
             proposer_cls.__qualname__, cfg.num_speculative_tokens, cfg.scorer, cfg.acceptance_method, cfg.kernel,
             "" if shape is None else f", tree depth={shape.depth} topk={shape.topk} budget={shape.budget}")
    proposer = proposer_cls(target, cfg)
    plain = PlainWorker(target, Sampler(kernel=cfg.kernel))
    target.use_kernel(cfg.kernel)  # a tree's KV compaction runs on the chosen kernel too
    top1 = Top1Proposer(proposer, cfg.num_speculative_tokens, max_model_len, target.vocab_size,
                        cfg.disable_by_batch_size, shape)
    layers = proposer.features.layers if proposer.features is not None else ()
    scorer = scorer_cls(target, plain.slots.slot_of, kernel=cfg.kernel, hidden_layers=layers)
    return SpecDecodeWorker(plain, top1, scorer, verifier_cls.from_config(cfg)), top1.k
