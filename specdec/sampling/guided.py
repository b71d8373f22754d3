"""Structured outputs (``SamplingParams.guided_decoding``): a grammar's token mask at every position, given its prefix.

- :class:`GrammarCompiler` compiles a request's GuidedDecodingParams against the model's vocabulary (xgrammar:
  ~9 us per token on SmolLM2's 49,152 tokens where llguidance took ~240, experiments/bench/guided_libs.py) and
  makes the request's :class:`GrammarState`, which rides on ``SequenceGroupState.grammar``.
- :class:`GrammarState` is a matcher plus the output tokens it has consumed. ``fill(tokens, ...)`` moves it to
  the state after ``tokens`` (rolled back to the longest common prefix, the rest accepted) and writes the
  next token's allowed set. So a mask is a pure function of the prefix, as the logits processors are
  (specdec/sampling/logits_process.py); the matcher only caches the walk. ``checkpoint`` / ``restore`` make it
  part of a step's transaction (specdec/core/transaction.py).
- Plain steps: :func:`allowed_next` gives the [B, V] mask of each row's next token (the sampler applies it).
- Speculative steps: :func:`guide_proposals` walks each guided row's draft tree in node order. A node is kept
  when its parent is kept, the grammar allows its token after the parent's prefix, and the grammar still allows
  a token after it; the first node that fails ends that branch, before scoring (a chain: its length is cut).
  Cutting a proposal never changes the law the verifier emits (any proposal is verified losslessly) and the
  decision reads only drafted tokens. Every kept position's mask then makes the verifier target the masked
  law, so greedy output equals plain guided decoding and sampling follows the masked target.
- A position where nothing is allowed (the grammar is complete but the request goes on with ``ignore_eos``, or
  the request's other processors mask every token the grammar allows) ends that request with an error that
  says so; its neighbours are not touched.

A masked logit is ``MASKED`` (finite; see logits_process.py). Knows nothing about models, KV caches or text
beyond the tokenizer that the compiler reads once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from specdec.datamodel.sampling_params import GuidedDecodingParams
from specdec.interfaces import SpeculativeProposals, Verdict
from specdec.sampling.logits_process import MASKED

__all__ = ["GrammarCompiler", "GrammarMasks", "GrammarState", "allowed_next", "guide_proposals", "no_token_error",
           "unpack_bitmask"]


def unpack_bitmask(bitmask: torch.Tensor,  # [..., W] int32, bit j of word w = token 32 w + j
                   vocab_size: int) -> torch.Tensor:  # [..., vocab_size] bool, True = allowed
    # numpy's unpackbits over the little-endian bytes: ~30 us a row of 49,152 tokens where shifts took ~5x more
    bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(bits[..., :vocab_size].view(np.bool_))


class GrammarState:
    """One request's grammar matcher and the output tokens it has consumed (module docstring)."""

    def __init__(self, matcher, params: GuidedDecodingParams, vocab_size: int) -> None:
        self.matcher = matcher  # xgrammar.GrammarMatcher, unbounded rollback
        self.params = params
        self.vocab_size = vocab_size
        self.tokens: list[int] = []  # what the matcher has consumed: output tokens, then drafts being explored

    def move(self, tokens: list[int]) -> bool:
        """The matcher to the state after ``tokens`` (output tokens, a list); False when one is forbidden (the
        matcher then stands after the longest allowed prefix)."""
        cur, n = self.tokens, min(len(self.tokens), len(tokens))
        if cur[:n] == tokens[:n]:
            c = n
        else:
            c = next(i for i in range(n) if cur[i] != tokens[i])
        if len(cur) > c:
            self.matcher.rollback(len(cur) - c)
            del cur[c:]
        for t in tokens[c:]:
            if not self.matcher.accept_token(t):
                return False
            cur.append(t)
        return True

    def fill(self, tokens: list[int], bitmask: torch.Tensor, index: int) -> bool:
        """Row ``index`` of ``bitmask`` ([R, W] int32) <- the tokens allowed after ``tokens``; none when the grammar
        has ended (its stop token was consumed). False (row untouched) when a token of ``tokens`` is forbidden."""
        if not self.move(tokens):
            return False
        if self.matcher.is_terminated():
            bitmask[index].zero_()
        else:
            self.matcher.fill_next_token_bitmask(bitmask, index)
        return True

    def checkpoint(self, output: Sequence[int]) -> int:
        """Before a step: drop the drafts explored last step; what :meth:`restore` needs to undo this step."""
        c = 0
        for a, b in zip(self.tokens, output):
            if a != b:
                break
            c += 1
        if len(self.tokens) > c:
            self.matcher.rollback(len(self.tokens) - c)
            del self.tokens[c:]
        return c

    def restore(self, n: int) -> None:
        """Back to the state after the first ``n`` consumed tokens (a step never rolls back below them)."""
        if len(self.tokens) > n:
            self.matcher.rollback(len(self.tokens) - n)
            del self.tokens[n:]


