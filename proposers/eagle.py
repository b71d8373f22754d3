"""EagleProposer: an EAGLE-1 head drafts a chain, or an EAGLE-2 dynamic tree, from the target's features.

The head (``specdec/heads/eagle.py``) keeps one KV slot per sequence, holding *pairs*: the pair of token i
is (the target's feature of token i-1, the embedding of token i), at RoPE position i-1. The features come
from the worker only (``FeatureSpec(history=None)``): every committed token's state since the proposer
last read (a prefill: the whole prompt; a step: the pending token and the accepted drafts), which is what
the EAGLE paper feeds. Before drafting, the proposer feeds the pairs of those rows in one head forward
batched across sequences, whose last output gives d1; then k-1 single-pair forwards feed (own output,
d_j) and give d2..dk. dk is never fed. :meth:`verified` cuts the slot back to pairs of committed tokens;
the next catch-up replaces the accepted drafts' pairs (keyed from the head's own outputs) with the
target's features. Tokens without features are skipped: a slot may have holes (RoPE keeps relative
positions right).

Sampling: greedy rows take the argmax; the others sample from q (the request's processed distribution
over the draft vocabulary, ``specdec.spec_decode.draft_sampling``) and return q, exactly what each draft
was drawn from. Knows nothing about verification or the target's KV cache.
"""

from __future__ import annotations

import bisect

import torch

from kernels import get_ops
from specdec.engine import ModelEngine
from specdec.engine.cpu.ops import NativeWeight, lib, linear, native_linears
from specdec.heads import HeadConfig, build_head, load_head
from specdec.heads.common import CHECKPOINTS, load_head_module
from specdec.sampling import SamplingTensors
from specdec.sampling_params import SamplingParams
from specdec.spec_decode.draft_sampling import greedy_free, sample_draft
from specdec.spec_decode.proposer import DraftOutput, FeatureSpec, ProposeBatch
from specdec.tree import TreeProposals, TreeProposer, TreeShape

_GREEDY = SamplingParams(temperature=0.0)


