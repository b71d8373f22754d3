"""experiments/train/mlp_speculator.py on the tiny model, in seconds: a 2-step run on synthetic feature
shards (prefill.py's format) checkpoints, logs, evaluates (reduced and full vocabulary) and exports a
target-tied speculator (proj/ln only; MLPSpeculatorProposer fills emb/head from the target's own, which the
trainer froze); resume=true continues and export_full=true writes the complete IBM layout (emb/head stored, equal to
the target's); MLPSpeculatorProposer loads either export and greedy output stays identical to plain greedy;
the trainer's state chain is MLPSpeculator.stage's; a failing W&B only warns."""

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from experiments.train import common, mlp_speculator
from proposers.mlp_speculator import MLPSpeculatorProposer
from specdec import LLM
from specdec.engine import ForwardBatch
from specdec.engine.tiny import tiny_config, tiny_random_llama, tiny_random_weights
from specdec.heads.mlp_speculator import TARGET_TIED, read_mlp_speculator
from specdec.spec_decode.config import SpeculativeConfig
from tests.proposers.helpers import BATCHES, LEN, generate_and_assert_greedy_equal

@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Two shards (5 and 4 sequences) of random prompt + "response" tokens with the tiny target's last-layer
    states (fp16), in prefill.py's shard format (aux None, as --no-aux writes)."""
    out = tmp_path_factory.mktemp("feat")
    eng = tiny_random_llama(0, num_slots=1, max_model_len=64)
    g = torch.Generator().manual_seed(0)
    manifest = {"shards": [], "model": "tiny-random-llama", "hidden_size": 64}
    for s, count in enumerate((5, 4)):
        toks, n_prompt, hidden = [], [], []
        for _ in range(count):
            prompt = torch.randint(3, 259, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
            seq = prompt + torch.randint(3, 100, (16,), generator=g).tolist()
            slot = eng.allocate_slot()
            h = eng.forward(ForwardBatch(torch.tensor(seq[:-1]), [slot], [len(seq) - 1])).hidden_states
            eng.free_slot(slot)
            toks.append(seq)
            n_prompt.append(len(prompt))
            hidden.append(h.half())
        name = f"shard_{s:04d}.pt"
        torch.save({"prompt_indices": list(range(count)), "sources": ["generated"] * count, "tokens": toks,
                    "num_prompt_tokens": n_prompt, "hidden": torch.cat(hidden), "aux": None}, out / name)
        manifest["shards"].append({"file": name, "prompt_indices": list(range(count)),
                                   "num_tokens": sum(map(len, toks))})
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def train(data, run, *extra) -> dict:
    """``python -m experiments.train.mlp_speculator data=... out=... <extra>`` on the tiny model, in process."""
    return mlp_speculator.run(common.compose("mlp_speculator", [
        f"data={data}", f"out={run}", "model=tiny-random-llama", "vocab=64", "token_budget=32", "warmup=1",
        "val_frac=0.25", "threads=1", *extra]))


def test_two_steps_export_resume_and_greedy_equal(data, tmp_path):
    run, head, full = tmp_path / "run", tmp_path / "head", tmp_path / "full"
    s = train(data, run, "max_steps=2", "no_wandb=true", f"export={head}")
    assert s["steps"] == 2 and (run / "ckpt.pt").is_file()
    for i in range(3):  # both held-out accuracies, per stage
        assert 0 <= s[f"val/acc{i}"] <= 1 and 0 <= s[f"val/acc_full{i}"] <= 1
    lines = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    assert lines[-1]["final"]["steps"] == 2 and any("loss" in x for x in lines)
    ck = torch.load(run / "ckpt.pt", weights_only=True)
    assert {k.split(".")[0] for k in ck["model"]} == {"proj", "ln"}  # emb/head are the target's, not saved

    cfg, sd, conf = read_mlp_speculator(head)  # target-tied by default: proj and ln only, no card
    assert (cfg.n_predict, cfg.emb_dim, cfg.inner_dim, cfg.vocab_size, cfg.tie_weights) == (3, 64, 64, 512, True)
    assert sorted(p.name for p in head.iterdir()) == ["config.json", "model.safetensors"]
    assert conf[TARGET_TIED] == ["emb", "head"] and {k.split(".")[0] for k in sd} == {"proj", "ln"}
    target = tiny_random_llama(0, num_slots=1, max_model_len=64)
    prop = MLPSpeculatorProposer(target, SpeculativeConfig(method="proposers.mlp_speculator:MLPSpeculatorProposer",
                                                           model=str(head), num_speculative_tokens=3))
    for i in range(3):  # the target's own tables
        assert torch.equal(prop.model.emb[i].weight, target.model.embed_weight)
        assert torch.equal(prop.model.head[i].weight, target.model.lm_head.w_t)
    torch.testing.assert_close(prop.model.proj[0].weight, sd["proj.0.weight"].float())

    s2 = train(data, run, "max_steps=3", "no_wandb=true", "resume=true",  # continues at step 2
               f"export={full}", "export_full=true")
    assert s2["steps"] == 3 and torch.load(run / "ckpt.pt", weights_only=True)["step"] == 3
    _, sd, conf = read_mlp_speculator(full)  # the complete published layout
    assert TARGET_TIED not in conf and {k.split(".")[0] for k in sd} == {"emb", "proj", "head", "ln"}
    w = tiny_random_weights(tiny_config(), 0)["model.embed_tokens.weight"]  # tied: embedding = LM head
    for k in ("emb.0.weight", "head.0.weight", "head.2.weight"):  # frozen through training
        torch.testing.assert_close(sd[k].float(), w.to(torch.bfloat16).float())

    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=LEN)
    spec = generate_and_assert_greedy_equal(llm, {"method": "proposers.mlp_speculator:MLPSpeculatorProposer",
                                                  "model": str(head), "num_speculative_tokens": 3},
                                            *BATCHES["ragged4"])
    assert spec.get_metrics().num_draft_tokens > 0
    spec = generate_and_assert_greedy_equal(llm, {"method": "proposers.mlp_speculator:MLPSpeculatorProposer",
                                                  "model": str(full), "num_speculative_tokens": 3},
                                            *BATCHES["ragged4"])
    assert spec.get_metrics().num_draft_tokens > 0


def test_states_are_the_proposers_stages():
    w = tiny_random_weights(tiny_config(), 0)["model.embed_tokens.weight"]
    m = mlp_speculator.build_speculator(3, w, w, "random", None, seed=1)
    head = m.head
    h, tok = torch.randn(5, 64), torch.randint(0, 512, (5, 3))
    got = mlp_speculator.states(m, h, tok)
    assert m.head is head
    state = m.first_state(h)
    for i in range(3):
        state, logits = m.stage(i, state, tok[:, i])
        torch.testing.assert_close(got[i], state)
    assert {n for n, p in m.named_parameters() if p.requires_grad} == {"proj.0.weight", "proj.1.weight",
                                                                        "ln.0.weight", "ln.0.bias"}


def test_a_failing_wandb_only_warns(data, tmp_path, monkeypatch):
    fake = types.ModuleType("wandb")

    def init(**kw):
        raise RuntimeError("no W&B here")

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with pytest.warns(RuntimeWarning, match=r"W&B init failed \(RuntimeError: no W&B here\); the run goes on"):
        s = train(data, tmp_path / "run", "max_steps=1")
    assert s["steps"] == 1
