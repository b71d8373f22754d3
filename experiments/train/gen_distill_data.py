"""Self-distillation data for the draft heads: the target's own responses to the prompt pool, as token
ids, in resumable shards. Features (hidden states) are *not* stored: experiments/distill/prefill.py
recomputes them from these ids on any machine. A Hydra app (conf/gen_distill_data.yaml): ``main`` is a thin
wrapper around ``run(cfg)``.

    python -m experiments.distill.build_prompts --out data/distill        # the pool, once (committed)
    nohup nice -n 19 python -m experiments.train.gen_distill_data pool=data/distill \
        out=~/.cache/specdec/distill/smollm2-gen threads=1 > gen.log 2>&1 &
    # killed? run the same command again: finished shards are kept, the pool is resumed where it stopped

Generation goes through specdec's own engine (``specdec.LLM``: continuous batching, ``batch`` sequences
at once), with each pool prompt's own temperature (0 = greedy or 0.7, alternating along the pool) and
seed, chat-templated by build_prompts.py exactly as ``specdec.experiment.run`` does. Prompts are taken in pool
order (any prefix of the pool is a balanced mix), so a longer run only adds data.

dtype: float32 by default, the target that ``+experiment=eagle`` runs and the heads are measured
against; bf16 would be ~1.8x faster on an AVX512_BF16 CPU but its tokens differ from the fp32 target's.

A shard (``shard_00000.npz``, written atomically every ``shard_size`` finished sequences, so a killed
job loses at most the sequences of one unfinished shard) holds ``prompt_id`` [n], ``tokens`` (response ids,
flat) with ``offsets`` [n+1], ``finish`` [n] (0 stop, 1 length, 2 error), ``temperature``, ``seed`` and
a ``meta`` JSON string. It knows nothing about hidden states or training.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from experiments.train.common import options

FINISH = {"stop": 0, "length": 1}  # anything else (error, abort) -> 2


def load_pool(pool: Path) -> dict[str, np.ndarray]:
    z = np.load(pool / "prompts.npz")
    return {k: z[k] for k in z.files}


def prompt_ids(pool: dict, i: int) -> list[int]:
    return pool["tokens"][pool["offsets"][i]:pool["offsets"][i + 1]].astype(np.int64).tolist()


def read_shards(out: Path) -> list[dict]:
    """Every finished shard in ``out`` (sorted by name), as dicts of arrays."""
    shards = []
    for p in sorted(out.glob("shard_*.npz")):
        with np.load(p) as z:
            shards.append({k: z[k] for k in z.files} | {"file": p.name})
    return shards


def write_shard(out: Path, index: int, rows: list[dict], meta: dict) -> Path:
    path = out / f"shard_{index:05d}.npz"
    if path.exists():
        raise FileExistsError(f"{path} exists: another generator writes to {out}? Stop it, or use another out=")
    toks = [r["tokens"] for r in rows]
    tmp = out / f".{path.name}.tmp.npz"
    np.savez_compressed(
        tmp, prompt_id=np.array([r["prompt_id"] for r in rows], dtype=np.int64),
        tokens=np.array([t for x in toks for t in x], dtype=np.uint16 if all(max(x, default=0) < 65536 for x in toks)
                        else np.int32),
        offsets=np.cumsum([0] + [len(x) for x in toks]).astype(np.int64),
        finish=np.array([r["finish"] for r in rows], dtype=np.uint8),
        temperature=np.array([r["temperature"] for r in rows], dtype=np.float32),
        seed=np.array([r["seed"] for r in rows], dtype=np.int64), meta=np.array(json.dumps(meta)))
    os.replace(tmp, path)  # atomic: a shard is there whole or not at all
    return path


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except Exception:  # noqa: BLE001 - no git: not recorded
        return None


def run(cfg) -> dict:
    """Generate as conf/gen_distill_data.yaml's keys say; ``cfg`` is a DictConfig (``common.compose(
    "gen_distill_data", [...])``) or a plain mapping of every key. Returns the run's figures."""
    from specdec import LLM, SamplingParams

    args = options(cfg, "gen_distill_data")

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    pool = load_pool(Path(args.pool))
    n_pool = len(pool["offsets"]) - 1
    shards = read_shards(out)
    done = {int(i) for s in shards for i in s["prompt_id"]}
    have_tokens = sum(int(s["offsets"][-1]) for s in shards)
    ids = [i for i in range(min(n_pool, args.limit or n_pool)) if i not in done]
    max_prompt = max((len(prompt_ids(pool, i)) for i in ids), default=1)
    llm = LLM(args.model, max_num_seqs=args.batch, max_model_len=max_prompt + args.max_new_tokens,
              dtype=args.dtype, num_threads=args.threads)
    eng = llm.engine
    meta = {"model": args.model, "dtype": str(eng.dtype).removeprefix("torch."), "max_new_tokens": args.max_new_tokens,
            "batch": args.batch, "pool": str(args.pool), "commit": git_commit(),
            "engine": type(eng).__name__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    print(f"pool {n_pool} prompts, {len(done)} done in {len(shards)} shards ({have_tokens} response tokens); "
          f"{len(ids)} to go; batch {args.batch}, dtype {meta['dtype']}, threads {torch.get_num_threads()}", flush=True)
    target = args.target_tokens
    bar = tqdm(total=target, initial=min(have_tokens, target), unit="tok", unit_scale=True, desc="distill",
               mininterval=args.bar_interval, smoothing=0.05, dynamic_ncols=True)
    buf: list[dict] = []
    n_shard = (max((int(s["file"][6:11]) for s in shards), default=-1) + 1)
    stats = {"new_tokens": 0, "prompt_tokens": 0, "sequences": 0, "seconds": 0.0}
    t0 = time.perf_counter()

    def flush() -> None:
        nonlocal n_shard
        if buf:
            write_shard(out, n_shard, buf, meta | {"written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
            n_shard += 1
            buf.clear()

    def on_term(signum, frame):  # SIGTERM (kill): keep what is finished, then stop like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    queue = iter(ids)
    in_flight = 0
    total = have_tokens
    try:
        while True:
            while in_flight < 2 * args.batch and total < target:  # keep the scheduler's waiting list short
                i = next(queue, None)
                if i is None:
                    break
                sp = SamplingParams(temperature=float(pool["temperature"][i]), seed=int(pool["seed"][i]),
                                    max_tokens=args.max_new_tokens)
                llm.add_request({"prompt_token_ids": prompt_ids(pool, i)}, sp, request_id=str(i))
                in_flight += 1
            if not llm.has_unfinished_requests():
                break
            for o in llm.step():
                in_flight -= 1
                i = int(o.request_id)
                c = o.outputs[0]
                buf.append({"prompt_id": i, "tokens": list(c.token_ids), "finish": FINISH.get(c.finish_reason, 2),
                            "temperature": float(pool["temperature"][i]), "seed": int(pool["seed"][i])})
                n = len(c.token_ids)
                stats["new_tokens"] += n
                stats["prompt_tokens"] += len(o.prompt_token_ids)
                stats["sequences"] += 1
                total += n
                bar.update(n)
                if len(buf) >= args.shard_size:
                    flush()
                    bar.set_postfix_str(f"{n_shard} shards, {len(done) + stats['sequences']} seqs", refresh=False)
    except KeyboardInterrupt:
        print("interrupted: writing the finished sequences, dropping the running ones", flush=True)
    finally:
        flush()
        bar.close()
    stats["seconds"] = time.perf_counter() - t0
    stats["tokens_per_s"] = stats["new_tokens"] / max(stats["seconds"], 1e-9)
    stats["total_response_tokens"] = total
    print(json.dumps(stats), flush=True)
    return stats


@hydra.main(version_base="1.3", config_path="conf", config_name="gen_distill_data")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
