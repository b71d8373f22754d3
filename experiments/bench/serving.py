"""Serving under load: Poisson arrivals at several request rates, speculation off and on, in one run.

    # the real run (a quiet machine: nothing else running), SmolLM2-135M, n-gram k=4 vs plain:
    python -m experiments.bench.serving --model smollm2-135m-instruct --experiment ngram \
        --rates 0.25,0.5,1,2,inf --num-prompts 64 --max-tokens 128 --tpot-slo 0.1 --out experiments/results/serving
    # a smoke test in seconds:
    python -m experiments.bench.serving --model tiny-random-llama --rates 2,inf --num-prompts 6 --max-tokens 16

    # the speculation policy (#44): plain, static n-gram and the goodput policy, side by side in one run
    python -m experiments.bench.serving --experiment ngram,ngram_goodput --check ngram_goodput \
        --rates 0.25,0.5,1,2,inf --num-prompts 64 --max-tokens 128 --out experiments/results/serving-policy

Modes: ``off`` (plain decoding) and one per ``--experiment`` (comma separated; its name is the mode's). Every
mode's server (``python -m specdec.serve`` on a free port) is started and healthy before any rate runs; idle, a
server waits on its socket. Then for each rate every mode runs the same prompts once, one after another, in an
order that rotates from rate to rate, so drift in the machine's speed hits every mode alike (the split overhead at
batch 1, one request at a time: server TPOT vs the in-process ``LLM``'s, when ``--split-overhead``, is taken
first for ``off``). Each run sends the Spec-Bench prompts (one turn, chat endpoint,
streaming, greedy) at the rate with exponential inter-arrival times (``inf``: all at once), and records per
request TTFT (first content chunk), ITL (gaps between content chunks), TPOT ((e2e - TTFT) / (tokens - 1)),
and per rate the throughput (output tokens/s), request rate, goodput (requests/s whose TPOT <= ``--tpot-slo``)
and the engine core's busy share (its step seconds / wall seconds, from /metrics). ``--url`` benchmarks a
server that is already running instead (one mode). Writes ``serving.json``, ``serving.md`` (the table) and
``serving.png`` (throughput, TTFT and TPOT against the rate, per mode) under ``--out``. ``--repeats N`` runs every
mode N times at each rate (the order rotating from repeat to repeat) and reports each figure's median over them, with
each run's tokens/s and median TPOT and their spread: on a noisy 2-core host one run's saturated median TPOT moved
by 10-20% from run to run of the same code. ``--check MODE`` adds, per
rate, MODE's output tokens/s and median TPOT against the best of the other modes, with #44's verdict (within 3% of
the best at every rate, better than every other mode at two rates or more).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from specdec.datamodel.metrics import percentiles


# ----------------------------------------------------------------------------------------------- server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, experiment: str | None, port: int, extra: list[str]) -> subprocess.Popen:
    model_group = "model=tiny" if model == "tiny-random-llama" else f"model.name={model}"
    cmd = [sys.executable, "-m", "specdec.serve", model_group, f"serve.port={port}", "serve.log_level=warning", *extra]
    if experiment:
        cmd.insert(3, f"+experiment={experiment}")
    print("starting:", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd)


def wait_health(url: str, proc: subprocess.Popen | None, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}/health not ok after {timeout} s")


def step_seconds(url: str) -> float:
    """The engine core's summed step time so far (specdec_engine_step_seconds_total)."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("specdec_engine_step_seconds_total"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


