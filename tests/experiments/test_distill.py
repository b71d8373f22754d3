"""The distillation-data pipeline on the tiny model, in seconds: distill/build_prompts.py (pool, de-dup, chat
template, sampling plan), train/gen_distill_data.py (sharded generation; a SIGKILLed run resumes and loses at
most one shard; reruns give the same tokens) and distill/prefill.py (features as train/common.py reads them)."""

import gzip
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from experiments.distill import build_prompts, prefill
from experiments.distill.dedup import dedup
from experiments.train import common, gen_distill_data

ROOT = Path(__file__).resolve().parents[2]
GEN = "experiments.train.gen_distill_data"  # python -m, from ROOT


def test_dedup_drops_near_duplicates_keeps_paraphrases():
    texts = ["Write a poem about the sea.", "write a poem about the sea!",  # same up to case/punctuation
             "The quick brown fox jumps over the lazy dog near the river bank today",
             "The quick brown fox jumps over the lazy dog near the river bank yesterday",  # Jaccard 9/11
             "Explain black holes to a child.", "Explain black holes to a small child."]  # Jaccard 3/7: kept
    assert dedup(texts) == [0, 2, 4, 5]


SOURCES: dict[str, Path] = {}  # the data folder the pool fixture used


def shared_data(tmp: Path) -> Path:
    """The shared data folder when this checkout has one (../shared/data), else a synthetic stand-in in its
    schema (a CI clone may sit anywhere): GSM8K-style questions and Self-Instruct-style seed tasks."""
    real = ROOT.parent / "shared" / "data"
    if (real / "gsm8k_train.jsonl").is_file() and (real / "self_instruct_seed_tasks.jsonl").is_file():
        return real
    tmp.mkdir(parents=True, exist_ok=True)
    gsm = [{"question": f"Sam has {i} apples and buys {i + 3} more. How many apples does Sam have now?",
            "answer": f"Sam has {i} + {i + 3} = <<{i}+{i + 3}={2 * i + 3}>>{2 * i + 3} apples.\n#### {2 * i + 3}"}
           for i in range(1000)]
    seeds = [{"id": f"seed_task_{i}", "name": f"task_{i}", "instruction": f"Write {i % 7 + 2} facts about topic {i}.",
              "instances": [{"input": "" if i % 2 else f"Topic {i}: the number {i}.", "output": f"Fact about {i}."}],
              "is_classification": False} for i in range(175)]
    (tmp / "gsm8k_train.jsonl").write_text("\n".join(json.dumps(r) for r in gsm) + "\n")
    (tmp / "self_instruct_seed_tasks.jsonl").write_text("\n".join(json.dumps(r) for r in seeds) + "\n")
    return tmp


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pool")
    data = SOURCES["data"] = shared_data(tmp_path_factory.mktemp("data"))
    build_prompts.main(["--model", "tiny-random-llama", "--out", str(out), "--data", str(data), "--small",
                        "--self-instruct-requests", "8", "--batch", "4", "--max-prompt-tokens", "3000"])
    return out


def test_pool_is_consistent_and_templated(pool):
    with gzip.open(pool / "prompts.jsonl.gz", "rt") as f:
        rows = [json.loads(x) for x in f]
    z = np.load(pool / "prompts.npz")
    assert len(rows) == len(z["offsets"]) - 1 == len(z["temperature"]) > 100
    assert [r["id"] for r in rows] == list(range(len(rows)))
    assert z["temperature"][:2].tolist() == pytest.approx([0.0, 0.7]) and len(set(z["seed"])) == len(rows)
    assert {"math", "coding", "rag", "translation", "multi_turn"} <= {r["category"] for r in rows}
    assert all(r["licence"] for r in rows)
    from specdec.engine.loader import load_tokenizer

    tok = load_tokenizer("tiny-random-llama")
    for i in (0, len(rows) - 1):  # ids are the chat template of the messages, as specdec.experiment.run builds them
        text = tok.apply_chat_template(rows[i]["messages"], add_generation_prompt=True, tokenize=False)
        ids = z["tokens"][z["offsets"][i]:z["offsets"][i + 1]].tolist()
        assert ids == tok(text, add_special_tokens=False)["input_ids"]
    # never a Spec-Bench question (decontamination check: the evaluation prompts are only read here)
    from specdec.experiment.data import spec_bench_path

    bench = spec_bench_path()  # the vendored Spec-Bench questions
    if bench.exists():
        turns = {t.strip() for x in bench.read_text().splitlines() if x.strip() for t in json.loads(x)["turns"]}
        assert not turns & {m["content"].strip() for r in rows for m in r["messages"]}
    # deterministic: a second build gives the same pool
    again = pool.parent / "again"
    build_prompts.main(["--model", "tiny-random-llama", "--out", str(again), "--data", str(SOURCES["data"]), "--small",
                        "--max-prompt-tokens", "3000", "--self-instruct-requests", "0"])
    assert np.array_equal(np.load(again / "prompts.npz")["tokens"][:5000], z["tokens"][:5000]) or \
        (pool / "self_instruct_target.jsonl").read_text().strip()  # the target's tasks can change the order


