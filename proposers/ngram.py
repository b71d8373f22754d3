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

How: :class:`NGramIndex` keeps, per sequence, a dict per n from each n-gram to where it ends, grown by the
tokens added since the last step (O(new tokens * n) dict inserts), so a step's lookup is max_n dict reads and
one bisect whatever the history's length. :func:`ngram_lookup` is the same rule over a whole array, in numpy,
with no state: the reference the index is tested equal to (and what a caller without sequence ids uses).
Measured on SmolLM2's Spec-Bench prompts (2026-12-05): a step's lookup took ~70 us through numpy (the array
copy ~25 us, the lookup ~45) and a shadow draft ~115 us; the policy's shadows alone were ~2% of a forward.

Knows nothing about models: it reads token ids only; its only per-sequence state is the index, freed with
the sequence.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence

import numpy as np
import torch

from typing import TYPE_CHECKING

from specdec.spec_decode.proposer import DraftOutput, Proposer, ProposeBatch

if TYPE_CHECKING:
    from specdec.datamodel.sequence import SequenceData


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


def _tokens_from(src: "Sequence[int] | SequenceData", start: int) -> list[int]:
    """``src``'s tokens from ``start`` on, as a list; ``src`` is a token list or a SequenceData (read through its
    live arrays: no whole-sequence list is made)."""
    if isinstance(src, Sequence):
        return list(src[start:])
    p, o = src.prompt_token_ids_array, src.output_token_ids_array
    P = len(p)
    return o[start - P:].tolist() if start >= P else p[start:].tolist() + o.tolist()


def _token_at(src: "Sequence[int] | SequenceData", i: int) -> int:
    if isinstance(src, Sequence):
        return src[i]
    p = src.prompt_token_ids_array
    return p[i] if i < len(p) else src.output_token_ids_array[i - len(p)]


