"""The brute-force reference of suffix decoding's drafts (proposers/suffix_tree.py), for tests.

No trie: every count is a scan of the history. ``count(s)`` = occurrences of the token string s fully inside
one of the sequences; the tie-break clock of s = the position (over all sequences, in the order given) of the
last token of its latest occurrence. The matching and the drafting rules are written again from their
definitions (suffix_tree.py's module docstring), so a bug in the trie's bookkeeping shows up as a different
draft. O(history * depth) per count: for short seeded sequences only. Torch-free.
"""

from __future__ import annotations

from proposers.suffix_tree import Draft, max_draft_tokens

__all__ = ["reference_draft"]


class _History:
    def __init__(self, seqs: list[list[int]], max_depth: int) -> None:
        self.seqs, self.D = seqs, max_depth
        self.offsets, o = [], 0
        for s in seqs:
            self.offsets.append(o)
            o += len(s)

    def occurrences(self, s: tuple[int, ...]) -> list[int]:
        """Global clock (1-based, as the trie's) of the last token of every occurrence of s."""
        out, n = [], len(s)
        for seq, off in zip(self.seqs, self.offsets):
            for i in range(len(seq) - n + 1):
                if tuple(seq[i: i + n]) == s:
                    out.append(off + i + n)
        return out

    def count(self, s: tuple[int, ...]) -> int:
        return len(self.occurrences(s)) if len(s) <= self.D else 0

    def children(self, s: tuple[int, ...]) -> list[tuple[int, int, int]]:
        """(token, count, clock) of every t with count(s + t) > 0, most frequent then latest first."""
        if len(s) + 1 > self.D:
            return []
        toks = {seq[i + len(s)] for seq in self.seqs for i in range(len(seq) - len(s))
                if tuple(seq[i: i + len(s)]) == s}
        kids = [(t, len(occ), max(occ)) for t in toks if (occ := self.occurrences(s + (t,)))]
        return sorted(kids, key=lambda x: (-x[1], -x[2]))


def reference_draft(history: list[list[int]], context: list[int], max_depth: int, max_spec_tokens: int,
                    factor: float, offset: float, min_prob: float, tree_depth: int | None = None) -> Draft:
    """The draft SuffixTrie.best_draft gives for ``context`` over a trie of ``history`` (sequences in insertion
    order): over every match length m = 1..D-1 the context's last m tokens occur in, the best-scoring chain
    (``tree_depth`` None) or best-first tree; equal scores: the longer match."""
    h = _History(history, max_depth)
    best = Draft()
    for m in range(1, min(max_depth - 1, len(context)) + 1):
        s = tuple(context[len(context) - m:])
        if h.count(s) == 0:
            break
        cap = max_draft_tokens(m, max_spec_tokens, factor, offset)
        d = _chain(h, s, cap, min_prob) if tree_depth is None else _tree(h, s, cap, min_prob, tree_depth)
        if d.token_ids and (not best.token_ids or d.score >= best.score):
            d.match_len = m
            best = d
    return best


def _chain(h: _History, s: tuple[int, ...], cap: int, min_prob: float) -> Draft:
    d, p = Draft(), 1.0
    while len(d.token_ids) < cap:
        kids = h.children(s)
        if not kids:
            break
        t, c, _ = kids[0]
        p = p * c / h.count(s)
        if p < min_prob:
            break
        d.parents.append(len(d.token_ids) - 1)
        d.token_ids.append(t)
        d.probs.append(p)
        d.score += p
        s = s + (t,)
    return d


def _tree(h: _History, s: tuple[int, ...], cap: int, min_prob: float, depth: int) -> Draft:
    """Best-first without a heap: each round takes the likeliest queued node (first queued on ties)."""
    d, queue = Draft(), []  # (prob, string, parent node, depth); queue order = push order

    def push(s: tuple[int, ...], p: float, at: int, dep: int) -> None:
        n = h.count(s)
        for t, c, _ in h.children(s):
            if p * c / n >= min_prob:
                queue.append((p * c / n, s + (t,), at, dep))

    if cap >= 1 and depth >= 1:
        push(s, 1.0, -1, 1)
    while queue and len(d.token_ids) < cap:
        i = max(range(len(queue)), key=lambda j: (queue[j][0], -j))
        p, s2, at, dep = queue.pop(i)
        d.parents.append(at)
        d.token_ids.append(s2[-1])
        d.probs.append(p)
        d.score += p
        if dep < depth:
            push(s2, p, len(d.token_ids) - 1, dep + 1)
    return d
