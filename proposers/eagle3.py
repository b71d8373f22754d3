"""Eagle3Proposer: EAGLE-3 chain drafting from the target's low, middle and high layers.

Everything about slots, catch-up, bonus back-fill and rollback is :class:`proposers.eagle.EagleProposer`'s;
what differs is what the head reads and how it scores:

- its FeatureSpec asks for the outputs of the target layers ``head.cfg.hidden_layers`` (default
  ``eagle3_layers(L)`` = (1, L//2-1, L-4)), which the worker threads concatenated, [rows, 3D]; the head's
  fc fuses them to D;
- while drafting, the head feeds its own output back directly (no fc), as in the EAGLE-3 code;
- its LM head scores a reduced draft vocabulary (``draft_vocab_size`` rows, the most frequent target
  tokens of the training data); draft id d is target id ``d + d2t[d]``. That keeps the draft's LM head
  small: on a 135M target the full one is ~1/5 of the model.

Knows nothing about verification or the target's KV cache.
"""

from __future__ import annotations

from proposers.eagle import EagleProposer
from specdec.heads import eagle3_layers
from specdec.heads.common import CHECKPOINTS
from specdec.heads.eagle3 import DraftVocab


class Eagle3Proposer(EagleProposer):
    """speculative_config as EagleProposer's; default head ``checkpoints/smollm2-135m-instruct-eagle3``."""

    method = "eagle3"
    default_head = CHECKPOINTS / "smollm2-135m-instruct-eagle3"

    def target_layers(self) -> tuple[int, ...]:
        return tuple(self.head.cfg.hidden_layers) or eagle3_layers(self.target.num_layers)

    def _check_fits(self) -> None:
        super()._check_fits()
        c, L = self.head.cfg, self.target.num_layers
        th = c.target_hidden_size or c.hidden_size
        if th != self.target.hidden_size:
            raise ValueError(f"Eagle3Proposer: head {self.head_name} fuses target layers of hidden_size={th} but "
                             f"the target has hidden_size={self.target.hidden_size}")
        bad = [i for i in self.features.layers if not 0 <= i < L]
        if bad or len(self.features.layers) != 3:
            raise ValueError(f"Eagle3Proposer: head {self.head_name} reads target layers {self.features.layers}; "
                             f"need 3 layers in 0..{L - 1}")

    def _setup_vocab(self, opts) -> None:
        if opts.get("draft_vocab_size"):
            raise ValueError("Eagle3Proposer: the draft vocabulary is the head's own lm_head "
                             "(draft_vocab_size rows); options.draft_vocab_size applies to method=eagle only")
        self.lm = DraftVocab(self.head.draft_logits, self.head.draft_to_target.to(self.target.device))
