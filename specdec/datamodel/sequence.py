"""The request/sequence data model, after the seed ``vllm.sequence`` (vLLM v0).

Token ids, statuses, per-request metrics and the engine-side ``Sequence``/``SequenceGroup``. The data
model is layered, each module importing only the ones above it:

- this module: ``Logprob``, ``SequenceStatus``, ``SequenceStage``, ``RequestMetrics``,
  ``SequenceData(Delta)``, ``Sequence``, ``SequenceGroupState``, ``SequenceGroup``;
- :mod:`specdec.datamodel.metadata`: the per-step ``SequenceGroupMetadata(Delta)``;
- :mod:`specdec.datamodel.hidden_states`: the structs that carry tensors (``HiddenStates``, ``ExecuteModelRequest``);
- :mod:`specdec.vllm_compat`: the seed-compatibility surface the step loop does not use (model outputs,
  ``IntermediateTensors``, the msgpack/JSON helpers, and the seed's behaviour the step never calls:
  deltas, computed-token progress, multi-step counters, ``array_full``), and every name of the data
  model in one namespace, as ``vllm.sequence`` has them.

Only what the step calls is a method here; the structs keep all the seed's fields. The progress fields
(``num_computed_tokens``, ``stage``, the pending delta) are written only by :mod:`specdec.vllm_compat`'s
functions; the step checkpoints and restores them with the rest.

Serialisation: token ids are kept in ``array('l')`` (compact, O(1) append); msgspec has no native
``array`` support, so :mod:`specdec.vllm_compat`'s helpers pass hooks for it.

This module knows nothing about models, tensors, KV caches or how tokens are chosen.
"""

from __future__ import annotations

import enum
from array import array
from typing import Any, Iterable

import msgspec

from specdec.datamodel.sampling_params import SamplingParams

VLLM_INVALID_TOKEN_ID = -1  # fills the verifier's output after the first rejected position
VLLM_TOKEN_ID_ARRAY_TYPE = "l"  # signed long: 8 bytes on 64-bit Linux, holds any vocabulary id


def _strip_underscore(name: str) -> str:
    # Private fields (`_stage`) are written on the wire under their public name (`stage`).
    return name.lstrip("_")


class Logprob(msgspec.Struct, array_like=True, omit_defaults=True):
    """Log-probability of one token, for OpenAI-style ``logprobs`` outputs."""

    logprob: float  # log p(token | prefix) under the target
    rank: int | None = None  # 1-based vocabulary rank of the token (1 = argmax)
    decoded_token: str | None = None  # detokenised text of the token, once known


PromptLogprobs = list[dict[int, Logprob] | None]  # one {token_id: Logprob} per prompt token
SampleLogprobs = list[dict[int, Logprob]]  # one {token_id: Logprob} per output token