class GrammarCompiler:
    """Compiles GuidedDecodingParams for one model's vocabulary; the stop token ends every grammar."""

    MAX_CACHED = 64  # compiled grammars kept (a 5-property JSON schema: ~40 ms to compile on SmolLM2's vocabulary)

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int] | None) -> None:
        import xgrammar as xgr  # experiments/bench/guided_libs.py: the measured choice

        self.xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids) if stop_token_ids else None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._cache: dict[bytes, object] = {}

    def compile(self, params: GuidedDecodingParams):
        key = msgspec.json.encode(params)
        compiled = self._cache.get(key)
        if compiled is None:
            try:
                compiled = self.compiler.compile_grammar(params.to_xgrammar())
            except RuntimeError as e:
                raise ValueError(f"GuidedDecodingParams.{params.kind}: cannot be compiled for this model's vocabulary: "
                                 f"{str(e).strip().splitlines()[-1]}") from None
            if len(self._cache) >= self.MAX_CACHED:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = compiled
        return compiled

    def state(self, params: GuidedDecodingParams) -> GrammarState:
        """A fresh matcher for one request (raises a ValueError naming the field if the grammar does not compile)."""
        return GrammarState(self.xgr.GrammarMatcher(self.compile(params), max_rollback_tokens=-1), params,
                            self.vocab_size)


def _bitmask(rows: int, vocab_size: int) -> torch.Tensor:  # [rows, W] int32, every token allowed
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def allowed_next(states: Sequence[GrammarState | None],  # [B] each row's grammar, None = not guided
                 seq_data: Sequence,  # [B] each row's SequenceData
                 vocab_size: int) -> torch.Tensor | None:  # [B, V] bool, True = may be sampled; None: no grammar
    """Plain steps: the tokens each row's grammar allows next (all, for rows without one)."""
    rows = [b for b, s in enumerate(states) if s is not None]
    if not rows:
        return None
    bitmask = _bitmask(len(states), vocab_size)
    for b in rows:
        if not states[b].fill(seq_data[b].get_output_token_ids(), bitmask, b):  # the output breaks its grammar
            bitmask[b].zero_()
    return unpack_bitmask(bitmask, vocab_size)


@dataclass
class GrammarMasks:
    """One speculative step's grammar masks, root-inclusive (row 0 = the pending token, row i = node i-1)."""

    rows: list[int]  # the batch rows of guided requests
    allowed: torch.Tensor  # [R, N+1, V] bool: the tokens the grammar allows after each scored position
    nodes: list[list[int]]  # [R] the kept nodes' indices in the proposer's tree, in the guided layout's order
    states: list[GrammarState]  # [R]
    dead: torch.Tensor | None = None  # [R, N+1] bool, after apply: no token left at that position

    def apply(self, logits: torch.Tensor) -> torch.Tensor:  # [B, N+1, V] -> the same, forbidden tokens MASKED
        """Mask the rows' forbidden tokens (after the logits processors) and note the positions left empty."""
        idx = torch.tensor(self.rows, device=logits.device)
        sub = logits.index_select(0, idx).masked_fill(~self.allowed.to(logits.device), MASKED)  # [R, N+1, V]
        self.dead = sub.amax(-1) <= MASKED / 2
        return logits.index_copy(0, idx, sub)

    def proposer_nodes(self, b: int, nodes: list[int]) -> list[int]:
        """Batch row ``b``'s accepted nodes (guided layout) as the proposer numbered them."""
        if b not in self.rows:
            return nodes
        kept = self.nodes[self.rows.index(b)]
        return [kept[i] for i in nodes]

    def error(self, b: int, verdict: Verdict, request_id: str) -> str | None:
        """The error batch row ``b`` finishes with when its final token would be sampled where nothing is
        allowed; None otherwise."""
        if self.dead is None or b not in self.rows:
            return None
        r = self.rows.index(b)
        last = int(verdict.path[b, int(verdict.num_accepted[b])])  # the position the final token is drawn at
        if not bool(self.dead[r, last]):
            return None
        return no_token_error(request_id, self.states[r], grammar_empty=not bool(self.allowed[r, last].any()))


