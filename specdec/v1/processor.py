"""The front end's input side: a prompt and SamplingParams -> checked EngineCoreRequests (one per child).

Everything that can be refused is refused here, before anything reaches the core, with TypeError or
ValueError naming the field (the server turns them into a 400): the prompt's form and token ids, a
prompt that leaves no room to generate inside max_model_len, the sampling parameters and their token
ids. Bad words are tokenized here. Knows nothing about steps.
"""

from __future__ import annotations

import time

from specdec.datamodel.inputs import PromptType, parse_prompt
from specdec.datamodel.sampling_params import SamplingParams
from specdec.core.parallel import child_params, child_request_id
from specdec.v1.protocol import EngineCoreRequest
from specdec.core.validate import (
    as_sampling_params, check_stop_token_ids, check_token_fields, check_token_ids, with_bad_words_tokenized,
)


class Processor:
    def __init__(self, tokenizer, *, vocab_size: int | None, max_model_len: int, speculative: bool) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.speculative = speculative

    def check_params(self, params: SamplingParams | dict | None) -> SamplingParams:
        params = as_sampling_params(params, "params")
        check_stop_token_ids(params, self.vocab_size)
        params = with_bad_words_tokenized(params, self.tokenizer)
        check_token_fields(params, self.vocab_size)
        return params  # processors are lossless under speculation too (specdec.sampling.sampler.logits_process.process_tree_logits)

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | dict | None,
                ) -> tuple[str | None, list[int], SamplingParams, list[EngineCoreRequest]]:
        """(prompt text, prompt ids, checked params, the requests to send: one, or n children)."""
        text, ids = parse_prompt(self.tokenizer, prompt)
        ids = check_token_ids(ids, self.vocab_size)
        if not ids:
            raise ValueError("prompt is empty: pass at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len={self.max_model_len} leaves no room "
                             f"to generate; shorten the prompt below {self.max_model_len} tokens")
        params = self.check_params(params)
        now = time.time()
        if params.n == 1:
            return text, ids, params, [EngineCoreRequest(request_id, ids, params, now)]
        reqs = [EngineCoreRequest(child_request_id(request_id, i), ids, child_params(params, i), now)
                for i in range(params.n)]
        return text, ids, params, reqs