class SequenceStatus(enum.IntEnum):
    """Lifecycle of a sequence. Everything after SWAPPED is a finished status."""

    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3  # EOS or a stop token was emitted
    FINISHED_LENGTH_CAPPED = 4  # max_tokens or max_model_len reached
    FINISHED_ABORTED = 5  # the user cancelled the request
    FINISHED_IGNORED = 6  # the prompt alone is longer than the model can take
    FINISHED_ERROR = 7  # specdec: the logits of the request were NaN/inf; nothing safe to sample

    @staticmethod
    def is_finished(status: SequenceStatus) -> bool:
        return status > SequenceStatus.SWAPPED

    @staticmethod
    def get_finished_reason(status: SequenceStatus) -> str | None:
        """OpenAI ``finish_reason`` of a finished status, None while unfinished."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    # An ignored prompt is too long for the model: OpenAI calls that "length" too.
    SequenceStatus.FINISHED_IGNORED: "length",
    SequenceStatus.FINISHED_ERROR: "error",
}


class SequenceStage(enum.Enum):
    PREFILL = 0  # some prompt (or recomputed output) tokens have not run through the model yet
    DECODE = 1  # every token has been computed; one (or k+1) new tokens per step


class RequestMetrics(msgspec.Struct, omit_defaults=True):
    """Timings (seconds, ``time.time()`` clock) and acceptance counters of one request."""

    arrival_time: float  # when the request reached the engine
    last_token_time: float  # when its latest token was emitted (arrival_time before any)
    first_scheduled_time: float | None = None  # first time the scheduler ran it
    first_token_time: float | None = None  # when its first output token was emitted
    time_in_queue: float | None = None  # first_scheduled_time - arrival_time
    finished_time: float | None = None  # when it finished
    scheduler_time: float | None = None  # time spent in the scheduler on its behalf
    model_forward_time: float | None = None  # time in model forwards while in the batch
    model_execute_time: float | None = None  # forward + sampling + syncs while in the batch
    # One counter per position 0..k (see the specdec docstring): [10, 8, 4, 2] = 10 steps, 8 accepted
    # the 1st draft, 4 the 2nd, 2 the 3rd. None when the engine does not speculate.
    spec_token_acceptance_counts: list[int] | None = None
    # Draft tokens (tree nodes) proposed for it over its decode steps, and the speculation policy's choice per
    # decode step as a histogram: chosen_k_counts[k] = steps at k (a tree: node budget; 0 = not speculated).
    num_draft_tokens: int = 0
    chosen_k_counts: list[int] | None = None


class SequenceDataDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What changed in a SequenceData since the last step (sent instead of the whole thing)."""

    new_output_token_ids: list[int]  # tokens appended since the last delta
    new_cumulative_logprob: float  # overwrites cumulative_logprob
    new_num_computed_tokens: int  # overwrites num_computed_tokens
    new_stage: SequenceStage  # overwrites stage


