"""`LLM`: the vLLM-like offline API. `LLM(model, speculative_config={...}).generate(prompts, params)`.

It wires a target engine, a tokenizer, a worker (plain or speculative) and the step loop together; it
knows nothing about how a step is computed. Inputs are checked before anything is admitted (see
validate.py); finished outputs are handed back once and dropped: only running counters stay behind.
"""

from __future__ import annotations

import functools
import os
import logging
from collections.abc import Sequence as Seq
from collections.abc import Mapping
from typing import Any

import msgspec
import torch
from tqdm.auto import tqdm

from specdec.engine.loader import load_engine, load_tokenizer
from specdec.core.llm_engine import LLMEngine
from specdec.datamodel.metrics import aggregate_counts, sum_counts
from specdec.datamodel.outputs import RequestOutput
from specdec.datamodel.sampling_params import SamplingParams
from specdec.core.parallel import child_params, merge_outputs
from specdec.datamodel.inputs import parse_prompt
from specdec.core.prompt_logprobs import score_prompt
from specdec.core.validate import as_sampling_params, check_int, check_stop_token_ids, check_token_ids

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any]  # "text" | {"prompt_token_ids": [...]} | {"prompt": "text"}


class LLM:
    def __init__(
        self,
        model: str = "smollm2-135m-instruct",
        *,
        max_num_seqs: int = 8,
        max_model_len: int = 2048,
        dtype: str = "auto",  # bfloat16 where the CPU has bf16 arithmetic, else float32 (engine/loader.py)
        seed: int = 0,
        speculative_config: dict[str, Any] | None = None,
        spec_method: str | None = None,
        spec_model: str | None = None,
        spec_tokens: int | None = None,
        num_threads: int | None = None,
        record_step_times: bool = False,
        num_scheduler_steps: int = 1,
    ) -> None:
        """``record_step_times=True`` keeps every decode step's phase timings in
        ``llm.llm_engine.step_times`` (for experiments); otherwise only running means are kept.
        ``num_scheduler_steps`` N > 1: multi-step decoding, the scheduler consulted once per N decode steps
        (specdec/core/multi_step.py); greedy outputs are the same for every N."""
        check_int("LLM", "max_num_seqs", max_num_seqs, 1)
        check_int("LLM", "max_model_len", max_model_len, 2, " (a prompt token and a generated one)")
        check_int("LLM", "seed", seed, 0)
        if seed >= 2**63:
            raise ValueError(f"LLM: seed={seed} is out of range: an int in [0, 2**63)")
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"LLM: model={model!r:.80} must be a model name or a path, e.g. "
                            "LLM('smollm2-135m-instruct') or LLM('tiny-random-llama')")
        if not isinstance(record_step_times, bool):
            raise TypeError(f"LLM: record_step_times={record_step_times!r:.40} must be True or False")
        check_int("LLM", "num_scheduler_steps", num_scheduler_steps, 1,
                  " (1 = consult the scheduler every step; N > 1 = once per N decode steps)")
        if num_threads is not None:
            torch.set_num_threads(check_int("LLM", "num_threads", num_threads, 1))
        torch.manual_seed(seed)  # unseeded requests draw from the default generator
        spec = _merge_spec_aliases(speculative_config, spec_method, spec_model, spec_tokens)
        self.model = model
        self.engine = load_engine(model, num_slots=max_num_seqs, max_model_len=max_model_len,
                                  dtype=dtype, seed=seed)
        self.tokenizer = load_tokenizer(model)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.worker, k = _build_worker(self.engine, spec, max_num_seqs=max_num_seqs,
                                       max_model_len=max_model_len, dtype=dtype, seed=seed)
        self.speculative_config = spec
        self.llm_engine = LLMEngine(self.worker, self.tokenizer, max_num_seqs=max_num_seqs,
                                    max_model_len=max_model_len, eos_token_id=eos,
                                    num_speculative_tokens=k, vocab_size=self.engine.vocab_size,
                                    record_step_times=record_step_times,
                                    score_prompt=functools.partial(score_prompt, self.engine),
                                    num_scheduler_steps=num_scheduler_steps)
        self._reset_outputs()

    def _reset_outputs(self) -> None:
        # running sums over every output handed back (get_metrics), not the outputs themselves
        self._acceptance_counts: list[int] = [0]
        # finished outputs of requests added with add_request that a generate() call drained: the next
        # step() hands them back
        self._unclaimed: list[RequestOutput] = []

    # ----------------------------------------------------------------- offline API
    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        ``sampling_params``: one SamplingParams (or dict of its fields) for all prompts, or one per
        prompt. Every prompt and parameter is checked before any is admitted. If the call is interrupted
        (Ctrl-C), its requests are aborted and the engine is left ready for the next call."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or not isinstance(sampling_params, (list, tuple)):
            params = [as_sampling_params(sampling_params)] * len(prompts)
        else:
            params = [as_sampling_params(sp, f"sampling_params[{i}]") for i, sp in enumerate(sampling_params)]
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams; "
                             "pass one SamplingParams or one per prompt")
        inputs = []
        for i, p in enumerate(prompts):  # check them all before admitting any
            try:
                text, token_ids = self._tokenize(p)
                inputs.append((text, check_token_ids(token_ids, self.engine.vocab_size)))
                check_stop_token_ids(params[i], self.engine.vocab_size)
            except (TypeError, ValueError) as e:
                raise type(e)(f"prompts[{i}]: {e}") from None
        ids: list[str] = []
        children: list[list[str]] = []  # per prompt: its request ids (n > 1: one per child, parallel.py)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=sum(sp.n for sp in params), desc="generate", disable=not use_tqdm)
        try:
            for (text, token_ids), sp in zip(inputs, params):
                kids = [self.llm_engine.add_request(token_ids, child_params(sp, i), prompt=text) for i in range(sp.n)]
                children.append(kids)
                ids.extend(kids)
            wanted = set(ids)
            while True:
                for out in self._drain():
                    if out.request_id in wanted:
                        results[out.request_id] = out
                        bar.update(1)
                    else:
                        self._unclaimed.append(out)  # an add_request() request: step() hands it back
                if len(results) == len(ids) or not self.llm_engine.has_unfinished_requests():
                    break
                self.llm_engine.step()
        except BaseException:
            # interrupted (or a bug): drop this call's requests, so nothing is left half-run
            mine = set(ids)
            for rid in mine - results.keys():
                self.llm_engine.abort_request(rid)
            self._unclaimed.extend(o for o in self._drain() if o.request_id not in mine)
            raise
        finally:
            bar.close()
        return [results[kids[0]] if len(kids) == 1 else merge_outputs(kids[0], [results[i] for i in kids])
                for kids in children]

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
    def add_request(self, prompt: PromptType, params: SamplingParams | dict | None = None,
                    request_id: str | None = None) -> str:
        """Admit one request (checked first: nothing is admitted if it raises); ``step()`` runs it."""
        text, token_ids = self._tokenize(prompt)
        return self.llm_engine.add_request(token_ids, as_sampling_params(params, "params"),
                                           request_id=request_id, prompt=text)

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that finished during it (and any a generate() call
        finished meanwhile)."""
        self.llm_engine.step()
        outs, self._unclaimed = self._unclaimed + self._drain(), []
        return outs

    def abort(self, request_id: str) -> None:
        self.llm_engine.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.llm_engine.has_unfinished_requests()

    def _drain(self) -> list[RequestOutput]:
        outs = self.llm_engine.pop_finished()
        for o in outs:
            if o.metrics is not None and o.metrics.spec_token_acceptance_counts:
                self._acceptance_counts = sum_counts([self._acceptance_counts, o.metrics.spec_token_acceptance_counts])
        return outs

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, Any]:
        return parse_prompt(self.tokenizer, prompt)

    # ----------------------------------------------------------------- metrics
    def get_metrics(self):
        """Aggregate speculative-decoding metrics over every request finished so far."""
        eng = self.llm_engine
        return aggregate_counts(self._acceptance_counts, num_draft_tokens=eng.num_draft_tokens,
                                mean_step_time_s=eng.step_stats.means())

    def reset_metrics(self) -> None:
        from specdec.datamodel.metrics import StepTimeStats

        self._acceptance_counts = [0]
        self.llm_engine.step_stats = StepTimeStats()
        if self.llm_engine.step_times is not None:
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
        speculative_config = _merge_spec_aliases(speculative_config, None, None, None)
        twin.worker, k = _build_worker(self.engine, speculative_config, max_num_seqs=sched.max_num_seqs,
                                       max_model_len=self.llm_engine.max_model_len)
        twin.speculative_config = speculative_config or None
        twin.llm_engine = LLMEngine(twin.worker, self.tokenizer, max_num_seqs=sched.max_num_seqs,
                                    max_model_len=self.llm_engine.max_model_len,
                                    eos_token_id=self.llm_engine.eos_token_id, num_speculative_tokens=k,
                                    vocab_size=self.llm_engine.vocab_size,
                                    record_step_times=self.llm_engine.step_times is not None,
                                    score_prompt=functools.partial(score_prompt, self.engine),
                                    num_scheduler_steps=self.llm_engine.num_scheduler_steps)
        twin._reset_outputs()
        return twin


def _merge_spec_aliases(config, method, model, tokens) -> dict[str, Any] | None:
    """The seed's top-level aliases spec_method/spec_model/spec_tokens fold into speculative_config."""
    if isinstance(config, msgspec.Struct):  # a SpeculativeConfig
        config = msgspec.structs.asdict(config)
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"LLM: speculative_config={config!r:.80} must be a dict (or None for plain decoding); "
                        f"pass e.g. speculative_config={{'method': {config!r:.40}, 'num_speculative_tokens': 4}}")
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
        from specdec.core.plain_worker import PlainWorker

        return PlainWorker(engine), 0
    from specdec.spec_decode.builder import build_spec_worker

    return build_spec_worker(engine, spec, **kwargs)
