"""Helpers for tests that drive an engine by hand and compare it with transformers (no pytest here).

``run(engine, {slot: tokens})`` forwards one batch; ``hf_logits(hf, ids)`` is the no-cache reference.
"""

from __future__ import annotations

import torch

from specdec.engine.interface import ForwardBatch, ForwardOutput, ModelEngine

__all__ = ["hf_logits", "rand_tokens", "run"]


def run(engine: ModelEngine, seqs: dict[int, list[int]], **batch_fields) -> ForwardOutput:
    """Forward ``{slot: new token ids}`` as one ForwardBatch, sequences in dict order."""
    ids = torch.tensor([t for toks in seqs.values() for t in toks], dtype=torch.long)
    return engine.forward(ForwardBatch(ids, list(seqs), [len(t) for t in seqs.values()], **batch_fields))


def hf_logits(hf, ids: list[int], positions: list[int] | None = None) -> torch.Tensor:
    """[len(ids), V] float32 logits of a transformers causal LM over the whole sequence, no cache."""
    kwargs = {} if positions is None else {"position_ids": torch.tensor([positions])}
    with torch.no_grad():
        return hf(torch.tensor([ids]), **kwargs).logits[0].float()


def rand_tokens(n: int, seed: int, vocab: int = 512, low: int = 3) -> list[int]:
    """n token ids in [low, vocab) from a seeded generator (low=3 skips the tiny tokenizer's specials)."""
    return torch.randint(low, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
