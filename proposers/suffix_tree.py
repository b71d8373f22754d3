"""SuffixTrie: a bounded-depth trie of every suffix of a few token sequences, with counts, for suffix decoding.

Suffix decoding (Oliaro et al. 2024, "SuffixDecoding"; Snowflake ArcticInference, vLLM ``method="suffix"``)
drafts from a suffix tree of the text seen so far: match the context's last tokens, then follow the
continuations seen most often after them. Here the tree is a plain trie of depth ``max_depth`` (D): each
sequence's substring starting at every position, cut at D tokens, is a root path, and a node's ``count`` is
how many times its string occurs (fully inside a sequence). ArcticInference compresses the paths (a true
suffix tree, O(N) memory); the uncompressed trie holds O(N * D) nodes at most, but its update is a few dict
look-ups per token and needs no path splitting.

- **Append** one token: the sequence's suffixes of length 0..D-1 ("active" nodes, shortest first) each step to
  (or create) their child for the token: O(D) per token, whatever the history's length.
- **Match**: the node of the context's last m tokens. For the sequence's own tokens these are its active
  nodes (O(1) each); for any other context :meth:`SuffixTrie.match` walks from the root, O(D^2) per call at
  most, independent of the history.
- **Draft** from a matched node: a child's probability is its parent's times ``count(child) / count(node)``
  (a node's count also holds the occurrences that end at it, the context's own one included). A chain
  follows the most frequent child while the probability stays >= ``min_token_prob``; a tree takes nodes
  best-first by probability (ArcticInference's rule). Ties: the higher count, then the child seen last
  (generated text repeats what it has just written; proposers/ngram.py measured that). Cost: the nodes
  drafted plus the children scanned, independent of the history.
- **Remove** a sequence (the global cache's eviction): every count on its suffixes' paths drops by one and
  nodes reaching 0 are freed for reuse: O(len * D).

Knows nothing about models, requests or torch: token ids in, (tokens, parents, probabilities) out.
``proposers/suffix_reference.py`` is the brute-force reference it is tested against.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["Draft", "SuffixTrie", "max_draft_tokens"]


@dataclass
class Draft:
    """A drafted token tree (a chain: parents i-1), nodes in best-first order, so parents come first."""

    token_ids: list[int] = field(default_factory=list)  # [n]
    parents: list[int] = field(default_factory=list)  # [n] index of the parent node, -1 = child of the context
    probs: list[float] = field(default_factory=list)  # [n] estimated probability of the path to each node
    score: float = 0.0  # sum of probs: the expected number of accepted tokens, up to the estimate
    match_len: int = 0  # context tokens matched


def max_draft_tokens(match_len: int, max_spec_tokens: int, factor: float, offset: float) -> int:
    """ArcticInference's cap: a match of m tokens drafts at most ``factor * m + offset`` tokens (a short match is
    weak evidence), and never more than ``max_spec_tokens``."""
    return max(0, min(max_spec_tokens, int(match_len * factor + offset + 1e-6)))


class SuffixTrie:
    """Counts of every substring of at most ``max_depth`` tokens of the sequences added, as a trie. Node 0 is
    the root (the empty string)."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"SuffixTrie: max_depth={max_depth}; need >= 2 (a matched token and one to draft)")
        self.max_depth = max_depth
        self.count: list[int] = [0]  # [nodes] occurrences of the node's string
        self.last: list[int] = [0]  # [nodes] clock of the latest occurrence counted (a tie-break)
        self.depth: list[int] = [0]  # [nodes] the string's length
        self.token: list[int] = [-1]  # [nodes] the string's last token
        self.parent: list[int] = [-1]  # [nodes]
        self.kids: list[dict[int, int] | None] = [None]  # [nodes] token -> child node; None = a leaf
        self._free: list[int] = []  # node ids released by remove(), reused first
        self.clock = 0  # tokens appended so far, over all sequences
        self.seqs: dict[int, list[int]] = {}  # seq id -> its tokens
        self.active: dict[int, list[int]] = {}  # seq id -> nodes of its suffixes of length 1..D-1, shortest first

    # ------------------------------------------------------------------ update
    @property
    def num_nodes(self) -> int:
        return len(self.count) - len(self._free)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.seqs.values())

    def extend(self, seq_id: int, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (a new one if unseen): O(D) per token."""
        seq = self.seqs.setdefault(seq_id, [])
        active = self.active.get(seq_id, [])
        D, count, last, depth, kids = self.max_depth, self.count, self.last, self.depth, self.kids
        for t in tokens:
            t = int(t)
            seq.append(t)
            self.clock += 1
            nxt = []
            for node in [0, *active]:  # the suffixes of length 0..D-1 grow by t
                ch = kids[node]
                c = ch.get(t) if ch is not None else None
                if c is None:
                    c = self._new(node, t)
                count[c] += 1
                last[c] = self.clock
                if depth[c] < D:
                    nxt.append(c)
            active = nxt
        self.active[seq_id] = active

    def remove(self, seq_id: int) -> None:
        """Forget sequence ``seq_id``: its suffixes' counts drop, and nodes no occurrence holds any more are
        detached and freed for reuse: O(len * D)."""
        seq = self.seqs.pop(seq_id, None)
        self.active.pop(seq_id, None)
        if seq is None:
            return
        D, count, kids, dead = self.max_depth, self.count, self.kids, []
        for i in range(len(seq)):
            node = 0
            for t in seq[i: i + D]:
                node = kids[node][t]  # type: ignore[index]  # present: this occurrence counted it
                count[node] -= 1
                if count[node] == 0:  # a child occurs only inside its parent: its subtree is dead too
                    dead.append(node)
        for n in dead:
            ch = kids[self.parent[n]]
            if ch is not None:  # None: the parent is dead and already detached
                del ch[self.token[n]]
                if not ch:
                    kids[self.parent[n]] = None
            kids[n] = None
        self._free.extend(dead)

    def _new(self, parent: int, t: int) -> int:
        if self._free:
            n = self._free.pop()
            self.count[n], self.last[n], self.depth[n] = 0, 0, self.depth[parent] + 1
            self.token[n], self.parent[n], self.kids[n] = t, parent, None
        else:
            n = len(self.count)
            self.count.append(0)
            self.last.append(0)
            self.depth.append(self.depth[parent] + 1)
            self.token.append(t)
            self.parent.append(parent)
            self.kids.append(None)
        if self.kids[parent] is None:
            self.kids[parent] = {}
        self.kids[parent][t] = n  # type: ignore[index]
        return n

    # ------------------------------------------------------------------ match
    def own_matches(self, seq_id: int) -> list[int]:
        """Nodes of sequence ``seq_id``'s last 1..D-1 tokens (the context is the sequence itself), shortest first."""
        return self.active.get(seq_id, [])

    def match(self, context: list[int]) -> list[int]:
        """Nodes of ``context``'s last m tokens for m = 1, 2, ... while the trie holds them (m <= D-1)."""
        out, kids = [], self.kids
        for m in range(1, min(self.max_depth - 1, len(context)) + 1):
            node = 0
            for t in context[len(context) - m:]:
                ch = kids[node]
                node = ch.get(t, -1) if ch is not None else -1
                if node < 0:
                    return out
            out.append(node)
        return out

    # ------------------------------------------------------------------ draft
    def _ranked(self, node: int) -> list[int]:
        """Children of ``node``, most frequent first, then the most recently seen."""
        ch = self.kids[node]
        if ch is None:
            return []
        count, last = self.count, self.last
        return sorted(ch.values(), key=lambda c: (-count[c], -last[c]))

    def draft_chain(self, node: int, max_tokens: int, min_prob: float) -> Draft:
        """The most frequent path below ``node``: up to ``max_tokens`` tokens, each with probability >= min_prob."""
        d, p, count, last = Draft(), 1.0, self.count, self.last
        while len(d.token_ids) < max_tokens:
            ch = self.kids[node]
            if ch is None:
                break
            c = max(ch.values(), key=lambda c: (count[c], last[c]))
            p = p * count[c] / count[node]
            if p < min_prob:
                break
            d.parents.append(len(d.token_ids) - 1)
            d.token_ids.append(self.token[c])
            d.probs.append(p)
            d.score += p
            node = c
        return d

    def draft_tree(self, node: int, max_tokens: int, min_prob: float, max_depth: int) -> Draft:
        """Up to ``max_tokens`` nodes below ``node``, best-first by path probability (>= min_prob), no path
        longer than ``max_depth``. Equal probabilities: the one queued first (a higher-ranked sibling, or an
        earlier parent)."""
        d, count, heap, order = Draft(), self.count, [], 0
        if max_tokens < 1 or max_depth < 1:
            return d

        def push(n: int, p: float, at: int, dep: int) -> None:
            nonlocal order
            for c in self._ranked(n):
                q = p * count[c] / count[n]
                if q < min_prob:
                    break  # ranked by count: the rest are no likelier
                heapq.heappush(heap, (-q, order, c, at, dep))
                order += 1

        push(node, 1.0, -1, 1)
        while heap and len(d.token_ids) < max_tokens:
            negp, _, c, par, dep = heapq.heappop(heap)
            d.parents.append(par)
            d.token_ids.append(self.token[c])
            d.probs.append(-negp)
            d.score += -negp
            if dep < max_depth:
                push(c, -negp, len(d.token_ids) - 1, dep + 1)
        return d

    def best_draft(self, matches: list[int], max_spec_tokens: int, factor: float, offset: float, min_prob: float,
                   tree_depth: int | None = None) -> Draft:
        """The best-scoring draft over the matched nodes (``matches[m-1]`` = the node of the last m tokens): a
        chain (``tree_depth`` None) or a tree. Equal scores: the longer match. Longest first, stopping once no
        shorter match's cap (:func:`max_draft_tokens`, a bound on its score) could beat the best."""
        best = Draft()
        for m in range(len(matches), 0, -1):
            cap = max_draft_tokens(m, max_spec_tokens, factor, offset)
            if best.token_ids and best.score >= cap:
                break
            if tree_depth is None:
                d = self.draft_chain(matches[m - 1], cap, min_prob)
            else:
                d = self.draft_tree(matches[m - 1], cap, min_prob, tree_depth)
            if d.token_ids and (not best.token_ids or d.score > best.score):
                d.match_len = m
                best = d
        return best
