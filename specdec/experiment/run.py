"""`python -m specdec.run [+experiment=NAME] [group=option] [key=value]`: one experiment -> summary.json.

The @hydra.main function is a thin wrapper around :func:`run`, which takes any mapping (a DictConfig
or a plain dict) so tests and notebooks call it without Hydra. `-m` makes a sweep (Hydra multirun,
joblib launcher by default, see conf/hydra/launcher/); `python -m specdec.report <sweep dir>` plots it.

Per question at batch 1, all turns in order (MT-bench's second turn sees the first answer): the plain
baseline on the same engine, then speculative decoding, each timed. Figures follow Spec-Bench (see
specdec/experiment/summary.py). Config typing and checks live in specdec/experiment/compose.py, W&B in specdec/experiment/loggers.py.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import msgspec

from specdec.experiment.compose import (  # noqa: F401 - RunConfig & co. are part of this module's API
    ModelCfg, RunConfig, SamplingCfg, components, locate, parse_config, qualname,
    speculative_config, to_container,
)
from specdec.experiment.loggers import question_figures
from specdec.experiment.summary import CategorySummary, RequestRecord, RunSummary, latency_summary, write_summary
from specdec.experiment.theory import Theory

log = logging.getLogger("specdec.run")
# the repository's conf/, absolute: Hydra finds it whatever module `python -m` ran (specdec.run is a shim)
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def load_prompts(dataset: dict[str, Any]):
    from specdec.experiment.data import load_spec_bench

    if not dataset:
        return load_spec_bench(per_category=1)
    fn = locate(dataset["_target_"], "dataset._target_")
    return fn(**{k: v for k, v in dataset.items() if k != "_target_"})


def make_logger(node: dict[str, Any]):
    from specdec.experiment.loggers import NullLogger

    if not node:
        return NullLogger()
    cls = locate(node["_target_"], "logger._target_")
    return cls(**{k: v for k, v in node.items() if k != "_target_"})


def run(cfg: Any) -> RunSummary:
    from specdec.datamodel.sampling_params import SamplingParams

    t_start = time.perf_counter()
    rc = parse_config(cfg)  # typed and checked: fails here, before any model loads
    spec = speculative_config(rc)
    parts = components(rc, spec)
    out_dir = Path(rc.output_dir or hydra_output_dir() or os.getcwd())
    logger = make_logger(rc.logger)
    log.info("logger: %s", qualname(type(logger)))
    group, name = sweep_group()
    logger.start({**msgspec.to_builtins(rc), "components": parts}, out_dir, group=group, name=name)
    try:
        # the prompts and sampling parameters first: a bad file or field fails here, before any model loads
        prompts = load_prompts(rc.dataset)
        log.info("dataset: %s -> %d prompts", parts["dataset"], len(prompts))
        params = SamplingParams(**msgspec.structs.asdict(rc.sampling))
        llm_cls = locate(rc.model.target, "model._target_")
        log.info("model: %s(%r, dtype=%s); speculative_config: %s", rc.model.target, rc.model.name,
                 rc.model.dtype, spec or "none (plain decoding)")
        llm = llm_cls(rc.model.name, max_num_seqs=rc.max_num_seqs, max_model_len=rc.max_model_len,
                      dtype=rc.model.dtype, seed=rc.seed, speculative_config=spec, num_threads=rc.num_threads)
        parts.update(check_built(llm, rc))
        log.info("engine: %s", llm.engine.describe())
        baseline = llm.without_speculation() if spec and rc.measure_baseline else None
        if rc.warmup:  # first calls pay one-off costs (allocator, kernels); keep them out of the figures
            for m in (llm, baseline):
                if m is not None:
                    m.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0),
                               use_tqdm=False)
                    m.reset_metrics()
        tracer = install_tracer(llm, rc)  # after the warmup: its request is no question's
        records = []
        for i, p in enumerate(prompts):
            records.append(run_prompt(llm, baseline, p, params, rc.turns, tracer))
            logger.log_question(i, records[-1])  # once per question: the engine's step loop stays W&B-free
            log.info("question %d/%d (%s, %s): %s", i + 1, len(prompts), p.category, p.question_id,
                     " ".join(f"{k}={v:.3g}" for k, v in question_figures(records[-1]).items()))
        summary = summarize(rc, llm, records, time.perf_counter() - t_start, params.greedy, parts)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "summary.json"
        write_summary(summary, path)
        if tracer is not None:
            log.info("trace: %s", write_trace(tracer, out_dir, rc, llm, spec))
        logger.log_summary(summary, path)
    finally:
        logger.finish()
    log.info("tau=%s acceptance_rate=%s tokens/s=%.2f speedup=%s", summary.mean_acceptance_length,
             summary.acceptance_rate, summary.tokens_per_s, summary.speedup)
    print(path)  # last line of stdout: the summary's path
    return summary


def check_built(llm, rc: RunConfig) -> dict[str, str]:
    """The class built for each speculative part (every part came through the one registry, from its
    group's ``_target_``: specdec.experiment.compose), logged and returned for the summary."""
    top1 = getattr(llm.worker, "top1", None)
    if top1 is None:
        return {}
    out = {"proposer": qualname(type(top1.proposer)), "scorer": qualname(type(llm.worker.scorer)),
           "verifier": qualname(type(llm.worker.verifier))}
    ops = getattr(llm.worker.verifier, "ops", None)
    out["kernel"] = f"{rc.kernel.get('_target_')}({getattr(ops, 'name', rc.kernel.get('name'))!r})"
    for group, built in out.items():
        log.info("%s: %s", group, built)
    return out


def hydra_output_dir() -> str | None:
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else None
    except Exception:  # noqa: BLE001 - not under Hydra
        return None


def sweep_group() -> tuple[str | None, str | None]:
    """(group, name) of a multirun member: the sweep dir (so a sweep reads as one W&B group) and the job's
    overrides; (None, None) outside a multirun."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
            return None, None
        hc = HydraConfig.get()
        group = "/".join(Path(hc.sweep.dir).parts[-3:])[-128:]  # W&B's limit on group names
        return group, hc.job.override_dirname or f"job{hc.job.num}"
    except Exception:  # noqa: BLE001 - not under Hydra
        return None, None


def install_tracer(llm, rc: RunConfig):
    """``trace=true``: a specdec.experiment.trace.Tracer on the worker's observers (None otherwise)."""
    if not rc.trace:
        return None
    from specdec.experiment.trace import install

    tracer, layers = install(llm, rc.trace_features, rc.trace_layers, rc.trace_features_dtype, rc.trace_top_n,
                             rc.trace_lookahead)
    tracer.layers = layers
    return tracer


def write_trace(tracer, out_dir: Path, rc: RunConfig, llm, spec) -> Path:
    meta = dict(model=rc.model.name, dtype=rc.model.dtype, max_model_len=rc.max_model_len, seed=rc.seed,
                vocab_size=llm.engine.vocab_size, feature_layers=list(tracer.layers), speculative_config=spec,
                config=msgspec.to_builtins(rc))
    return tracer.write(out_dir, meta)


def run_prompt(llm, baseline, prompt, params, turns: int, tracer=None) -> RequestRecord:
    """All turns of one question at batch 1: baseline first, then speculative, each timed."""
    from specdec.datamodel.metrics import sum_counts

    conv: list[dict[str, str]] = []
    base_conv: list[dict[str, str]] = []
    n_prompt = n_gen = n_base = 0
    secs = base_secs = 0.0
    match: bool | None = True if (baseline is not None and params.greedy) else None
    text = ""
    finish = None
    counts_list: list[list[int]] = []
    drafts_before = llm.llm_engine.num_draft_tokens
    steps: tuple[dict[str, float], dict[str, int]] = ({}, {})  # decode-step phase seconds and counts
    base_steps: tuple[dict[str, float], dict[str, int]] = ({}, {})
    lat: dict[str, list[float]] = {"ttft": [], "tpot": [], "itl": []}  # this question's turns (speculative run)
    for turn in prompt.turns[:turns]:
        conv.append({"role": "user", "content": turn})
        ids = llm.chat_prompt_ids(conv)
        base_out = None
        if baseline is not None:
            base_conv.append({"role": "user", "content": turn})
            before = _step_totals(baseline)
            t = time.perf_counter()
            base_out = baseline.generate([{"prompt_token_ids": baseline.chat_prompt_ids(base_conv)}], params,
                                         use_tqdm=False)[0]
            base_secs += time.perf_counter() - t
            _add_delta(base_steps, before, _step_totals(baseline))
            base_conv.append({"role": "assistant", "content": base_out.outputs[0].text})
            n_base += len(base_out.outputs[0].token_ids)
        before = _step_totals(llm)
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        secs += time.perf_counter() - t
        if tracer is not None:
            tracer.label(out, prompt.question_id, prompt.category, len(conv) // 2)
        _add_delta(steps, before, _step_totals(llm))
        comp = out.outputs[0]
        if out.metrics is not None and out.metrics.spec_token_acceptance_counts:
            counts_list.append(list(out.metrics.spec_token_acceptance_counts))
        if match is not None and base_out is not None and comp.token_ids != base_out.outputs[0].token_ids:
            match = False
        conv.append({"role": "assistant", "content": comp.text})
        n_prompt += len(ids)
        n_gen += len(comp.token_ids)
        text, finish = comp.text, comp.finish_reason
        if out.latency is not None:
            lat["ttft"] += [] if out.latency.ttft is None else [out.latency.ttft]
            lat["tpot"] += [] if out.latency.tpot is None else [out.latency.tpot]
            lat["itl"] += out.latency.itl
    return RequestRecord(
        question_id=prompt.question_id, category=prompt.category, num_prompt_tokens=n_prompt,
        num_generated_tokens=n_gen, seconds=secs, baseline_seconds=base_secs if baseline else None,
        baseline_num_generated_tokens=n_base if baseline else None,
        finish_reason=finish, text=text, greedy_match=match, acceptance_counts=sum_counts(counts_list),
        num_draft_tokens=llm.llm_engine.num_draft_tokens - drafts_before,
        step_seconds=steps[0], step_counts=steps[1],
        baseline_step_seconds=base_steps[0].get("step", 0.0) if baseline else None,
        baseline_num_steps=base_steps[1].get("step", 0) if baseline else None,
        ttft_s=lat["ttft"], tpot_s=lat["tpot"], itl_s=lat["itl"],
    )


def _step_totals(llm) -> tuple[dict[str, float], dict[str, int]]:
    """The engine's running step statistics so far (phase -> summed seconds, -> step count): a question's
    timings are the difference around its generate calls, so they pool exactly per category."""
    stats = llm.llm_engine.step_stats
    return dict(stats.total), dict(stats.count)


def _add_delta(acc: tuple[dict[str, float], dict[str, int]], before, after) -> None:
    for i in (0, 1):
        for phase, x in after[i].items():
            acc[i][phase] = acc[i].get(phase, 0) + x - before[i].get(phase, 0)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _figures(records: list[RequestRecord]) -> tuple[int, float, float | None, float | None, float | None]:
    """(tokens, tokens/s, baseline tokens/s, speedup, speedup of means). tokens/s is the mean of
    per-question tokens/s (Spec-Bench's speed.py). ``speedup`` is the mean over questions of each
    question's tokens/s ratio (the definition the issue and Spec-Bench's paper tables use);
    ``speedup of means`` is the ratio of the two mean speeds (speed.py's ``speedup_ratio``)."""
    toks = sum(r.num_generated_tokens for r in records)
    tps = _mean([r.num_generated_tokens / r.seconds for r in records if r.seconds > 0]) or 0.0
    if not records or any(r.baseline_seconds is None for r in records):
        return toks, tps, None, None, None
    base = [((r.baseline_num_generated_tokens if r.baseline_num_generated_tokens is not None
              else r.num_generated_tokens) / r.baseline_seconds) if r.baseline_seconds > 0 else None
            for r in records]
    btps = _mean([b for b in base if b])
    ratios = [(r.num_generated_tokens / r.seconds) / b for r, b in zip(records, base)
              if b and r.seconds > 0 and r.num_generated_tokens > 0]
    return toks, tps, btps, _mean(ratios), (tps / btps if btps else None)


def _category(recs: list[RequestRecord], speculative: bool, k: int = 0) -> CategorySummary:
    from specdec.datamodel.metrics import sum_counts, tau

    counts = sum_counts([r.acceptance_counts for r in recs if r.acceptance_counts])
    drafts = sum(r.num_draft_tokens for r in recs)
    toks, tps, btps, speed, speed_of_means = _figures(recs)
    return CategorySummary(
        num_prompts=len(recs), num_generated_tokens=toks,
        mean_acceptance_length=tau(counts) if counts[0] else None,
        acceptance_rate=sum(counts[1:]) / drafts if (speculative and drafts) else None,
        tokens_per_s=tps, baseline_tokens_per_s=btps, speedup=speed, speedup_of_means=speed_of_means,
        **_theory(recs, counts, k if speculative else 0, speed),
    )


def _mean_phases(recs: list[RequestRecord]) -> dict[str, float]:
    """Mean seconds per phase over the records' speculative decode steps (pooled, not a mean of means)."""
    secs: dict[str, float] = {}
    count: dict[str, int] = {}
    for r in recs:
        for phase, x in r.step_seconds.items():
            secs[phase] = secs.get(phase, 0.0) + x
            count[phase] = count.get(phase, 0) + r.step_counts.get(phase, 0)
    return {p: secs[p] / count[p] for p in secs if count[p]}


def _baseline_step_s(recs: list[RequestRecord]) -> float | None:
    """The plain baseline's mean decode step: theory's one-token forward t1 (see specdec/experiment/theory.py)."""
    steps = sum(r.baseline_num_steps or 0 for r in recs)
    return sum(r.baseline_step_seconds or 0.0 for r in recs) / steps if steps else None


def _theory(recs: list[RequestRecord], counts: list[int], k: int, measured: float | None) -> dict[str, Any]:
    from specdec.experiment.theory import theory

    phases = _mean_phases(recs)
    th = theory(counts, k, phases.get("propose"), phases.get("score"), _baseline_step_s(recs), measured)
    return msgspec.structs.asdict(th)


def summarize(rc: RunConfig, llm, records: list[RequestRecord], wall: float, greedy: bool,
              parts: dict[str, str] | None = None) -> RunSummary:
    from specdec.experiment.data import SPEC_BENCH_TASKS
    from specdec.datamodel.metrics import per_position, sum_counts

    speculative = bool(llm.speculative_config)
    k = llm.llm_engine.num_speculative_tokens  # the tree depth for scorer=tree
    by_cat: dict[str, list[RequestRecord]] = {}
    for r in records:
        by_cat.setdefault(r.category, []).append(r)
    per_task = {task: _category([r for r in records if r.category in cats], speculative, k)
                for task, cats in SPEC_BENCH_TASKS.items() if any(r.category in cats for r in records)}
    overall = _category(records, speculative, k)
    t1 = _baseline_step_s(records)
    counts = sum_counts([r.acceptance_counts for r in records if r.acceptance_counts])
    checked = [r.greedy_match for r in records if r.greedy_match is not None]
    return RunSummary(
        config=msgspec.to_builtins(rc), num_prompts=len(records), num_generated_tokens=overall.num_generated_tokens,
        mean_acceptance_length=overall.mean_acceptance_length, acceptance_rate=overall.acceptance_rate,
        acceptance_per_position=per_position(counts), tokens_per_s=overall.tokens_per_s,
        baseline_tokens_per_s=overall.baseline_tokens_per_s, speedup=overall.speedup,
        speedup_of_means=overall.speedup_of_means,
        per_category={cat: _category(recs, speculative, k) for cat, recs in by_cat.items()},
        greedy_mismatches=(len(checked) - sum(checked)) if (greedy and checked) else None,
        wall_time_s=wall, step_time_s=llm.get_metrics().mean_step_time_s, requests=records,
        baseline_step_time_s={} if t1 is None else {"step": t1},
        **{f: getattr(overall, f) for f in Theory.__struct_fields__},
        per_task=per_task, components=dict(parts or {}),
        engine=llm.engine.describe(),
        latency=latency_summary(records),
    )


def main() -> None:
    import hydra

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
    def _main(cfg) -> None:
        run(cfg)

    _main()


if __name__ == "__main__":
    main()