def gen(pool, out, *extra):
    """The overrides of a tiny generation run (``python -m experiments.train.gen_distill_data <these>``)."""
    return ["model=tiny-random-llama", f"pool={pool}", f"out={out}", "batch=4", "max_new_tokens=12", "shard_size=4",
            "threads=1", "bar_interval=0", *extra]


def gen_process(pool, out, *extra) -> list[str]:
    return [sys.executable, "-m", GEN, *gen(pool, out, *extra)]


def load(out):
    shards = gen_distill_data.read_shards(out)
    return {int(p): (s["tokens"][s["offsets"][j]:s["offsets"][j + 1]].tolist(), float(s["temperature"][j]))
            for s in shards for j, p in enumerate(s["prompt_id"])}


@pytest.fixture(scope="module")
def responses(pool, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gen")
    gen_distill_data.run(common.compose("gen_distill_data", gen(pool, out, "limit=24")))
    return out


def test_generator_shards_every_prompt_once(responses, pool):
    got = load(responses)
    assert sorted(got) == list(range(24))
    assert len(list(responses.glob("shard_*.npz"))) == 6
    z = np.load(pool / "prompts.npz")
    assert all(t == z["temperature"][i] for i, (_, t) in got.items())
    meta = json.loads(str(np.load(responses / "shard_00000.npz")["meta"]))
    assert meta["dtype"] == "float32" and meta["model"] == "tiny-random-llama"


def test_generator_resumes_after_sigkill(pool, responses, tmp_path):
    out = tmp_path / "killed"
    p = subprocess.Popen(gen_process(pool, out, "limit=24"), cwd=ROOT, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    t0 = time.time()
    while not (out / "shard_00001.npz").exists() and p.poll() is None and time.time() - t0 < 120:
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)  # no chance to flush: the unfinished shard is lost
    p.wait()
    before = load(out)
    assert len(before) % 4 == 0  # whole shards only (8 of 24 sequences when this was written)
    subprocess.run(gen_process(pool, out, "limit=24"), cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    after = load(out)
    assert sorted(after) == list(range(24))
    assert all(after[i] == before[i] for i in before)  # finished shards untouched
    assert after == load(responses)  # per-sequence seeds: the same tokens whatever the batch or the run


def test_prefill_features_match_the_engine(pool, responses, tmp_path):
    out = tmp_path / "feat"
    argv = ["--model", "tiny-random-llama", "--pool", str(pool), "--responses", str(responses), "--out", str(out),
            "--batch-tokens", "256", "--threads", "1"]
    man = prefill.main(argv)
    assert len(man["shards"]) == 6 and man["num_sequences"] == 24 and man["hidden_layers"]
    d = torch.load(out / "shard_00000.pt", weights_only=True)
    n = sum(len(t) - 1 for t in d["tokens"])
    D = man["hidden_size"]
    assert d["hidden"].shape == (n, D) and d["aux"].shape == (n, 3 * D) and d["hidden"].dtype == torch.float16
    from specdec.engine import ForwardBatch
    from specdec.engine.loader import load_engine

    seq = d["tokens"][1]
    eng = load_engine("tiny-random-llama", num_slots=1, max_model_len=max(1024, len(seq)))
    slot = eng.allocate_slot()
    o = eng.forward(ForwardBatch(torch.tensor(seq[:-1]), [slot], [len(seq) - 1], hidden_layers=tuple(man["hidden_layers"])))
    r0 = len(d["tokens"][0]) - 1
    torch.testing.assert_close(d["hidden"][r0:r0 + len(seq) - 1].float(), o.hidden_states, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(d["aux"][r0:r0 + len(seq) - 1, D:2 * D].float(), o.aux_hidden_states[1], atol=2e-3, rtol=2e-3)
    # resumable: a rerun skips every shard; the training scripts read the result
    mtime = (out / "shard_00000.pt").stat().st_mtime
    prefill.main(argv)
    assert (out / "shard_00000.pt").stat().st_mtime == mtime
    seqs = common.load_data(out, need_aux=True)
    assert len(seqs) == 24 and seqs[0]["aux"].shape[1] == 3 * D


def test_prefill_first_shard_skips_the_earlier_ones(pool, responses, tmp_path):
    out = tmp_path / "feat-tail"
    man = prefill.main(["--model", "tiny-random-llama", "--pool", str(pool), "--responses", str(responses), "--out",
                        str(out), "--batch-tokens", "256", "--threads", "1", "--first-shard", "4"])
    assert [s["file"] for s in man["shards"]] == ["shard_00004.pt", "shard_00005.pt"]
    assert sorted(p for s in man["shards"] for p in s["prompt_indices"]) == list(range(16, 24))


def test_prefill_trace_scores_a_benchmark_text(tmp_path):
    """--trace: a token trace's requests (prompt + output ids) become one feature shard in the training
    scripts' format, the category as each sequence's source; a request with no output is left out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    trace = tmp_path / "trace-run"
    (trace / "trace").mkdir(parents=True)
    rows = {"category": ["writing", "math", "qa"], "prompt_ids": [[1, 5, 9, 13], [1, 7, 8], [1, 2]],
            "output_ids": [[20, 21, 22, 23, 24], [30, 31, 32], []]}
    pq.write_table(pa.table(rows), trace / "trace" / "requests.parquet")
    out = tmp_path / "feat-trace"
    man = prefill.main(["--model", "tiny-random-llama", "--trace", str(trace), "--out", str(out), "--threads", "1"])
    assert man["num_sequences"] == 2 and man["trace"] == str(trace)
    d = torch.load(out / "shard_00000.pt", weights_only=True)
    assert d["sources"] == ["writing", "math"] and d["num_prompt_tokens"] == [4, 3]
    assert d["tokens"] == [[1, 5, 9, 13, 20, 21, 22, 23, 24], [1, 7, 8, 30, 31, 32]]
    assert d["hidden"].shape[0] == 8 + 5 and d["aux"].shape == (13, 3 * man["hidden_size"])
    with pytest.raises(FileNotFoundError, match="trace=true"):
        prefill.main(["--model", "tiny-random-llama", "--trace", str(tmp_path), "--out", str(out)])


# ------------------------------------------------------------------ magpie.py: a pool the target writes itself

def test_dedup_near_probes_without_keeping():
    from experiments.distill.dedup import MinHashDeduper

    d = MinHashDeduper(0.5)
    assert d.add("Explain how a rainbow forms after the rain.")
    assert d.near("explain how a rainbow forms after the rain!")
    assert not d.near("Write a haiku about autumn leaves falling.")
    assert d.add("Write a haiku about autumn leaves falling.")  # near() kept nothing: still new


def test_magpie_filters():
    from experiments.distill import magpie

    assert magpie.clean("  Can you help me plan a trip to Lisbon?  ", "stop") == "Can you help me plan a trip to Lisbon?"
    assert magpie.clean("Can you help me plan a trip", "length") is None  # cut off, not ended by the target
    assert magpie.clean("Hi there", "stop") is None  # too short
    assert magpie.clean("1234 5678 9999 0000 ### $$$", "stop") is None  # not text
    assert magpie.clean("Tell me a joke<|im_end|> please now", "stop") is None


def test_magpie_refuses_to_renumber_a_pool_with_responses(tmp_path):
    from experiments.distill import magpie

    (tmp_path / "responses").mkdir()
    (tmp_path / "responses" / "shard_00000.npz").write_bytes(b"")
    with pytest.raises(SystemExit, match="already has responses"):
        magpie.main(["--out", str(tmp_path), "--requests", "1"])


@pytest.mark.slow
def test_magpie_pool_on_the_target(tmp_path):
    """The real target writes user turns from its bare pre-query template; the pool is in build_prompts.py's
    format, its ids are the chat template of its messages, and no turn is a Spec-Bench turn."""
    from experiments.distill import magpie
    from specdec.engine.loader import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    pre = magpie.pre_query_ids(tok)
    full = tok(tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True,
                                       tokenize=False), add_special_tokens=False)["input_ids"]
    assert full[:len(pre)] == pre and tok.decode(pre).endswith("<|im_start|>user\n")
    st = magpie.main(["--out", str(tmp_path), "--pool", str(tmp_path / "none"), "--requests", "32",
                      "--max-tokens", "64", "--threads", "2"])
    n = st["num_prompts"]
    assert n >= 8 and st["magpie"]["requests"] == 32 and st["by_category"] == {"magpie": n}
    with gzip.open(tmp_path / "prompts.jsonl.gz", "rt") as f:
        rows = [json.loads(x) for x in f]
    z = np.load(tmp_path / "prompts.npz")
    assert len(rows) == n and len(z["offsets"]) == n + 1
    assert {r["temperature"] for r in rows} == {0.0, 0.7} and min(z["seed"]) >= 10_000_000 * magpie.SEED_OFFSET
    for i in (0, n - 1):
        ids = z["tokens"][z["offsets"][i]:z["offsets"][i + 1]].tolist()
        assert ids == tok(tok.apply_chat_template(rows[i]["messages"], add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)["input_ids"]
    bench = set(magpie.benchmark_turns())
    assert len(bench) > 100 and not bench & {r["messages"][0]["content"] for r in rows}


def test_committed_pools_are_decontaminated_and_disjoint():
    """Every committed pool (data/distill and the Magpie pools under it): no message is a Spec-Bench turn, and no
    prompt appears in two pools, so one pool's held-out split is never another's training data."""
    from experiments.distill import magpie

    bench = set(magpie.benchmark_turns())
    paths = sorted((ROOT / "data" / "distill").glob("**/prompts.jsonl.gz"))
    assert len(paths) >= 2
    seen: dict[str, Path] = {}
    for p in paths:
        with gzip.open(p, "rt") as f:
            assert not bench & {m["content"].strip() for x in f if x.strip() for m in json.loads(x)["messages"]}, p
        for t in set(magpie.pool_texts(p.parent)):
            assert t not in seen, f"{p} repeats a prompt of {seen.get(t)}"
            seen[t] = p
