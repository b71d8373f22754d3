"""NGramProposer: prompt lookup (Saxena 2023) over each sequence's own tokens, prompt and output.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min`` (longest match first): find an earlier
occurrence of the sequence's last n tokens and propose the up-to-k tokens that followed it. No match
of any n -> a proposal of length 0. Drafts are deterministic, so ``probs`` is None (one-hot q).

Which occurrence: the **most recent one that still has k tokens after it**, else the earliest (whose
continuation is the longest). transformers' prompt lookup and vLLM v0's NGramWorker take the earliest.
Why recency: generated text repeats what it has just written (a list being continued, code edited line
by line, a multi-turn answer quoting the last turn), so the latest context is the best predictor; for
prompt-lookup tasks (summarisation, RAG) the matched n-gram is usually unique and the choice does not
matter. Why the k-token condition: in text repeating with a period p < k the most recent occurrence is
cut by the end of the sequence and would propose only p tokens (measured: tau 1.5 instead of ~4 on a
greedy loop of the tiny model).

Knows nothing about models: it reads token ids only and keeps no per-sequence state.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.spec_decode.proposer import DraftOutput, Proposer, ProposeBatch


def ngram_lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Draft for one sequence: ``tokens`` [L] int64 (the last one is pending) -> [<= k] int64.

    Candidates are the earlier positions e holding the sequence's last token (one comparison over the whole
    sequence); ``run`` = how many tokens ending at each candidate match the suffix (capped at max_n), grown by
    max_n - 1 comparisons over the candidates alone. O(L + C * max_n) in numpy, C = candidates.
    """
    L = tokens.shape[0]
    if L < min_n + 1 or k < 1:  # an n-gram plus at least one earlier token is needed
        return tokens[:0]
    max_n = min(max_n, L - 1)
    ends = np.flatnonzero(tokens[: L - 1] == tokens[L - 1])  # [C] candidate end indices e <= L-2, ascending
    if ends.size == 0:
        return tokens[:0]
    run = np.ones(ends.size, dtype=np.int64)  # [C] match length ending at each candidate
    alive = np.ones(ends.size, dtype=bool)  # [C] still matching at every shift so far
    for t in range(1, max_n):
        # tokens[e - t] against tokens[L-1-t]; a candidate with e < t cannot reach that far back (its negative
        # index, >= -max_n > -L, reads a valid wrong token that the second term discards)
        alive &= (tokens[ends - t] == tokens[L - 1 - t]) & (ends >= t)
        if not alive.any():
            break
        run += alive
    best = int(run.max())
    if best < min_n:
        return tokens[:0]
    ends = ends[run >= best]  # occurrences of the longest match, ascending
    full = ends[ends + k < L]  # those with k tokens after them
    e = int(full[-1]) if full.size else int(ends[0])  # most recent full one, else the earliest
    return tokens[e + 1 : e + 1 + k]  # cut at the end of the sequence: may be shorter than k


class NGramProposer(Proposer):
    free_drafts = True  # a numpy lookup over the sequence's tokens: shadow drafts replace the policy's probes

    def __init__(self, target, config) -> None:
        super().__init__(target, config)
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"NGramProposer: prompt_lookup_min={self.min_n} / prompt_lookup_max={self.max_n}; "
                             "need 1 <= min <= max")

    def propose(self, batch: ProposeBatch) -> DraftOutput:
        B, k = len(batch.seq_ids), batch.k
        out = np.full((B, k), -1, dtype=np.int64)  # [B, k]
        lens = np.zeros(B, dtype=np.int64)  # [B]
        row_k = batch.row_k or [k] * B  # the speculation policy's k per row: look up no further
        for b, toks in enumerate(batch.token_arrays()):
            draft = ngram_lookup(toks, row_k[b], self.min_n, self.max_n)
            out[b, : draft.shape[0]] = draft
            lens[b] = draft.shape[0]
        return DraftOutput(token_ids=torch.from_numpy(out), probs=None, lens=torch.from_numpy(lens))

    def draft_lists(self, batch: ProposeBatch) -> list[list[int]]:
        row_k = batch.row_k or [batch.k] * len(batch.seq_ids)
        return [ngram_lookup(toks, kk, self.min_n, self.max_n).tolist()
                for toks, kk in zip(batch.token_arrays(), row_k)]
