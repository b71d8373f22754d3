"""experiments/train/eagle.py (EAGLE-1) and eagle3.py (EAGLE-3) on the tiny model: a few steps on
feature shards in prefill.py's format checkpoint, resume, export heads that the proposers load and that
keep greedy outputs identical; the held-out split does not move when the training data grows."""

import json
import re
from pathlib import Path

import pytest
import torch

from experiments.train import common, eagle
from specdec import LLM, SamplingParams
from specdec.engine import ForwardBatch
from specdec.engine.tiny import tiny_random_llama
from specdec.heads.config import eagle3_layers

@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Two shards of 10 sequences (random prompt + "response") with the tiny target's last-layer states and
    its EAGLE-3 layers, fp16, as experiments/distill/prefill.py writes them."""
    out = tmp_path_factory.mktemp("feat")
    eng = tiny_random_llama(0, num_slots=1, max_model_len=64)
    layers = eagle3_layers(eng.num_layers)
    g = torch.Generator().manual_seed(0)
    manifest = {"shards": [], "model": "tiny-random-llama", "hidden_size": eng.hidden_size, "hidden_layers": list(layers)}
    for s in range(2):
        ids = list(range(10 * s, 10 * s + 10))
        toks, n_prompt, hid, aux = [], [], [], []
        for _ in ids:
            prompt = torch.randint(3, 259, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
            seq = prompt + torch.randint(3, 100, (24,), generator=g).tolist()
            slot = eng.allocate_slot()
            o = eng.forward(ForwardBatch(torch.tensor(seq[:-1]), [slot], [len(seq) - 1], hidden_layers=layers))
            eng.free_slot(slot)
            toks.append(seq)
            n_prompt.append(len(prompt))
            hid.append(o.hidden_states.half())
            aux.append(torch.cat(o.aux_hidden_states, -1).half())
        name = f"shard_{s:05d}.pt"
        torch.save({"prompt_indices": ids, "sources": ["generated"] * 10, "tokens": toks, "num_prompt_tokens": n_prompt,
                    "temperature": [0.0] * 10, "hidden": torch.cat(hid), "aux": torch.cat(aux)}, out / name)
        manifest["shards"].append({"file": name, "prompt_indices": ids, "num_tokens": sum(map(len, toks))})
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def train(method: str, data, run, *extra) -> None:
    """``python -m experiments.train.<method> data=... out=... <extra>`` on the tiny model, in process."""
    eagle.run(common.compose(method, [f"data={data}", f"out={run}", "model=tiny-random-llama", "vocab=96",
                                      "warmup=1", "token_budget=256", "threads=1", "no_wandb=true", "val_frac=0.2",
                                      *extra]))


def greedy_equal(method: str, head: Path) -> None:
    llm = LLM("tiny-random-llama", max_num_seqs=2, max_model_len=128)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 50, 60, 70]}, {"prompt_token_ids": [9, 8, 7]}]
    got = llm.with_speculation({"method": method, "model": str(head), "num_speculative_tokens": 3}).generate(
        prompts, sp, use_tqdm=False)
    want = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_split_keeps_the_held_out_set(data):
    seqs = common.load_data(data, need_aux=False)
    tr_all, val_all = eagle.split(seqs, 0.2)
    tr_few, val_few = eagle.split(seqs, 0.2, train_tokens=30)
    assert val_all == val_few and [seqs[i]["prompt_id"] % 5 for i in val_all] == [0] * len(val_all)
    assert not set(tr_all) & set(val_all) and len(tr_all) + len(val_all) == len(seqs)
    assert tr_few == tr_all[:len(tr_few)] and 0 < len(tr_few) < len(tr_all)


def test_first_shard_keeps_the_newer_shards_only(data):
    every = common.load_data(data, need_aux=False)
    newer = common.load_data(data, need_aux=False, first_shard=1)
    assert [s["prompt_id"] for s in newer] == list(range(10, 20))  # shard_00001's sequences, in order
    assert [s["prompt_id"] for s in every] == list(range(20))
    assert all(torch.equal(a["hidden"], b["hidden"]) for a, b in zip(newer, every[10:]))
    with pytest.raises(ValueError, match=r"first_shard=2 leaves no shard .*shard_00000.pt .. shard_00001.pt.*lower it"):
        common.load_data(data, need_aux=False, first_shard=2)
    with pytest.raises(ValueError, match="'features.pt' is not named shard_NNNNN.pt"):
        common.shard_index("features.pt")


def test_extra_data_adds_a_second_pool(data, tmp_path):
    """extra_data=[DIR]: all of another feature directory's shards after data's (first_shard is data's),
    each held out by its own prompt ids."""
    run = tmp_path / "run"
    train("eagle", data, run, "max_steps=1", "amp=none")
    evs = {}
    for name, extra in (("one", []), ("two", [f"extra_data=[{data}]"])):
        train("eagle", data, tmp_path / name, "first_shard=1", f"heldout={run / 'ckpt.pt'}", *extra)
        evs[name] = json.loads((tmp_path / name / "heldout.json").read_text())
    assert evs["one"]["val_sequences"] == 2  # prompt ids 10, 15 of shard_00001
    assert evs["two"]["val_sequences"] == 2 + 4  # and 0, 5, 10, 15 of the extra directory's two shards


class _RunsCode:
    """A pickle payload: unpickling it calls os.system (here a harmless touch of a marker file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_runs_code_is_refused(data, tmp_path):
    """A shard or checkpoint whose unpickling would run code is refused, naming the file; the code never ran."""
    marker = tmp_path / "ran"
    bad = tmp_path / "feat"
    bad.mkdir()
    torch.save({"prompt_indices": [0], "evil": _RunsCode(marker)}, bad / "shard_00000.pt")
    (bad / "manifest.json").write_text(json.dumps({"shards": [{"file": "shard_00000.pt"}]}))
    with pytest.raises(ValueError, match=r"shard_00000.pt: refused to load: .*could run code"):
        common.load_data(bad, need_aux=False)
    torch.save({"step": 1, "rng": _RunsCode(marker)}, tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match=r"ckpt.pt: refused to load"):
        common.read_checkpoint(tmp_path / "ckpt.pt")
    assert not marker.exists()
    # a plain checkpoint (tensors, tuples like random.getstate(), dicts of lists) still loads
    import random

    common.save_atomic({"step": 2, "rng": random.Random(0).getstate(), "freq": torch.arange(3)}, tmp_path / "ok.pt")
    assert common.read_checkpoint(tmp_path / "ok.pt")["step"] == 2


@pytest.mark.parametrize("entry", ["../shard_00000.pt", "/etc/passwd", "sub/shard_00000.pt", "..", "", 7])
def test_a_manifest_entry_outside_its_directory_is_refused(data, tmp_path, entry):
    """manifest.json's "file" must name a file directly in the data directory: no absolute path, no '..'."""
    bad = tmp_path / "inner"
    bad.mkdir()
    (tmp_path / "shard_00000.pt").write_bytes((data / "shard_00000.pt").read_bytes())  # a real shard, one level up
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["shards"] = [manifest["shards"][0] | {"file": entry}]
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=rf"shard entry {re.escape(repr(entry))} is not a plain file name inside"):
        common.load_data(bad, need_aux=False)


@pytest.mark.parametrize("script,method", [("eagle", "proposers.eagle:EagleProposer"),
                                           ("eagle3", "proposers.eagle3:Eagle3Proposer")])
def test_steps_resume_export(script, method, data, tmp_path):
    run, head = tmp_path / "run", tmp_path / "head"
    train(script, data, run, "epochs=2", "max_steps=2", f"export={head}")
    assert torch.load(run / "ckpt.pt", weights_only=True)["step"] == 2
    log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    assert any("val/acc0" in r for r in log)
    train(script, data, run, "epochs=2", "max_steps=3", "resume=true", "amp=none")
    assert torch.load(run / "ckpt.pt", weights_only=True)["step"] == 3
    assert (head / "config.json").is_file() and (head / "draft_vocab.safetensors").is_file()
    greedy_equal(method, head)
    # heldout= scores a checkpoint on the held-out set, unrolled as far as asked
    train(script, data, tmp_path / "ev", f"heldout={run / 'ckpt.pt'}", "ttt_steps=3")
    ev = json.loads((tmp_path / "ev" / "heldout.json").read_text())
    assert ev["trained_steps"] == 3 and all(0 <= ev[f"val/acc{j}"] <= 1 for j in range(3))
    assert all(ev[f"val/acc_all{j}"] <= ev[f"val/acc{j}"] + 1e-6 for j in range(3))  # misses outside the vocabulary
    # by_source=true: the same figures per source; one source here, so they are the overall ones
    train(script, data, tmp_path / "ev2", f"heldout={run / 'ckpt.pt'}", "ttt_steps=3", "by_source=true")
    ev2 = json.loads((tmp_path / "ev2" / "heldout.json").read_text())
    g = ev2["by_source"]["generated"]
    assert g["sequences"] == ev2["val_sequences"] and 0 < g["coverage"] <= 1
    assert all(abs(g[f"val/acc{j}"] - ev2[f"val/acc{j}"]) < 1e-6 for j in range(3))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_exported_head_is_a_warm_start(method, data, tmp_path):
    """heldout= and init= take an exported head directory as well as a ckpt.pt: export folded the input
    scale into fc, and the warm start unfolds it, so the exported head scores as its run checkpoint did (up to
    the export's bf16 rounding) and trains on from there."""
    run, head = tmp_path / "run", tmp_path / "head"
    train(method, data, run, "epochs=2", "max_steps=2", f"export={head}")
    evs = []
    for src, name in ((run / "ckpt.pt", "ev_ckpt"), (head, "ev_head")):
        train(method, data, tmp_path / name, f"heldout={src}", "ttt_steps=2", "amp=none")
        evs.append(json.loads((tmp_path / name / "heldout.json").read_text()))
    a, b = evs
    assert b["trained_steps"] == 2 and b["vocab"] == a["vocab"]
    losses = [k for k in a if k.startswith(("val/ce", "val/reg"))]
    assert losses and all(abs(a[k] - b[k]) <= 0.02 * abs(a[k]) + 1e-3 for k in losses), (a, b)
    train(method, data, tmp_path / "more", f"init={head}", "max_steps=1")
    assert torch.load(tmp_path / "more" / "ckpt.pt", weights_only=True)["step"] == 1
    # export_train_state= writes a small bf16 warm start that scores as the run checkpoint does and trains on
    state = tmp_path / "state" / "train_state.pt"
    train(method, data, run, "epochs=2", "max_steps=2", "resume=true", f"export_train_state={state}")
    st = torch.load(state, weights_only=True)
    assert st["step"] == 2 and "opt" not in st and st["args"]["vocab"] == 96
    assert all(v.dtype == torch.bfloat16 for v in st["head"].values() if v.is_floating_point())
    train(method, data, tmp_path / "ev_state", f"heldout={state}", "ttt_steps=2", "amp=none")
    c = json.loads((tmp_path / "ev_state" / "heldout.json").read_text())
    assert c["trained_steps"] == 2 and all(abs(a[k] - c[k]) <= 0.02 * abs(a[k]) + 1e-3 for k in losses), (a, c)
    train(method, data, tmp_path / "more2", f"init={state}", "max_steps=1")
    assert torch.load(tmp_path / "more2" / "ckpt.pt", weights_only=True)["step"] == 1
    with pytest.raises(FileNotFoundError, match="draft_vocab"):
        (head / "draft_vocab.safetensors").unlink()
        train(method, data, tmp_path / "bad", f"heldout={head}")


def test_init_grows_the_draft_vocabulary(data, tmp_path):
    """init= with a larger vocab than the start's (EAGLE-3): the ids in both keep their trained LM-head rows,
    the new ids start from the target's rows, d2t/t2d describe the new vocabulary, and the grown head trains,
    exports and keeps greedy output identical."""
    run, grown, head = tmp_path / "run", tmp_path / "grown", tmp_path / "head"
    train("eagle3", data, run, "max_steps=2", "amp=none")
    prev = torch.load(run / "ckpt.pt", weights_only=True)
    train("eagle3", data, grown, f"init={run / 'ckpt.pt'}", "max_steps=1", "amp=none", "lr=0", f"export={head}",
          "vocab=128")  # the last override wins
    st = torch.load(grown / "ckpt.pt", weights_only=True)
    old_ids, new_ids = prev["freq"][:96].sort().values, prev["freq"][:128].sort().values
    assert torch.equal(st["freq"], prev["freq"]) and st["args"]["vocab"] == 128
    W_old, W = prev["head"]["lm_head.weight"], st["head"]["lm_head.weight"]
    assert W.shape[0] == 128 and torch.equal(torch.arange(128) + st["head"]["d2t"], new_ids)
    assert torch.equal(torch.nonzero(st["head"]["t2d"]).flatten(), new_ids)
    _, _, _, lm = common.target_parts("tiny-random-llama")
    for j, t in enumerate(new_ids.tolist()):  # lr 0: the rows are the grown start's
        k = (old_ids == t).nonzero()
        want = W_old[int(k)] if len(k) else lm[t]
        assert torch.allclose(W[j], want.float()), (j, t)
    greedy_equal("proposers.eagle3:Eagle3Proposer", head)
    with pytest.raises(ValueError, match="lm_head has 96 rows for 95 draft ids"):
        eagle.regrow_draft_vocab(prev["head"], old_ids[:95], new_ids, lm)
