"""`python -m specdec.run [+experiment=NAME] [overrides]`: one experiment, written to summary.json.

The @hydra.main function is a thin wrapper around :func:`run`, which takes any mapping (a DictConfig
or a plain dict) so tests and notebooks call it without Hydra.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import msgspec

from specdec.summary import CategorySummary, RequestRecord, RunSummary, write_summary

log = logging.getLogger("specdec.run")


class ModelCfg(msgspec.Struct, forbid_unknown_fields=True):
    name: str = "smollm2-135m-instruct"  # engine model name, HF directory or .gguf path
    dtype: str = "float32"


class SamplingCfg(msgspec.Struct, forbid_unknown_fields=True):
    temperature: float = 0.0
    max_tokens: int = 128
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None


class RunConfig(msgspec.Struct, forbid_unknown_fields=True):
    """The plain (non-``_target_``) keys of a run, typed: a typo is an error naming the key."""

    model: ModelCfg = msgspec.field(default_factory=ModelCfg)
    proposer: dict[str, Any] = msgspec.field(default_factory=dict)  # speculative_config; {} = plain
    dataset: dict[str, Any] = msgspec.field(default_factory=dict)  # a _target_ returning list[Prompt]
    logger: dict[str, Any] = msgspec.field(default_factory=dict)
    sampling: SamplingCfg = msgspec.field(default_factory=SamplingCfg)
    seed: int = 0
    num_threads: int | None = None
    max_num_seqs: int = 1  # Spec-Bench measures at batch 1
    max_model_len: int = 4096  # Spec-Bench's longest prompts (summarization, rag) are ~3.3k tokens
    turns: int = 2  # MT-bench questions have 2 turns; 1 = first turn only
    measure_baseline: bool = True  # decode the same prompts plainly in the same run
    warmup: bool = True
    debug: bool = False  # tiny-random-llama, 1 prompt per category, 8 tokens: a smoke test in seconds
    output_dir: str | None = None  # where summary.json goes; default: Hydra's run dir or the cwd


def to_container(cfg: Any) -> dict[str, Any]:
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover
        pass
    return dict(cfg)


def parse_config(cfg: Any) -> RunConfig:
    raw = {k: v for k, v in to_container(cfg).items() if k not in ("hydra", "experiment")}
    try:
        rc = msgspec.convert(raw, RunConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"invalid run config: {e}. See conf/config.yaml for the valid keys.") from e
    if rc.debug:
        rc = msgspec.structs.replace(
            rc, model=ModelCfg(name="tiny-random-llama"), turns=1,
            sampling=msgspec.structs.replace(rc.sampling, max_tokens=8),
            dataset={**rc.dataset, "per_category": 1} if rc.dataset else rc.dataset,
        )
    return rc


def load_prompts(dataset: dict[str, Any]):
    from specdec.data import load_spec_bench

    if not dataset:
        return load_spec_bench(per_category=1)
    from hydra.utils import instantiate

    log.info("dataset: instantiating %s", dataset.get("_target_"))
    return instantiate(dataset)


def run(cfg: Any) -> RunSummary:
    from specdec.llm import LLM
    from specdec.sampling_params import SamplingParams

    t_start = time.perf_counter()
    rc = parse_config(cfg)
    spec = {k: v for k, v in rc.proposer.items() if v is not None} or None
    log.info("target: %s (%s); speculation: %s", rc.model.name, rc.model.dtype, spec or "off")
    llm = LLM(rc.model.name, max_num_seqs=rc.max_num_seqs, max_model_len=rc.max_model_len,
              dtype=rc.model.dtype, seed=rc.seed, speculative_config=spec, num_threads=rc.num_threads)
    baseline = llm.without_speculation() if spec and rc.measure_baseline else None
    prompts = load_prompts(rc.dataset)
    params = SamplingParams(**msgspec.structs.asdict(rc.sampling))
    if rc.warmup:  # first calls pay one-off costs (allocator, kernels); keep them out of the figures
        for m in (llm, baseline):
            if m is not None:
                m.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0),
                           use_tqdm=False)
                m.reset_metrics()

    records = []
    for p in prompts:
        records.append(run_prompt(llm, baseline, p, params, rc.turns))
    summary = summarize(rc, cfg, llm, records, time.perf_counter() - t_start, params.greedy)
    out_dir = Path(rc.output_dir or hydra_output_dir() or os.getcwd())
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "summary.json"
    write_summary(summary, path)
    summary_path = str(path)
    log.info("tau=%s tokens/s=%.2f speedup=%s", summary.mean_acceptance_length, summary.tokens_per_s,
             summary.speedup)
    print(summary_path)
    return summary


def hydra_output_dir() -> str | None:
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else None
    except Exception:  # noqa: BLE001 - not under Hydra
        return None


def run_prompt(llm, baseline, prompt, params, turns: int) -> RequestRecord:
    """All turns of one question at batch 1: baseline first, then speculative, each timed."""
    from specdec.metrics import sum_counts

    conv: list[dict[str, str]] = []
    base_conv: list[dict[str, str]] = []
    n_prompt = n_gen = 0
    secs = base_secs = 0.0
    match: bool | None = True if (baseline is not None and params.greedy) else None
    text = ""
    finish = None
    counts_list: list[list[int]] = []
    drafts_before = llm.llm_engine.num_draft_tokens
    for turn in prompt.turns[:turns]:
        conv.append({"role": "user", "content": turn})
        ids = llm.chat_prompt_ids(conv)
        base_out = None
        if baseline is not None:
            base_conv.append({"role": "user", "content": turn})
            t = time.perf_counter()
            base_out = baseline.generate([{"prompt_token_ids": baseline.chat_prompt_ids(base_conv)}], params,
                                         use_tqdm=False)[0]
            base_secs += time.perf_counter() - t
            base_conv.append({"role": "assistant", "content": base_out.outputs[0].text})
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        secs += time.perf_counter() - t
        comp = out.outputs[0]
        if out.metrics is not None and out.metrics.spec_token_acceptance_counts:
            counts_list.append(list(out.metrics.spec_token_acceptance_counts))
        if match is not None and base_out is not None and comp.token_ids != base_out.outputs[0].token_ids:
            match = False
        conv.append({"role": "assistant", "content": comp.text})
        n_prompt += len(ids)
        n_gen += len(comp.token_ids)
        text, finish = comp.text, comp.finish_reason
    return RequestRecord(
        question_id=prompt.question_id, category=prompt.category, num_prompt_tokens=n_prompt,
        num_generated_tokens=n_gen, seconds=secs, baseline_seconds=base_secs if baseline else None,
        finish_reason=finish, text=text, greedy_match=match, acceptance_counts=sum_counts(counts_list),
        num_draft_tokens=llm.llm_engine.num_draft_tokens - drafts_before,
    )


def _figures(records: list[RequestRecord]) -> tuple[int, float, float | None, float | None]:
    """(tokens, tokens/s, baseline tokens/s, Spec-Bench speedup = mean of per-question tok/s ratios)."""
    toks = sum(r.num_generated_tokens for r in records)
    secs = sum(r.seconds for r in records)
    tps = toks / secs if secs else 0.0
    if not records or any(r.baseline_seconds is None for r in records):
        return toks, tps, None, None
    bsecs = sum(r.baseline_seconds for r in records)
    ratios = [r.baseline_seconds / r.seconds for r in records if r.seconds > 0 and r.baseline_seconds > 0]
    # same tokens in both runs under greedy; the ratio of times is the ratio of tokens/s
    return toks, tps, (toks / bsecs if bsecs else None), (sum(ratios) / len(ratios) if ratios else None)


def summarize(rc: RunConfig, cfg: Any, llm, records: list[RequestRecord], wall: float, greedy: bool) -> RunSummary:
    from specdec.metrics import per_position, sum_counts, tau

    def accept(recs: list[RequestRecord]) -> tuple[list[int], float, float | None]:
        counts = sum_counts([r.acceptance_counts for r in recs if r.acceptance_counts])
        drafts = sum(r.num_draft_tokens for r in recs)
        rate = sum(counts[1:]) / drafts if (llm.speculative_config and drafts) else None
        return counts, (tau(counts) if counts[0] else None), rate

    by_cat: dict[str, list[RequestRecord]] = {}
    for r in records:
        by_cat.setdefault(r.category, []).append(r)
    per_category = {}
    for cat, recs in by_cat.items():
        _, cat_tau, cat_rate = accept(recs)
        toks, tps, btps, speed = _figures(recs)
        per_category[cat] = CategorySummary(
            num_prompts=len(recs), num_generated_tokens=toks, mean_acceptance_length=cat_tau,
            acceptance_rate=cat_rate, tokens_per_s=tps, baseline_tokens_per_s=btps, speedup=speed,
        )
    counts, all_tau, rate = accept(records)
    toks, tps, btps, speed = _figures(records)
    checked = [r.greedy_match for r in records if r.greedy_match is not None]
    return RunSummary(
        config=to_container(cfg) if cfg is not None else {},
        num_prompts=len(records), num_generated_tokens=toks,
        mean_acceptance_length=all_tau, acceptance_rate=rate, acceptance_per_position=per_position(counts),
        tokens_per_s=tps, baseline_tokens_per_s=btps, speedup=speed, per_category=per_category,
        greedy_mismatches=(len(checked) - sum(checked)) if (greedy and checked) else None,
        wall_time_s=wall, step_time_s=llm.get_metrics().mean_step_time_s, requests=records,
    )


def main() -> None:
    import hydra

    @hydra.main(version_base="1.3", config_path="../conf", config_name="config")
    def _main(cfg) -> None:
        run(cfg)

    _main()


if __name__ == "__main__":
    main()
