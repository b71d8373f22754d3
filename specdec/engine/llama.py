"""The llama-family model (Llama, SmolLM2, Qwen2, Mistral) as plain tensors and functions, gpt-fast style.

RMSNorm -> fused qkv projection (+ optional bias) -> RoPE -> attention -> o projection -> residual;
RMSNorm -> fused gate/up projection -> SiLU(gate) * up -> down projection -> residual.

This module knows nothing about KV caches, slots or batches: ``Llama.forward`` calls an ``attend``
callback per layer with the roped q, k and v of all new tokens, and the engine (``native.py``) decides
where K/V go and what each token sees. No ``nn.Module``: weights are tensors held in small dataclasses,
so a layer costs only its ~20 tensor ops of Python overhead.

Projection weights are stored transposed, ``[in, out]``, and applied as ``x @ W``: on these CPUs MKL
reads an ``[in, out]`` matrix ~1.5x faster for 1-3 rows than ``F.linear`` reads an ``[out, in]`` one
(424 MB of matrices, 1 row: 21 ms vs 32 ms; 2 rows: 33 ms vs 57 ms; equal from ~8 rows), and
decoding is those reads. The LM head therefore keeps its own transposed copy even when tied.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import msgspec
import torch
import torch.nn.functional as F

from specdec.engine.config import ModelConfig, rope_inv_freq

__all__ = ["Llama", "LayerWeights", "ModelConfig", "rope_tables"]

# attend(layer, q [T, nh, hd], k [T, nkv, hd], v [T, nkv, hd]) -> [T, nh * hd]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [D]
    wqkv: torch.Tensor  # [D, (nh + 2 nkv) * hd]: q, k, v projections concatenated at load, [in, out]
    bqkv: torch.Tensor | None  # [(nh + 2 nkv) * hd] or None
    wo: torch.Tensor  # [nh * hd, D]
    bo: torch.Tensor | None  # [D] or None
    ffn_norm: torch.Tensor  # [D]
    w13: torch.Tensor  # [D, 2 I]: gate then up, concatenated at load
    w2: torch.Tensor  # [I, D]
    # the same four matrices [out, in], contiguous (filled by Llama): read for 2..SMALL_M rows, see _mm
    wqkv_t: torch.Tensor | None = None
    wo_t: torch.Tensor | None = None
    w13_t: torch.Tensor | None = None
    w2_t: torch.Tensor | None = None


def rope_tables(cfg: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device | str):
    """(cos, sin_signed), each [max_len, head_dim], for ``rope(x) = x * cos + swap_halves(x) * sin_signed``.

    Computed in float32 like transformers (angles = position * inv_freq), then cast. ``sin_signed`` is
    cat(-sin, sin): swapping the two halves of x and multiplying by it equals HF's ``rotate_half(x) * sin``.
    """
    inv_freq = rope_inv_freq(cfg)  # [hd/2]
    angles = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [M, hd/2]
    cos, sin = angles.cos(), angles.sin()
    cos_t = torch.cat([cos, cos], dim=-1)
    sin_t = torch.cat([-sin, sin], dim=-1)
    return cos_t.to(device=device, dtype=dtype), sin_t.to(device=device, dtype=dtype)


# Rows at which the `[out, in]` copy is read as ``(W_t @ x.T).T``: MKL's GEMM on the `[in, out]` layout is slow
# for a few rows (30 SmolLM2 layers, cache-cold, 2 threads: `x @ W` / `W_t @ x.T` = 28.0 / 35.6 ms at 1 row,
# 46.9 / 33.2 at 2, 65.1 / 42.0 at 5, 70.4 / 45.1 at 8, 76.6 / 64.1 at 17), and a speculative step scores
# 2..~20 tokens. One row keeps `x @ W`; prefill-sized inputs keep it too.
SMALL_M = 32


def _mm(x: torch.Tensor, w: torch.Tensor, w_t: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ w [in, out] (+ bias [out]) -> [T, out], reading ``w_t`` [out, in] for 2..SMALL_M rows."""
    T = x.shape[0]
    if w_t is None or T == 1 or T > SMALL_M:
        return x @ w if bias is None else torch.addmm(bias, x, w)
    y = (w_t @ x.t()).t()
    return y if bias is None else y + bias


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # F.rms_norm computes in float32 for fp32 input; matches HF's LlamaRMSNorm to ~1e-7.
    return F.rms_norm(x, (x.shape[-1],), w, eps)


