"""Top1Proposer: the per-step edge cases of proposing, once, around any Proposer.

- each sequence's k: the configured k, 0 within k+1 tokens of max_model_len (the target must hold the k+1
  scored tokens), 0 for the whole batch when running_queue_size >= disable_by_batch_size;
- a proposer that returns nothing (or shorter proposals) yields proposal_lens 0 (or shorter);
- drafts without probabilities get one-hot q; everything is padded to [B, k].
"""

from __future__ import annotations

import torch

from specdec.interfaces import SpeculativeProposals, SpeculativeProposer
from specdec.sequence import ExecuteModelRequest, HiddenStates
from specdec.spec_decode.proposer import Proposer, ProposeBatch


class Top1Proposer(SpeculativeProposer):
    def __init__(self, proposer: Proposer, k: int, max_model_len: int, vocab_size: int,
                 disable_by_batch_size: int | None = None) -> None:
        self.proposer = proposer
        self.k = k
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.disable_by_batch_size = disable_by_batch_size
        self.hidden_states: HiddenStates | None = None  # set by the worker before each call

    def seq_ks(self, req: ExecuteModelRequest) -> list[int]:
        """k for each sequence group of the request."""
        if self.disable_by_batch_size is not None and req.running_queue_size >= self.disable_by_batch_size:
            return [0] * len(req.seq_group_metadata_list)
        ks = []
        for meta in req.seq_group_metadata_list:
            data = next(iter(meta.seq_data.values()))
            ks.append(self.k if data.get_len() + self.k + 1 <= self.max_model_len else 0)
        return ks

    def get_spec_proposals(self, execute_model_req: ExecuteModelRequest,
                           seq_ids_with_bonus_token_in_last_step: set[int]) -> SpeculativeProposals:
        metas = execute_model_req.seq_group_metadata_list
        B, k = len(metas), self.k
        ks = self.seq_ks(execute_model_req)
        token_ids = torch.full((B, k), -1, dtype=torch.long)
        probs = torch.zeros(B, k, self.vocab_size)
        lens = torch.zeros(B, dtype=torch.long)
        rows = [i for i, kk in enumerate(ks) if kk > 0]
        if rows:
            batch = self._batch(metas, rows, seq_ids_with_bonus_token_in_last_step)
            out = self.proposer.propose(batch)
            got = out.token_ids[:, :k]  # [b, k]
            n = got.shape[1]
            out_lens = out.lens if out.lens is not None else torch.full((len(rows),), n, dtype=torch.long)
            # positions past a proposal's length are -1 whatever the proposer left there
            valid = torch.arange(n)[None, :] < out_lens[:, None]
            got = torch.where(valid, got, torch.full_like(got, -1))
            idx = torch.tensor(rows)
            token_ids[idx, :n] = got
            lens[idx] = out_lens.clamp(max=n)
            if out.probs is not None:
                probs[idx, :n] = out.probs[:, :n].float() * valid[..., None]
            else:  # deterministic drafts: q is one-hot at the drafted token
                sub = torch.zeros(len(rows), n, self.vocab_size)
                sub.scatter_(2, got.clamp(min=0)[..., None], valid[..., None].float())
                probs[idx, :n] = sub
        return SpeculativeProposals(token_ids, probs, lens, no_proposals=bool((lens == 0).all()))

    def _batch(self, metas, rows: list[int], bonus: set[int]) -> ProposeBatch:
        seq_ids, toks, params, gens = [], [], [], []
        for i in rows:
            meta = metas[i]
            seq_id, data = next(iter(meta.seq_data.items()))
            seq_ids.append(seq_id)
            toks.append(list(data.get_token_ids()))
            params.append(meta.sampling_params)
            gens.append(meta.state.generator if meta.state is not None else None)
        hs = None
        if self.proposer.needs_hidden_states and self.hidden_states is not None:
            hs = self.hidden_states
        return ProposeBatch(seq_ids=seq_ids, token_ids=toks, k=self.k, sampling_params=params, generators=gens,
                            hidden_states=hs, seq_ids_with_bonus_token_in_last_step=frozenset(bonus))
