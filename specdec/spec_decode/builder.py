"""Build a SpecDecodeWorker from `speculative_config`: proposer, scorer and verifier by name."""

from __future__ import annotations

import logging
from typing import Any

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


def build_spec_worker(target: ModelEngine, spec: dict[str, Any], *, max_num_seqs: int, max_model_len: int,
                      dtype: str = "float32", seed: int = 0) -> tuple[SpecDecodeWorker, int]:
    cfg = parse_speculative_config(spec)
    check_fits(cfg, max_model_len)
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
