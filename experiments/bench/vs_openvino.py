"""Our engine against OpenVINO GenAI's LLMPipeline on the same prompts, side by side in one run (issue #43).

    python -m experiments.bench.vs_openvino --ov-python /path/to/venv/bin/python [--export] [--ov-model DIR]
        [--lengths 256,512] [--prompts 4] [--decode-tokens 64] [--precision bf16] [--threads 2]

OpenVINO GenAI is not a dependency of specdec: it lives in its own environment (it pins its own torch and
transformers), made once with

    python -m venv --system-site-packages /tmp/ovenv && /tmp/ovenv/bin/pip install openvino-genai "optimum-intel[openvino]"

``--export`` converts the local SmolLM2 checkpoint (``resolve_model_dir``, no hub) to OpenVINO IR with that
environment's ``optimum-cli export openvino --weight-format fp32`` into ``--ov-model``. The pipeline then runs in a
subprocess of ``--ov-python`` (this file's ``--worker`` mode), prefix caching off, ``INFERENCE_NUM_THREADS`` and
``INFERENCE_PRECISION_HINT`` set (bf16: the same arithmetic class as our bf16 engine; f32 against our fp32).

Prompts: the longest Spec-Bench prompts (chat template), cut to each of ``--lengths`` tokens, a distinct prompt per
measurement so no cache can serve one; for each, ours then OpenVINO (OpenVINO first on odd prompts), one warm-up
prompt each first. Per length: time to first token (ours: ``LLM.generate`` of 1 token, wall; OpenVINO: wall of
``generate`` of 1 token, and its own ``perf_metrics`` TTFT), min and median over prompts, and with
``--decode-tokens`` the time per output token after the first (ours: (wall of N tokens - wall of 1) / (N - 1);
OpenVINO: its TPOT). Both sides' greedy first tokens are compared. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def worker(model_dir: str, threads: int, precision: str) -> None:
    """--worker: an OpenVINO GenAI pipeline answering JSON lines {"ids": [...], "max_new_tokens": n} on stdin with
    {"wall_ms", "ttft_ms", "tpot_ms", "tokens"} on stdout."""
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    sc = og.SchedulerConfig()
    sc.enable_prefix_caching = False
    pipe = og.LLMPipeline(model_dir, "CPU", scheduler_config=sc, INFERENCE_NUM_THREADS=threads,
                          INFERENCE_PRECISION_HINT=precision)
    print(json.dumps({"ready": og.__version__}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        ids = np.array([req["ids"]], dtype=np.int64)
        cfg = og.GenerationConfig()
        cfg.max_new_tokens, cfg.min_new_tokens, cfg.do_sample = req["max_new_tokens"], req["max_new_tokens"], False
        t = time.perf_counter()
        r = pipe.generate(og.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids))), cfg)
        wall = (time.perf_counter() - t) * 1e3
        pm = r.perf_metrics
        tpot = pm.get_tpot().mean if req["max_new_tokens"] > 1 else None
        print(json.dumps({"wall_ms": wall, "ttft_ms": pm.get_ttft().mean, "tpot_ms": tpot,
                          "tokens": [int(x) for x in r.tokens[0]]}), flush=True)


class OpenVINO:
    def __init__(self, python: str, model_dir: str, threads: int, precision: str) -> None:
        self.p = subprocess.Popen([python, __file__, "--worker", "--ov-model", model_dir, "--threads", str(threads),
                                   "--precision", precision], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.version = json.loads(self._line())["ready"]

    def _line(self) -> str:
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise SystemExit(f"the OpenVINO worker stopped (exit {self.p.poll()}); run it alone to see why")
            if line.startswith("{"):
                return line

    def __call__(self, ids: list[int], n: int) -> dict:
        self.p.stdin.write(json.dumps({"ids": ids, "max_new_tokens": n}) + "\n")
        self.p.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=60)


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ov-python", default=None, help="a python with openvino_genai (see the docstring)")
    ap.add_argument("--ov-model", default="/tmp/specdec-ov/smollm2-135m-instruct", help="the exported IR directory")
    ap.add_argument("--export", action="store_true", help="export the local checkpoint to --ov-model first")
    ap.add_argument("--lengths", default="256,512")
    ap.add_argument("--prompts", type=int, default=4, help="timed prompts per length")
    ap.add_argument("--decode-tokens", type=int, default=64, help="0: time to first token only")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.ov_model, a.threads, a.precision)
        return None
    if not a.ov_python:
        raise SystemExit("--ov-python: the python of an environment with openvino_genai (see the docstring)")

    import torch

    from specdec import LLM, SamplingParams
    from specdec.engine.bench import read_rate_gbs, weight_bytes
    from specdec.engine.loader import resolve_model_dir
    from specdec.experiment.data import load_spec_bench

    torch.set_num_threads(a.threads)
    if a.export:
        cli = Path(a.ov_python).parent / "optimum-cli"
        subprocess.run([str(cli), "export", "openvino", "--model", str(resolve_model_dir("smollm2-135m-instruct")),
                        "--task", "text-generation-with-past", "--weight-format", "fp32", a.ov_model], check=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lengths = [int(x) for x in a.lengths.split(",")]
    ours = LLM("smollm2-135m-instruct", max_num_seqs=1, max_model_len=4096,
               dtype="bfloat16" if a.precision == "bf16" else "float32")
    ov = OpenVINO(a.ov_python, a.ov_model, a.threads, a.precision)
    # the longest prompts first: each measurement a distinct prompt, cut to the length
    texts = sorted((ours.chat_prompt_ids([{"role": "user", "content": q.turns[0]}]) for q in load_spec_bench(None, None)),
                   key=len, reverse=True)
    need = max(lengths)
    pool = [ids for ids in texts if len(ids) >= need]
    if len(pool) < a.prompts + 1:
        raise SystemExit(f"only {len(pool)} Spec-Bench prompts reach {need} tokens; lower --lengths or --prompts")

    def ours_run(ids: list[int], n: int) -> tuple[float, list[int]]:
        t = time.perf_counter()
        out = ours.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=n,
                                                                         ignore_eos=True), use_tqdm=False)
        return (time.perf_counter() - t) * 1e3, list(out[0].outputs[0].token_ids)

    rate0 = read_rate_gbs(weight_bytes(ours.engine))
    result: dict = {"args": {k: v for k, v in vars(a).items() if k != "worker"}, "openvino_genai": ov.version,
                    "engine": ours.engine.describe(), "read_gb_s": [rate0], "lengths": {}}
    for L in lengths:
        ours_run(pool[0][:L], 2), ov(pool[0][:L], 2)  # warm-up: one-off costs out of the figures
        rows = {"ours_ttft": [], "ov_ttft_wall": [], "ov_ttft": [], "ours_tpot": [], "ov_tpot": [], "same_first": 0}
        for i, ids in enumerate(pool[1: a.prompts + 1]):
            ids = ids[:L]
            sides = ["ours", "ov"] if i % 2 == 0 else ["ov", "ours"]
            first = {}
            for side in sides:
                if side == "ours":
                    w1, t1 = ours_run(ids, 1)
                    rows["ours_ttft"].append(w1)
                    first["ours"] = t1[0]
                    if a.decode_tokens > 1:
                        wn, _ = ours_run(ids, a.decode_tokens)
                        rows["ours_tpot"].append((wn - w1) / (a.decode_tokens - 1))
                else:
                    r = ov(ids, 1)
                    rows["ov_ttft_wall"].append(r["wall_ms"])
                    rows["ov_ttft"].append(r["ttft_ms"])
                    first["ov"] = r["tokens"][0]
                    if a.decode_tokens > 1:
                        rows["ov_tpot"].append(ov(ids, a.decode_tokens)["tpot_ms"])
            rows["same_first"] += first["ours"] == first["ov"]
        result["lengths"][L] = rows
    result["read_gb_s"].append(read_rate_gbs(weight_bytes(ours.engine)))
    ov.close()

    def mm(xs):
        return f"{min(xs):.1f} / {statistics.median(xs):.1f}" if xs else "-"

    print(f"\n# ours ({result['engine']['kernels']}, {a.precision}) vs OpenVINO GenAI {ov.version} "
          f"(INFERENCE_PRECISION_HINT={a.precision}, prefix caching off), {a.threads} threads, {a.prompts} prompts "
          f"per length; read rate {rate0:.1f} -> {result['read_gb_s'][1]:.1f} GB/s")
    print("| prompt tokens | ours TTFT ms (min / median) | OpenVINO TTFT ms, wall | OpenVINO TTFT ms, its metric | "
          "ours / OpenVINO (median, wall) | ours TPOT ms | OpenVINO TPOT ms | same first token |")
    print("|---|---|---|---|---|---|---|---|")
    for L, r in result["lengths"].items():
        ratio = statistics.median(r["ours_ttft"]) / statistics.median(r["ov_ttft_wall"])
        r["ttft_ratio"] = ratio
        print(f"| {L} | {mm(r['ours_ttft'])} | {mm(r['ov_ttft_wall'])} | {mm(r['ov_ttft'])} | {ratio:.2f} | "
              f"{mm(r['ours_tpot'])} | {mm(r['ov_tpot'])} | {r['same_first']}/{a.prompts} |")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
