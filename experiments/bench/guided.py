"""Structured outputs on SmolLM2 (#47): do greedy JSON-schema outputs parse and validate, plain and speculative?

    python -m experiments.bench.guided [--limit 50] [--configs plain,ngram,eagle3_ngram] [--max-tokens 128] \
        [--threads 2] [--out experiments/results/<date>-guided-json-schemas.json]

For each schema of data/guided/schemas.jsonl (50, of six shapes: flat, enum, number, pattern, array, nested; see
data/guided/README.md) the chat prompt gives the task and the schema, and the output is guided by the schema
(``GuidedDecodingParams(json=schema, disable_any_whitespace=True)``), greedy, ``--max-tokens`` at most. Per
config, one markdown table row:

- parse: ``json.loads`` succeeds (strict: a raw control character in a string fails). An output cut by
  max_tokens is not complete JSON and counts as a failure (finish ``length``): the schemas are bounded so that
  their objects fit (data/guided/README.md); ``max tok`` is the longest output, the margin to the cut.
- valid: ``jsonschema.validate`` passes (the ``dev`` extra; pure Python).
- = plain: outputs whose tokens *and* finish reason equal plain decoding's (speculation must change nothing).
- grammar us/tok: seconds inside the grammar calls the workers make (``allowed_next`` in a plain step: fill +
  unpack the [B, V] mask; ``guide_proposals`` in a speculative one: walk the drafts, fill + unpack the masks of
  every scored position) per emitted token. Timed by wrapping those two functions for this run only (a
  measurement shim: the library carries no timer); the masked_fill on the logits is not in it.
- tok/s: emitted tokens over the wall time of ``generate`` (batch ``--batch``, rows verified among others).

Then the grammar's own cost per token, apart from the engine: a fresh matcher replays each plain output (fill the
bitmask, unpack it to the [V] mask the sampler applies, accept the token): the median of the outputs' means, and
all tokens pooled (mean, median, p99, max; mean with and without a ``maxLength`` string in the schema: the heavy
tail is there).
``eagle3_ngram`` is the speculative_config that ``python -m specdec.run +experiment=eagle3_ngram`` builds.
Prints the table and every failure; ``--out`` writes the figures and each output as JSON. Run it alone on the
machine: the wall times are only comparable within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "data" / "guided" / "schemas.jsonl"
CONFIGS = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": 4}, "eagle3_ngram": "exp:eagle3_ngram"}


def experiment_spec(name: str) -> dict | None:
    """The speculative_config of ``+experiment=<name>`` (conf/experiment), composed as specdec.run does."""
    from hydra import compose, initialize_config_dir

    from specdec.experiment.compose import parse_config, speculative_config

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=" + name])
    return speculative_config(parse_config(cfg))


def load_rows(path: str | Path, limit: int | None = None) -> list[dict]:
    """The schema rows ({"name", "shape", "task", "schema"}), the first ``limit``."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return rows[:limit]


def prompt_text(row: dict) -> str:
    return (f"{row['task']} Reply with one JSON object that follows this JSON schema: "
            f"{json.dumps(row['schema'])}")


def check(text: str, schema: dict) -> tuple[bool, bool]:
    """(parses, validates)."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError:
        return False, False
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return True, False
    return True, True


@contextlib.contextmanager
def grammar_timer():
    """Seconds and calls inside the workers' grammar entry points while the block runs (wrapped, then restored)."""
    from unittest import mock

    from specdec.core import plain_worker
    from specdec.spec_decode import spec_decode_worker

    acc = {"seconds": 0.0, "calls": 0}

    def timed(fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc["seconds"] += time.perf_counter() - t
                acc["calls"] += 1
        return wrapper

    with mock.patch.object(plain_worker, "allowed_next", timed(plain_worker.allowed_next)), \
            mock.patch.object(spec_decode_worker, "guide_proposals", timed(spec_decode_worker.guide_proposals)):
        yield acc


def replay_cost_us(llm, outputs: list[list[int]], params: list) -> list[list[float]]:
    """Microseconds of fill + unpack + accept at each token of each output, on a fresh matcher ([] for an empty
    output)."""
    import xgrammar as xgr

    from specdec.core.validate import grammar_compiler
    from specdec.sampling.guided import unpack_bitmask

    V = llm.engine.vocab_size
    compiler = grammar_compiler(llm.tokenizer, V, llm.llm_engine.eos_token_id)  # what the engine builds
    per = []
    for out, sp in zip(outputs, params):
        m = xgr.GrammarMatcher(compiler.compile(sp.guided_decoding))
        bm = xgr.allocate_token_bitmask(1, V)
        times = []
        for t in out:
            if m.is_terminated():
                break
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bm)
            unpack_bitmask(bm, V)
            m.accept_token(t)
            times.append(1e6 * (time.perf_counter() - t0))
        per.append(times)
    return per


