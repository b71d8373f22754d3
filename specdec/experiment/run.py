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
import torch

from specdec.engine.cpu.threads import thread_report
from specdec.experiment.baseline import TurnOutput, key_fields, open_baseline
from specdec.experiment.compose import (  # noqa: F401 - RunConfig & co. are part of this module's API
    ModelCfg, RunConfig, SamplingCfg, components, flagship, locate, open_options, parse_config, qualname,
    speculative_config, to_container,
)
from specdec.experiment.loggers import question_figures
from specdec.experiment.summary import (CategorySummary, RequestRecord, RunSummary, latency_summary, policy_figures,
                                       write_summary)
from specdec.experiment.theory import Theory

log = logging.getLogger("specdec.run")
# the repository's conf/, absolute: Hydra finds it whatever module `python -m` ran (specdec.run is a shim)
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
# torch's thread count when this process started: num_threads=null means it. torch.set_num_threads persists in a
# process, so without this a sweep job of num_threads=null ran with the previous job's count (basic launcher).
_PROCESS_THREADS = torch.get_num_threads()


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
                      dtype=rc.model.dtype, seed=rc.seed, speculative_config=spec,
                      num_threads=_PROCESS_THREADS if rc.num_threads is None else rc.num_threads,
                      num_scheduler_steps=rc.num_scheduler_steps)
        parts.update(check_built(llm, rc))
        log.info("engine: %s", llm.engine.describe())
        baseline = llm.without_speculation() if spec and rc.measure_baseline else None
        base = None
        if baseline is not None and rc.max_num_seqs == 1:
            base = open_baseline(rc.baseline, key_fields(rc, llm.engine.describe(), prompts),
                                 rc.baseline_remeasure_tokens)
        elif baseline is not None:
            log.info("batch %d: the plain baseline is decoded at the same batch in this run (the cache serves "
                     "batch 1)", rc.max_num_seqs)
        if rc.warmup:  # first calls pay one-off costs (allocator, kernels); keep them out of the figures
            for m in (llm, baseline):
                if m is not None:
                    m.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0),
                               use_tqdm=False)
                    m.reset_metrics()
        tracer = install_tracer(llm, rc)  # after the warmup: its request is no question's
        rates = {"start": read_rate(llm.engine)}
        try:
            if rc.max_num_seqs > 1:
                records = run_batched(llm, baseline, prompts, params, rc.turns, rc.max_num_seqs, tracer)
                for i, r in enumerate(records):
                    logger.log_question(i, r)
            else:
                records = []
                for i, p in enumerate(prompts):
                    records.append(run_prompt(llm, baseline, p, params, rc.turns, tracer, base, plain_first=i % 2 == 0))
                    logger.log_question(i, records[-1])  # once per question: the step loop stays W&B-free
                    log.info("question %d/%d (%s, %s): %s", i + 1, len(prompts), p.category, p.question_id,
                             " ".join(f"{k}={v:.3g}" for k, v in question_figures(records[-1]).items()))
            if base is not None:
                base.store(out_dir)
        finally:
            if base is not None:
                base.release()
        rates["end"] = read_rate(llm.engine)
        summary = summarize(rc, llm, records, time.perf_counter() - t_start, params.greedy, parts)
        summary.read_rate_gbs = {k: v for k, v in rates.items() if v is not None}
        summary.baseline = base.describe() if base is not None else (
            {"source": f"decoded at batch {rc.max_num_seqs}"} if baseline is not None else {})
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "summary.json"
        write_summary(summary, path)
        if tracer is not None:
            log.info("trace: %s", write_trace(tracer, out_dir, rc, llm, spec))
        logger.log_summary(summary, path)
    finally:
        logger.finish()
    th = summary.threads
    if th.get("reduced_forwards"):  # a share of 1% or more: a warning; a blip below it: said, not shouted
        share = th["reduced_forwards"] / max(th["forwards"], 1)
        (log.warning if share >= 0.01 else log.info)(
            "the machine was busy: %d of %d forwards ran with fewer than %d threads because another process took the "
            "cores (summary.json threads)%s", th["reduced_forwards"], th["forwards"], th["full"],
            "; its speeds are not a quiet machine's" if share >= 0.01 else "")
    if summary.read_rate_gbs:
        log.info("memory read rate (W.sum over the weights' bytes): %s GB/s", " -> ".join(
            f"{summary.read_rate_gbs[k]:.1f}" for k in ("start", "end") if k in summary.read_rate_gbs))
    log.info("tau=%s acceptance_rate=%s tokens/s=%.2f speedup=%s", summary.mean_acceptance_length,
             summary.acceptance_rate, summary.tokens_per_s, summary.speedup)
    print(path)  # last line of stdout: the summary's path
    return summary


