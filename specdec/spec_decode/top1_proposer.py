"""Top1Proposer: the per-step edge cases of proposing, once, around any Proposer, chain or tree.

- which rows draft: none when running_queue_size >= disable_by_batch_size; a row whose k+1 scored tokens
  (a tree: its budget, or the proposer's own lookahead) would pass max_model_len does not; nor does a row
  without feature rows when the proposer reads the target's features;
- the proposer sees only the rows that draft; its output is checked and scattered back to [B, ...];
- a proposer that returns shorter proposals (or none) yields num_nodes below k (or 0);
- chain drafts become a chain-shaped SpeculativeProposals (parents i-1);
- the speculation policy's choice per row (specdec/spec_decode/policy.py; ``ks``): a row at 0 is not handed
  over; the proposer is told each row's number (``ProposeBatch.row_k``, which it may ignore) and every proposal
  is cut to it here: a chain to its first k tokens, a tree to its first ``budget`` nodes (ancestor-closed: a
  node's parent precedes it). The padded width stays the configured one (k, or the tree's noise width), so a
  seeded row draws its randomness the same way whatever was chosen.
"""

from __future__ import annotations

import torch

from specdec.interfaces import SpeculativeProposals, SpeculativeProposer
from specdec.datamodel.hidden_states import ExecuteModelRequest
from specdec.spec_decode.proposer import Proposer, ProposeBatch, TokenLists, TreeShape