# ----------------------------------------------------------------------------------------------- client
async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    chunks: list[float] = []
    tokens = 0
    error = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if "error" in msg:
                error = msg["error"]["message"]
                continue
            if msg.get("usage"):
                tokens = msg["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in msg.get("choices", [])):
                chunks.append(time.perf_counter())
    e2e = time.perf_counter() - t0
    if error:
        return {"error": error}
    ttft = chunks[0] - t0 if chunks else e2e  # no text at all (e.g. EOS first): the finish is the first token
    return {"ttft": ttft, "e2e": e2e, "tokens": tokens, "itl": [b - a for a, b in zip(chunks, chunks[1:])],
            "tpot": (e2e - ttft) / (tokens - 1) if tokens > 1 else None}


async def run_rate(url: str, model: str, prompts: list[str], rate: float, max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600), limits=limits) as client:
        t0 = time.perf_counter()
        busy0 = step_seconds(url)
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(one_request(client, url, model, p, max_tokens)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    busy = step_seconds(url) - busy0
    return {"rate": rate, "wall_s": wall, "busy_share": busy / wall, "results": results}


def summarize(run: dict, tpot_slo: float) -> dict:
    ok = [r for r in run["results"] if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    row = {"rate": run["rate"], "completed": len(ok), "errors": len(run["results"]) - len(ok),
           "throughput_tok_s": tokens / run["wall_s"], "request_rate": len(ok) / run["wall_s"],
           "goodput_req_s": sum(1 for r in ok if r["tpot"] is not None and r["tpot"] <= tpot_slo) / run["wall_s"],
           "core_busy_share": run["busy_share"],
           "error_examples": sorted({r["error"][:160] for r in run["results"] if "error" in r})[:3]}
    for name in ("ttft", "tpot"):
        for k, v in percentiles([r[name] for r in ok if r[name] is not None]).items():
            row[f"{name}_{k}"] = v
    for k, v in percentiles([x for r in ok for x in r["itl"]]).items():
        row[f"itl_{k}"] = v
    return row


def merge(rows: list[dict]) -> dict:
    """One cell from its repeated runs (``--repeats``): each figure's median over the runs, each run's output
    tokens/s and median TPOT listed (``runs_throughput_tok_s``, ``runs_tpot_p50``) and their spread (max / min - 1).
    The medians are taken figure by figure, so a row's figures need not come from one run."""
    import statistics

    if len(rows) == 1:
        return rows[0]
    out = {k: (statistics.median([r[k] for r in rows]) if isinstance(v, (int, float)) and not isinstance(v, bool)
               else v) for k, v in rows[0].items()}
    out["error_examples"] = sorted({e for r in rows for e in r["error_examples"]})[:3]
    out["repeats"] = len(rows)
    for k in ("throughput_tok_s", "tpot_p50"):
        runs = [r[k] for r in rows]
        out[f"runs_{k}"] = runs
        out[f"spread_{k}"] = max(runs) / min(runs) - 1 if min(runs) > 0 else math.nan
    return out


# ----------------------------------------------------------------------------------------------- overhead
def split_overhead(url: str, model: str, prompts: list[str], max_tokens: int, model_name: str) -> dict:
    """TPOT of one request at a time: through the server (core in its own process) vs the in-process LLM."""
    from specdec import LLM, SamplingParams

    served = [asyncio.run(run_rate(url, model, [p], float("inf"), max_tokens, 0))["results"][0] for p in prompts]
    llm = LLM(model_name, max_num_seqs=1, max_model_len=4096)
    tok = llm.tokenizer
    local = []
    for p in prompts:
        ids = tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False),
                  add_special_tokens=False)["input_ids"]
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
        local.append(out.latency.tpot)
    s = [r["tpot"] for r in served if r.get("tpot")]
    loc = [x for x in local if x]
    mean_s, mean_l = sum(s) / len(s), sum(loc) / len(loc)
    return {"server_tpot_s": mean_s, "inprocess_tpot_s": mean_l, "overhead": mean_s / mean_l - 1}