def read_rate(engine, min_bytes: int = 64 << 20) -> float | None:
    """GB/s of ``W.sum()`` over a buffer of the target's weight bytes (specdec.engine.bench.read_rate_gbs): where the
    machine's memory stands now, for the summary beside its absolute speeds. None for a model whose weights are under
    ``min_bytes`` (they fit in caches: no stream to compare with) or an engine without a config."""
    from specdec.engine.bench import read_rate_gbs, weight_bytes

    try:
        nbytes = weight_bytes(engine)
    except AttributeError:
        return None
    return read_rate_gbs(nbytes, reps=3) if nbytes >= min_bytes else None


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
    meta = dict(model=rc.model.name, dtype=llm.engine.describe()["dtype"], max_model_len=rc.max_model_len, seed=rc.seed,
                vocab_size=llm.engine.vocab_size, feature_layers=list(tracer.layers), speculative_config=spec,
                config=msgspec.to_builtins(rc))
    return tracer.write(out_dir, meta)


def run_prompt(llm, baseline, prompt, params, turns: int, tracer=None, base=None,
               plain_first: bool = True) -> RequestRecord:
    """All turns of one question at batch 1, plain and speculative interleaved turn by turn (``plain_first``
    alternates between questions, so a drift of the machine's speed during a question falls on both sides).
    ``base``: the :class:`~specdec.experiment.baseline.Baseline` (cached turns are re-timed, not re-decoded)."""
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
    for t_index, turn in enumerate(prompt.turns[:turns]):
        conv.append({"role": "user", "content": turn})
        ids = llm.chat_prompt_ids(conv)
        base_ids: list[int] | None = None
        out = None

        def plain() -> None:
            nonlocal base_secs, n_base, base_ids
            base_conv.append({"role": "user", "content": turn})
            before = _step_totals(baseline)
            tokens, text_, seconds = plain_turn(baseline, baseline.chat_prompt_ids(base_conv), params,
                                                base.turn(prompt.question_id, t_index) if base else None,
                                                base.remeasure_tokens if base else 0, prompt.question_id)
            if base is not None and base.cached is None:
                base.record(prompt.question_id, TurnOutput(tokens, text_, seconds))
            base_secs += seconds
            _add_delta(base_steps, before, _step_totals(baseline))
            base_conv.append({"role": "assistant", "content": text_})
            n_base += len(tokens)
            base_ids = tokens

        def speculative() -> None:
            nonlocal secs, out
            before = _step_totals(llm)
            t = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            secs += time.perf_counter() - t
            _add_delta(steps, before, _step_totals(llm))

        for side in ((plain, speculative) if plain_first else (speculative, plain)):
            if side is speculative or baseline is not None:
                side()
        if tracer is not None:
            tracer.label(out, prompt.question_id, prompt.category, len(conv) // 2)
        comp = out.outputs[0]
        if out.metrics is not None and out.metrics.spec_token_acceptance_counts:
            counts_list.append(list(out.metrics.spec_token_acceptance_counts))
        if match is not None and base_ids is not None and list(comp.token_ids) != list(base_ids):
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


def plain_turn(baseline, ids: list[int], params, cached, remeasure_tokens: int,
               question_id: str) -> tuple[list[int], str, float]:
    """One plain turn: (tokens, text, seconds). Decoded in full when nothing is cached; otherwise the cached
    tokens and text, and the seconds re-measured now: a plain decode of the first ``remeasure_tokens`` tokens
    (measured time, plus the remaining tokens at its measured time per token). Greedy: the re-measured
    tokens must be the cached ones' prefix, or the cache does not belong to this engine."""
    if cached is None:
        t = time.perf_counter()
        out = baseline.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        return list(out.outputs[0].token_ids), out.outputs[0].text, time.perf_counter() - t
    n = len(cached.token_ids)
    m = max(1, min(remeasure_tokens, n))
    short = params.clone()
    short.max_tokens, short.min_tokens, short.ignore_eos = m, 0, True
    t = time.perf_counter()
    out = baseline.generate([{"prompt_token_ids": ids}], short, use_tqdm=False)[0]
    dt = time.perf_counter() - t
    got = list(out.outputs[0].token_ids)
    if params.greedy and got != list(cached.token_ids[:len(got)]):
        raise ValueError(f"the cached plain baseline of question {question_id!r} differs from this engine's plain "
                         "decoding (first tokens); it was decoded by other code or settings: use baseline=fresh")
    if len(got) >= n:
        return list(cached.token_ids), cached.text, dt
    ttft = out.latency.ttft if out.latency is not None and out.latency.ttft is not None else 0.0
    tpot = (dt - ttft) / (len(got) - 1) if len(got) > 1 else dt
    return list(cached.token_ids), cached.text, dt + (n - len(got)) * tpot


def run_batched(llm, baseline, prompts, params, turns: int, batch: int, tracer=None) -> list[RequestRecord]:
    """The dataset through the engine with continuous batching, ``batch`` requests in flight: turn by turn
    (a second turn needs the first answer), plain and speculative alternating which goes first per turn.
    A request's seconds are its share of the steps it was in flight for (each step's wall time split equally
    among the requests in flight), so the totals are the wall times and the bootstrap over prompts works as
    at batch 1."""
    from specdec.datamodel.metrics import sum_counts

    convs = {p.question_id: [] for p in prompts}
    base_convs = {p.question_id: [] for p in prompts}
    recs = {p.question_id: RequestRecord(
        question_id=p.question_id, category=p.category, num_prompt_tokens=0, num_generated_tokens=0, seconds=0.0,
        baseline_seconds=0.0 if baseline is not None else None, finish_reason=None, text="",
        baseline_num_generated_tokens=0 if baseline is not None else None,
        greedy_match=True if (baseline is not None and params.greedy) else None) for p in prompts}
    accepted: dict[str, list[list[int]]] = {p.question_id: [] for p in prompts}
    for t_index in range(turns):
        live = [p for p in prompts if t_index < len(p.turns)]
        if not live:
            break
        for p in live:
            convs[p.question_id].append({"role": "user", "content": p.turns[t_index]})
            base_convs[p.question_id].append({"role": "user", "content": p.turns[t_index]})
        sides = [("spec", llm)] + ([("plain", baseline)] if baseline is not None else [])
        results: dict[str, dict[str, tuple[Any, float]]] = {}
        drafts_delta: list[int] = []
        for name, engine in (sides if t_index % 2 else sides[::-1]):
            conv = convs if name == "spec" else base_convs
            items = [(p.question_id, engine.chat_prompt_ids(conv[p.question_id])) for p in live]
            before = _step_totals(engine)
            drafts_before = engine.llm_engine.num_draft_tokens
            results[name] = _drive(engine, items, params, batch)
            delta: tuple[dict[str, float], dict[str, int]] = ({}, {})
            _add_delta(delta, before, _step_totals(engine))
            if name == "spec":
                drafts_delta.append(engine.llm_engine.num_draft_tokens - drafts_before)
            # the batch's decode steps, shared among its questions (phase seconds equally, step counts in
            # integers summing to the batch's), so pooled means per step are the batch's
            counts = {ph: _split(c, [1] * len(live)) for ph, c in delta[1].items()}
            for i, p in enumerate(live):
                r = recs[p.question_id]
                if name == "spec":
                    for ph, x in delta[0].items():
                        r.step_seconds[ph] = r.step_seconds.get(ph, 0.0) + x / len(live)
                    for ph, c in counts.items():
                        r.step_counts[ph] = r.step_counts.get(ph, 0) + c[i]
                else:
                    r.baseline_step_seconds = (r.baseline_step_seconds or 0.0) + delta[0].get("step", 0.0) / len(live)
                    r.baseline_num_steps = (r.baseline_num_steps or 0) + counts.get("step", [0] * len(live))[i]
        metrics = [results["spec"][p.question_id][0].metrics for p in live]
        drafted = _split(drafts_delta.pop(), [m.spec_token_acceptance_counts[0] if m is not None and
                                             m.spec_token_acceptance_counts else 0 for m in metrics])
        for i, p in enumerate(live):
            qid = p.question_id
            r = recs[qid]
            r.num_draft_tokens += drafted[i]  # the engine counts drafts per batch: split by speculative steps
            out, secs = results["spec"][qid]
            comp = out.outputs[0]
            if tracer is not None:
                tracer.label(out, qid, p.category, t_index + 1)
            r.num_prompt_tokens += len(out.prompt_token_ids or [])
            r.num_generated_tokens += len(comp.token_ids)
            r.seconds += secs
            r.text, r.finish_reason = comp.text, comp.finish_reason
            if out.metrics is not None and out.metrics.spec_token_acceptance_counts:
                accepted[qid].append(list(out.metrics.spec_token_acceptance_counts))
            convs[qid].append({"role": "assistant", "content": comp.text})
            if baseline is not None:
                bout, bsecs = results["plain"][qid]
                r.baseline_seconds += bsecs
                r.baseline_num_generated_tokens += len(bout.outputs[0].token_ids)
                base_convs[qid].append({"role": "assistant", "content": bout.outputs[0].text})
                if r.greedy_match and list(bout.outputs[0].token_ids) != list(comp.token_ids):
                    r.greedy_match = False
            if out.latency is not None:
                r.ttft_s += [] if out.latency.ttft is None else [out.latency.ttft]
                r.tpot_s += [] if out.latency.tpot is None else [out.latency.tpot]
                r.itl_s += out.latency.itl
    for qid, r in recs.items():
        r.acceptance_counts = sum_counts(accepted[qid])
    return list(recs.values())


def _split(total: int, weights: list[int]) -> list[int]:
    """``total`` split in proportion to ``weights`` in integers summing to it (the last takes the remainder)."""
    w = sum(weights)
    if not w:
        return [0] * len(weights)
    parts = [total * x // w for x in weights]
    parts[-1] += total - sum(parts)
    return parts


def _drive(engine, items: list[tuple[str, list[int]]], params, batch: int) -> dict[str, tuple[Any, float]]:
    """Run ``items`` (key, prompt ids) with at most ``batch`` in flight, admitting the next as one finishes:
    key -> (its RequestOutput, its share of the wall time)."""
    from collections import deque

    pending = deque(items)
    inflight: dict[str, str] = {}  # request id -> key
    share: dict[str, float] = {}
    done: dict[str, tuple[Any, float]] = {}
    while pending or inflight:
        while pending and len(inflight) < batch:
            key, ids = pending.popleft()
            rid = engine.add_request({"prompt_token_ids": ids}, params)
            inflight[rid], share[rid] = key, 0.0
        t = time.perf_counter()
        finished = engine.step()
        dt = time.perf_counter() - t
        for rid in inflight:
            share[rid] += dt / len(inflight)
        for out in finished:
            key = inflight.pop(out.request_id, None)
            if key is not None:
                done[key] = (out, share.pop(out.request_id))
    return done


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


class Figures(msgspec.Struct):
    tokens: int
    tokens_per_s: float | None  # total tokens / total seconds
    baseline_tokens_per_s: float | None
    speedup: float | None  # their ratio: the ratio of means (specdec/experiment/speedup.py)
    speedup_ci95: list[float] | None  # its bootstrap 95% interval over prompts
    speedup_mean_of_ratios: float | None  # the mean of per-question ratios (Spec-Bench's tables)


def _figures(records: list[RequestRecord]) -> Figures:
    """tokens/s as total tokens over total seconds, the speedup as the ratio of the two (ratio of means) with its
    bootstrap interval over questions, and the mean of per-question ratios beside it."""
    from specdec.experiment.speedup import bootstrap_interval, mean_of_ratios, ratio_of_means

    toks = sum(r.num_generated_tokens for r in records)
    secs = sum(r.seconds for r in records)
    tps = toks / secs if secs > 0 else None
    if not records or any(r.baseline_seconds is None for r in records):
        return Figures(toks, tps, None, None, None, None)
    spec = [(r.num_generated_tokens, r.seconds) for r in records]
    base = [(r.baseline_num_generated_tokens if r.baseline_num_generated_tokens is not None
             else r.num_generated_tokens, r.baseline_seconds) for r in records]
    bsecs = sum(s for _, s in base)
    btps = sum(t for t, _ in base) / bsecs if bsecs > 0 else None
    ci = bootstrap_interval(spec, base)
    return Figures(toks, tps, btps, ratio_of_means(spec, base), list(ci) if ci else None, mean_of_ratios(spec, base))


def _category(recs: list[RequestRecord], speculative: bool, k: int = 0, slots: int = 0) -> CategorySummary:
    """``slots``: draft tokens a step may propose (k for a chain, the budget for a tree): draft_coverage is the
    share of them filled over the decode steps."""
    from specdec.datamodel.metrics import sum_counts, tau

    counts = sum_counts([r.acceptance_counts for r in recs if r.acceptance_counts])
    drafts = sum(r.num_draft_tokens for r in recs)
    f = _figures(recs)
    return CategorySummary(
        num_prompts=len(recs), num_generated_tokens=f.tokens,
        mean_acceptance_length=tau(counts) if counts[0] else None,
        acceptance_rate=sum(counts[1:]) / drafts if (speculative and drafts) else None,
        tokens_per_s=f.tokens_per_s or 0.0, baseline_tokens_per_s=f.baseline_tokens_per_s, speedup=f.speedup,
        speedup_ci95=f.speedup_ci95, speedup_mean_of_ratios=f.speedup_mean_of_ratios,
        draft_coverage=drafts / (slots * counts[0]) if (speculative and slots and counts[0]) else None,
        **_theory(recs, counts, k if speculative else 0, f.speedup),
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
    # the longest path a step can accept (a tree: its depth, or a grafted branch's length past it); counters that grew
    # past it (metrics.record_acceptance) widen it
    k = max([llm.llm_engine.num_speculative_tokens] + [len(r.acceptance_counts) - 1 for r in records if r.acceptance_counts])
    top1 = getattr(getattr(llm, "worker", None), "top1", None)  # a synthetic llm (tests) may have no worker
    slots = (top1.shape.budget if top1.shape is not None else top1.k) if top1 is not None else 0
    by_cat: dict[str, list[RequestRecord]] = {}
    for r in records:
        by_cat.setdefault(r.category, []).append(r)
    per_task = {task: _category([r for r in records if r.category in cats], speculative, k, slots)
                for task, cats in SPEC_BENCH_TASKS.items() if any(r.category in cats for r in records)}
    overall = _category(records, speculative, k, slots)
    t1 = _baseline_step_s(records)
    counts = sum_counts([r.acceptance_counts for r in records if r.acceptance_counts])
    checked = [r.greedy_match for r in records if r.greedy_match is not None]
    return RunSummary(
        config=msgspec.to_builtins(rc), num_prompts=len(records), num_generated_tokens=overall.num_generated_tokens,
        mean_acceptance_length=overall.mean_acceptance_length, acceptance_rate=overall.acceptance_rate,
        acceptance_per_position=per_position(counts), tokens_per_s=overall.tokens_per_s,
        baseline_tokens_per_s=overall.baseline_tokens_per_s, speedup=overall.speedup,
        speedup_ci95=overall.speedup_ci95, speedup_mean_of_ratios=overall.speedup_mean_of_ratios,
        draft_coverage=overall.draft_coverage,
        per_category={cat: _category(recs, speculative, k, slots) for cat, recs in by_cat.items()},
        greedy_mismatches=(len(checked) - sum(checked)) if (greedy and checked) else None,
        wall_time_s=wall, step_time_s=llm.get_metrics().mean_step_time_s, requests=records,
        baseline_step_time_s={} if t1 is None else {"step": t1},
        **{f: getattr(overall, f) for f in Theory.__struct_fields__},
        per_task=per_task, components=dict(parts or {}),
        engine=llm.engine.describe(), threads=thread_report(),
        latency=latency_summary(records), **policy_figures(llm),
    )


def main() -> None:
    import sys

    import hydra

    sys.argv[1:] = flagship(open_options(sys.argv[1:]))  # proposer.options.x=1 without a +; the default run

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
    def _main(cfg) -> None:
        run(cfg)

    _main()


if __name__ == "__main__":
    main()
