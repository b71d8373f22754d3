"""The engine-core wire format: every struct round-trips through msgpack, tags are one byte."""

import msgspec

from specdec.datamodel.sampling_params import SamplingParams
from specdec.datamodel.sequence import Logprob, RequestMetrics
from specdec.v1 import protocol as P


def test_request_types_are_one_byte_and_finish_reasons_read_as_openai():
    assert all(len(t.value) == 1 for t in P.EngineCoreRequestType)
    assert [str(r) for r in P.FinishReason] == ["stop", "length", "abort", "error"]
    assert P.FinishReason.from_str("length") is P.FinishReason.LENGTH and P.FinishReason.from_str(None) is None


def test_structs_round_trip():
    req = P.EngineCoreRequest("r1", [1, 2, 3], SamplingParams(temperature=0.5, stop=["x"], logit_bias={3: 1.0}), 12.5)
    assert P.REQUEST_DECODER.decode(P.encode(req)) == req
    out = P.EngineCoreOutputs(
        outputs=[P.EngineCoreOutput("r1", [4, 5], new_logprobs=[{4: Logprob(-0.1, 1)}, {5: Logprob(-2.0, 3)}],
                                    num_draft_tokens=3, num_accepted_tokens=1),
                 P.EngineCoreOutput("r2", [], finish_reason=P.FinishReason.STOP, stop_reason=7, error=None,
                                    metrics=RequestMetrics(arrival_time=1.0, last_token_time=2.0, first_token_time=1.5))],
        scheduler_stats=P.SchedulerStats(num_running_reqs=2, num_drafts=2, num_draft_tokens=6, num_accepted_tokens=3,
                                         num_accepted_tokens_per_pos=[2, 1, 0], num_chosen_per_k=[0, 0, 1, 1]),
        timestamp=3.0, utility_output=P.UtilityOutput(4, result={"a": [1, 2]}), finished_requests=["r2"])
    back = P.OUTPUTS_DECODER.decode(P.encode(out))
    assert back == out and back.outputs[1].finished and not back.outputs[0].finished
    assert P.UTILITY_DECODER.decode(P.encode(P.UtilityRequest(1, "get_stats", []))).method == "get_stats"
    # array_like: no field names on the wire
    assert b"request_id" not in P.encode(out) and isinstance(msgspec.msgpack.decode(P.encode(req)), list)
