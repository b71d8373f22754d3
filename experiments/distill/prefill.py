"""Recompute the target's features for the distillation token ids, in the shard format that
experiments/train/eagle.py, eagle3.py, medusa.py and mlp_speculator.py read (manifest.json + shard_*.pt).

    python -m experiments.distill.prefill --pool data/distill --responses data/distill/responses \
        --out ~/.cache/specdec/distill/smollm2-feat --threads 2

For every sequence (chat-templated prompt + the target's response, from build_prompts.py and
gen_distill_data.py) it runs the target once over all tokens but the last and keeps, per position, the
last-layer hidden state after the final norm ([T-1, D] fp16: the EAGLE-1 / Medusa feature, and through
the LM head the target's distribution) and the outputs of the EAGLE-3 layers
(``specdec.heads.config.eagle3_layers``, concatenated: [T-1, 3D] fp16), asked of the engine through
``ForwardBatch.hidden_layers``. fp16, not bf16: SmolLM2's residual stream reaches ~3e4, inside fp16's range,
and fp16 keeps 3 more mantissa bits; a non-finite value stops the run.

One feature shard per response shard, written atomically; a rerun skips the shards already there (resume),
then rewrites manifest.json. ~4.6 kB per token with the EAGLE-3 layers (--no-aux: ~1.2 kB). It knows
nothing about how the responses were generated.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from experiments.train.common import load_tensors
from experiments.train.gen_distill_data import load_pool, prompt_ids, read_shards


def sequences(pool: dict, categories: list[str], shard: dict) -> list[dict]:
    """Prompt + response token ids of a response shard's usable sequences (errors and empty ones dropped)."""
    out = []
    for j, pid in enumerate(shard["prompt_id"]):
        resp = shard["tokens"][shard["offsets"][j]:shard["offsets"][j + 1]].astype(np.int64).tolist()
        if shard["finish"][j] == 2 or not resp:
            continue
        p = prompt_ids(pool, int(pid))
        out.append({"prompt_id": int(pid), "tokens": p + resp, "n_prompt": len(p),
                    "source": categories[int(pid)] if categories else "", "temperature": float(shard["temperature"][j])})
    return out


def trace_sequences(trace: Path) -> list[dict]:
    """Prompt + output token ids of a token trace's requests (``python -m specdec.run trace=true``; its
    ``trace/requests.parquet``), numbered in trace order, with the request's category as the source: a
    benchmark's own text to score a head on (``python -m experiments.train.eagle heldout=CKPT val_frac=1``),
    never to train on."""
    import pyarrow.parquet as pq

    path = trace / "trace" / "requests.parquet"
    if not path.is_file():
        raise FileNotFoundError(f"--trace {trace}: no {path}; record one with python -m specdec.run trace=true")
    rows = pq.read_table(path, columns=["category", "prompt_ids", "output_ids"]).to_pylist()
    return [{"prompt_id": i, "tokens": list(r["prompt_ids"]) + list(r["output_ids"]), "n_prompt": len(r["prompt_ids"]),
             "source": r["category"] or "", "temperature": 0.0} for i, r in enumerate(rows) if r["output_ids"]]


@torch.inference_mode()
def features(engine, seqs: list[dict], layers: tuple[int, ...], batch_tokens: int):
    """(hidden [sum(T-1), D] fp16, aux [sum(T-1), len(layers)*D] fp16 or None), sequence after sequence."""
    from specdec.engine import ForwardBatch

    hid, aux = [], []
    i = 0
    while i < len(seqs):
        group, n = [], 0  # sequences sharing one forward, up to batch_tokens tokens (at least one)
        while i < len(seqs) and len(group) < engine.num_slots and (not group or n + len(seqs[i]["tokens"]) <= batch_tokens):
            group.append(seqs[i])
            n += len(seqs[i]["tokens"]) - 1
            i += 1
        slots = [engine.allocate_slot() for _ in group]
        try:
            feeds = [s["tokens"][:-1] for s in group]
            out = engine.forward(ForwardBatch(
                token_ids=torch.tensor([t for f in feeds for t in f], dtype=torch.long), slots=slots,
                query_lens=[len(f) for f in feeds], logits_indices=torch.zeros(1, dtype=torch.long),
                hidden_layers=layers))
        finally:
            for s in slots:
                engine.free_slot(s)
        hid.append(out.hidden_states.half())
        if layers:
            aux.append(torch.cat(out.aux_hidden_states, dim=-1).half())
    h = torch.cat(hid)
    a = torch.cat(aux) if layers else None
    if not torch.isfinite(h).all() or (a is not None and not torch.isfinite(a).all()):
        raise RuntimeError("prefill: a hidden state overflowed fp16; store float32 instead")
    return h, a