# ----------------------------------------------------------------------------------------------- report
def check(rows_by_mode: dict[str, list[dict]], mode: str, tolerance: float = 0.03) -> dict:
    """``mode`` against the best other mode at each rate: output tokens/s >= (1 - tolerance) x the best other's
    and median TPOT <= (1 + tolerance) x the best other's; "above" where it beats every other mode on both."""
    others = [m for m in rows_by_mode if m != mode]
    rates, lines, ok_all, above = [], [f"Check: {mode} against the best of {others} (tolerance {tolerance:.0%}):"], True, 0
    for i, row in enumerate(rows_by_mode[mode]):
        best_tput = max(rows_by_mode[m][i]["throughput_tok_s"] for m in others)
        best_tpot = min(rows_by_mode[m][i]["tpot_p50"] for m in others)
        ok = (row["throughput_tok_s"] >= (1 - tolerance) * best_tput
              and row["tpot_p50"] <= (1 + tolerance) * best_tpot)
        wins = row["throughput_tok_s"] > best_tput and row["tpot_p50"] < best_tpot
        ok_all &= ok
        above += wins
        rates.append({"rate": row["rate"], "throughput_vs_best": row["throughput_tok_s"] / best_tput,
                      "tpot_vs_best": row["tpot_p50"] / best_tpot, "within": ok, "above": wins})
        spread = ""
        if "runs_tpot_p50" in row:  # repeated runs: the medians' spreads, this mode's and the best other's
            other = min(others, key=lambda m: rows_by_mode[m][i]["tpot_p50"])
            spread = (f" (medians of {row['repeats']} runs; TPOT p50 spread {row['spread_tpot_p50']:.0%} here, "
                      f"{rows_by_mode[other][i].get('spread_tpot_p50', math.nan):.0%} for {other})")
        lines.append(f"- rate {row['rate']:g}: tokens/s x{row['throughput_tok_s'] / best_tput:.3f}, TPOT p50 "
                     f"x{row['tpot_p50'] / best_tpot:.3f} of the best other -> {'ok' if ok else 'BELOW'}"
                     f"{', above every other' if wins else ''}{spread}")
    met = ok_all and above >= 2
    lines.append(f"- {'met' if met else 'NOT met'}: within at every rate {ok_all}, above every other at {above} rates")
    return {"mode": mode, "rates": rates, "met": met, "text": "\n".join(lines)}



COLS = ["rate", "completed", "errors", "throughput_tok_s", "request_rate", "goodput_req_s", "ttft_p50", "ttft_p99",
        "tpot_p50", "tpot_p99", "itl_p50", "itl_p99", "core_busy_share"]


def table(rows_by_mode: dict[str, list[dict]]) -> str:
    lines = ["| mode | " + " | ".join(COLS) + " |", "|" + "---|" * (len(COLS) + 1)]
    for mode, rows in rows_by_mode.items():
        for row in rows:
            lines.append(f"| {mode} | " + " | ".join(f"{row[c]:.4g}" if isinstance(row[c], float) else str(row[c])
                                                  for c in COLS) + " |")
    return "\n".join(lines)