class Llama:
    """Weights of a llama-family decoder plus the forward math. Tensors may be shared between instances
    (``truncated``), so nothing here mutates them."""

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,  # [V, D]
        layers: Sequence[LayerWeights],
        norm: torch.Tensor,  # [D]
        lm_head: torch.Tensor,  # [D, V] (transposed; a copy of embed.T when tied)
    ) -> None:
        self.config = config
        self.embed_weight = embed
        self.layers = list(layers)
        self.norm = norm
        self.lm_head = lm_head
        c = config
        self._nh, self._nkv, self._hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self._eps = c.rms_norm_eps
        for L in self.layers:  # [out, in] copies for few-row inputs (see _mm); shared by truncated() copies
            if L.wqkv_t is None:
                L.wqkv_t, L.wo_t = L.wqkv.t().contiguous(), L.wo.t().contiguous()
                L.w13_t, L.w2_t = L.w13.t().contiguous(), L.w2.t().contiguous()
        self.lm_head_t = embed if c.tie_word_embeddings else lm_head.t().contiguous()  # [V, D]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    def from_hf_state_dict(
        cls,
        config: ModelConfig,
        sd: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> Llama:
        """Build from transformers' parameter names (``model.layers.{i}.self_attn.q_proj.weight``, ...)."""

        def get(name: str) -> torch.Tensor:
            if name not in sd:
                raise KeyError(f"Llama.from_hf_state_dict: checkpoint has no tensor {name!r}")
            return sd[name].to(device=device, dtype=dtype)

        def cat_t(*names: str) -> torch.Tensor:  # HF [out, in] pieces -> one [in, sum(out)]
            return torch.cat([get(n) for n in names], dim=0).t().contiguous()

        def cat(*names: str) -> torch.Tensor:
            return torch.cat([get(n) for n in names], dim=0)

        layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layers.append(
                LayerWeights(
                    attn_norm=get(p + "input_layernorm.weight"),
                    wqkv=cat_t(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                    bqkv=cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias") if config.attention_bias else None,
                    wo=cat_t(a + "o_proj.weight"),
                    bo=get(a + "o_proj.bias") if config.o_proj_bias else None,
                    ffn_norm=get(p + "post_attention_layernorm.weight"),
                    w13=cat_t(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    w2=cat_t(p + "mlp.down_proj.weight"),
                )
            )
        embed = get("model.embed_tokens.weight")
        lm_head = embed.t().contiguous() if config.tie_word_embeddings else cat_t("lm_head.weight")
        return cls(config, embed, layers, get("model.norm.weight"), lm_head)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The inverse of ``from_hf_state_dict`` (views into our tensors, some transposed; clone to mutate)."""
        c = self.config
        q, kv = self._nh * self._hd, self._nkv * self._hd
        sd = {"model.embed_tokens.weight": self.embed_weight, "model.norm.weight": self.norm}
        if not c.tie_word_embeddings:
            sd["lm_head.weight"] = self.lm_head.t()
        for i, L in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            for name, t in zip(("q_proj", "k_proj", "v_proj"), L.wqkv.split([q, kv, kv], dim=1)):
                sd[a + name + ".weight"] = t.t()
            if L.bqkv is not None:
                for name, t in zip(("q_proj", "k_proj", "v_proj"), L.bqkv.split([q, kv, kv])):
                    sd[a + name + ".bias"] = t
            sd[a + "o_proj.weight"] = L.wo.t()
            if L.bo is not None:
                sd[a + "o_proj.bias"] = L.bo
            gate, up = L.w13.chunk(2, dim=1)
            sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = gate.t(), up.t()
            sd[p + "mlp.down_proj.weight"] = L.w2.t()
            sd[p + "input_layernorm.weight"] = L.attn_norm
            sd[p + "post_attention_layernorm.weight"] = L.ffn_norm
        return sd

    def truncated(self, num_layers: int) -> Llama:
        """The first ``num_layers`` layers + the final norm + LM head, sharing every tensor with self."""
        n = self.config.num_hidden_layers
        if not 1 <= num_layers <= n:
            raise ValueError(f"Llama.truncated: num_layers={num_layers} must be in 1..{n}")
        cfg = msgspec.structs.replace(self.config, num_hidden_layers=num_layers)
        return Llama(cfg, self.embed_weight, self.layers[:num_layers], self.norm, self.lm_head)

    # ---- math ----------------------------------------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.embed_weight)  # [T, D]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _mm(hidden_states, self.lm_head, self.lm_head_t).float()  # [N, V]

    def forward(
        self,
        token_ids: torch.Tensor,  # [T]
        cos: torch.Tensor,  # [T, 1, hd] for each token's position
        sin: torch.Tensor,  # [T, 1, hd] (signed, see rope_tables)
        attend: AttendFn,
        hidden_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """-> (final-normed hidden states [T, D], outputs of ``hidden_layers`` [T, D] each)."""
        nh, nkv, hd, eps = self._nh, self._nkv, self._hd, self._eps
        half = hd // 2
        T = token_ids.shape[0]
        x = F.embedding(token_ids, self.embed_weight)  # [T, D]
        aux: dict[int, torch.Tensor] = {}
        want = set(hidden_layers)
        for i, L in enumerate(self.layers):
            h = _rms_norm(x, L.attn_norm, eps)
            qkv = _mm(h, L.wqkv, L.wqkv_t, L.bqkv).reshape(T, nh + 2 * nkv, hd)
            qk = qkv[:, : nh + nkv]  # q and k heads are roped together: [T, nh + nkv, hd]
            qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin)
            a = attend(i, qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :])  # [T, nh * hd]
            x = x + _mm(a, L.wo, L.wo_t, L.bo)
            h = _rms_norm(x, L.ffn_norm, eps)
            gu = _mm(h, L.w13, L.w13_t)  # [T, 2I]
            gate, up = gu.chunk(2, dim=-1)
            x = x + _mm(F.silu(gate) * up, L.w2, L.w2_t)
            if i in want:
                aux[i] = x
        return _rms_norm(x, self.norm, eps), [aux[i] for i in hidden_layers]


