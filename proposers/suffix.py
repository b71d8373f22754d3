"""SuffixProposer: suffix decoding (Oliaro et al. 2024; ArcticInference, vLLM ``method="suffix"``), chain or tree.

Each sequence gets a suffix trie (proposers/suffix_tree.py) of its own tokens, prompt and output; with
``cache_tokens`` > 0, the outputs of finished requests go to one more, global trie, shared by every request and
bounded to that many tokens (the oldest outputs are evicted first). Each step the context's last tokens are
matched in both tries, and the better-scoring draft wins (equal scores: the request's own):

- chain (scorer mqa / batch_expansion): the most frequent continuation, up to k tokens;
- tree (scorer tree): nodes best-first by estimated probability, up to the tree's budget and depth.

The draft adapts to how well the history predicts the text: a match of m tokens drafts at most
``max_spec_factor * m + max_spec_offset`` tokens, and no token whose estimated probability (the product of the
count ratios down its path) is below ``min_token_prob``. A context that matches nothing drafts nothing (a
plain step). Defaults are ArcticInference's / vLLM's (max_tree_depth 24, max_spec_factor 1.0,
min_token_prob 0.1); they have not been tuned on this machine.

State is incremental and holds committed tokens only: each step appends to a sequence's trie the tokens it
gained since the last step (O(depth) each), never the drafts, so a rejected draft or a rolled-back step leaves
nothing to undo; a sequence whose tokens no longer extend what the trie holds is re-indexed. :meth:`free`
drops the request's trie (finish or abort). Drafts are deterministic (one-hot q), so verification is lossless
as for any n-gram draft. :class:`SuffixBranch` is the same drafting as a branch grafted onto an EAGLE head's
tree (``options.branch: suffix``, proposers/ngram_branch.py).

Knows nothing about models: token ids in, token ids out.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from proposers.suffix_tree import Draft, SuffixTrie
from specdec.spec_decode.proposer import DraftOutput, ProposeBatch, TreeProposals, TreeProposer, TreeShape

__all__ = ["SuffixIndex", "SuffixBranch", "SuffixProposer"]


class SuffixIndex:
    """The tries of suffix decoding: one per live sequence, plus the global cache of finished outputs."""

    def __init__(self, max_depth: int = 24, max_spec_factor: float = 1.0, max_spec_offset: float = 0.0,
                 min_token_prob: float = 0.1, cache_tokens: int = 0) -> None:
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"suffix decoding: min_token_prob={min_token_prob} must be in [0, 1]")
        if max_spec_factor < 0 or cache_tokens < 0:
            raise ValueError(f"suffix decoding: max_spec_factor={max_spec_factor} and cache_tokens={cache_tokens} "
                             "must be >= 0 (cache_tokens 0 = no global cache)")
        self.max_depth, self.factor, self.offset = max_depth, max_spec_factor, max_spec_offset
        self.min_prob, self.cache_tokens = min_token_prob, cache_tokens
        self.local: dict[int, SuffixTrie] = {}  # seq id -> trie of its tokens (seq 0 inside)
        self.start: dict[int, int] = {}  # seq id -> index of its first output token (as first seen)
        self.glob = SuffixTrie(max_depth)  # finished outputs, seq ids of its own
        self.cached: OrderedDict[int, int] = OrderedDict()  # global seq id -> tokens, oldest first
        self.cached_total = 0  # tokens in the global cache, <= cache_tokens
        self._next = 0

    def update(self, seq_id: int, tokens: list[int]) -> SuffixTrie:
        """Bring ``seq_id``'s trie up to ``tokens`` (its committed tokens, the pending one last)."""
        trie = self.local.get(seq_id)
        if trie is not None:
            have = trie.seqs[0]
            n = len(have)
            if n > len(tokens) or tokens[n - 1] != have[-1]:  # cut back under us (not by a step): re-index
                trie = None
        if trie is None:
            trie = self.local[seq_id] = SuffixTrie(self.max_depth)
            self.start.setdefault(seq_id, len(tokens) - 1)  # the prompt, then the first output token
            trie.extend(0, tokens)
        elif len(tokens) > len(trie.seqs[0]):
            trie.extend(0, tokens[len(trie.seqs[0]):])
        return trie

    def draft(self, seq_id: int, tokens: list[int], max_tokens: int, tree_depth: int | None = None) -> Draft:
        """The best draft after ``tokens`` (a chain when ``tree_depth`` is None), from the request's trie and the
        global cache."""
        trie = self.update(seq_id, tokens)
        best = trie.best_draft(trie.own_matches(0), max_tokens, self.factor, self.offset, self.min_prob, tree_depth)
        if self.cached:
            ctx = tokens[max(0, len(tokens) - self.max_depth + 1):]
            other = self.glob.best_draft(self.glob.match(ctx), max_tokens, self.factor, self.offset, self.min_prob,
                                         tree_depth)
            if other.score > best.score:
                best = other
        return best

    def free(self, seq_id: int) -> None:
        """The request finished or was aborted: drop its trie; with a global cache, its output joins it."""
        trie = self.local.pop(seq_id, None)
        start = self.start.pop(seq_id, 0)
        if trie is None or not self.cache_tokens:
            return
        out = trie.seqs[0][start:][-self.cache_tokens:]  # an output longer than the cache keeps its end
        if not out:
            return
        while self.cached and self.cached_total + len(out) > self.cache_tokens:
            old, n = self.cached.popitem(last=False)
            self.glob.remove(old)
            self.cached_total -= n
        self.glob.extend(self._next, out)
        self.cached[self._next] = len(out)
        self.cached_total += len(out)
        self._next += 1