def plot(rows_by_mode: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for mode, rows in rows_by_mode.items():
        finite = [r for r in rows if math.isfinite(r["rate"])]
        xs = [r["rate"] for r in finite]
        axes[0].plot(xs, [r["throughput_tok_s"] for r in finite], "o-", label=mode)
        for q, style in (("p50", "o-"), ("p99", "x--")):
            axes[1].plot(xs, [r[f"ttft_{q}"] for r in finite], style, label=f"{mode} {q}")
            axes[2].plot(xs, [r[f"tpot_{q}"] for r in finite], style, label=f"{mode} {q}")
    for ax, title in zip(axes, ("output tokens/s", "TTFT (s)", "TPOT (s)")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--experiment", default="ngram",
                    help="the speculative modes' +experiment names (conf/experiment/), comma separated")
    ap.add_argument("--rates", default="0.25,0.5,1,2,inf", help="requests/s, comma separated; inf = all at once")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tpot-slo", type=float, default=0.1, help="goodput objective: TPOT at most this (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--url", default=None, help="benchmark this running server (one mode) instead of starting them")
    ap.add_argument("--split-overhead", action="store_true", help="also measure the process split at batch 1")
    ap.add_argument("--server-arg", action="append", default=[], help="extra Hydra override for the servers")
    ap.add_argument("--check", default=None, help="a mode to hold against the best of the others (#44's target)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each mode at each rate (the order rotating); a cell holds their medians and spread")
    ap.add_argument("--out", default="experiments/results/serving")
    args = ap.parse_args()

    from specdec.experiment.data import load_spec_bench

    qs = load_spec_bench()
    random.Random(args.seed).shuffle(qs)
    prompts = [q.turns[0] for q in qs[:args.num_prompts]]
    rates = [float(r) for r in args.rates.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    experiments = [e for e in args.experiment.split(",") if e]
    modes = {"url": None} if args.url else {"off": None, **{e: e for e in experiments}}
    if args.check and args.check not in modes:
        raise SystemExit(f"serving.py: --check {args.check!r} is not a mode; modes are {list(modes)}")
    rows_by_mode: dict[str, list[dict]] = {m: [] for m in modes}
    overhead = {}
    servers: dict[str, tuple[subprocess.Popen | None, str, str]] = {}  # mode -> (process, url, served model)
    try:
        for mode, experiment in modes.items():
            proc, url = None, args.url
            if url is None:
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                proc = start_server(args.model, experiment, port, args.server_arg)
            servers[mode] = (proc, url, "")
            wait_health(url, proc)
            served = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            servers[mode] = (proc, url, served)
            asyncio.run(run_rate(url, served, prompts[:2], float("inf"), 8, args.seed))  # warm up
        if args.split_overhead:
            mode = next(iter(modes))
            _, url, served = servers[mode]
            overhead[mode] = split_overhead(url, served, prompts[:4], args.max_tokens, args.model)
            print(f"split overhead ({mode}): {overhead[mode]}", flush=True)
        names = list(modes)
        if args.repeats < 1:
            raise SystemExit(f"serving.py: --repeats {args.repeats} must be >= 1")
        for i, rate in enumerate(rates):
            runs: dict[str, list[dict]] = {m: [] for m in names}
            for rep in range(args.repeats):
                j = (i + rep) % len(names)
                for mode in names[j:] + names[:j]:  # rotating from rate to rate and from repeat to repeat
                    _, url, served = servers[mode]
                    run = asyncio.run(run_rate(url, served, prompts, rate, args.max_tokens, args.seed))
                    runs[mode].append(summarize(run, args.tpot_slo))
                    print(f"{mode} rate={rate}" + (f" run {rep + 1}" if args.repeats > 1 else "") + ": "
                          + " ".join(f"{k}={v:.4g}" for k, v in runs[mode][-1].items() if isinstance(v, float)),
                          flush=True)
            for mode in names:
                rows_by_mode[mode].append(merge(runs[mode]))
    finally:
        for proc, _, _ in servers.values():
            if proc is not None:
                proc.terminate()
                proc.wait(60)
    md = table(rows_by_mode)
    verdict = check(rows_by_mode, args.check) if args.check else None
    if verdict is not None:
        md += "\n\n" + verdict["text"]
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": args.model, "experiment": args.experiment,
            "repeats": args.repeats, "num_prompts": len(prompts), "max_tokens": args.max_tokens, "tpot_slo_s": args.tpot_slo,
            "cpu_count": os.cpu_count(), "command": " ".join(sys.argv)}
    (out / "serving.json").write_text(json.dumps({"meta": meta, "rows": rows_by_mode, "split_overhead": overhead, "check": verdict},
                                                 indent=1, default=str))
    (out / "serving.md").write_text(f"{json.dumps(meta)}\n\n{md}\n")
    plot(rows_by_mode, out / "serving.png")
    print(md)
    print(out / "serving.json")


if __name__ == "__main__":
    main()
