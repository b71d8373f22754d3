"""EagleProposer: an EAGLE-1 head drafts k tokens as a chain from the target's hidden states.

The head (``proposers/eagle_head.py``) keeps one KV slot per sequence, holding *pairs*: the pair of token
i is (feature of token i-1, embedding of token i), at RoPE position i-1. Before drafting, the proposer
feeds the pairs it has features for and has not fed yet: the rows of ``ProposeBatch.hidden_states``
belong to the sequence's last m tokens (m = 1: the pending token; m = 2 after a bonus token: the last
accepted draft, never fed, then the bonus), so those m pairs go in, in one head forward batched across
sequences, whose last output gives d1. Then k-1 single-pair forwards feed (own output, d_j) and give
d2..dk; dk is never fed (the next step's rows cover it). :meth:`verified` rolls the slot back to the
pairs of accepted tokens: accepted drafts keep the KV computed from the head's own features, as in
vLLM's EAGLE; only unfed tokens get the target's features. Rows that cover tokens already fed replace
them (the slot is cut back first), so a worker that threads more rows gets the exact EAGLE behaviour.

Features (``options.features``). The worker threads the target's rows only for tokens the head never
fed, so by default a head would attend to (a) nothing of the prompt but its last token and (b) accepted
drafts keyed from its *own* features (vLLM v0's EAGLE; ``features: threaded``). ``features: exact`` (the
default) gives it what the EAGLE paper does, from a :class:`TargetTap` on the target's forward: the
rows of each prefill (the whole prompt, keyed by its token ids: hidden states are a function of the
tokens) and of each scoring forward (keyed by its start and tokens: pending + drafts), so accepted drafts
are re-fed with the target's features. ``features: worker``: no tap; the worker passes the same rows
through :meth:`prefilled` (prompt) and :meth:`scored` (pending + accepted drafts) and, for EAGLE-3,
threads the fused layers itself. Tokens without features are skipped: a slot may have holes (RoPE
keeps relative positions right).

Sampling: greedy rows take the argmax; the others sample from q (the request's processed distribution
over the draft vocabulary) and return q, exactly what each draft was drawn from. Knows nothing about
verification or the target's KV cache.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import OrderedDict
from pathlib import Path

import torch

from proposers.eagle_head import sample_draft
from specdec.engine import ForwardOutput, ModelEngine
from specdec.engine.cpu.ops import NativeWeight, lib, linear, native_linears
from specdec.sampling import SamplingTensors
from specdec.sampling_params import SamplingParams
from kernels import get_ops
from specdec.spec_decode.proposer import DraftOutput, Proposer, ProposeBatch
from specdec.tree import TreeProposals, TreeProposer, TreeShape

REPO_HEADS = Path(__file__).resolve().parents[1] / "heads"
_GREEDY = SamplingParams(temperature=0.0)


class TargetTap:
    """Interim side channel on the target's forward, installed by an EAGLE proposer until the worker
    threads what it needs itself (see experiments/LOG.md, EAGLE section):

    - ``hidden_layers`` non-empty (EAGLE-3): every forward that asks for no layers of its own asks for
      these, and its ``hidden_states`` become ``cat(aux_hidden_states, -1)`` [T, len * D], so what the
      worker threads in HiddenStates are the fused layers;
    - ``keep``: the rows of each sequence of each multi-token forward are kept, keyed by (start, token
      ids): a prefill (start 0) or a scoring forward (pending + drafts); the proposer takes (removes) the
      ones it uses, the oldest others go once more than ``max_rows`` rows are kept (a plain twin sharing
      the engine prefills too).
    """

    def __init__(self, target: ModelEngine, hidden_layers: tuple[int, ...] = (), keep: bool = True,
                 max_rows: int = 32768) -> None:
        self.target = target
        self.hidden_layers = tuple(hidden_layers)
        self.keep = keep
        self.max_rows = max_rows  # 32k rows of D=576 fp32 = 75 MB (x3 for EAGLE-3's fused layers)
        self.rows: OrderedDict[tuple[int, tuple[int, ...]], torch.Tensor] = OrderedDict()
        self._num_rows = 0
        self._inner = target.forward
        target.forward = self.forward  # instance attribute: shadows the class's method for this engine only

    @classmethod
    def install(cls, target: ModelEngine, hidden_layers: tuple[int, ...] = (), keep: bool = True) -> "TargetTap":
        old = getattr(target, "_eagle_tap", None)
        if old is not None:  # one tap per engine; a second proposer on it shares the first's
            if tuple(hidden_layers) != old.hidden_layers:
                raise ValueError(f"TargetTap: the target already threads layers {old.hidden_layers}; a second "
                                 f"EAGLE proposer wants {tuple(hidden_layers)}. Use one head kind per engine")
            old.keep |= keep
            return old
        tap = cls(target, hidden_layers, keep)
        target._eagle_tap = tap
        return tap

    def forward(self, batch) -> ForwardOutput:
        swap = bool(self.hidden_layers) and not batch.hidden_layers
        if swap:
            batch = dataclasses.replace(batch, hidden_layers=self.hidden_layers)
        starts = [self.target.seq_len(s) for s in batch.slots] if self.keep else None
        out = self._inner(batch)
        if swap:
            out = ForwardOutput(logits=out.logits, hidden_states=torch.cat(out.aux_hidden_states, -1))
        if self.keep and max(batch.query_lens) > 1 and batch.tree_mask is None:
            t0 = 0
            toks = batch.token_ids.tolist()
            for start, n in zip(starts, batch.query_lens):
                key = (start, tuple(toks[t0:t0 + n]))
                if n > 1 and key not in self.rows:
                    self.rows[key] = out.hidden_states[t0:t0 + n].clone()
                    self._num_rows += n
                t0 += n
            while self._num_rows > self.max_rows and len(self.rows) > 1:
                self._num_rows -= self.rows.popitem(last=False)[1].shape[0]
        return out

    def take(self, start: int, tokens: tuple[int, ...]) -> torch.Tensor | None:
        """The rows [n, F] of the forward that fed ``tokens`` from cache index ``start`` (removed), or None."""
        rows = self.rows.pop((start, tokens), None)
        if rows is not None:
            self._num_rows -= rows.shape[0]
        return rows

    def take_prefix(self, tokens: list[int], limit: int) -> torch.Tensor | None:
        """The rows of the longest kept prefill that is a prefix of ``tokens[:limit]`` (removed), or None."""
        best = None
        for start, key in self.rows:
            n = len(key)
            if start == 0 and n <= limit and (best is None or n > len(best)) and tokens[:n] == list(key):
                best = key
        return None if best is None else self.take(0, best)


class EagleProposer(TreeProposer):
    """EAGLE-1 chain drafting. speculative_config: ``model`` or ``options.head`` = the head directory
    (default ``heads/smollm2-135m-instruct-eagle``); ``options.head_module`` = an in-process head (tests);
    ``options.features`` = exact | threaded | worker (see the module docstring); ``options.draft_vocab_size``
    = N: score only the head's N most frequent training tokens (needs ``draft_vocab.safetensors`` beside it)."""

    needs_hidden_states = True
    method = "eagle"
    default_head = REPO_HEADS / "smollm2-135m-instruct-eagle"
    hidden_layers: tuple[int, ...] = ()  # target layers the head reads; () = the last layer (after its norm)

    def load(self, path, seed: int = 0):
        """The head at ``path`` (a directory in the published layout; relative paths also resolve against
        the repository), or for ``tiny-random-llama`` a seeded random head shaped like the target (debug
        runs and smoke tests, as the draft-model proposer treats that name)."""
        from proposers.eagle_head import HeadConfig, build_head, load_head

        if str(path) == "tiny-random-llama":
            cfg = getattr(self.target, "config", None)
            if cfg is None:
                raise ValueError(f"{type(self).__name__}: a random head needs the target's ModelConfig "
                                 f"(target.config); {type(self.target).__name__} has none")
            torch.manual_seed(seed)
            extra = {"draft_vocab_size": min(cfg.vocab_size, 256)} if self.method == "eagle3" else {}
            head = build_head(HeadConfig.for_target(cfg, self.method, **extra))
            if self.method == "eagle3":
                head.set_vocab(torch.arange(extra["draft_vocab_size"]))
            head.freq_ids = torch.arange(cfg.vocab_size)  # no training frequencies: id order
            return head
        p = Path(path).expanduser()
        if not p.exists() and not p.is_absolute() and (REPO_HEADS.parent / p).exists():
            p = REPO_HEADS.parent / p
        return load_head(p, method=self.method)

    def target_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs the head reads; () = the last layer after the final norm."""
        return ()

    def __init__(self, target: ModelEngine, config) -> None:
        super().__init__(target, config)
        opts = config.options
        head = opts.get("head_module")
        self.head_name = "<in-process head>"
        if head is None:
            path = opts.get("head") or config.model or self.default_head
            self.head_name = str(path)
            head = self.load(path, opts.get("seed", 0))
        self.head = head
        self.hidden_layers = self.target_layers()
        self._check_fits()
        self.head.to(device=target.device, dtype=target.dtype).eval()
        native_linears(self.head)  # the head's projections through the CPU kernels (inference only)
        self.head.init_cache(target.num_slots, target.max_model_len, target.dtype, target.device)
        self._setup_vocab(opts)
        mode = opts.get("features", "exact")
        if mode not in ("exact", "threaded", "worker"):
            raise ValueError(f"{type(self).__name__}: options.features={mode!r}; choose exact, threaded or worker")
        self.mode = mode
        self.exact = mode == "exact"
        self.tap = None
        if self.exact or (self.hidden_layers and mode != "worker"):
            self.tap = TargetTap.install(target, self.hidden_layers, keep=self.exact)
        self._ops = get_ops(config.kernel)
        self.slot_of: dict[int, int] = {}  # seq_id -> head KV slot
        self._idx: dict[int, list[int]] = {}  # seq_id -> token index of each pair in the slot (ascending)
        self._tok: dict[int, list[int]] = {}  # seq_id -> token id of each pair in the slot
        self._prompt_rows: dict[int, torch.Tensor] = {}  # seq_id -> [P, F] from prefilled()
        self._scored: dict[int, tuple[int, tuple[int, ...]]] = {}  # seq_id -> (start, pending + drafts) last step
        self._accepted: dict[int, torch.Tensor] = {}  # seq_id -> [a+1, F] from scored()

    # ------------------------------------------------------------------ head <-> target
    def _check_fits(self) -> None:
        c, t = self.head.cfg, self.target
        if c.hidden_size != t.hidden_size:
            raise ValueError(f"{type(self).__name__}: head {self.head_name} has hidden_size={c.hidden_size} but the "
                             f"target has hidden_size={t.hidden_size}; a head fits only the model it was trained on")
        if c.vocab_size != t.vocab_size:
            raise ValueError(f"{type(self).__name__}: head {self.head_name} has vocab_size={c.vocab_size} but the "
                             f"target has vocab_size={t.vocab_size}; a head fits only the model it was trained on")
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
    def prefilled(self, seq_id: int, hidden_states: torch.Tensor) -> None:
        """The target's features of every prompt token ([P, F]), for a worker that passes them."""
        self._prompt_rows[seq_id] = hidden_states

    def scored(self, seq_id: int, hidden_states: torch.Tensor) -> None:
        """The target's features of the last step's pending token and accepted drafts ([a+1, F]), for a
        worker that passes them: the next step re-feeds the accepted drafts with them."""
        self._accepted[seq_id] = hidden_states

    def verified(self, seq_id: int, num_valid_tokens: int) -> None:
        idx = self._idx.get(seq_id)
        if idx is None:
            return
        n = bisect.bisect_left(idx, num_valid_tokens)
        if n < len(idx):
            self.head.cache.rollback(self.slot_of[seq_id], n)
            del idx[n:], self._tok[seq_id][n:]

    def free(self, seq_id: int) -> None:
        slot = self.slot_of.pop(seq_id, None)
        self._idx.pop(seq_id, None)
        self._tok.pop(seq_id, None)
        self._prompt_rows.pop(seq_id, None)
        self._scored.pop(seq_id, None)
        self._accepted.pop(seq_id, None)
        if slot is not None:
            self.head.cache.free(slot)

    def snapshot(self, seq_ids: list[int]):
        """Per sequence: pairs in its head slot (None: no slot) and its pending feature rows; and the tap's
        kept rows. A step's catch-up may cut the slot back and re-feed accepted drafts with the target's
        features; restoring to min(held, now) pairs and the same rows makes the re-run cut and feed the same."""
        seqs = {s: (len(self._idx[s]) if s in self.slot_of else None, self._prompt_rows.get(s),
                    self._scored.get(s), self._accepted.get(s)) for s in seq_ids}
        return seqs, None if self.tap is None else (OrderedDict(self.tap.rows), self.tap._num_rows)

    def restore(self, seq_ids: list[int], snapshot) -> None:
        seqs, tap = snapshot
        for s, (n, prompt_rows, scored, accepted) in seqs.items():
            if n is None:
                self.free(s)
            elif s in self.slot_of:
                slot, idx, tok = self.slot_of[s], self._idx[s], self._tok[s]
                m = min(n, len(idx), self.head.cache.seq_len(slot))
                self.head.cache.rollback(slot, m)
                del idx[m:], tok[m:]
            for kept, value in ((self._prompt_rows, prompt_rows), (self._scored, scored), (self._accepted, accepted)):
                if value is None:
                    kept.pop(s, None)
                else:
                    kept[s] = value
        if tap is not None:
            self.tap.rows, self.tap._num_rows = OrderedDict(tap[0]), tap[1]

    def _sync(self, seq_id: int, tokens: list[int], first_row: int) -> list[tuple[int, torch.Tensor | None]]:
        """Cut the slot back to pairs of tokens before ``first_row`` that still match ``tokens``; return
        extra (token index, feature) pairs to feed before the rows: the prompt's, on a fresh slot."""
        if seq_id not in self.slot_of:
            self.slot_of[seq_id] = self.head.cache.allocate()
            self._idx[seq_id], self._tok[seq_id] = [], []
        idx, tok = self._idx[seq_id], self._tok[seq_id]
        n = bisect.bisect_left(idx, first_row)
        if tok[:n] != [tokens[i] for i in idx[:n]]:  # a missed verified(): keep the matching prefix
            n = next(j for j in range(n) if tok[j] != tokens[idx[j]])
        if n < len(idx):
            self.head.cache.rollback(self.slot_of[seq_id], n)
            del idx[n:], tok[n:]
        extra: list[tuple[int, torch.Tensor]] = []
        if not idx:  # fresh slot: the prompt's features, where we have them
            rows = self._prompt_rows.pop(seq_id, None)
            if rows is None and self.exact:
                rows = self.tap.take_prefix(tokens, first_row)
            if rows is not None:
                P = min(rows.shape[0], first_row)
                # the pair of token i takes the feature of token i-1
                extra = [(i, rows[i - 1]) for i in range(1, P)]
        return extra

    def _exact_rows(self, seq_id: int, tokens: list[int]) -> list[torch.Tensor] | None:
        """The target's features of every token since the last step's pending one (accepted drafts +
        the new token): from :meth:`scored`, or the tap's copy of the last scoring forward; None if none."""
        acc = self._accepted.pop(seq_id, None)
        if acc is not None:
            return list(acc)
        if not self.exact:
            return None
        last = self._scored.pop(seq_id, None)
        if last is None:
            return None
        start, fed = last
        a = len(tokens) - 2 - start  # accepted drafts: the new token sits at start + a + 1
        if not 0 <= a < len(fed) or tuple(tokens[start:start + a + 1]) != fed[:a + 1]:
            return None
        rows = self.tap.take(start, fed)
        return None if rows is None else list(rows[:a + 1])

    # ------------------------------------------------------------------ drafting
    def _rows_by_seq(self, batch: ProposeBatch) -> tuple[torch.Tensor | None, dict[int, list[int]]]:
        hs = batch.hidden_states
        if hs is None:
            return None, {}
        rows: dict[int, list[int]] = {}
        for r, s in enumerate(hs.seq_ids):
            rows.setdefault(s, []).append(r)
        feats = hs.hidden_states
        want = self.head.cfg.feature_size
        if feats.shape[-1] != want:
            raise ValueError(
                f"{type(self).__name__}: the threaded hidden states are {feats.shape[-1]} wide but head "
                f"{self.head_name} takes {want}-wide features"
                + (f" (target layers {self.hidden_layers} concatenated; the TargetTap or the worker must "
                   "thread them)" if self.hidden_layers else " (the target's last layer)"))
        return feats, rows

    def _catch_up(self, batch: ProposeBatch):
        """Feed every pair the head has a feature for and has not fed, one forward for all sequences.
        -> (act: batch rows that can draft, last [len(act), D] head output at each pending token, their head
        slots, their pending pairs' positions); act empty: nothing to draft from."""
        dev = self.target.device
        feats, rows_of = self._rows_by_seq(batch)
        act = [b for b, s in enumerate(batch.seq_ids) if rows_of.get(s)]  # no row: nothing to draft from
        if not act:
            return act, None, [], []
        toks, fts, pos, qlens, slots, last_pos = [], [], [], [], [], []
        for b in act:
            s, tokens = batch.seq_ids[b], batch.token_ids[b]
            rows = [feats[r] for r in rows_of[s]]
            rows = self._exact_rows(s, tokens) or rows
            first = len(tokens) - len(rows)  # token index of the first row's token
            pairs = self._sync(s, tokens, first) + [(first + i, f) for i, f in enumerate(rows)]
            for i, f in pairs:
                toks.append(tokens[i])
                fts.append(f)
                pos.append(i - 1)
            self._idx[s].extend(i for i, _ in pairs)
            self._tok[s].extend(tokens[i] for i, _ in pairs)
            qlens.append(len(pairs))
            slots.append(self.slot_of[s])
            last_pos.append(len(tokens) - 2)
        emb = self.target.embed(torch.tensor(toks, dtype=torch.long, device=dev))
        out = self.head.forward_cached(emb, torch.stack(fts).to(emb.dtype), torch.tensor(pos, device=dev), slots, qlens)
        return act, out[torch.tensor(qlens, device=dev).cumsum(0) - 1], slots, last_pos

    def propose(self, batch: ProposeBatch) -> DraftOutput:
        B, k = len(batch.seq_ids), batch.k
        dev = self.target.device
        lens = torch.zeros(B, dtype=torch.long)
        token_ids = torch.full((B, k), -1, dtype=torch.long)
        act, last, slots, last_pos = self._catch_up(batch)
        if not act:
            return DraftOutput(token_ids=token_ids, probs=None, lens=lens)

        params = [batch.sampling_params[b] or _GREEDY for b in act]
        st = SamplingTensors.from_params(params, device=dev)
        gens = [None if p.temperature == 0 else batch.generators[b] for p, b in zip(params, act)]
        d2t = self.draft_to_target()
        drafts, probs = [], []
        positions = torch.tensor(last_pos, device=dev)
        for j in range(k):
            d, q = sample_draft(self.draft_logits(last), st, gens)  # draft ids [b], q [b, Vd]
            tok = d if d2t is None else d2t[d]
            drafts.append(tok)
            probs.append(q)
            if j == k - 1:
                break  # dk is never fed: the next step's rows cover it
            positions = positions + 1
            last = self.head.forward_cached(self.target.embed(tok), last, positions, slots, [1] * len(act))
            for b, t in zip(act, tok.tolist()):
                s = batch.seq_ids[b]
                self._idx[s].append(len(batch.token_ids[b]) - 1 + j + 1)
                self._tok[s].append(t)
        sel = torch.tensor(act)
        token_ids[sel] = torch.stack(drafts, 1).cpu()
        if self.exact:
            for b, d in zip(act, token_ids[sel].tolist()):
                self._scored[batch.seq_ids[b]] = (len(batch.token_ids[b]) - 1, (batch.token_ids[b][-1], *d))
        lens[sel] = k
        q_full = None
        if not st.all_greedy:
            q = torch.stack(probs, 1)  # [b, k, Vd]
            if d2t is not None:  # scatter the draft vocabulary's q into the target's
                q = torch.zeros(*q.shape[:2], self.target.vocab_size, device=q.device).index_copy_(2, d2t, q)
            q_full = torch.zeros(B, k, q.shape[-1])
            q_full[sel] = q.cpu()
            # rows with no proposal keep q = 0; Top1Proposer masks them by lens
        return DraftOutput(token_ids=token_ids, probs=q_full, lens=lens)

    # ------------------------------------------------------------------ EAGLE-2 dynamic tree
    def tree_lookahead(self, shape: TreeShape) -> int:
        return max(shape.budget, (shape.depth - 1) * shape.topk)  # the last re-feed holds (depth-1)*k pairs

    def propose_tree(self, batch: ProposeBatch, shape: TreeShape) -> TreeProposals:
        """EAGLE-2: catch up as the chain does, then :func:`build_dynamic_tree` with the head as ``expand``.
        The head's tree mask covers new pairs only (its cached prefix is always visible), so each expansion
        cuts the slot back to the committed pairs and re-feeds every frontier node so far: node n at depth d
        is the pair (its parent's head output, or the pending token's for d = 1; embed(token n)) at the
        pending pair's position + d, seeing its ancestors. Afterwards the slot is cut back to the committed
        pairs: :meth:`verified_tree` keeps the target's features of the accepted path, and the next step's
        catch-up feeds it (EAGLE's exact features)."""
        from proposers.tree_draft import CandidateTree, build_dynamic_tree, frontier_subtree

        B = len(batch.seq_ids)
        dev = self.target.device
        act, last, slots, last_pos = self._catch_up(batch)
        if not act:
            return TreeProposals.empty(B)
        A = len(act)
        committed = [len(self._idx[batch.seq_ids[b]]) for b in act]
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
        tree = TreeProposals(target_ids(tree.token_ids), tree.parents, tree.num_nodes)
        return tree.scatter_rows(act, B) if A < B else tree

    def verified_tree(self, seq_id: int, base_len: int, accepted_nodes: list[int],
                      hidden_states: torch.Tensor | None = None) -> None:
        self.verified(seq_id, base_len)
        if hidden_states is not None:  # the target's features of the pending token + accepted path
            self._accepted[seq_id] = hidden_states
