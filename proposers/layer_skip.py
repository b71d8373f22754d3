"""LayerSkipProposer: self-speculation, the target's first ``num_layers`` layers draft (LayerSkip,
Elhoushi et al. 2024; Draft & Verify, Zhang et al. 2023, without their training or layer search).

The draft engine is ``target.truncated(num_layers)``: the first N decoder layers + the target's final
norm and LM head, every weight shared with the target (no extra memory but its own KV cache). Everything
else (lazy catch-up, sampling, q, rollback) is DraftModelProposer's. The KV of the shared layers is not
reused between draft and target: the target recomputes it at verification, as in the paper's simple form.
"""

from __future__ import annotations

from specdec.engine import ModelEngine
from proposers.draft_model import DraftModelProposer


class LayerSkipProposer(DraftModelProposer):
    @classmethod
    def config_keys(cls, spec):
        return frozenset({"num_layers"})  # the draft is the target's first layers: no proposer.model
    def build_engine(self, target: ModelEngine, config) -> ModelEngine:
        n, total = config.num_layers, target.num_layers
        if n is None or isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= total - 1:
            raise ValueError(f"LayerSkipProposer: num_layers={n!r} is invalid; the target has {total} layers, so "
                             f"set speculative_config num_layers to an integer in 1..{total - 1}")
        truncated = getattr(target, "truncated", None)
        if truncated is None:
            raise TypeError(f"LayerSkipProposer: the target engine {type(target).__name__} has no truncated(); "
                            "layer skipping needs an engine that can run its first layers alone (NativeEngine)")
        return truncated(n)

    def _name(self) -> str:
        return f"(the target's first {self.config.num_layers} layers)"
