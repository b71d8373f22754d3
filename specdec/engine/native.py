"""`NativeEngine`: the llama-family model of ``llama.py`` over the slot KV cache of ``kv_cache.py``.

A forward takes a flat batch of new tokens (sequence after sequence). All projections and MLPs run
once over the flat [T, D] batch, so weights are read once per forward whatever B is; attention runs
per sequence on views of that sequence's slot (no gather, no padding, no mask for a single decode
token). Sequences whose new tokens see each other causally from an empty slot use SDPA's ``is_causal``;
otherwise one boolean mask per sequence is built once per forward and reused by every layer.

The engine knows nothing about sampling, requests or speculation; see ``interface.py`` for the contract.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.engine.interface import ForwardBatch, ForwardOutput, ModelEngine
from specdec.engine.kv_cache import SlotKVCache
from specdec.engine.llama import Llama, rope_tables

__all__ = ["NativeEngine"]


class NativeEngine(ModelEngine):
    def __init__(self, model: Llama, *, num_slots: int = 8, max_model_len: int = 2048) -> None:
        cfg = model.config
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"NativeEngine: max_model_len={max_model_len} exceeds the model's "
                f"max_position_embeddings={cfg.max_position_embeddings}; lower max_model_len"
            )
        if cfg.sliding_window is not None and max_model_len > cfg.sliding_window:
            # With every sequence inside the window, full attention is exactly sliding-window attention.
            raise ValueError(
                f"NativeEngine: sliding_window={cfg.sliding_window} < max_model_len={max_model_len}; the native "
                f"engine implements full attention only, so set max_model_len <= {cfg.sliding_window}"
            )
        self.model = model
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.hidden_size
        self.num_layers = cfg.num_hidden_layers
        self.max_model_len = max_model_len
        self.num_slots = num_slots
        self.device = model.device
        self.dtype = model.dtype
        self.cache = SlotKVCache(
            cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, max_model_len, cfg.head_dim,
            dtype=self.dtype, device=self.device,
        )  # fmt: skip
        self._cos, self._sin = rope_tables(cfg, max_model_len, self.dtype, self.device)  # [M, hd] each
        self._nh, self._nkv, self._hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self._gqa = self._nh != self._nkv

    def truncated(self, num_layers: int, *, num_slots: int | None = None, max_model_len: int | None = None):
        """A layer-skip draft: the first ``num_layers`` layers + final norm + LM head. Shares every weight
        tensor with this engine; has its own KV cache (same num_slots/max_model_len unless given)."""
        return NativeEngine(
            self.model.truncated(num_layers),
            num_slots=self.num_slots if num_slots is None else num_slots,
            max_model_len=self.max_model_len if max_model_len is None else max_model_len,
        )

    # ---- slots ---------------------------------------------------------------------------------
    def allocate_slot(self) -> int:
        return self.cache.allocate()

    def free_slot(self, slot: int) -> None:
        self.cache.free(slot)

    def num_free_slots(self) -> int:
        return self.cache.num_free()

    def seq_len(self, slot: int) -> int:
        return self.cache.seq_len(slot)

    def rollback(self, slot: int, length: int) -> None:
        self.cache.rollback(slot, length)

    @torch.inference_mode()
    def compact(self, slot: int, src_indices: torch.Tensor, dst_start: int) -> None:
        self.cache.compact(slot, src_indices, dst_start)

    # ---- model ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(token_ids.to(self.device))

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_states)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        seqs, T = self._plan(batch)
        token_ids = batch.token_ids.to(self.device)
        if batch.positions is not None:
            pos = batch.positions.to(self.device)
            cos, sin = self._cos[pos], self._sin[pos]
        elif len(seqs) == 1:
            start = seqs[0][1]
            cos, sin = self._cos[start : start + T], self._sin[start : start + T]
        else:
            pos = torch.cat([torch.arange(s[1], s[1] + s[3] - s[2]) for s in seqs]).to(self.device)
            cos, sin = self._cos[pos], self._sin[pos]
        attend = self._attend_one if len(seqs) == 1 else self._attend_many
        self._seqs = seqs
        hidden, aux = self.model.forward(token_ids, cos[:, None], sin[:, None], attend, batch.hidden_layers)
        for slot, start, t0, t1, _, _ in seqs:
            self.cache.lens[slot] = start + t1 - t0
        h = hidden if batch.logits_indices is None else hidden[batch.logits_indices.to(self.device)]
        return ForwardOutput(logits=self.model.compute_logits(h), hidden_states=hidden, aux_hidden_states=aux)

    def _plan(self, batch: ForwardBatch):
        """Validate the batch; per sequence (slot, start, t0, t1, attn_mask, is_causal)."""
        slots, qlens = batch.slots, batch.query_lens
        if len(slots) != len(qlens):
            raise ValueError(f"ForwardBatch: {len(slots)} slots but {len(qlens)} query_lens")
        T = int(batch.token_ids.shape[0])
        if sum(qlens) != T:
            raise ValueError(f"ForwardBatch: sum(query_lens)={sum(qlens)} != {T} token_ids")
        if len(set(slots)) != len(slots):
            raise ValueError(f"ForwardBatch: slots {slots} repeat a slot; one sequence per slot per forward")
        tm = batch.tree_mask
        if tm is not None and (tm.dim() != 2 or tm.shape[0] != T or tm.shape[1] < max(qlens)):
            raise ValueError(f"ForwardBatch: tree_mask shape {tuple(tm.shape)}; expected [{T}, {max(qlens)}]")
        if batch.positions is not None and tuple(batch.positions.shape) != (T,):
            raise ValueError(f"ForwardBatch: positions shape {tuple(batch.positions.shape)}; expected [{T}]")
        for i in batch.hidden_layers:
            if not 0 <= i < self.num_layers:
                raise ValueError(f"ForwardBatch: hidden_layers has {i}; this model has layers 0..{self.num_layers - 1}")
        lens, m = self.cache.lens, self.max_model_len
        seqs, t0 = [], 0
        for s, n in zip(slots, qlens):
            self.cache.check_allocated(s)
            if n < 1:
                raise ValueError(f"ForwardBatch: slot {s} has query_len={n}; each must be >= 1")
            start = lens[s]
            if start + n > m:
                raise ValueError(f"slot {s}: {start + n} tokens exceed max_model_len={m}; raise max_model_len or shorten the prompt")
            mask, causal = None, False
            if tm is not None:
                mask = torch.ones(n, start + n, dtype=torch.bool, device=self.device)
                mask[:, start:] = tm[t0 : t0 + n, :n]
            elif n > 1 and start == 0:
                causal = True
            elif n > 1:  # causal among new tokens, after a cached prefix every new token sees
                mask = torch.ones(n, start + n, dtype=torch.bool, device=self.device).tril_(start)
            seqs.append((s, start, t0, t0 + n, mask, causal))
            t0 += n
        if batch.positions is not None and T and int(batch.positions.max()) >= m:
            raise ValueError(f"ForwardBatch: a position {int(batch.positions.max())} >= max_model_len={m}")
        return seqs, T

    def _attend_one(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        slot, start, t0, t1, mask, causal = self._seqs[0]
        return self._attend_seq(layer, q, k, v, slot, start, mask, causal)

    def _attend_many(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs = [
            self._attend_seq(layer, q[t0:t1], k[t0:t1], v[t0:t1], slot, start, mask, causal)
            for slot, start, t0, t1, mask, causal in self._seqs
        ]
        return torch.cat(outs)

    def _attend_seq(self, layer, q, k, v, slot, start, mask, causal) -> torch.Tensor:
        # q [n, nh, hd]; k, v [n, nkv, hd] -> [n, nh * hd]
        n = q.shape[0]
        end = start + n
        kc = self.cache.k_layers[layer][slot]  # [nkv, M, hd]
        vc = self.cache.v_layers[layer][slot]
        kc[:, start:end] = k.transpose(0, 1)
        vc[:, start:end] = v.transpose(0, 1)
        nh, hd = self._nh, self._hd
        # 4-D with enable_gqa picks SDPA's fused CPU kernel (3-D inputs fall back to the math path,
        # ~2x slower per call at decode). The KV views are strided; no copy is made.
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], kc[None, :, :end], vc[None, :, :end],
            attn_mask=mask, is_causal=causal, enable_gqa=self._gqa,
        )  # fmt: skip  # [1, nh, n, hd]
        return o[0].transpose(0, 1).reshape(n, nh * hd)
