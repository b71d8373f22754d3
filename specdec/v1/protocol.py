"""The engine-core wire format (after vLLM v1 ``vllm/v1/engine/__init__.py``), as msgspec structs.

Front end -> core: one ZeroMQ multipart message ``[EngineCoreRequestType tag (1 byte), msgpack payload]``:
- ADD: an :class:`EngineCoreRequest`;
- ABORT: a list of request ids;
- UTILITY: a :class:`UtilityRequest` (stats, reset, profile, ...: any ``EngineCore`` method named in
  ``UTILITY_METHODS``).
Core -> front end: one msgpack :class:`EngineCoreOutputs` per step (or per utility answer).

Hot structs are ``array_like`` (encoded as msgpack arrays: no field names on the wire) and ``gc=False``
(they hold no reference cycles, so the cyclic GC never scans them); ``experiments/bench/protocol.py``
measures what that buys. Nothing here holds a tensor, and nothing here knows about models or text.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from specdec.datamodel.sampling_params import SamplingParams
from specdec.datamodel.sequence import Logprob, RequestMetrics


class EngineCoreRequestType(bytes, enum.Enum):
    """The first frame of a front-end message: one byte, so the core dispatches before decoding."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"


class FinishReason(enum.IntEnum):
    """Why a request finished; an int on the wire, the OpenAI string through ``str()``."""

    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens, max_model_len, or a prompt with no room to generate
    ABORT = 2  # aborted by the client (or a stop string matched by the front end)
    ERROR = 3  # the request failed (NaN logits, a step that raised): see EngineCoreOutput.error

    def __str__(self) -> str:
        return self.name.lower()

    @staticmethod
    def from_str(reason: str | None) -> "FinishReason | None":
        return None if reason is None else FinishReason[reason.upper()]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request as the core admits it: already tokenized and checked by the front end."""

    request_id: str
    prompt_token_ids: list[int]  # [prompt_len]
    sampling_params: SamplingParams
    arrival_time: float  # time.time() when the front end received it


class UtilityRequest(msgspec.Struct, array_like=True, gc=False):
    call_id: int  # echoed in UtilityOutput.call_id
    method: str  # an EngineCore method in UTILITY_METHODS
    args: list[Any] = []


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    call_id: int
    failure_message: str | None = None  # set when the call raised: what and why
    result: Any = None  # msgpack-able result of the call


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step did for one request: the tokens it emitted, and how it ended if it did."""

    request_id: str
    new_token_ids: list[int]  # emitted this step (1..k+1 under speculation; 0 when it just ended)
    new_logprobs: list[dict[int, Logprob]] | None = None  # one per new token, when logprobs were asked for
    finish_reason: FinishReason | None = None  # None while running
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_draft_tokens: int = 0  # this step's draft tokens for this request (0: not speculated)
    num_accepted_tokens: int = 0  # of those, accepted by the verifier
    error: str | None = None  # why it ended early, when it did: value + way out
    metrics: RequestMetrics | None = None  # at the finish only
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # with the first output, when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The core's state after one step, with that step's speculative counters."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    step_time: float = 0.0  # seconds of this step (scheduler + worker), 0 when no step ran
    num_drafts: int = 0  # requests that got a proposal this step
    num_draft_tokens: int = 0  # draft tokens proposed this step
    num_accepted_tokens: int = 0  # draft tokens accepted this step
    num_accepted_tokens_per_pos: list[int] = []  # [k] accepted at draft position 0..k-1 this step
    # [K+1] requests (one per row) whose speculation policy chose k drafts (a tree: a budget of k nodes) this
    # step, k = 0..K (policy.py; 0 = no speculation for that row); [] for a prefill or a non-speculative worker
    num_chosen_per_k: list[int] = []


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One message from the core: a step's outputs, or a utility answer."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0  # time.monotonic() in the core when the message was made
    utility_output: UtilityOutput | None = None
    finished_requests: list[str] | None = None  # ids that finished this step (aborts included)
    engine_dead: bool = False  # the core hit an error it cannot survive; see utility/failure logs


# one encoder/decoder per message type, reused: building one per message costs more than encoding
_ENCODER = msgspec.msgpack.Encoder()


def encode(obj: Any) -> bytes:
    return _ENCODER.encode(obj)


REQUEST_DECODER = msgspec.msgpack.Decoder(EngineCoreRequest)
ABORT_DECODER = msgspec.msgpack.Decoder(list[str])
UTILITY_DECODER = msgspec.msgpack.Decoder(UtilityRequest)
OUTPUTS_DECODER = msgspec.msgpack.Decoder(EngineCoreOutputs)