class SequenceData(msgspec.Struct, omit_defaults=True, rename=_strip_underscore):
    """Token ids and progress of one sequence. Build it with :meth:`from_seqs`.

    Lists passed for the token-id fields are converted to ``array('l')`` in ``__post_init__``.
    """

    _prompt_token_ids: array  # [prompt_len] the prompt, never changes
    _output_token_ids: array = msgspec.field(default_factory=lambda: array(VLLM_TOKEN_ID_ARRAY_TYPE))
    _cumulative_logprob: float = 0.0  # sum of the logprobs of the output tokens
    _num_computed_tokens: int = 0  # tokens (prompt + output) already run through the model
    _stage: SequenceStage = SequenceStage.PREFILL
    _new_appended_tokens: list[int] = msgspec.field(default_factory=list)  # since the last delta

    def __post_init__(self) -> None:
        for name in ("_prompt_token_ids", "_output_token_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, array):
                setattr(self, name, array(VLLM_TOKEN_ID_ARRAY_TYPE, ids))
            elif ids.typecode != VLLM_TOKEN_ID_ARRAY_TYPE:
                raise TypeError(f"SequenceData.{name[1:]} has typecode {ids.typecode!r}; "
                                f"use array({VLLM_TOKEN_ID_ARRAY_TYPE!r}, ...) or from_seqs().")

    @staticmethod
    def from_seqs(prompt_token_ids: Iterable[int],
                  output_token_ids: Iterable[int] | None = None) -> SequenceData:
        return SequenceData(array(VLLM_TOKEN_ID_ARRAY_TYPE, prompt_token_ids),
                            array(VLLM_TOKEN_ID_ARRAY_TYPE, output_token_ids or ()))

    # -- views ---------------------------------------------------------------------------------------
    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return tuple(self._prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """A copy: appending to it does not change the sequence."""
        return self._output_token_ids.tolist()

    @property
    def prompt_token_ids_array(self) -> array:
        return self._prompt_token_ids  # the live array, not a copy

    @property
    def output_token_ids_array(self) -> array:
        return self._output_token_ids  # the live array, not a copy

    @property
    def cumulative_logprob(self) -> float:
        return self._cumulative_logprob

    @property
    def stage(self) -> SequenceStage:
        return self._stage

    def get_prompt_token_ids(self) -> tuple[int, ...]:
        return self.prompt_token_ids

    def get_output_token_ids(self) -> list[int]:
        return self.output_token_ids

    def get_token_ids(self) -> list[int]:
        """Prompt then output, as a new list."""
        return self._prompt_token_ids.tolist() + self._output_token_ids.tolist()

    def get_token_array(self) -> "np.ndarray":
        """Prompt then output as a new int64 numpy array [len] (no Python list on the way: a proposer's lookup)."""
        import numpy as np

        # frombuffer views of the live arrays, dropped before returning (an array exporting its buffer cannot grow)
        return np.concatenate((np.frombuffer(self._prompt_token_ids, dtype=np.dtype(VLLM_TOKEN_ID_ARRAY_TYPE)),
                               np.frombuffer(self._output_token_ids, dtype=np.dtype(VLLM_TOKEN_ID_ARRAY_TYPE)))
                              ).astype(np.int64, copy=False)

    def get_last_token_id(self) -> int:
        return self._output_token_ids[-1] if self._output_token_ids else self._prompt_token_ids[-1]

    def get_len(self) -> int:
        return len(self._prompt_token_ids) + len(self._output_token_ids)

    def get_prompt_len(self) -> int:
        return len(self._prompt_token_ids)

    def get_output_len(self) -> int:
        return len(self._output_token_ids)

    # -- progress ------------------------------------------------------------------------------------
    def append_token_id(self, token_id: int, logprob: float) -> None:
        self._output_token_ids.append(token_id)
        self._new_appended_tokens.append(token_id)
        self._cumulative_logprob += logprob

    def get_num_computed_tokens(self) -> int:
        return self._num_computed_tokens

    def checkpoint(self) -> tuple:
        """What :meth:`restore` needs to undo the appends and progress made after this call."""
        return (len(self._output_token_ids), self._cumulative_logprob, self._num_computed_tokens, self._stage,
                len(self._new_appended_tokens))

    def restore(self, checkpoint: tuple) -> None:
        """Back to ``checkpoint`` (a failed step): drop the tokens appended since, restore the progress."""
        n_out, self._cumulative_logprob, self._num_computed_tokens, self._stage, n_new = checkpoint
        del self._output_token_ids[n_out:]
        del self._new_appended_tokens[n_new:]

class Sequence:
    """One generated continuation of a prompt: its tokens, status, logprobs and text."""

    def __init__(self, seq_id: int, prompt_token_ids: Iterable[int], eos_token_id: int | None = None,
                 prompt: str | None = None) -> None:
        self.seq_id = seq_id  # unique across the engine; keys KV slots and HiddenStates rows
        self.prompt = prompt  # the prompt text, when the request came as text
        self.eos_token_id = eos_token_id  # the tokenizer's EOS (None: never stop on EOS)
        self.data = SequenceData.from_seqs(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.output_logprobs: SampleLogprobs = []  # one {token_id: Logprob} per output token
        self.output_text = ""  # detokenised output so far
        self.stop_reason: int | str | None = None  # the stop token id / string that finished it

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.data.prompt_token_ids

    def append_token_id(self, token_id: int, logprobs: dict[int, Logprob]) -> None:
        """Append one emitted token with its logprobs (it, plus any top-n alternatives).

        An empty dict means "logprobs not computed": the token counts 0.0 towards the cumulative
        logprob. A non-empty dict without the token is a bug upstream and raises.
        """
        if logprobs and token_id not in logprobs:
            raise ValueError(f"Sequence {self.seq_id}: token {token_id} is missing from its logprobs "
                             f"(keys {sorted(logprobs)}); include the emitted token's Logprob.")
        self.output_logprobs.append(logprobs)
        self.data.append_token_id(token_id, logprobs[token_id].logprob if logprobs else 0.0)

    def checkpoint(self) -> tuple:
        """What :meth:`restore` needs to undo a step: tokens, logprobs, status, stop reason, text."""
        return self.data.checkpoint(), len(self.output_logprobs), self.status, self.stop_reason, self.output_text

    def restore(self, checkpoint: tuple) -> None:
        data, n_lps, self.status, self.stop_reason, self.output_text = checkpoint
        self.data.restore(data)
        del self.output_logprobs[n_lps:]

    def get_len(self) -> int:
        return self.data.get_len()

    def get_prompt_len(self) -> int:
        return self.data.get_prompt_len()

    def get_output_len(self) -> int:
        return self.data.get_output_len()

    def get_token_ids(self) -> list[int]:
        return self.data.get_token_ids()

    def get_prompt_token_ids(self) -> tuple[int, ...]:
        return self.data.get_prompt_token_ids()

    def get_output_token_ids(self) -> list[int]:
        return self.data.get_output_token_ids()

    def get_last_token_id(self) -> int:
        return self.data.get_last_token_id()

    def get_cumulative_logprob(self) -> float:
        return self.data.cumulative_logprob

    def is_finished(self) -> bool:
        return SequenceStatus.is_finished(self.status)

    def is_prefill(self) -> bool:
        return self.data.stage == SequenceStage.PREFILL

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, status={self.status.name}, "
                f"prompt_len={self.get_prompt_len()}, output_len={self.get_output_len()})")


class SequenceGroupState(msgspec.Struct, omit_defaults=True):
    """Mutable per-request state that rides along with the metadata."""

    num_steps: int = 1  # forward steps per scheduler call (multi-step decoding)
    current_step: int = 0  # steps done of num_steps
    # The request's own torch.Generator (SamplingParams.seed): its draws do not depend on the rest of
    # the batch. Not serialisable: it must be None on the wire.
    generator: Any = None
    # The request's GrammarState (specdec/sampling/guided.py) when it asks for guided_decoding; part of each
    # step's transaction (specdec/core/transaction.py). Not serialisable either.
    grammar: Any = None


class SequenceGroup:
    """The sequences generated from one request's prompt (specdec supports one per group)."""

    def __init__(self, request_id: str, seqs: list[Sequence], arrival_time: float,
                 sampling_params: SamplingParams | None = None, draft_size: int = 1) -> None:
        """``draft_size`` = k + 1: one acceptance counter per position 0..k (1 = no speculation)."""
        if not seqs:
            raise ValueError(f"SequenceGroup {request_id!r} needs at least one Sequence, got none.")
        if draft_size < 1:
            raise ValueError(f"SequenceGroup {request_id!r}: draft_size={draft_size} must be >= 1 "
                             "(num_speculative_tokens + 1).")
        self.request_id = request_id
        self.seqs = seqs
        self.seqs_dict = {seq.seq_id: seq for seq in seqs}
        self.sampling_params = sampling_params
        self.metrics = RequestMetrics(arrival_time=arrival_time, last_token_time=arrival_time,
                                      spec_token_acceptance_counts=[0] * draft_size)
        self.state = SequenceGroupState()
        self.prompt_logprobs: PromptLogprobs | None = None
        self.last_token_latency = 0.0  # seconds between the last two emissions (vllm_compat.set_last_token_time)

    @property
    def first_seq(self) -> Sequence:
        return self.seqs[0]

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.first_seq.prompt_token_ids  # every sequence of a group shares the prompt

    def maybe_set_first_token_time(self, time: float) -> None:
        # Only on the very first token: after a preemption the pause counts as inter-token latency.
        if self.metrics.first_token_time is None and self.first_seq.get_output_len() >= 1:
            self.metrics.first_token_time = time

    def maybe_set_first_scheduled_time(self, time: float) -> None:
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = time
            self.metrics.time_in_queue = time - self.metrics.arrival_time

    def set_finished_time(self, time: float | None) -> None:
        self.metrics.finished_time = time

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return self.seqs
        return [seq for seq in self.seqs if seq.status == status]

    def get_unfinished_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs if not seq.is_finished()]

    def get_finished_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs if seq.is_finished()]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        return len(self.get_seqs(status))

    def find(self, seq_id: int) -> Sequence:
        if seq_id not in self.seqs_dict:
            raise ValueError(f"SequenceGroup {self.request_id!r} has no sequence {seq_id} "
                             f"(it has {list(self.seqs_dict)}).")
        return self.seqs_dict[seq_id]

    def is_finished(self) -> bool:
        return all(seq.is_finished() for seq in self.seqs)

    def is_prefill(self) -> bool:
        return self.first_seq.is_prefill()  # every sequence of a group is in the same stage

    def __repr__(self) -> str:
        return (f"SequenceGroup(request_id={self.request_id!r}, "
                f"sampling_params={self.sampling_params}, num_seqs={len(self.seqs)})")
