"""Structured outputs on SmolLM2 (#47): do greedy JSON-schema outputs parse and validate, plain and speculative?

    python -m experiments.bench.guided [--limit 50] [--configs plain,ngram,eagle3_ngram] [--max-tokens 128]

For each schema of data/guided/schemas.jsonl (50, of six shapes: flat, enums, numbers, patterns, arrays, nested;
see data/guided/README.md) the chat prompt gives the task and the schema, and the output is guided by the schema
(``GuidedDecodingParams(json=schema, disable_any_whitespace=True)``), greedy, ``--max-tokens`` at most. Per
config: the share of outputs that parse (``json.loads``, strict: raw control characters in a string fail) and
that validate (jsonschema), finish reasons, whether the tokens equal plain decoding's (speculation must change
nothing), tau, and the wall time. Then the grammar's mask cost per token: a fresh matcher replays each plain
output (fill the bitmask, unpack it to the [V] mask the sampler applies, accept the token), median per token.
``eagle3_ngram`` is the speculative_config that ``python -m specdec.run +experiment=eagle3_ngram`` builds.
Writes nothing; prints one table. Run it alone on the machine: the wall times are only comparable in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

SCHEMAS = Path(__file__).resolve().parents[2] / "data" / "guided" / "schemas.jsonl"
CONFIGS = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": 4}, "eagle3_ngram": "exp:eagle3_ngram"}


def experiment_spec(name: str) -> dict | None:
    """The speculative_config of ``+experiment=<name>`` (conf/experiment), composed as specdec.run does."""
    from hydra import compose, initialize_config_dir

    from specdec.experiment.compose import parse_config, speculative_config

    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=" + name])
    return speculative_config(parse_config(cfg))


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


def mask_cost_us(llm, outputs: list[list[int]], params: list) -> float:
    """Median microseconds per token of fill + unpack + accept along each output, on a fresh matcher."""
    import xgrammar as xgr

    from specdec.core.validate import grammar_compiler
    from specdec.sampling.guided import unpack_bitmask

    V = llm.engine.vocab_size
    compiler = grammar_compiler(llm.tokenizer, V, llm.llm_engine.eos_token_id)  # what the engine builds
    per = []
    for out, sp in zip(outputs, params):
        if not out:
            continue
        compiled = compiler.compile(sp.guided_decoding)
        m = xgr.GrammarMatcher(compiled)
        bm = xgr.allocate_token_bitmask(1, V)
        t0 = time.perf_counter()
        for t in out:
            if m.is_terminated():
                break
            m.fill_next_token_bitmask(bm)
            unpack_bitmask(bm, V)
            m.accept_token(t)
        per.append((time.perf_counter() - t0) / len(out))
    return 1e6 * statistics.median(per) if per else float("nan")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemas", default=str(SCHEMAS))
    ap.add_argument("--limit", type=int, default=50, help="the first N schemas")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="max_num_seqs: rows are verified among others, as served")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from specdec import LLM, SamplingParams
    from specdec.datamodel.sampling_params import GuidedDecodingParams

    rows = [json.loads(line) for line in Path(args.schemas).read_text().splitlines() if line.strip()][: args.limit]
    target = LLM("smollm2-135m-instruct", max_num_seqs=args.batch, max_model_len=2048)
    prompts = [{"prompt_token_ids": target.chat_prompt_ids([{
        "role": "user", "content": f"{r['task']} Reply with one JSON object that follows this JSON schema: "
                                   f"{json.dumps(r['schema'])}"}])} for r in rows]
    params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                             guided_decoding=GuidedDecodingParams(json=r["schema"], disable_any_whitespace=True))
              for r in rows]
    print(f"# {len(rows)} schemas, greedy, max_tokens={args.max_tokens}, batch {args.batch}, "
          f"engine {target.engine.describe()}, torch threads {torch.get_num_threads()}")
    print(f"{'config':<14} {'parse':>7} {'valid':>7} {'stop':>5} {'length':>6} {'error':>5} {'= plain':>8} "
          f"{'tau':>5} {'tokens':>7} {'seconds':>8}")
    ref: list[list[int]] | None = None
    failures: dict[str, list[str]] = {}
    for name in args.configs.split(","):
        spec = CONFIGS[name]
        spec = experiment_spec(spec.removeprefix("exp:")) if isinstance(spec, str) else spec
        llm = target if spec is None else target.with_speculation(spec)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        toks = [list(o.outputs[0].token_ids) for o in outs]
        ok = [check(o.outputs[0].text, r["schema"]) for o, r in zip(outs, rows)]
        reasons = [o.outputs[0].finish_reason for o in outs]
        same = "-" if ref is None else f"{sum(a == b for a, b in zip(toks, ref))}/{len(rows)}"
        if name == "plain" or ref is None:
            ref = toks
        tau = llm.get_metrics().mean_acceptance_length if spec is not None else 1.0
        n = len(rows)
        print(f"{name:<14} {100 * sum(p for p, _ in ok) / n:6.1f}% {100 * sum(v for _, v in ok) / n:6.1f}% "
              f"{reasons.count('stop'):>5} {reasons.count('length'):>6} {reasons.count('error'):>5} {same:>8} "
              f"{tau:5.2f} {sum(map(len, toks)):>7} {dt:8.1f}", flush=True)
        failures[name] = [f"{r['name']} ({o.outputs[0].finish_reason}): {o.outputs[0].text[:100]!r}"
                          for o, r, (_, v) in zip(outs, rows, ok) if not v]
    print(f"mask cost per token (fill + unpack + accept, median over outputs): "
          f"{mask_cost_us(target, ref, params):.1f} us")
    for name, bad in failures.items():
        for line in bad:
            print(f"  {name}: not valid: {line}")


if __name__ == "__main__":
    main()
