"""`NativeEngine`: the llama-family model of ``llama.py`` over the slot KV cache of ``kv_cache.py``.

A forward takes a flat batch of new tokens (sequence after sequence). All projections and MLPs run
once over the flat [T, D] batch, so weights are read once per forward whatever B is; attention reads
the cache through views of the slots (``attention.py`` picks one batched call over a slot range or one
call per sequence). Not thread-safe: one forward at a time per engine.

The engine knows nothing about sampling, requests or speculation; see ``interface.py`` for the contract.
"""

from __future__ import annotations

import torch

from specdec.engine.attention import plan_attention
from specdec.engine.cpu.stack import NativeStack, stack_unsupported
from specdec.engine.cpu.threads import governor
from specdec.engine.interface import ForwardBatch, ForwardOutput, ModelEngine
from specdec.engine.kv_cache import SlotKVCache
from specdec.engine.llama import Llama, rope_tables
from specdec.engine.matmul import blas_forward, release_threads

__all__ = ["NativeEngine"]


class NativeEngine(ModelEngine):
    def __init__(
        self, model: Llama, *, num_slots: int = 8, max_model_len: int = 2048, _share: NativeStack | None = None
    ) -> None:
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
        # The CPU kernels (cpu/kernels.cpp: batch-invariant, fp32 activations and cache) unless they cannot
        # run this model; then the torch path below, which is the reference and is not batch-invariant.
        self.kernel_fallback_reason = stack_unsupported(model)
        act = torch.float32 if self.kernel_fallback_reason is None else self.dtype
        self.cache = SlotKVCache(
            cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, max_model_len, cfg.head_dim,
            dtype=act, device=self.device,
        )  # fmt: skip
        self._cos, self._sin = rope_tables(cfg, max_model_len, act, self.device)  # [M, hd] each
        self._stack = None if self.kernel_fallback_reason else NativeStack(model, self.cache, share=_share)
        self._nh, self._nkv, self._hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def truncated(self, num_layers: int, *, num_slots: int | None = None, max_model_len: int | None = None):
        """A layer-skip draft: the first ``num_layers`` layers + final norm + LM head. Shares every weight
        tensor with this engine; has its own KV cache (same num_slots/max_model_len unless given)."""
        return NativeEngine(
            self.model.truncated(num_layers),
            num_slots=self.num_slots if num_slots is None else num_slots,
            max_model_len=self.max_model_len if max_model_len is None else max_model_len,
            _share=self._stack,
        )

    def packed_weight_bytes(self) -> int:
        """Bytes of the weights the CPU kernels hold packed (0 on the torch reference path)."""
        return 0 if self._stack is None else self._stack.weight_bytes

    @property
    def batch_invariant(self) -> bool:
        """True when a row's logits and hidden states are bit-identical whatever else is in the forward
        (the CPU kernels); False on the torch reference path."""
        return self._stack is not None

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.cache.k_layers[0].dtype  # fp32 on the kernels (bf16 weights included), the weights' on torch's

    def describe(self) -> dict[str, str]:
        """What runs the forward, for summaries and logs: weight dtype, kernels (or why torch) and the CPU."""
        from specdec.engine.cpu.build import status

        kernels = f"{status()} (batch-invariant)" if self._stack is not None else \
            f"torch reference (not batch-invariant): {self.kernel_fallback_reason}"
        # the attention's arithmetic: the kernels' bf16 copies of K and V (ops.attention_copies) or fp32; torch: its dtype
        attention = str(self.dtype).removeprefix("torch.") if self._stack is None else \
            "bf16 copies of K and V" if self._stack.vh is not None else "float32"
        return {"dtype": str(self.dtype).removeprefix("torch."), "kernels": kernels, "attention": attention,
                "cpu_capability": torch.backends.cpu.get_cpu_capability()}

    # ---- slots ---------------------------------------------------------------------------------
    def allocate_slot(self) -> int:
        slot = self.cache.allocate()
        if self._stack is not None:
            self._stack.truncate(slot, 0)
        return slot

    def free_slot(self, slot: int) -> None:
        self.cache.free(slot)
        if self._stack is not None:
            self._stack.truncate(slot, 0)

    def num_free_slots(self) -> int:
        return self.cache.num_free()

    def seq_len(self, slot: int) -> int:
        return self.cache.seq_len(slot)

    def rollback(self, slot: int, length: int) -> None:
        self.cache.rollback(slot, length)
        if self._stack is not None:
            self._stack.truncate(slot, length)

    @torch.inference_mode()
    def use_kernel(self, kernel: str) -> None:
        """Route KV compaction through a ``specdec_kernels`` backend ("torch" keeps the plain index copy)."""
        if kernel == "torch":
            self.cache.compact_op = None
        else:
            from specdec_kernels import get_ops

            self.cache.compact_op = get_ops(kernel).kv_compact

    def compact(self, slot: int, src_indices: torch.Tensor, dst_start: int) -> None:
        self.cache.compact(slot, src_indices, dst_start)
        if self._stack is not None:
            self._stack.truncate(slot, dst_start)

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        self.cache.copy_prefix(src_slot, dst_slot, length)
        if self._stack is not None:
            self._stack.copy_prefix(src_slot, dst_slot, length)

    # ---- model ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(token_ids.to(self.device))

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self._stack is not None:
            return self._stack.logits(hidden_states)
        return self.model.compute_logits(hidden_states.to(self.dtype))

    @torch.inference_mode()
    def release_threads(self) -> None:
        """Between steps: leave the torch path's OpenBLAS decode mode (engine/matmul.py), if it entered one."""
        release_threads()

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        starts, T = self._check(batch)
        slots, qlens = batch.slots, batch.query_lens
        token_ids = batch.token_ids.to(self.device)
        if self._stack is not None:
            return self._forward_native(batch, token_ids, starts, T)
        blas_forward(T, self.dtype, self.device)  # one row: decode mode, else torch's threads (matmul.py)
        cos, sin = self._rope_rows(batch, starts, T)
        tm = None if batch.tree_mask is None else batch.tree_mask.to(device=self.device, dtype=torch.bool)
        attend = plan_attention(self.cache, slots, starts, qlens, tm, self._nh, self._nkv)
        hidden, aux = self.model.forward(token_ids, cos[:, None], sin[:, None], attend, batch.hidden_layers)
        for s, start, n in zip(slots, starts, qlens):
            self.cache.lens[s] = start + n
        h = hidden if batch.logits_indices is None else hidden[batch.logits_indices.to(self.device)]
        return ForwardOutput(logits=self.model.compute_logits(h), hidden_states=hidden, aux_hidden_states=aux)

    def _forward_native(self, batch: ForwardBatch, token_ids: torch.Tensor, starts: list[int], T: int) -> ForwardOutput:
        slots, qlens = batch.slots, batch.query_lens
        release_threads()  # torch's threads back from an OpenBLAS decode mode, if a torch-path engine left one
        cos, sin = self._rope_rows(batch, starts, T)
        x = self.model.embed(token_ids).float()  # [T, D], a fresh tensor the stack updates in place
        tm = None if batch.tree_mask is None else batch.tree_mask.to(dtype=torch.bool)
        gov = governor()  # one thread fewer while another process takes our cores (cpu/threads.py)
        gov.before()
        try:
            hidden, aux = self._stack.forward(x, slots, starts, qlens, cos, sin, tm, batch.hidden_layers)
            for s, start, n in zip(slots, starts, qlens):
                self.cache.lens[s] = start + n
            h = hidden if batch.logits_indices is None else hidden[batch.logits_indices]
            if not batch.logit_stats:
                return ForwardOutput(logits=self._stack.logits(h), hidden_states=hidden, aux_hidden_states=aux)
            logits, stats = self._stack.logits_stats(h)
            return ForwardOutput(logits=logits, hidden_states=hidden, aux_hidden_states=aux, logit_stats=stats)
        finally:
            gov.after()

    def _rope_rows(self, batch: ForwardBatch, starts: list[int], T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, hd] at each new token's position: ``batch.positions``, else its cache index."""
        if batch.positions is not None:
            pos = batch.positions.to(self.device)
        elif len(starts) == 1:
            return self._cos[starts[0] : starts[0] + T], self._sin[starts[0] : starts[0] + T]
        else:
            pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, batch.query_lens)]).to(self.device)
        return self._cos[pos], self._sin[pos]

    def _check(self, batch: ForwardBatch) -> tuple[list[int], int]:
        """Validate the batch before anything is written; -> (each slot's current length, T)."""
        slots, qlens = batch.slots, batch.query_lens
        if len(slots) != len(qlens) or not slots:
            raise ValueError(f"ForwardBatch: {len(slots)} slots and {len(qlens)} query_lens; need as many, >= 1")
        T = int(batch.token_ids.shape[0])
        if sum(qlens) != T:
            raise ValueError(f"ForwardBatch: sum(query_lens)={sum(qlens)} != {T} token_ids")
        if len(set(slots)) != len(slots):
            raise ValueError(f"ForwardBatch: slots {slots} repeat a slot; one sequence per slot per forward")
        tm = batch.tree_mask
        if tm is not None and (tm.dim() != 2 or tm.shape[0] != T or tm.shape[1] < max(qlens)):
            raise ValueError(f"ForwardBatch: tree_mask shape {tuple(tm.shape)}; expected [{T}, {max(qlens)}]")
        if batch.positions is not None:
            if tuple(batch.positions.shape) != (T,):
                raise ValueError(f"ForwardBatch: positions shape {tuple(batch.positions.shape)}; expected [{T}]")
            if int(batch.positions.max()) >= self.max_model_len or int(batch.positions.min()) < 0:
                raise ValueError(f"ForwardBatch: positions must lie in 0..max_model_len-1={self.max_model_len - 1}")
        for i in batch.hidden_layers:
            if not 0 <= i < self.num_layers:
                raise ValueError(f"ForwardBatch: hidden_layers has {i}; this model has layers 0..{self.num_layers - 1}")
        lens, m = self.cache.lens, self.max_model_len
        for s, n in zip(slots, qlens):
            self.cache.check_allocated(s)
            if n < 1:
                raise ValueError(f"ForwardBatch: slot {s} has query_len={n}; each must be >= 1")
            if lens[s] + n > m:
                raise ValueError(
                    f"slot {s}: {lens[s] + n} tokens exceed max_model_len={m}; raise max_model_len or shorten the prompt"
                )
        return [lens[s] for s in slots], T
