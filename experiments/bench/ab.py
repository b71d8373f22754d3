"""A/B of two git revisions of specdec, side by side in one run: the same prompts, interleaved.

    python -m experiments.bench.ab --rev-a c23d200 --rev-b HEAD [--configs plain,ngram,eagle,eagle_chain,eagle3_ngram]
        [--categories mt_bench,summarization,...] [--per-category 2] [--max-new-tokens 128] [--threads 2]

Each revision is checked out in a temporary git worktree and runs in its own process (two versions of
one package cannot share an interpreter), with its model loaded once. The driver sends one prompt to A,
waits, then the same prompt to B, then the next prompt (B first on odd prompts), so drift in the
machine's speed hits both alike. Greedy, batch 1, the chat template, first turns of Spec-Bench questions.
Prints per config: tokens/s of A and B (mean over prompts), the ratio B/A with its spread over prompts (median,
min-max of the per-prompt ratios), tau of each, whether the two revisions emitted the same tokens, and the host's
memory read rate (``W.sum()`` over the default model's bf16 bytes) after the config's first prompt and its last: this host's
memory phase moves a speculative step's cost by up to 1.5x (experiments/LOG.md), so a ratio is read beside it.

``exp:NAME`` runs what ``python -m specdec.run +experiment=NAME`` builds at each revision: its own conf/ composed
by its own compose code (``exp:eagle``: the shipped EAGLE-2 tree, head and draft vocabulary; ``exp:medusa``,
``exp:draft_model``, ...); ``eagle3_ngram`` is ``exp:eagle3_ngram``. The fixed ``eagle`` config above is the old one.

Why: issue #14 rewrote the speculative layer and asks that the benchmark figures stay within noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
READ_BYTES = 269 << 20  # the default model's bf16 weights: the read rate (W.sum) printed beside each config's figures

# config name -> speculative_config per revision layout ("old": before the one-stack redesign, heads/ and
# options.features; "new": checkpoints/); None = plain decoding
CONFIGS = {
    "plain": lambda layout: None,
    "ngram": lambda layout: {"method": "ngram", "num_speculative_tokens": 10, "prompt_lookup_max": 3},
    "eagle": lambda layout: {
        "method": "eagle", "num_speculative_tokens": 3, "scorer": "tree", "tree_depth": 3, "tree_topk": 3,
        "tree_budget": 6, "model": f"{'heads' if layout == 'old' else 'checkpoints'}/smollm2-135m-instruct-eagle",
        "options": {"draft_vocab_size": 2048, **({"features": "exact"} if layout == "old" else {})}},
    "eagle_chain": lambda layout: {
        "method": "eagle", "num_speculative_tokens": 2,
        "model": f"{'heads' if layout == 'old' else 'checkpoints'}/smollm2-135m-instruct-eagle",
        "options": {"draft_vocab_size": 2048, **({"features": "exact"} if layout == "old" else {})}},
}

# configs read from each revision's own conf/experiment/<name>.yaml (a tree proposer's shape and options), so a
# revision that changed the experiment is measured as it ships it
EXPERIMENTS = ("eagle3_ngram",)


COMPOSE = r'''
import json, sys
from hydra import compose, initialize_config_dir
import importlib
# the revision's own code decides what its experiment means (the package moved in issue #42); decided by the files
# the revision has, not by trying imports (an editable install of another revision may answer them)
compose_mod = importlib.import_module(sys.argv[3])
parse_config, speculative_config = compose_mod.parse_config, compose_mod.speculative_config
with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    cfg = compose(config_name="config", overrides=["+experiment=" + sys.argv[2]])
print(json.dumps(speculative_config(parse_config(cfg))))
'''


def experiment_spec(path: Path, name: str) -> dict | None:
    """The speculative_config that ``python -m specdec.run +experiment=<name>`` builds at the revision checked out
    in ``path``: composed by that revision's own conf/ and its own compose code, in a process of its own (None =
    plain decoding)."""
    path = Path(path).resolve()
    module = "specdec.experiment.compose" if (path / "specdec" / "experiment" / "compose.py").exists() else "specdec.compose"
    res = subprocess.run([sys.executable, "-c", COMPOSE, str(path / "conf"), name, module], cwd=path, text=True,
                         capture_output=True, env={**os.environ, "PYTHONPATH": str(path)})
    if res.returncode != 0:
        raise RuntimeError(f"composing +experiment={name} at {path} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


WORKER = r'''
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[1]))
from specdec import LLM, SamplingParams
llms = {}
for line in sys.stdin:
    req = json.loads(line)
    name, spec = req["config"], req["spec"]
    if name not in llms:  # configs run one after another: free the last one (two processes hold ~12 GB each)
        llms.clear()
        __import__("gc").collect()
        llms[name] = LLM("smollm2-135m-instruct", max_num_seqs=1, max_model_len=4096, speculative_config=spec)
    llm = llms[name]
    sp = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"])
    if req.get("warmup"):
        llm.generate([{"prompt_token_ids": req["ids"][:64]}], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": req["ids"]}], sp, use_tqdm=False)[0]
    dt = time.perf_counter() - t
    c = out.metrics.spec_token_acceptance_counts or [1]
    toks = list(out.outputs[0].token_ids)
    print(json.dumps({"tokens": toks, "seconds": dt, "steps": c[0] if c and c[0] else len(toks)}), flush=True)
'''


def worktree(rev: str, root: Path) -> Path:
    path = root / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev], check=True,
                   capture_output=True)
    return path


def layout(path: Path) -> str:
    return "new" if (path / "checkpoints").is_dir() else "old"


class Runner:
    def __init__(self, path: Path, threads: int) -> None:
        self.path, self.layout = path, layout(path)
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(threads)], cwd=path, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, "PYTHONPATH": str(path)})
        self.specs: dict[str, dict | None] = {}

    def run(self, config: str, ids: list[int], max_tokens: int, warmup: bool) -> dict:
        if config not in self.specs:
            if config in EXPERIMENTS or config.startswith("exp:"):
                self.specs[config] = experiment_spec(self.path, config.removeprefix("exp:"))
            else:
                self.specs[config] = CONFIGS[config](self.layout)
        spec = self.specs[config]
        self.proc.stdin.write(json.dumps({"config": config, "spec": spec, "ids": ids, "max_tokens": max_tokens,
                                          "warmup": warmup}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker of {self.path} died; run it by hand to see why")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev-a", required=True)
    ap.add_argument("--rev-b", default="HEAD")
    ap.add_argument("--configs", default="plain,ngram,eagle,eagle_chain")
    ap.add_argument("--categories", default="mt_bench")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    from specdec.engine.bench import read_rate_gbs
    from specdec.experiment.data import load_spec_bench
    from specdec.engine.loader import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    cats = args.categories if args.categories in ("all", "mt_bench") else args.categories.split(",")
    prompts = load_spec_bench(cats, per_category=args.per_category)
    texts = [tok.apply_chat_template([{"role": "user", "content": p.turns[0]}], add_generation_prompt=True,
                                     tokenize=False) for p in prompts]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]  # as LLM.chat_prompt_ids
    with tempfile.TemporaryDirectory() as tmp:
        paths = [worktree(args.rev_a, Path(tmp)), worktree(args.rev_b, Path(tmp))]
        runners = [Runner(p, args.threads) for p in paths]
        try:
            rows = {}
            for config in args.configs.split(","):
                res = {0: [], 1: []}
                for i, x in enumerate(ids):
                    order = (0, 1) if i % 2 == 0 else (1, 0)
                    for r in order:
                        res[r].append(runners[r].run(config, x, args.max_new_tokens, warmup=i == 0))
                    if i == 0:  # the host's memory phase, taken while both runners wait (loaded and warm by now)
                        rate0 = read_rate_gbs(READ_BYTES)
                tps = [statistics.mean(len(o["tokens"]) / o["seconds"] for o in res[r]) for r in (0, 1)]
                tau = [sum(len(o["tokens"]) for o in res[r]) / sum(o["steps"] for o in res[r]) for r in (0, 1)]
                same = sum(a["tokens"] == b["tokens"] for a, b in zip(res[0], res[1]))
                # the spread: per prompt, B's tokens/s over A's (the two ran back to back on the same prompt)
                per = sorted((len(b["tokens"]) / b["seconds"]) / (len(a["tokens"]) / a["seconds"])
                             for a, b in zip(res[0], res[1]))
                rate1 = read_rate_gbs(READ_BYTES)
                rows[config] = dict(tps_a=tps[0], tps_b=tps[1], ratio=tps[1] / tps[0], tau_a=tau[0], tau_b=tau[1],
                                    same_tokens=f"{same}/{len(ids)}", ratio_per_prompt_median=statistics.median(per),
                                    ratio_per_prompt_min=per[0], ratio_per_prompt_max=per[-1],
                                    read_rate_gbs={"start": rate0, "end": rate1})
                print(f"{config:16s} A {tps[0]:6.2f} tok/s  B {tps[1]:6.2f} tok/s  B/A {tps[1] / tps[0]:.3f} "
                      f"(per prompt: median {statistics.median(per):.3f}, {per[0]:.3f}-{per[-1]:.3f}, n={len(per)})  "
                      f"tau A {tau[0]:.3f} B {tau[1]:.3f}  same tokens {same}/{len(ids)}  "
                      f"read rate {rate0:.1f} -> {rate1:.1f} GB/s", flush=True)
            print(json.dumps({"rev_a": args.rev_a, "rev_b": args.rev_b, "prompts": len(ids), **rows}))
        finally:
            for r in runners:
                r.close()
            for p in paths:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(p)], capture_output=True)


if __name__ == "__main__":
    main()
