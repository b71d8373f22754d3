"""Build a SpecDecodeWorker from `speculative_config`: proposer, scorer and verifier by name."""

from __future__ import annotations

import logging
from typing import Any

import torch

from specdec.engine import ModelEngine
from specdec.spec_decode.config import check_fits, parse_speculative_config
from specdec.spec_decode.registry import resolve_proposer
from specdec.spec_decode.top1_proposer import Top1Proposer
from specdec.spec_decode.worker import SpecDecodeWorker
from specdec.sampling import Sampler
from specdec.worker import PlainWorker

log = logging.getLogger(__name__)


def build_scorer(name: str, target: ModelEngine, slot_of: dict[int, int]):
    if name == "mqa":
        from scorers.mqa import MQAScorer

        return MQAScorer(target, slot_of)
    from scorers.batch_expansion import BatchExpansionScorer

    return BatchExpansionScorer(target, slot_of)


def build_verifier(cfg):
    from specdec.verify import RejectionSampler, TypicalAcceptanceSampler

    if cfg.acceptance_method == "typical_acceptance":
        return TypicalAcceptanceSampler(cfg.posterior_threshold, cfg.posterior_alpha, kernel=cfg.kernel)
    return RejectionSampler(kernel=cfg.kernel)


def check_invariant(target: ModelEngine) -> None:
    """Greedy speculation is lossless only if the target scores a row the same alone and among k+1 rows.
    The native kernels guarantee it; the torch reference path does not. In fp32 its one-row and M-row
    products differ only in the last bits (0 greedy mismatches measured on 130 Spec-Bench prompts), so it
    is allowed with a warning; in bf16/fp16 they flip argmaxes (15 of 26 prompts differed), so it is refused."""
    if getattr(target, "batch_invariant", True):
        return
    why = getattr(target, "kernel_fallback_reason", "torch path")
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
    cfg = parse_speculative_config(spec)
    check_fits(cfg, max_model_len)
    check_invariant(target)
    cls = resolve_proposer(cfg.method)
    log.info("speculation: proposer %s.%s, k=%d, scorer=%s, verifier=%s, kernel=%s", cls.__module__,
             cls.__qualname__, cfg.num_speculative_tokens, cfg.scorer, cfg.acceptance_method, cfg.kernel)
    if cfg.scorer == "tree":  # its own worker: tree proposals, scorer, verifier and KV compaction
        from specdec.spec_decode.tree_worker import build_tree_worker

        return build_tree_worker(target, cfg, cls, max_model_len=max_model_len)
    proposer = cls(target, cfg)
    plain = PlainWorker(target, Sampler(kernel=cfg.kernel))
    top1 = Top1Proposer(proposer, cfg.num_speculative_tokens, max_model_len, target.vocab_size,
                        cfg.disable_by_batch_size)
    worker = SpecDecodeWorker(plain, top1, build_scorer(cfg.scorer, target, plain.slots.slot_of),
                              build_verifier(cfg))
    return worker, cfg.num_speculative_tokens
