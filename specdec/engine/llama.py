"""The llama-family model (Llama, SmolLM2, Qwen2, Mistral) as plain tensors and functions, gpt-fast style.

RMSNorm -> fused qkv projection (+ optional bias) -> RoPE -> attention -> o projection -> residual;
RMSNorm -> fused gate/up projection -> SiLU(gate) * up -> down projection -> residual.

This module knows nothing about KV caches, slots or batches: ``Llama.forward`` calls an ``attend``
callback per layer with the roped q, k and v of all new tokens, and the engine (``native.py``) decides
where K/V go and what each token sees. No ``nn.Module``: weights are tensors held in small dataclasses,
so a layer costs only its ~20 tensor ops of Python overhead.

Each projection is a ``matmul.Weight`` (the matrix as ``[in, out]`` and ``[out, in]``), multiplied by
``matmul.mm``, which picks the library per row count: decoding is those reads, see ``matmul.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import msgspec
import torch
import torch.nn.functional as F

from specdec.engine.config import ModelConfig, rope_inv_freq
from specdec.engine.matmul import Weight, mm

__all__ = ["Llama", "LayerWeights", "ModelConfig", "rope_tables"]

# attend(layer, q [T, nh, hd], k [T, nkv, hd], v [T, nkv, hd]) -> [T, nh * hd]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [D]
    wqkv: Weight  # [D, (nh + 2 nkv) * hd] (+ bias): q, k, v projections concatenated at load
    wo: Weight  # [nh * hd, D] (+ bias for o_proj_bias models)
    ffn_norm: torch.Tensor  # [D]
    w13: Weight  # [D, 2 I]: gate then up, concatenated at load
    w2: Weight  # [I, D]


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
        lm_head: Weight,  # [D, V]; its [V, D] layout is ``embed`` itself when tied
    ) -> None:
        self.config = config
        # [V, D] embedding; None once only the packed LM head of a tied model holds it (keep_packed)
        self._embed: torch.Tensor | None = embed
        self._embed_packed = None  # that packed LM head (cpu.ops.NativeWeight), which embed() then reads rows of
        self._dtype, self._device = embed.dtype, embed.device
        self.layers = list(layers)
        self.norm = norm
        self.lm_head = lm_head
        c = config
        self._nh, self._nkv, self._hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self._eps = c.rms_norm_eps

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def embed_weight(self) -> torch.Tensor:
        """[V, D]: the embedding (unpacked on demand from the LM head's packed copy when tied and packed)."""
        return self._embed if self._embed is not None else self._embed_packed.w

    def keep_packed(self, projections: Sequence[Sequence], lm_head) -> None:
        """After the CPU kernels packed this model (``projections``: per layer the packed wqkv, wo, w13, w2; ``lm_head``:
        the packed LM head), keep only those copies; a tied embedding is read out of the packed LM head. The torch
        reference path still works: it unpacks each weight when it reads it. One copy of the weights in memory, not
        three (#43 item 5)."""
        for L, packed in zip(self.layers, projections):
            for wt, nw in zip((L.wqkv, L.wo, L.w13, L.w2), packed):
                wt.keep_packed(nw)
        self.lm_head.keep_packed(lm_head)
        if self.config.tie_word_embeddings:
            self._embed, self._embed_packed = None, lm_head

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
            # a copy, never a view: a view into a safetensors file's mapping keeps the whole file resident
            return sd[name].to(device=device, dtype=dtype, copy=True)

        def proj(*names: str, bias: tuple[str, ...] = ()) -> Weight:  # HF [out, in] pieces -> one Weight
            w_t = torch.cat([get(n) for n in names], dim=0)  # [sum(out), in]
            b = torch.cat([get(n) for n in bias], dim=0) if bias else None
            return Weight.from_in_out(w_t.t().contiguous(), b, w_t=w_t.contiguous())

        layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv_bias = tuple(a + n + "_proj.bias" for n in "qkv") if config.attention_bias else ()
            layers.append(
                LayerWeights(
                    attn_norm=get(p + "input_layernorm.weight"),
                    wqkv=proj(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight", bias=qkv_bias),
                    wo=proj(a + "o_proj.weight", bias=(a + "o_proj.bias",) if config.o_proj_bias else ()),
                    ffn_norm=get(p + "post_attention_layernorm.weight"),
                    w13=proj(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    w2=proj(p + "mlp.down_proj.weight"),
                )
            )
        embed = get("model.embed_tokens.weight").contiguous()
        if config.tie_word_embeddings:  # the [V, D] layout is the embedding itself
            lm_head = Weight.from_in_out(embed.t().contiguous(), w_t=embed)
        else:
            lm_head = proj("lm_head.weight")
        return cls(config, embed, layers, get("model.norm.weight"), lm_head)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The inverse of ``from_hf_state_dict`` (views into our tensors, some transposed; clone to mutate)."""
        c = self.config
        q, kv = self._nh * self._hd, self._nkv * self._hd
        sd = {"model.embed_tokens.weight": self.embed_weight, "model.norm.weight": self.norm}
        if not c.tie_word_embeddings:
            sd["lm_head.weight"] = self.lm_head.w_t
        for i, L in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            for name, t in zip(("q_proj", "k_proj", "v_proj"), L.wqkv.w_t.split([q, kv, kv], dim=0)):
                sd[a + name + ".weight"] = t
            if L.wqkv.bias is not None:
                for name, t in zip(("q_proj", "k_proj", "v_proj"), L.wqkv.bias.split([q, kv, kv])):
                    sd[a + name + ".bias"] = t
            sd[a + "o_proj.weight"] = L.wo.w_t
            if L.wo.bias is not None:
                sd[a + "o_proj.bias"] = L.wo.bias
            gate, up = L.w13.w_t.chunk(2, dim=0)
            sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = gate, up
            sd[p + "mlp.down_proj.weight"] = L.w2.w_t
            sd[p + "input_layernorm.weight"] = L.attn_norm
            sd[p + "post_attention_layernorm.weight"] = L.ffn_norm
        return sd

    def truncated(self, num_layers: int) -> Llama:
        """The first ``num_layers`` layers + the final norm + LM head, sharing every tensor with self."""
        n = self.config.num_hidden_layers
        if not 1 <= num_layers <= n:
            raise ValueError(f"Llama.truncated: num_layers={num_layers} must be in 1..{n}")
        cfg = msgspec.structs.replace(self.config, num_hidden_layers=num_layers)
        embed = self._embed if self._embed is not None else torch.empty(0, dtype=self.dtype, device=self.device)
        t = Llama(cfg, embed, self.layers[:num_layers], self.norm, self.lm_head)
        t._embed, t._embed_packed = self._embed, self._embed_packed  # shared, not unpacked
        return t

    # ---- math ----------------------------------------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self._embed is None:  # rows of the packed tied LM head
            return self._embed_packed.rows(token_ids.reshape(-1)).reshape(*token_ids.shape, -1)
        return F.embedding(token_ids, self._embed)  # [T, D]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return mm(hidden_states, self.lm_head).float()  # [N, V]

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
        x = self.embed(token_ids)  # [T, D]
        aux: dict[int, torch.Tensor] = {}
        want = set(hidden_layers)
        for i, L in enumerate(self.layers):
            h = _rms_norm(x, L.attn_norm, eps)
            qkv = mm(h, L.wqkv).reshape(T, nh + 2 * nkv, hd)
            qk = qkv[:, : nh + nkv]  # q and k heads are roped together: [T, nh + nkv, hd]
            qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin)
            a = attend(i, qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :])  # [T, nh * hd]
            x = x + mm(a, L.wo)
            h = _rms_norm(x, L.ffn_norm, eps)
            gu = mm(h, L.w13)  # [T, 2I]
            gate, up = gu.chunk(2, dim=-1)
            x = x + mm(F.silu(gate) * up, L.w2)
            if i in want:
                aux[i] = x
        return _rms_norm(x, self.norm, eps), [aux[i] for i in hidden_layers]


