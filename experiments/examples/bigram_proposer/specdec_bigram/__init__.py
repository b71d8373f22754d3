"""BigramProposer: an example specdec plug-in proposer, installed as its own package.

It drafts by chaining successors: from the pending token, the token that most recently followed it in
the sequence (prompt and output), then the one that followed that, k times or until a token has no
successor. Deterministic drafts, so ``probs=None`` (q is one-hot; the verifier stays lossless).
"""

import torch

from specdec.spec_decode.proposer import DraftOutput, Proposer, ProposeBatch


class BigramProposer(Proposer):
    def propose(self, batch: ProposeBatch) -> DraftOutput:
        B, k = len(batch.seq_ids), batch.k
        out = torch.full((B, k), -1, dtype=torch.long)  # [B, k]; -1 past each proposal's length
        lens = torch.zeros(B, dtype=torch.long)  # [B]
        for b, toks in enumerate(batch.token_ids):
            follower = dict(zip(toks[:-1], toks[1:]))  # token -> its latest successor (later pairs win)
            tok = toks[-1]  # the pending token
            for i in range(k):
                if tok not in follower:
                    break
                tok = follower[tok]
                out[b, i] = tok
                lens[b] = i + 1
        return DraftOutput(token_ids=out, probs=None, lens=lens)