class SuffixProposer(TreeProposer):
    """speculative_config: ``num_speculative_tokens`` = k, the longest chain; options (``proposer.options.x``):
    ``max_tree_depth`` (D, the longest string the tries count; matches up to D-1 tokens), ``max_spec_factor``,
    ``max_spec_offset``, ``min_token_prob`` (module docstring), ``cache_tokens`` (global cache of finished
    outputs, in tokens; 0 = off). With ``scorer: tree`` it drafts trees of the scorer's budget and depth."""

    free_drafts = True  # a walk of the tries, which catch up on the tokens alone: shadow drafts replace probes

    @classmethod
    def config_keys(cls, spec):
        return frozenset()  # its options only
    def __init__(self, target, config, max_tree_depth: int = 24, max_spec_factor: float = 1.0,
                 max_spec_offset: float = 0.0, min_token_prob: float = 0.1, cache_tokens: int = 0) -> None:
        super().__init__(target, config)
        self.index = SuffixIndex(max_tree_depth, max_spec_factor, max_spec_offset, min_token_prob, cache_tokens)

    def propose(self, batch: ProposeBatch) -> DraftOutput:
        B, k = len(batch.seq_ids), batch.k
        out = torch.full((B, k), -1, dtype=torch.long)  # [B, k]
        lens = torch.zeros(B, dtype=torch.long)  # [B]
        row_k = batch.row_k or [k] * B  # the speculation policy's k per row
        for b, (s, toks) in enumerate(zip(batch.seq_ids, batch.token_ids)):
            d = self.index.draft(s, toks, row_k[b])
            if d.token_ids:
                out[b, : len(d.token_ids)] = torch.tensor(d.token_ids, dtype=torch.long)
                lens[b] = len(d.token_ids)
        return DraftOutput(token_ids=out, probs=None, lens=lens)

    def draft_lists(self, batch: ProposeBatch) -> list[list[int]]:
        row_k = batch.row_k or [batch.k] * len(batch.seq_ids)
        return [list(self.index.draft(s, toks, kk).token_ids)
                for s, toks, kk in zip(batch.seq_ids, batch.token_ids, row_k)]

    def propose_tree(self, batch: ProposeBatch, shape: TreeShape) -> TreeProposals:
        budgets = batch.row_k or [shape.budget] * len(batch.seq_ids)  # the speculation policy's nodes per row
        drafts = [self.index.draft(s, toks, n, shape.depth)
                  for s, toks, n in zip(batch.seq_ids, batch.token_ids, budgets)]
        N = max((len(d.token_ids) for d in drafts), default=0)
        tok = torch.full((len(drafts), N), -1, dtype=torch.long)  # [B, N] -1 = padding
        par = torch.full((len(drafts), N), -1, dtype=torch.long)  # [B, N]
        for b, d in enumerate(drafts):
            if d.token_ids:
                tok[b, : len(d.token_ids)] = torch.tensor(d.token_ids, dtype=torch.long)
                par[b, : len(d.parents)] = torch.tensor(d.parents, dtype=torch.long)
        return TreeProposals(tok, par, torch.tensor([len(d.token_ids) for d in drafts], dtype=torch.long))

    def free(self, seq_id: int) -> None:
        self.index.free(seq_id)

    def restore(self, seq_ids: list[int], snapshot) -> None:
        """Nothing to undo: the tries hold tokens committed before the step only (module docstring)."""


class SuffixBranch:
    """Suffix decoding's chain as the branch grafted onto a head's tree (proposers/ngram_branch.py), with the
    defaults above (no global cache)."""

    def __init__(self, config) -> None:
        self.index = SuffixIndex()

    def chains(self, batch: ProposeBatch, m: int) -> tuple[list[list[int]], list[bool]]:
        """Each row's chain of up to m tokens; none leads the tree's order (Branch)."""
        chains = [self.index.draft(s, toks, m).token_ids for s, toks in zip(batch.seq_ids, batch.token_ids)]
        return chains, [False] * len(chains)

    def free(self, seq_id: int) -> None:
        self.index.free(seq_id)
