"""The contract of a model engine: target and draft are two instances of it.

An engine owns a model and a KV cache held per *slot* (one slot = one live sequence). It runs a flat
batch of new tokens, sequence after sequence, appending each sequence's tokens at the end of its slot,
and returns logits plus hidden states. It knows nothing about sampling, requests or speculation.

Rolling back is setting a slot's length: the KV entries past it are simply overwritten later.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    """New tokens for B sequences, laid out sequence after sequence (T = sum(query_lens))."""

    token_ids: torch.Tensor  # [T] int64 new tokens
    slots: list[int]  # [B] KV slot of each sequence
    query_lens: list[int]  # [B] new tokens per sequence, each >= 1; sum == T
    # [T] int64 RoPE positions. None: a token's position is its cache index (seq_len(slot) + i).
    # Tree verification passes depth-based positions here while tokens still take consecutive cache slots.
    positions: torch.Tensor | None = None
    # [T, max(query_lens)] bool: row t (a new token) may attend to the j-th new token of its own
    # sequence. None = causal. Cached (prefix) tokens are always visible. Used for tree attention.
    tree_mask: torch.Tensor | None = None
    # [N] int64 rows of T whose logits to compute (the LM head is ~1/5 of a 135M model, so a prefill
    # asks only for its last row). None = all T rows.
    logits_indices: torch.Tensor | None = None
    # decoder-layer indices whose *outputs* (residual stream, pre final norm) to return, e.g. EAGLE-3's
    # low/mid/high layers. Empty = none.
    hidden_layers: tuple[int, ...] = field(default_factory=tuple)
    # ask for ForwardOutput.logit_stats (each logits row's argmax, logsumexp, finiteness) where the engine can take
    # them as it writes the logits; verification and plain decoding ask (the sampler's argmax, logsumexp and
    # finiteness without another pass over the rows)
    logit_stats: bool = False


@dataclass
class LogitStats:
    """Facts of each row of ``ForwardOutput.logits`` that an engine may take while it writes them (the CPU
    kernels do: reading an LM head's output back costs a cold pass over it), so that verification and logprobs
    need not read the [N, V] rows again. Where ``finite`` is False the other two are unset."""

    argmax: torch.Tensor  # [N] int64 the first index of the row's maximum (torch.argmax's)
    lse: torch.Tensor  # [N] float32 logsumexp of the row
    finite: torch.Tensor  # [N] bool every value of the row is finite
    # the logits tensor they describe and its version counter then: a wrapper that replaces or edits the logits
    # (fault injection, a processor) leaves stats that ``valid_for`` refuses
    of: torch.Tensor | None = None
    version: int = 0

    def valid_for(self, logits: torch.Tensor) -> bool:
        return self.of is logits and logits._version == self.version

    def nonfinite_rows(self) -> torch.Tensor:  # [B] bool for [B, M] stats: a row with a non-finite position
        """``~finite.all(-1)``, computed once (asked by verification and by commit in the same step)."""
        got = self.__dict__.get("_nonfinite")
        if got is None:
            f = self.finite
            if f.dim() == 2 and f.numel() <= 256 and f.device.type == "cpu":  # a step's few rows: lists, not a cold op
                got = torch.tensor([not all(row) for row in f.tolist()], dtype=torch.bool)
            else:
                got = ~f.all(-1)
            self.__dict__["_nonfinite"] = got
        return got

    def map(self, fn, of: torch.Tensor) -> LogitStats:
        """The same facts with ``fn`` applied to each tensor (a padding to [B, M]: scorers/mqa.py), describing ``of``."""
        return LogitStats(fn(self.argmax), fn(self.lse), fn(self.finite), of, of._version)


def current_stats(stats: LogitStats | None, logits: torch.Tensor) -> LogitStats | None:
    """``stats`` while they still describe ``logits`` (the same tensor, not edited since), else None."""
    return stats if stats is not None and stats.valid_for(logits) else None


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [N, V] float32: rows = logits_indices (or all T)
    hidden_states: torch.Tensor  # [T, D] last layer after the final norm: the LM head's input
    aux_hidden_states: list[torch.Tensor] = field(default_factory=list)  # one [T, D] per hidden_layers
    logit_stats: LogitStats | None = None  # of ``logits``' rows, when the engine took them (None: read the logits)

    @property
    def features(self) -> torch.Tensor:
        """[T, F] what the batch's ``hidden_layers`` asked for: their outputs concatenated (F = len * D),
        or, when it asked for none, the last layer after the final norm (F = D). The rows a draft head reads."""
        return torch.cat(self.aux_hidden_states, -1) if self.aux_hidden_states else self.hidden_states


class ModelEngine(ABC):
    """A model plus a slot KV cache. Target and draft engines are both of this type."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    max_model_len: int  # longest sequence (prompt + output) a slot holds
    num_slots: int  # how many sequences can be live at once
    device: torch.device
    dtype: torch.dtype
    # Capabilities the step asks about, declared here with their defaults (an engine overrides them):
    # why the engine is not batch-invariant (None when it is, or when it does not say)
    kernel_fallback_reason: str | None = None

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of the forward's activations, hidden states and KV cache (what a head fed by them computes in).
        Default: the weights' dtype; the CPU kernels keep fp32 whatever the weights are."""
        return self.dtype

    @property
    def batch_invariant(self) -> bool:
        """True when a row's logits and hidden states are bit-identical whatever else is in the forward (what
        makes greedy speculation lossless in every dtype). Default: True; an engine that is not says so."""
        return True

    def use_kernel(self, kernel: str) -> None:
        """Route the engine's own ops (a tree's KV compaction) through a ``specdec_kernels`` backend. Default: none."""

    def release_threads(self) -> None:
        """The step loop went idle: hand back threads held for decoding between steps. Default: none held."""

    def describe(self) -> dict[str, str]:
        """What runs the forward (dtype, kernels, CPU), for summaries and logs. Default: the dtype."""
        return {"dtype": str(self.dtype).removeprefix("torch.")}

    @abstractmethod
    def allocate_slot(self) -> int:
        """Return a free slot with length 0. Raises RuntimeError naming num_slots when none is free."""

    @abstractmethod
    def free_slot(self, slot: int) -> None:
        """Make the slot reusable. Freeing a free slot is an error."""

    @abstractmethod
    def num_free_slots(self) -> int: ...

    @abstractmethod
    def seq_len(self, slot: int) -> int:
        """Tokens whose KV the slot holds."""

    @abstractmethod
    def rollback(self, slot: int, length: int) -> None:
        """Truncate the slot to ``length`` tokens (0 <= length <= seq_len). O(1)."""

    @abstractmethod
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Append each sequence's new tokens to its slot and run the model over them."""

    @abstractmethod
    def compact(self, slot: int, src_indices: torch.Tensor, dst_start: int) -> None:
        """Copy the KV entries at cache indices ``src_indices`` ([n] int64, ascending) of ``slot``
        to ``dst_start .. dst_start+n-1`` in every layer, then set the slot length to dst_start+n.
        Used to move an accepted tree path into place."""

    @abstractmethod
    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Make ``dst_slot`` hold the first ``length`` KV entries of ``src_slot`` (0 <= length <=
        seq_len(src_slot), dst_slot allocated and != src_slot), in every layer, and set its length to
        ``length``: a forward over dst_slot then computes what it would after prefilling those tokens
        itself. Used to prefill a prompt once for the n children of a request."""

    @abstractmethod
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T, D] input embeddings (shared with EAGLE-style heads)."""

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, D] final-normed hidden states -> [N, V] float32 logits through the LM head."""
