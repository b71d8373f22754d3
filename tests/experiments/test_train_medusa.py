"""experiments/train/medusa.py on the tiny model: a 2-step run on synthetic distillation shards (in
gen_distill_data.py's format) checkpoints, logs, exports heads that MedusaProposer loads and that keep
greedy outputs identical; --resume continues from the checkpoint; a failing W&B only warns."""

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from experiments.train import common, medusa
from specdec import LLM, SamplingParams
from specdec.engine import ForwardBatch
from specdec.engine.tiny import tiny_random_llama

@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Two shards of 6 sequences of random tokens (prompt + "response") with the tiny target's last-layer
    hidden states (fp16), as gen_distill_data.py writes them (the loss does not care who wrote the text)."""
    out = tmp_path_factory.mktemp("distill")
    eng = tiny_random_llama(0, num_slots=1, max_model_len=64)
    g = torch.Generator().manual_seed(0)
    manifest = {"shards": [], "model": "tiny-random-llama", "hidden_size": 64}
    for s in range(2):
        toks, n_prompt, hidden = [], [], []
        for _ in range(6):
            prompt = torch.randint(3, 259, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
            seq = prompt + torch.randint(3, 100, (20,), generator=g).tolist()
            slot = eng.allocate_slot()
            h = eng.forward(ForwardBatch(torch.tensor(seq[:-1]), [slot], [len(seq) - 1])).hidden_states
            eng.free_slot(slot)
            toks.append(seq)
            n_prompt.append(len(prompt))
            hidden.append(h.half())
        name = f"shard_{s:04d}.pt"
        torch.save({"prompt_indices": list(range(6)), "sources": ["generated"] * 6, "tokens": toks,
                    "num_prompt_tokens": n_prompt, "hidden": torch.cat(hidden), "aux": None}, out / name)
        manifest["shards"].append({"file": name, "prompt_indices": list(range(6)), "num_tokens": sum(map(len, toks))})
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def train(data, run, *extra) -> dict:
    """``python -m experiments.train.medusa data=... out=... <extra>`` on the tiny model, in process."""
    return medusa.run(common.compose("medusa", [f"data={data}", f"out={run}", "model=tiny-random-llama", "heads=3",
                                                "vocab=128", "batch=32", "warmup=1", "threads=1", *extra]))


def test_two_steps_export_resume(data, tmp_path):
    run, head = tmp_path / "run", tmp_path / "head"
    s = train(data, run, "steps=2", "no_wandb=true", f"export={head}")
    assert s["steps"] == 2 and (run / "ckpt.pt").is_file() and len(s["val_top1"]) == 3
    assert json.loads((run / "log.jsonl").read_text().splitlines()[-1])["final"]["steps"] == 2
    conf = json.loads((head / "config.json").read_text())
    assert conf["medusa_num_heads"] == 3 and conf["original_lm_head"] and conf["truncated_vocab_size"] == 128
    assert len(conf["topk_accuracy"]) == 3 and (head / "README.md").is_file()

    s2 = train(data, run, "steps=3", "no_wandb=true", "resume=true")  # continues at step 2
    assert s2["steps"] == 3
    assert torch.load(run / "ckpt.pt", weights_only=True)["step"] == 3

    llm = LLM("tiny-random-llama", max_num_seqs=2, max_model_len=128)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 50, 60, 70]}, {"prompt_token_ids": [9, 8, 7]}]
    got = llm.with_speculation({"method": "proposers.medusa:MedusaProposer", "model": str(head),
                                "num_speculative_tokens": 3}).generate(prompts, sp, use_tqdm=False)
    want = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_a_failing_wandb_only_warns(data, tmp_path, monkeypatch):
    fake = types.ModuleType("wandb")

    def init(**kw):
        raise RuntimeError("no W&B here")

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with pytest.warns(RuntimeWarning, match=r"W&B init failed \(RuntimeError: no W&B here\); the run goes on"):
        s = train(data, tmp_path / "run", "steps=1")
    assert s["steps"] == 1