class NGramIndex:
    """:func:`ngram_lookup` per sequence, incrementally: the tokens seen so far and, per n in [min_n, max_n], a dict
    from each n-gram (a token for n = 1, else a tuple) to the ascending end positions where it occurs.

    A sequence's tokens only grow between lookups (they are committed); one that shrank or whose last indexed
    token changed (cut back under the index) is re-indexed from scratch. :meth:`free` drops a sequence (the
    engine never reuses an id)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NGramIndex: min_n={min_n} / max_n={max_n}; need 1 <= min <= max")
        self.min_n, self.max_n = min_n, max_n
        self._seqs: dict[int, tuple[list[int], list[dict]]] = {}  # seq_id -> (tokens, [dict per n])

    def __len__(self) -> int:
        return len(self._seqs)

    def free(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def _update(self, seq_id: int, src, L: int) -> tuple[list[int], list[dict]]:
        got = self._seqs.get(seq_id)
        if got is not None and (len(got[0]) > L or (got[0] and _token_at(src, len(got[0]) - 1) != got[0][-1])):
            got = None  # cut back under us
        if got is None:
            got = self._seqs[seq_id] = ([], [{} for _ in range(self.min_n, self.max_n + 1)])
        toks, maps = got
        start = len(toks)
        if start == L:
            return got
        toks.extend(_tokens_from(src, start))
        for n, m in enumerate(maps, self.min_n):
            first = max(start, n - 1)  # an n-gram ends at e >= n - 1
            if first >= L:
                continue
            grams = toks[first:L] if n == 1 else zip(*(toks[first - n + 1 + i:L - n + 1 + i] for i in range(n)))
            for e, g in enumerate(grams, first):
                ends = m.get(g)
                if ends is None:
                    m[g] = [e]
                else:
                    ends.append(e)
        return got

    def _match(self, seq_id: int, src: "Sequence[int] | SequenceData") -> tuple[list[int], int, list[int]]:
        """(the sequence's tokens, n, the ascending end positions of its last n tokens' n-gram, the last being the
        suffix itself) for the longest n in [min_n, max_n] that also occurs earlier; n = 0 when none does."""
        L = len(src) if isinstance(src, Sequence) else src.get_len()
        if L < self.min_n + 1:  # an n-gram plus at least one earlier token is needed
            return [], 0, []
        toks, maps = self._update(seq_id, src, L)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            ends = maps[n - self.min_n][toks[-1] if n == 1 else tuple(toks[L - n:])]
            if len(ends) > 1:
                return toks, n, ends
        return toks, 0, []

    def match_length(self, seq_id: int, src: "Sequence[int] | SequenceData") -> int:
        """The n of the match :meth:`lookup` drafts from (any k), 0 = none (it drafts nothing): the proposer's
        confidence class. On SmolLM2's Spec-Bench greedy outputs a 3-gram match's draft (k = 10) accepted 4.7 tokens
        on average, a 2-gram's 1.7, a 1-gram's 0.6 (experiments/bench/ngram_classes.py, LOG 2026-12-05)."""
        return self._match(seq_id, src)[1]

    def lookup(self, seq_id: int, src: "Sequence[int] | SequenceData", k: int) -> list[int]:
        """ngram_lookup(tokens, k, min_n, max_n) as a list, for sequence ``seq_id`` whose tokens ``src`` holds (a
        list, or its SequenceData; the last one is pending)."""
        return self.draft(seq_id, src, lambda n: k)[0] if k >= 1 else []

    def draft(self, seq_id: int, src: "Sequence[int] | SequenceData", k_of: "Callable[[int], int]",
              ) -> tuple[list[int], int]:
        """(:meth:`lookup`'s draft of ``k_of(n)`` tokens, the match length n) from one pass over the index: a caller
        whose k depends on the match (EAGLE's n-gram branch) asks once, not :meth:`match_length` then lookup."""
        toks, n, ends = self._match(seq_id, src)
        k = k_of(n) if n else 0
        if k < 1:
            return [], n
        j = bisect_right(ends, len(toks) - 1 - k, 0, len(ends) - 1) - 1  # the latest with k tokens after it
        e = ends[j] if j >= 0 else ends[0]  # else the earliest
        return toks[e + 1:e + 1 + k], n


class NGramProposer(Proposer):
    free_drafts = True  # a dict lookup in the sequence's n-gram index: shadow drafts replace the policy's probes

    @classmethod
    def config_keys(cls, spec):
        return frozenset({"prompt_lookup_max", "prompt_lookup_min"})

    def __init__(self, target, config) -> None:
        super().__init__(target, config)
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"NGramProposer: prompt_lookup_min={self.min_n} / prompt_lookup_max={self.max_n}; "
                             "need 1 <= min <= max")
        self.index = NGramIndex(self.min_n, self.max_n)

    def propose(self, batch: ProposeBatch) -> DraftOutput:
        B, k = len(batch.seq_ids), batch.k
        out = np.full((B, k), -1, dtype=np.int64)  # [B, k]
        lens = np.zeros(B, dtype=np.int64)  # [B]
        for b, draft in enumerate(self.draft_lists(batch)):
            out[b, : len(draft)] = draft
            lens[b] = len(draft)
        return DraftOutput(token_ids=torch.from_numpy(out), probs=None, lens=torch.from_numpy(lens))

    def draft_lists(self, batch: ProposeBatch) -> list[list[int]]:
        row_k = batch.row_k or [batch.k] * len(batch.seq_ids)  # the speculation policy's k per row
        srcs = batch.sequences if batch.sequences is not None else batch.token_ids
        return [self.index.lookup(s, src, kk) for s, src, kk in zip(batch.seq_ids, srcs, row_k)]

    def draft_classes(self, batch: ProposeBatch) -> list[int]:
        """[B] each row's match length (NGramIndex.match_length; 0 = no match, no draft)."""
        srcs = batch.sequences if batch.sequences is not None else batch.token_ids
        return [self.index.match_length(s, src) for s, src in zip(batch.seq_ids, srcs)]

    def free(self, seq_id: int) -> None:
        self.index.free(seq_id)

    def restore(self, seq_ids: list[int], snapshot) -> None:
        """Nothing to undo: the index holds committed tokens only, and re-indexes a sequence that was cut back."""
