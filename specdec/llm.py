"""`LLM`: the vLLM-like offline API. `LLM(model, speculative_config={...}).generate(prompts, params)`.

It wires a target engine, a tokenizer, a worker (plain or speculative) and the step loop together; it
knows nothing about how a step is computed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from typing import Any

import torch
from tqdm.auto import tqdm

from specdec.engine.loader import load_engine, load_tokenizer
from specdec.llm_engine import LLMEngine
from specdec.outputs import RequestOutput
from specdec.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any]  # "text" | {"prompt_token_ids": [...]} | {"prompt": "text"}


class LLM:
    def __init__(
        self,
        model: str = "smollm2-135m-instruct",
        *,
        max_num_seqs: int = 8,
        max_model_len: int = 2048,
        dtype: str = "float32",
        seed: int = 0,
        speculative_config: dict[str, Any] | None = None,
        spec_method: str | None = None,
        spec_model: str | None = None,
        spec_tokens: int | None = None,
        num_threads: int | None = None,
    ) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        torch.manual_seed(seed)  # unseeded requests draw from the default generator
        self.model = model
        self.engine = load_engine(model, num_slots=max_num_seqs, max_model_len=max_model_len,
                                  dtype=dtype, seed=seed)
        self.tokenizer = load_tokenizer(model)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        spec = _merge_spec_aliases(speculative_config, spec_method, spec_model, spec_tokens)
        self.worker, k = _build_worker(self.engine, spec, max_num_seqs=max_num_seqs,
                                       max_model_len=max_model_len, dtype=dtype, seed=seed)
        self.speculative_config = spec
        self.llm_engine = LLMEngine(self.worker, self.tokenizer, max_num_seqs=max_num_seqs,
                                    max_model_len=max_model_len, eos_token_id=eos,
                                    num_speculative_tokens=k)
        self._finished: list[RequestOutput] = []  # every output so far, for get_metrics()

    # ----------------------------------------------------------------- offline API
    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams; "
                             "pass one SamplingParams or one per prompt")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        for out in self._drain():
            results[out.request_id] = out
            bar.update(1)
        while self.llm_engine.has_unfinished_requests():
            self.llm_engine.step()
            for out in self._drain():
                results[out.request_id] = out
                bar.update(1)
        bar.close()
        return [results[i] for i in ids]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.chat_prompt_ids(c)} for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt_ids(self, conversation: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # ----------------------------------------------------------------- streaming-style API
    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        if isinstance(params, dict):
            params = SamplingParams(**params)
        text, token_ids = self._tokenize(prompt)
        return self.llm_engine.add_request(token_ids, params, request_id=request_id, prompt=text)

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that finished during it."""
        self.llm_engine.step()
        return self._drain()

    def abort(self, request_id: str) -> None:
        self.llm_engine.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.llm_engine.has_unfinished_requests()

    def _drain(self) -> list[RequestOutput]:
        outs = self.llm_engine.pop_finished()
        self._finished.extend(outs)
        return outs

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer(prompt["prompt"])["input_ids"]
        raise ValueError(f"prompt {prompt!r:.80} is not a string, {{'prompt': str}} or "
                         "{'prompt_token_ids': [...]}")

    # ----------------------------------------------------------------- metrics
    def get_metrics(self):
        """Aggregate speculative-decoding metrics over every request finished so far."""
        from specdec.metrics import aggregate_metrics

        return aggregate_metrics([o.metrics for o in self._finished if o.metrics is not None],
                                 num_draft_tokens=self.llm_engine.num_draft_tokens,
                                 step_times=self.llm_engine.step_times)

    def reset_metrics(self) -> None:
        self._finished = []
        self.llm_engine.step_times = []
        self.llm_engine.num_draft_tokens = 0

    def without_speculation(self) -> "LLM":
        """A plain-decoding LLM over the same target engine and tokenizer (the in-run baseline)."""
        return self.with_speculation(None)

    def with_speculation(self, speculative_config: dict[str, Any] | None) -> "LLM":
        """A new LLM sharing this one's target engine and tokenizer, with another (or no) speculative
        config. The two must not run at the same time (they share the engine's slots)."""
        twin = object.__new__(LLM)
        twin.model, twin.engine, twin.tokenizer = self.model, self.engine, self.tokenizer
        sched = self.llm_engine.scheduler
        twin.worker, k = _build_worker(self.engine, speculative_config, max_num_seqs=sched.max_num_seqs,
                                       max_model_len=self.llm_engine.max_model_len)
        twin.speculative_config = speculative_config or None
        twin.llm_engine = LLMEngine(twin.worker, self.tokenizer, max_num_seqs=sched.max_num_seqs,
                                    max_model_len=self.llm_engine.max_model_len,
                                    eos_token_id=self.llm_engine.eos_token_id, num_speculative_tokens=k)
        twin._finished = []
        return twin


def _merge_spec_aliases(config, method, model, tokens) -> dict[str, Any] | None:
    """The seed's top-level aliases spec_method/spec_model/spec_tokens fold into speculative_config."""
    cfg = dict(config or {})
    for key, val in (("method", method), ("model", model), ("num_speculative_tokens", tokens)):
        if val is None:
            continue
        if key in cfg and cfg[key] != val:
            raise ValueError(f"speculative_config[{key!r}]={cfg[key]!r} clashes with the alias value {val!r}; "
                             "give it once")
        cfg[key] = val
    return cfg or None


def _build_worker(engine, spec: dict[str, Any] | None, **kwargs):
    """(worker, k): the plain worker, or a speculative one when a config is given."""
    if not spec:
        from specdec.worker import PlainWorker

        return PlainWorker(engine), 0
    from specdec.spec_decode.builder import build_spec_worker

    return build_spec_worker(engine, spec, **kwargs)