def guide_proposals(proposals: SpeculativeProposals,
                    states: Sequence[GrammarState | None],  # [B] each row's grammar, None = not guided
                    seq_data: Sequence,  # [B] each row's SequenceData (its output so far, pending token last)
                    vocab_size: int) -> tuple[SpeculativeProposals, GrammarMasks | None]:
    """The proposals cut where the grammar forbids a drafted token (or allows nothing after it), and the masks
    of every scored position; ``(proposals, None)`` when no row is guided (module docstring)."""
    rows = [b for b, s in enumerate(states) if s is not None]
    if not rows:
        return proposals, None
    N = proposals.token_ids.shape[1]
    tokens, parents, n_nodes = proposals.token_ids.tolist(), proposals.parents.tolist(), proposals.num_nodes.tolist()
    bitmask = _bitmask(len(rows) * (N + 1), vocab_size).view(len(rows), N + 1, -1)
    kept_of: list[list[int]] = []
    for r, b in enumerate(rows):
        state, out, bm = states[b], seq_data[b].get_output_token_ids(), bitmask[r]
        if not state.fill(out, bm, 0):  # the committed output breaks its grammar: nothing is allowed
            bm[0].zero_()
        path: dict[int, list[int]] = {-1: []}  # kept node -> its drafted tokens from the root
        row: dict[int, int] = {-1: 0}  # kept node -> its row in the guided layout
        kept: list[int] = []
        for i in range(n_nodes[b]):
            par, t = parents[b][i], tokens[b][i]
            if par not in path or not (int(bm[row[par], t >> 5]) >> (t & 31)) & 1:  # the parent's mask forbids t
                continue
            j = len(kept) + 1
            if not state.fill(out + path[par] + [t], bm, j) or not bool(bm[j].any()):
                continue  # the grammar allows nothing after it (its stop token, or a dead end)
            path[i], row[i] = path[par] + [t], j
            kept.append(i)
        bm[len(kept) + 1:] = -1  # padding rows: not read by the verifier
        kept_of.append(kept)
    masks = GrammarMasks(rows, unpack_bitmask(bitmask, vocab_size), kept_of, [states[b] for b in rows])
    if all(len(k) == n_nodes[b] for k, b in zip(kept_of, rows)):
        return proposals, masks
    return _keep(proposals, dict(zip(rows, kept_of))), masks


def _keep(p: SpeculativeProposals, kept: dict[int, list[int]]) -> SpeculativeProposals:
    """``p`` with only the ``kept`` nodes of these rows (each node's parent kept before it), renumbered in order.
    A chain cut at a node keeps its first nodes: the same layout, a shorter length."""
    tok, par, n = p.token_ids.clone(), p.parents.clone(), p.num_nodes.clone()
    q = None if p.draft_probs is None else p.draft_probs.clone()
    chain = p.is_chain  # its padding keeps parents i-1
    for b, nodes in kept.items():
        new = {old: i for i, old in enumerate(nodes)}
        idx = torch.tensor(nodes, dtype=torch.long)
        m = len(nodes)
        tok[b, :m] = p.token_ids[b, idx]
        tok[b, m:] = -1
        par[b, :m] = torch.tensor([new.get(int(p.parents[b, i]), -1) for i in nodes], dtype=torch.long)
        if not chain:
            par[b, m:] = -1
        n[b] = m
        if q is not None:
            q[b, :m] = p.draft_probs[b, idx.to(q.device)]
            q[b, m:] = 0
    return SpeculativeProposals(tok, par, n, q, p.noise_width, list(p.drafted_seq_ids))


def no_token_error(request_id: str, state: GrammarState | None, grammar_empty: bool) -> str:
    kind = state.params.kind if state is not None else "grammar"
    done = state is not None and state.matcher.is_terminated()
    why = ("its grammar is complete (the stop token was emitted) and the request goes on (ignore_eos=True)" if done
           else "its grammar cannot continue with this vocabulary" if grammar_empty
           else "the request's other processors (min_tokens, allowed_token_ids, bad_words) mask every token its "
                "grammar allows")
    return (f"request {request_id}: guided decoding ({kind}) allows no next token: {why}; the request was stopped "
            "(drop ignore_eos or min_tokens, or loosen the grammar)")