class Top1Proposer(SpeculativeProposer):
    def __init__(self, proposer: Proposer, k: int, max_model_len: int, vocab_size: int,
                 disable_by_batch_size: int | None = None, shape: TreeShape | None = None) -> None:
        self.proposer = proposer
        self.shape = shape  # None: chains of k; else trees of this shape (k = shape.depth)
        self.k = shape.depth if shape is not None else k
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.disable_by_batch_size = disable_by_batch_size
        # positions past the committed tokens one step needs in the target (and the proposer's cache); whether
        # a tree shape fits the proposer is the builder's check (specdec/spec_decode/builder.py)
        self.need = self.k + 1 if shape is None else max(shape.budget, proposer.tree_lookahead(shape))

    @property
    def max_path(self) -> int:
        """The most drafts one step can accept: k (a chain), or the longest root-to-leaf path of the proposer's trees
        (TreeProposer.tree_max_path: the depth, or a grafted branch's length past it)."""
        return self.k if self.shape is None else max(self.shape.depth, self.proposer.tree_max_path(self.shape))

    @property
    def size(self) -> int:
        """The most a row drafts per step: k (a chain) or the tree's node budget."""
        return self.k if self.shape is None else self.shape.budget

    def seq_ks(self, req: ExecuteModelRequest) -> list[int]:
        """k for each sequence group of the request (0 = it does not draft this step)."""
        if self.disable_by_batch_size is not None and req.running_queue_size >= self.disable_by_batch_size:
            return [0] * len(req.seq_group_metadata_list)
        return [self.k if m.first_seq_data().get_len() + self.need <= self.max_model_len else 0
                for m in req.seq_group_metadata_list]

    def limits(self, req: ExecuteModelRequest, held: set[int] | None = None) -> list[int]:
        """The most each row may draft this step (k, or a tree's budget), for the speculation policy: 0 where
        :meth:`seq_ks` says no, where a feature proposer has no rows for it, or where the request switched
        speculation off; a request's ``SamplingParams.num_speculative_tokens`` caps it. ``held``: the sequences
        with feature rows, when the caller knows them without ``req.previous_hidden_states`` (the worker builds
        that only for a speculative step)."""
        metas = req.seq_group_metadata_list
        hs = req.previous_hidden_states
        have = held if held is not None else set(hs.seq_ids) if hs is not None else set()
        needs = self.proposer.features is not None
        out = []
        for m, kk in zip(metas, self.seq_ks(req)):
            own = m.sampling_params.num_speculative_tokens if m.sampling_params is not None else None
            lim = self.size if kk > 0 and (not needs or m.get_first_seq_id() in have) else 0
            out.append(lim if own is None else min(lim, own))
        return out

    @property
    def free_drafts(self) -> bool:
        """Chains of a proposer whose drafts are free (Proposer.free_drafts): :meth:`shadow_drafts` may be asked."""
        return self.shape is None and self.proposer.free_drafts

    def draft_classes(self, execute_model_req: ExecuteModelRequest, limits: list[int]) -> list[int] | None:
        """[B] the proposer's confidence class per row (Proposer.draft_classes), 0 where ``limits`` is 0; None for a
        proposer without classes or whose drafts are not free (a tree, a model)."""
        if not self.free_drafts or type(self.proposer).draft_classes is Proposer.draft_classes:
            return None  # no classes: no batch to build every step
        rows = [b for b, lim in enumerate(limits) if lim]
        got = self.proposer.draft_classes(self._batch(execute_model_req.seq_group_metadata_list, rows, set(), None))
        if got is None:
            return None
        out = [0] * len(limits)
        for b, c in zip(rows, got):
            out[b] = c
        return out

    def shadow_drafts(self, execute_model_req: ExecuteModelRequest, rows: list[int],
                      ks: list[int]) -> list[list[int]]:
        """[len(rows)] what batch rows ``rows`` would draft (up to ``ks`` tokens each) after their pending token, for
        the speculation policy's shadow acceptance (policy.py); nothing is proposed, scored or verified."""
        metas = execute_model_req.seq_group_metadata_list
        batch = self._batch(metas, rows, set(), None)
        batch.row_k = list(ks)
        return [d[:kk] for d, kk in zip(self.proposer.draft_lists(batch), ks)]

    def get_spec_proposals(self, execute_model_req: ExecuteModelRequest,
                           seq_ids_with_bonus_token_in_last_step: set[int],
                           ks: list[int] | None = None) -> SpeculativeProposals:
        """``ks``: the policy's number per row ([B], each <= :meth:`limits`); None = the limits (static)."""
        metas = execute_model_req.seq_group_metadata_list
        hs = execute_model_req.previous_hidden_states
        needs = self.proposer.features is not None
        lim = self.limits(execute_model_req)
        if ks is None:
            ks = lim
        elif len(ks) != len(lim) or any(not 0 <= a <= b for a, b in zip(ks, lim)):
            raise ValueError(f"speculation policy chose {ks} for rows whose limits are {lim}: each must be in "
                             "[0, limit]; fix the policy's choose()")
        rows = [i for i, kk in enumerate(ks) if kk > 0]
        out = self._propose(metas, rows, seq_ids_with_bonus_token_in_last_step, hs if needs else None,
                            [ks[i] for i in rows])
        out.drafted_seq_ids = [metas[i].get_first_seq_id() for i in rows]  # their feature rows are spent
        if any(kk < self.size for kk in ks):
            cut_proposals(out, ks)
        return out

    def _propose(self, metas, rows: list[int], bonus: set[int], hs,
                 row_k: list[int] | None = None) -> SpeculativeProposals:
        B = len(metas)
        if not rows:  # verified like any step of this shape: a seeded row's draws do not depend on the others
            if self.shape is not None:
                out = SpeculativeProposals.empty(B)
                out.noise_width = self.shape.budget + 1
                return out
            return SpeculativeProposals.chain(torch.full((B, self.k), -1), None, torch.zeros(B, dtype=torch.long))
        batch = self._batch(metas, rows, bonus, hs)
        if row_k is not None and any(kk < self.size for kk in row_k):
            batch.row_k = row_k
        name = type(self.proposer).__name__
        if self.shape is not None:
            out = self.proposer.propose_tree(batch, self.shape)
            if out.token_ids.shape[0] != len(rows) or out.token_ids.shape[1] > self.shape.budget:
                raise ValueError(f"{name}.propose_tree returned {tuple(out.token_ids.shape)} nodes for {len(rows)} "
                                 f"sequences; expected [{len(rows)}, <= budget={self.shape.budget}]")
            out.noise_width = self.shape.budget + 1
            return out.scatter_rows(rows, B) if len(rows) < B else out
        return self._chain(self.proposer.propose(batch), rows, B, name)

    def _chain(self, out, rows: list[int], B: int, name: str) -> SpeculativeProposals:
        k = self.k
        got = out.token_ids[:, :k]  # [b, n]
        if got.shape[0] != len(rows):
            raise ValueError(f"{name}.propose returned {got.shape[0]} rows for {len(rows)} sequences")
        n = got.shape[1]
        # a step's few deterministic drafts: lists beat the ~10 tensor ops below (timeit, 1 thread, k = 3, with
        # SpeculativeProposals.chain: 96 vs 210 us at B = 1, 131 vs 222 us at B = 8; 2026-11-28, shared box)
        if out.probs is None and got.device.type == "cpu" and B * k <= 256:
            return self._chain_small(got, out.lens, rows, B)
        out_lens = out.lens if out.lens is not None else torch.full((len(rows),), n, dtype=torch.long)
        # positions past a proposal's length are -1 whatever the proposer left there
        valid = torch.arange(n)[None, :] < out_lens[:, None]
        got = torch.where(valid, got.cpu(), torch.full_like(got.cpu(), -1))
        idx = torch.tensor(rows)
        token_ids = torch.full((B, k), -1, dtype=torch.long)
        token_ids[idx, :n] = got
        lens = torch.zeros(B, dtype=torch.long)
        lens[idx] = out_lens.cpu().clamp(max=n)
        probs = None
        if out.probs is not None:  # q of each drafted token; zero past a proposal's length
            probs = torch.zeros(B, k, self.vocab_size)
            probs[idx, :n] = out.probs[:, :n].float().cpu() * valid[..., None]
        return SpeculativeProposals.chain(token_ids, probs, lens)

    def _chain_small(self, got: torch.Tensor,  # [b, n] int64 on the CPU, n <= k
                     lens: torch.Tensor | None,  # [b] drafts per row, None = n
                     rows: list[int], B: int) -> SpeculativeProposals:
        """_chain's result for deterministic drafts (no probs), in lists: the same tensors."""
        k, n = self.k, got.shape[1]
        got_l = got.tolist()
        lens_l = [n] * len(rows) if lens is None else lens.tolist()
        tok, out_lens = [[-1] * k for _ in range(B)], [0] * B
        for r, b in enumerate(rows):
            m = min(lens_l[r], n)
            tok[b][:max(m, 0)] = got_l[r][:max(m, 0)]  # positions past a proposal's length stay -1
            out_lens[b] = m
        return SpeculativeProposals.chain(torch.tensor(tok, dtype=torch.long), None,
                                          torch.tensor(out_lens, dtype=torch.long))

    def _batch(self, metas, rows: list[int], bonus: set[int], hs) -> ProposeBatch:
        seq_ids, seqs, params, gens = [], [], [], []
        for i in rows:
            meta = metas[i]
            seq_id, data = meta.first_seq()
            seq_ids.append(seq_id)
            seqs.append(data)
            params.append(meta.sampling_params)
            gens.append(meta.state.generator if meta.state is not None else None)
        # ``hs`` may also hold rows of batch sequences that do not draft: ProposeBatch.feature_rows reads by seq id.
        # token_ids: new lists, made when a proposer reads them (token_arrays reads ``seqs`` directly)
        return ProposeBatch(seq_ids=seq_ids, token_ids=TokenLists(seqs), k=self.k, sampling_params=params,
                            generators=gens, hidden_states=hs, seq_ids_with_bonus_token_in_last_step=frozenset(bonus),
                            sequences=seqs)


def cut_proposals(p: SpeculativeProposals, ks: list[int]) -> None:
    """Keep row b's first ``ks[b]`` nodes (a chain: its first k tokens; a tree: a prefix in creation order,
    ancestor-closed since every node's parent precedes it). The padded width is kept; ``p``'s tensors are
    replaced by cut copies (a proposer may still hold the ones it returned), the originals kept in ``p.uncut``."""
    n = p.num_nodes.tolist()
    cut = [b for b, (have, kk) in enumerate(zip(n, ks)) if have > kk]
    if not cut:
        return
    p.uncut = (p.token_ids, p.parents, p.num_nodes)  # replaced below, not written to
    p.token_ids, p.parents, p.num_nodes = p.token_ids.clone(), p.parents.clone(), p.num_nodes.clone()
    if p.draft_probs is not None:
        p.draft_probs = p.draft_probs.clone()
    for b in cut:
        kk = ks[b]
        p.token_ids[b, kk:] = -1
        p.parents[b, kk:] = -1
        p.num_nodes[b] = kk
        if p.draft_probs is not None:
            p.draft_probs[b, kk:] = 0