class EagleProposer(TreeProposer):
    """EAGLE-1. speculative_config: ``model`` or ``options.head`` = the head directory (default
    ``checkpoints/smollm2-135m-instruct-eagle``; ``tiny-random-llama`` = a seeded random head shaped like
    the target); ``options.head_module`` = an in-process head (tests); ``options.draft_vocab_size`` = N:
    score only the head's N most frequent training tokens (needs ``draft_vocab.safetensors`` beside it)."""

    method = "eagle"
    default_head = CHECKPOINTS / "smollm2-135m-instruct-eagle"

    def __init__(self, target: ModelEngine, config) -> None:
        super().__init__(target, config)
        opts = config.options
        if "features" in opts:
            raise ValueError(f"{type(self).__name__}: options.features is gone: the worker now threads the target's "
                             "features of every committed token (the former 'exact'); drop the option")
        head = opts.get("head_module")
        self.head_name = "<in-process head>"
        if head is None:
            path = opts.get("head") or config.model or self.default_head
            self.head_name = str(path)
            head = load_head_module(path, type(self).__name__, lambda p: load_head(p, method=self.method),
                                    lambda: self._random(opts.get("seed", 0)),
                                    f"train one with experiments/train_{self.method}.py --export <dir>")
        self.head = head
        self.features = FeatureSpec(layers=self.target_layers(), history=None)
        self._check_fits()
        self.head.to(device=target.device, dtype=target.dtype).eval()
        native_linears(self.head)  # the head's projections through the CPU kernels (inference only)
        self.head.init_cache(target.num_slots, target.max_model_len, target.dtype, target.device)
        self._setup_vocab(opts)
        self._ops = get_ops(config.kernel)
        self.slot_of: dict[int, int] = {}  # seq_id -> head KV slot
        self._idx: dict[int, list[int]] = {}  # seq_id -> token index of each pair in the slot (ascending)
        self._tok: dict[int, list[int]] = {}  # seq_id -> token id of each pair in the slot

    def _random(self, seed: int):
        cfg = getattr(self.target, "config", None)
        if cfg is None:
            raise ValueError(f"{type(self).__name__}: a random head needs the target's ModelConfig (target.config); "
                             f"{type(self.target).__name__} has none")
        torch.manual_seed(seed)
        extra = {"draft_vocab_size": min(cfg.vocab_size, 256)} if self.method == "eagle3" else {}
        head = build_head(HeadConfig.for_target(cfg, self.method, **extra))
        if self.method == "eagle3":
            head.set_vocab(torch.arange(extra["draft_vocab_size"]))
        head.freq_ids = torch.arange(cfg.vocab_size)  # no training frequencies: id order
        return head

    def target_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs the head reads; () = the last layer after the final norm."""
        return ()

    # ------------------------------------------------------------------ head <-> target
    def _check_fits(self) -> None:
        c, t = self.head.cfg, self.target
        for key, have in (("hidden_size", t.hidden_size), ("vocab_size", t.vocab_size)):
            if getattr(c, key) != have:
                raise ValueError(f"{type(self).__name__}: head {self.head_name} has {key}={getattr(c, key)} but the "
                                 f"target has {key}={have}; a head fits only the model it was trained on")
        if c.method != self.method:
            raise ValueError(f"{type(self).__name__}: head {self.head_name} is an {c.method!r} head; "
                             f"use method={'eagle3' if c.method == 'eagle3' else 'eagle'}")

    def _setup_vocab(self, opts) -> None:
        """EAGLE-1 scores the target's LM head; ``draft_vocab_size`` restricts it to frequent tokens."""
        self._draft_ids: torch.Tensor | None = None  # [Vd] target id of each draft id; None = all
        self._draft_head: torch.Tensor | None = None  # [Vd, D] rows of the LM head
        self._draft_native = None  # the same, packed for the CPU kernels
        n = opts.get("draft_vocab_size")
        if n:
            ids = getattr(self.head, "freq_ids", None)
            if ids is None:
                raise ValueError(f"{type(self).__name__}: options.draft_vocab_size={n} needs the head's token "
                                 f"frequencies (draft_vocab.safetensors beside {self.head_name})")
            ids = ids[:n].sort().values.to(self.target.device)
            # the LM head's weight [V, D], recovered through the engine's interface: logits of e_i = W[:, i]
            eye = torch.eye(self.target.hidden_size, dtype=self.target.dtype, device=self.target.device)
            self._draft_head = self.target.compute_logits(eye).T[ids].to(self.target.dtype).contiguous()
            self._draft_ids = ids
            if lib() is not None:  # [Vd, D] packed once for the CPU kernels
                self._draft_native = NativeWeight(self._draft_head)

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """[B, D] head outputs -> [B, Vd] float32 logits over the draft vocabulary."""
        if self._draft_native is not None:
            return linear(out.float().contiguous(), self._draft_native)
        if self._draft_head is not None:
            return (out @ self._draft_head.T).float()
        return self.target.compute_logits(out)

    def draft_to_target(self) -> torch.Tensor | None:
        return self._draft_ids

    def head_vocab_size(self) -> int:
        """Width of :meth:`draft_logits`."""
        return self.target.vocab_size if self._draft_ids is None else self._draft_ids.numel()

    # ------------------------------------------------------------------ state
    def verified(self, seq_id: int, num_valid_tokens: int) -> None:
        idx = self._idx.get(seq_id)
        if idx is not None:
            self._cut(seq_id, bisect.bisect_left(idx, num_valid_tokens))

    def _cut(self, seq_id: int, n: int) -> None:
        """Keep the first ``n`` pairs of the sequence's slot."""
        idx = self._idx[seq_id]
        if n < len(idx):
            self.head.cache.rollback(self.slot_of[seq_id], n)
            del idx[n:], self._tok[seq_id][n:]

    def free(self, seq_id: int) -> None:
        slot = self.slot_of.pop(seq_id, None)
        self._idx.pop(seq_id, None)
        self._tok.pop(seq_id, None)
        if slot is not None:
            self.head.cache.free(slot)

    def snapshot(self, seq_ids: list[int]) -> dict[int, int | None]:
        """Pairs in each sequence's slot (None: no slot). A step only cuts back and appends, and the rows it
        re-feeds are restored with the worker's HiddenStates, so re-running it feeds the same pairs."""
        return {s: len(self._idx[s]) if s in self.slot_of else None for s in seq_ids}

    def restore(self, seq_ids: list[int], snapshot: dict[int, int | None]) -> None:
        for s, n in snapshot.items():
            if n is None:
                self.free(s)
            elif s in self.slot_of:
                self._cut(s, min(n, self.head.cache.seq_len(self.slot_of[s])))

    # ------------------------------------------------------------------ drafting
    def _catch_up(self, batch: ProposeBatch):
        """Feed the pairs of every threaded row, one head forward for all sequences.
        -> (last [B, D] head output at each pending token, head slots, the pending pairs' positions)."""
        dev = self.target.device
        toks, fts, pos, qlens, slots = [], [], [], [], []
        for s, tokens, rows in zip(batch.seq_ids, batch.token_ids, batch.feature_rows()):
            if s not in self.slot_of:
                self.slot_of[s] = self.head.cache.allocate()
                self._idx[s], self._tok[s] = [], []
            first = len(tokens) - rows.shape[0]  # token index of the first row's pair
            idx, tok = self._idx[s], self._tok[s]
            n = bisect.bisect_left(idx, first)
            if tok[:n] != [tokens[i] for i in idx[:n]]:  # a missed verified(): keep the matching prefix
                n = next(j for j in range(n) if tok[j] != tokens[idx[j]])
            self._cut(s, n)
            new = range(first, len(tokens))
            toks += [tokens[i] for i in new]
            fts.append(rows)
            pos += [i - 1 for i in new]
            idx.extend(new)
            tok.extend(tokens[i] for i in new)
            qlens.append(len(new))
            slots.append(self.slot_of[s])
        emb = self.target.embed(torch.tensor(toks, dtype=torch.long, device=dev))
        feats = torch.cat(fts).to(dev, emb.dtype)
        if feats.shape[-1] != self.head.cfg.feature_size:
            raise ValueError(f"{type(self).__name__}: the threaded features are {feats.shape[-1]} wide but head "
                             f"{self.head_name} takes {self.head.cfg.feature_size} (target layers {self.features.layers})")
        out = self.head.forward_cached(emb, feats, torch.tensor(pos, device=dev), slots, qlens)
        last_pos = [len(t) - 2 for t in batch.token_ids]
        return out[torch.tensor(qlens, device=dev).cumsum(0) - 1], slots, last_pos

    def propose(self, batch: ProposeBatch) -> DraftOutput:
        dev = self.target.device
        last, slots, last_pos = self._catch_up(batch)
        params = [p or _GREEDY for p in batch.sampling_params]
        st = SamplingTensors.from_params(params, device=dev)
        gens = greedy_free(params, batch.generators)
        d2t = self.draft_to_target()
        drafts, probs = [], []
        positions = torch.tensor(last_pos, device=dev)
        for j in range(batch.k):
            d, q = sample_draft(self.draft_logits(last), st, gens, self.config.kernel)  # draft ids [B], q [B, Vd]
            tok = d if d2t is None else d2t[d]
            drafts.append(tok)
            probs.append(q)
            if j == batch.k - 1:
                break  # dk is never fed: the next step's rows cover it
            positions = positions + 1
            last = self.head.forward_cached(self.target.embed(tok), last, positions, slots, [1] * len(slots))
            for s, tokens, t in zip(batch.seq_ids, batch.token_ids, tok.tolist()):
                self._idx[s].append(len(tokens) + j)
                self._tok[s].append(t)
        q = None
        if not st.all_greedy:
            q = torch.stack(probs, 1)  # [B, k, Vd]
            if d2t is not None:  # the draft vocabulary's q inside the target's
                q = torch.zeros(*q.shape[:2], self.target.vocab_size, device=q.device).index_copy_(2, d2t, q)
        return DraftOutput(token_ids=torch.stack(drafts, 1), probs=q)

    # ------------------------------------------------------------------ EAGLE-2 dynamic tree
    def tree_lookahead(self, shape: TreeShape) -> int:
        return max(shape.budget, (shape.depth - 1) * shape.topk)  # the last re-feed holds (depth-1)*k pairs

    def propose_tree(self, batch: ProposeBatch, shape: TreeShape) -> TreeProposals:
        """EAGLE-2: catch up as the chain does, then :func:`build_dynamic_tree` with the head as ``expand``.
        The head's tree mask covers new pairs only (its cached prefix is always visible), so each expansion
        cuts the slot back to the committed pairs and re-feeds every frontier node so far: node n at depth d
        is the pair (its parent's head output, or the pending token's for d = 1; embed(token n)) at the
        pending pair's position + d, seeing its ancestors. Afterwards the slot is cut back to the committed
        pairs; the next step's rows re-feed the accepted path with the target's features."""
        from proposers.tree_draft import CandidateTree, build_dynamic_tree, frontier_subtree

        dev = self.target.device
        last, slots, last_pos = self._catch_up(batch)
        A = len(slots)
        committed = [len(self._idx[s]) for s in batch.seq_ids]
        pos0 = torch.tensor(last_pos, device=dev)
        d2t = self.draft_to_target()
        D = last.shape[-1]
        k0 = min(shape.topk, self.head_vocab_size())
        # [A, C, D] head output at each candidate node (by candidate id), filled as frontiers are fed
        outs = last.new_zeros(A, k0 + (shape.depth - 1) * k0 * k0, D)

        def target_ids(d: torch.Tensor) -> torch.Tensor:
            return d if d2t is None else d2t[d]

        def expand(cands: CandidateTree, frontiers: list[torch.Tensor]) -> torch.Tensor:
            fed, parents, depths = frontier_subtree(cands, frontiers)  # [A, F], [A, F+1], [A, F]
            F_, k = fed.shape[1], frontiers[-1].shape[1]
            mask = self._ops.build_tree_mask(parents)[:, 1:, 1:]  # [A, F, F] ancestors among the fed nodes
            par = cands.parents.gather(1, fed)  # [A, F] candidate id of each fed node's parent, -1 = pending
            # a node's parent was fed, and its output kept, by an earlier expansion
            feat = torch.where((par < 0)[..., None], last[:, None, :],
                               outs.gather(1, par.clamp(min=0)[..., None].expand(A, F_, D)))  # [A, F, D]
            for slot, n in zip(slots, committed):
                self.head.cache.rollback(slot, n)
            tok = target_ids(cands.token_ids.gather(1, fed))  # [A, F]
            o = self.head.forward_cached(self.target.embed(tok.reshape(-1)), feat.reshape(A * F_, D),
                                         (pos0[:, None] + depths).reshape(-1), slots, [F_] * A,
                                         tree_mask=mask.reshape(A * F_, F_)).view(A, F_, D)
            newest = o[:, F_ - k:]  # [A, k, D]
            outs.scatter_(1, fed[:, F_ - k:, None].expand(A, k, D), newest)
            return torch.log_softmax(self.draft_logits(newest.reshape(A * k, D)), -1).view(A, k, -1)

        tree, _ = build_dynamic_tree(torch.log_softmax(self.draft_logits(last), -1), expand, shape)
        for slot, n in zip(slots, committed):
            self.head.cache.rollback(slot, n)
        return TreeProposals(target_ids(tree.token_ids), tree.parents, tree.num_nodes)