def write_manifest(out: Path, meta: dict) -> dict:
    shards = []
    for p in sorted(out.glob("shard_*.pt")):
        d = load_tensors(p, mmap=True)  # the ids only: do not read GBs of features
        shards.append({"file": p.name, "prompt_indices": d["prompt_indices"], "num_tokens": sum(map(len, d["tokens"]))})
    manifest = meta | {"shards": shards, "num_sequences": sum(len(s["prompt_indices"]) for s in shards),
                       "num_tokens": sum(s["num_tokens"] for s in shards)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def save_shard(path: Path, seqs: list[dict], h: torch.Tensor, a: torch.Tensor | None) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"prompt_indices": [x["prompt_id"] for x in seqs], "sources": [x["source"] for x in seqs],
                "tokens": [x["tokens"] for x in seqs], "num_prompt_tokens": [x["n_prompt"] for x in seqs],
                "temperature": [x["temperature"] for x in seqs], "hidden": h, "aux": a}, tmp)
    os.replace(tmp, path)


def open_engine(args, longest: int) -> tuple:
    """(the target's engine for sequences up to ``longest`` tokens, the EAGLE-3 layers to keep (() with
    --no-aux), the manifest's description of both)."""
    from specdec.engine.loader import load_engine
    from specdec.heads.config import eagle3_layers

    engine = load_engine(args.model, num_slots=16, max_model_len=max(longest, args.batch_tokens) + 1, dtype=args.dtype)
    layers = () if args.no_aux else eagle3_layers(engine.num_layers)
    meta = {"model": args.model, "dtype": args.dtype, "hidden_layers": list(layers), "hidden_size": engine.hidden_size}
    return engine, layers, meta


def prefill_trace(trace: Path, out: Path, args) -> dict:
    """``--trace``: the trace's sequences as ``out/shard_00000.pt`` and a manifest."""
    seqs = trace_sequences(trace)
    engine, layers, meta = open_engine(args, max(len(x["tokens"]) for x in seqs))
    h, a = features(engine, seqs, layers, args.batch_tokens)
    save_shard(out / "shard_00000.pt", seqs, h, a)
    manifest = write_manifest(out, meta | {"trace": str(trace)})
    print(f"{len(seqs)} traced sequences, {manifest['num_tokens']} tokens in {out}", flush=True)
    return manifest


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--pool", default="data/distill")
    ap.add_argument("--responses", default="data/distill/responses", help="gen_distill_data.py's shard dir")
    ap.add_argument("--out", default="~/.cache/specdec/distill/smollm2-feat")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-aux", action="store_true", help="skip the EAGLE-3 layers (4x smaller)")
    ap.add_argument("--batch-tokens", type=int, default=2048, help="tokens per forward")
    ap.add_argument("--limit-shards", type=int, default=None)
    ap.add_argument("--first-shard", type=int, default=0, help="skip the response shards before this index")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--trace", default=None, metavar="DIR", help="instead of the pool: a token trace's requests "
                    "(prompt + output ids) as one shard, to score heads on a benchmark's text (not to train on)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    if args.trace:
        return prefill_trace(Path(args.trace), out, args)
    pool = load_pool(Path(args.pool))
    cats_path = Path(args.pool) / "prompts.jsonl.gz"
    categories: list[str] = []
    if cats_path.exists():
        import gzip

        with gzip.open(cats_path, "rt") as f:
            categories = [json.loads(x)["category"] for x in f]
    resp = read_shards(Path(args.responses).expanduser())[args.first_shard:][: args.limit_shards]
    todo = [s for s in resp if not (out / s["file"].replace(".npz", ".pt")).exists()]
    longest = max((len(x["tokens"]) for s in todo for x in sequences(pool, categories, s)), default=2)
    engine, layers, meta = open_engine(args, longest)
    meta |= {"pool": str(args.pool), "responses": str(args.responses)}
    print(f"{len(resp)} response shards, {len(resp) - len(todo)} already prefilled; layers {layers}", flush=True)
    n_tok, t0 = 0, time.perf_counter()
    bar = tqdm(total=sum(int(s["offsets"][-1]) for s in todo), unit="tok", unit_scale=True, desc="prefill (resp. tok)")
    for s in todo:
        seqs = sequences(pool, categories, s)
        h, a = features(engine, seqs, layers, args.batch_tokens)
        save_shard(out / s["file"].replace(".npz", ".pt"), seqs, h, a)
        n_tok += sum(len(x["tokens"]) - 1 for x in seqs)
        bar.update(int(s["offsets"][-1]))
    bar.close()
    manifest = write_manifest(out, meta)
    dt = time.perf_counter() - t0
    print(f"prefilled {n_tok} tokens in {dt:.0f} s ({n_tok / max(dt, 1e-9):.0f} tok/s); {manifest['num_sequences']} "
          f"sequences, {manifest['num_tokens']} tokens in {out}", flush=True)
    return manifest


if __name__ == "__main__":
    main()