def replay_summary(per: list[list[float]], rows: list[dict]) -> dict:
    """The replay's figures: per output (median of the outputs' means), per token (all tokens pooled), and pooled
    apart for the schemas with a ``maxLength`` string (xgrammar 0.2.8 makes it a bounded repetition of any character
    but a quote, a backslash or a line break, whose masks it cannot all precompute) and those without."""
    def has_max(r: dict) -> bool:
        return '"maxLength"' in json.dumps(r["schema"])

    def pooled(sel):
        ts = [t for times, r in zip(per, rows) if sel(r) for t in times]
        return sum(ts) / len(ts) if ts else float("nan")

    allt = sorted(t for times in per for t in times)
    return {"median_of_output_means": statistics.median([sum(t) / len(t) for t in per if t]),
            "pooled_mean": pooled(lambda r: True), "pooled_median": statistics.median(allt),
            "pooled_p99": allt[min(len(allt) - 1, int(0.99 * len(allt)))], "max": allt[-1],
            "pooled_mean_with_maxlength": pooled(has_max),
            "pooled_mean_without_maxlength": pooled(lambda r: not has_max(r)),
            "schemas_with_maxlength": sum(map(has_max, rows))}


HEADER = ("| config | parse | valid | stop | length | error | = plain | tau | tokens | max tok | tok/s "
          "| grammar us/tok | grammar % of wall |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def table_row(name: str, r: dict) -> str:
    return (f"| {name} | {r['parse_pct']:.1f}% | {r['valid_pct']:.1f}% | {r['finish']['stop']} | "
            f"{r['finish']['length']} | {r['finish']['error']} | {r['equal_plain']} | {r['tau']:.2f} | {r['tokens']} | "
            f"{r['max_tokens_out']} | {r['tokens_per_s']:.1f} | {r['grammar_us_per_token']:.1f} | "
            f"{100 * r['grammar_seconds'] / r['seconds']:.1f}% |")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemas", default=str(SCHEMAS))
    ap.add_argument("--limit", type=int, default=50, help="the first N schemas")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}; plain first")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the target (tests: tiny-random-llama)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="max_num_seqs: rows are verified among others, as served")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave torch's default)")
    ap.add_argument("--out", default=None, help="also write the figures and every output as JSON here")
    args = ap.parse_args(argv)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    if args.threads:
        torch.set_num_threads(args.threads)

    from specdec import LLM, SamplingParams
    from specdec.datamodel.sampling_params import GuidedDecodingParams
    from specdec.engine.bench import read_rate_gbs, weight_bytes

    rows = load_rows(args.schemas, args.limit)
    target = LLM(args.model, max_num_seqs=args.batch, max_model_len=2048)
    prompts = [{"prompt_token_ids": target.chat_prompt_ids([{"role": "user", "content": prompt_text(r)}])}
               for r in rows]
    params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                             guided_decoding=GuidedDecodingParams(json=r["schema"], disable_any_whitespace=True))
              for r in rows]
    nbytes = weight_bytes(target.engine)
    rate0 = read_rate_gbs(nbytes)
    print(f"# {len(rows)} schemas, greedy, max_tokens={args.max_tokens}, batch {args.batch}, model {args.model}, "
          f"engine {target.engine.describe()}, torch threads {torch.get_num_threads()}, read rate {rate0:.1f} GB/s")
    print(HEADER, flush=True)
    ref: tuple[list[list[int]], list[str]] | None = None
    results: dict[str, dict] = {}
    per_schema = [{"name": r["name"], "shape": r.get("shape", "-")} for r in rows]
    for name in names:
        spec = CONFIGS[name]
        spec = experiment_spec(spec.removeprefix("exp:")) if isinstance(spec, str) else spec
        llm = target if spec is None else target.with_speculation(spec)
        with grammar_timer() as g:
            t = time.perf_counter()
            outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
            dt = time.perf_counter() - t
        toks = [list(o.token_ids) for o in outs]
        reasons = [o.finish_reason for o in outs]
        ok = [check(o.text, r["schema"]) for o, r in zip(outs, rows)]
        if ref is None:
            ref = (toks, reasons)
        same = [a == b and ra == rb for a, b, ra, rb in zip(toks, ref[0], reasons, ref[1])]
        n, ntok = len(rows), sum(map(len, toks))
        results[name] = {
            "speculative_config": spec, "parse_pct": 100 * sum(p for p, _ in ok) / n,
            "valid_pct": 100 * sum(v for _, v in ok) / n,
            "finish": {k: reasons.count(k) for k in ("stop", "length", "error")},
            "equal_plain": "-" if name == names[0] else f"{sum(same)}/{n}",
            "tau": llm.get_metrics().mean_acceptance_length if spec is not None else 1.0,
            "tokens": ntok, "max_tokens_out": max(map(len, toks)), "seconds": dt, "tokens_per_s": ntok / dt,
            "grammar_seconds": g["seconds"], "grammar_calls": g["calls"],
            "grammar_us_per_token": 1e6 * g["seconds"] / max(ntok, 1),
        }
        for d, o, (p, v), s in zip(per_schema, outs, ok, same):
            d[name] = {"text": o.text, "tokens": len(o.token_ids), "finish": o.finish_reason, "parse": p,
                       "valid": v, "equal_plain": s, "token_ids": list(o.token_ids)}
        print(table_row(name, results[name]), flush=True)
    rate1 = read_rate_gbs(nbytes)
    per = replay_cost_us(target, ref[0], params)
    mc = replay_summary(per, rows)
    for d, times in zip(per_schema, per):
        d["replay_mask_us_per_token"] = sum(times) / len(times) if times else None
    print(f"\nmask cost per token on a fresh matcher (fill + unpack + accept along each {names[0]} output), us: "
          f"median of the outputs' means {mc['median_of_output_means']:.1f}; all tokens pooled: mean "
          f"{mc['pooled_mean']:.1f}, median {mc['pooled_median']:.1f}, p99 {mc['pooled_p99']:.0f}, max {mc['max']:.0f}; "
          f"pooled mean with a maxLength string {mc['pooled_mean_with_maxlength']:.1f} "
          f"({mc['schemas_with_maxlength']} schemas), without {mc['pooled_mean_without_maxlength']:.1f}")
    print(f"read rate {rate0:.1f} -> {rate1:.1f} GB/s")
    failures = [f"  {name}: {d['name']} ({d[name]['finish']}, {d[name]['tokens']} tokens"
                f"{'' if d[name]['parse'] else ', does not parse'}"
                f"{'' if d[name]['valid'] or not d[name]['parse'] else ', does not validate'}"
                f"{'' if d[name]['equal_plain'] else ', differs from ' + names[0]}): {d[name]['text'][:120]!r}"
                for name in names for d in per_schema
                if not d[name]["valid"] or not d[name]["equal_plain"]]
    print("failures:\n" + "\n".join(failures) if failures else "failures: none")
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "args": vars(args),
              "engine": target.engine.describe(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "read_rate_gbs": [rate0, rate1], "replay_mask_us_per_token": mc,
              "configs": results, "schemas": per_schema}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
