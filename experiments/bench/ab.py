"""A/B of two git revisions of specdec, side by side in one run: the same prompts, interleaved.

    python -m experiments.bench.ab --rev-a c23d200 --rev-b HEAD [--configs plain,ngram,eagle,eagle_chain,eagle3_ngram]
        [--categories mt_bench,summarization,...] [--per-category 2] [--max-new-tokens 128] [--threads 2]

Each revision is checked out in a temporary git worktree and runs in its own process (two versions of
one package cannot share an interpreter), with its model loaded once. The driver sends one prompt to A,
waits, then the same prompt to B, then the next prompt (B first on odd prompts), so drift in the
machine's speed hits both alike. Greedy, batch 1, the chat template, first turns of Spec-Bench questions.
Prints per config: tokens/s of A and B (mean over prompts), the ratio B/A, tau of each, and whether the
two revisions emitted the same tokens.

``eagle3_ngram`` is read from each revision's conf/experiment/eagle3_ngram.yaml (its tree and n-gram branch);
``exp:NAME`` reads any conf/experiment/NAME.yaml the same way (``exp:eagle``: the shipped EAGLE-2 tree, head and
draft vocabulary, where the ``eagle`` config above is the old fixed one).

Why: issue #14 rewrote the speculative layer and asks that the benchmark figures stay within noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

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


def experiment_spec(path: Path, name: str) -> dict:
    """The speculative_config that ``+experiment=<name>`` composes at the revision checked out in ``path`` (its
    own conf/, composed by Hydra: the experiment's tree and options over its proposer's defaults and head)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(Path(path).resolve() / "conf"), version_base="1.3"):
        c = compose(config_name="config", overrides=[f"+experiment={name}"])
    p, sc = OmegaConf.to_container(c.proposer), OmegaConf.to_container(c.scorer)
    method = p["_target_"].rsplit(".", 1)[0].rsplit(".", 1)[-1]  # proposers.eagle3.Eagle3Proposer -> eagle3
    return {"method": method, "num_speculative_tokens": p["num_speculative_tokens"], "scorer": "tree",
            "tree_depth": sc["tree_depth"], "tree_topk": sc["tree_topk"], "tree_budget": sc["tree_budget"],
            **{k: p[k] for k in ("model", "prompt_lookup_min", "prompt_lookup_max") if k in p},
            "options": p.get("options", {})}


WORKER = r'''
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[1]))
from specdec import LLM, SamplingParams
llms = {}
for line in sys.stdin:
    req = json.loads(line)
    name, spec = req["config"], req["spec"]
    if name not in llms:
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
                                     env={**__import__("os").environ, "PYTHONPATH": str(path)})

    def run(self, config: str, ids: list[int], max_tokens: int, warmup: bool) -> dict:
        if config in EXPERIMENTS or config.startswith("exp:"):
            spec = experiment_spec(self.path, config.removeprefix("exp:"))
        else:
            spec = CONFIGS[config](self.layout)
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

    from specdec.experiment.data import load_spec_bench
    from specdec.engine.loader import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    prompts = load_spec_bench(args.categories, per_category=args.per_category)
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
                tps = [statistics.mean(len(o["tokens"]) / o["seconds"] for o in res[r]) for r in (0, 1)]
                tau = [sum(len(o["tokens"]) for o in res[r]) / sum(o["steps"] for o in res[r]) for r in (0, 1)]
                same = sum(a["tokens"] == b["tokens"] for a, b in zip(res[0], res[1]))
                rows[config] = dict(tps_a=tps[0], tps_b=tps[1], ratio=tps[1] / tps[0], tau_a=tau[0], tau_b=tau[1],
                                    same_tokens=f"{same}/{len(ids)}")
                print(f"{config:12s} A {tps[0]:6.2f} tok/s  B {tps[1]:6.2f} tok/s  B/A {tps[1] / tps[0]:.3f}  "
                      f"tau A {tau[0]:.3f} B {tau[1]:.3f}  same tokens {same}/{len(ids)}", flush=True)
            print(json.dumps({"rev_a": args.rev_a, "rev_b": args.rev_b, "prompts": len(ids), **rows}))
        finally:
            for r in runners:
                r.close()
            for p in paths:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(p)], capture_output=True)


if __name__ == "__main__":
    main()
