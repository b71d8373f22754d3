"""experiments/train_eagle.py (EAGLE-1) and train_eagle3.py (EAGLE-3) on the tiny model: a few steps on
feature shards in prefill.py's format checkpoint, resume, export heads that the proposers load and that
keep greedy outputs identical; the held-out split does not move when the training data grows."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.engine import ForwardBatch
from specdec.engine.tiny import tiny_random_llama
from specdec.heads.config import eagle3_layers

EXP = Path(__file__).resolve().parents[2] / "experiments"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXP / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def train():
    return load("train_eagle")


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


def argv(data, run, *extra):
    return ["--data", str(data), "--out", str(run), "--model", "tiny-random-llama", "--vocab", "96", "--warmup", "1",
            "--token-budget", "256", "--threads", "1", "--no-wandb", "--val-frac", "0.2", *extra]


def greedy_equal(method: str, head: Path) -> None:
    llm = LLM("tiny-random-llama", max_num_seqs=2, max_model_len=128)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 50, 60, 70]}, {"prompt_token_ids": [9, 8, 7]}]
    got = llm.with_speculation({"method": method, "model": str(head), "num_speculative_tokens": 3}).generate(
        prompts, sp, use_tqdm=False)
    want = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_split_keeps_the_held_out_set(train, data):
    seqs = train.load_data(data, need_aux=False)
    tr_all, val_all = train.split(seqs, 0.2)
    tr_few, val_few = train.split(seqs, 0.2, train_tokens=30)
    assert val_all == val_few and [seqs[i]["prompt_id"] % 5 for i in val_all] == [0] * len(val_all)
    assert not set(tr_all) & set(val_all) and len(tr_all) + len(val_all) == len(seqs)
    assert tr_few == tr_all[:len(tr_few)] and 0 < len(tr_few) < len(tr_all)


def test_first_shard_keeps_the_newer_shards_only(train, data):
    every = train.load_data(data, need_aux=False)
    newer = train.load_data(data, need_aux=False, first_shard=1)
    assert [s["prompt_id"] for s in newer] == list(range(10, 20))  # shard_00001's sequences, in order
    assert [s["prompt_id"] for s in every] == list(range(20))
    assert all(torch.equal(a["hidden"], b["hidden"]) for a, b in zip(newer, every[10:]))
    with pytest.raises(ValueError, match=r"--first-shard 2 leaves no shard .*shard_00000.pt .. shard_00001.pt.*lower it"):
        train.load_data(data, need_aux=False, first_shard=2)
    with pytest.raises(ValueError, match="'features.pt' is not named shard_NNNNN.pt"):
        train.shard_index("features.pt")


def test_extra_data_adds_a_second_pool(train, data, tmp_path):
    """--extra-data DIR: all of another feature directory's shards after --data's (--first-shard is --data's),
    each held out by its own prompt ids."""
    run = tmp_path / "run"
    train.main(argv(data, run, "--max-steps", "1", "--amp", "none"), method="eagle")
    evs = {}
    for name, extra in (("one", []), ("two", ["--extra-data", str(data)])):
        train.main(argv(data, tmp_path / name, "--first-shard", "1", "--heldout", str(run / "ckpt.pt"), *extra),
                   method="eagle")
        evs[name] = json.loads((tmp_path / name / "heldout.json").read_text())
    assert evs["one"]["val_sequences"] == 2  # prompt ids 10, 15 of shard_00001
    assert evs["two"]["val_sequences"] == 2 + 4  # and 0, 5, 10, 15 of the extra directory's two shards


@pytest.mark.parametrize("script,method", [("train_eagle", "proposers.eagle:EagleProposer"),
                                           ("train_eagle3", "proposers.eagle3:Eagle3Proposer")])
def test_steps_resume_export(script, method, data, tmp_path):
    mod = load(script)
    run, head = tmp_path / "run", tmp_path / "head"
    mod.main(argv(data, run, "--epochs", "2", "--max-steps", "2", "--export", str(head)), **(
        {"method": "eagle3"} if script == "train_eagle3" else {}))
    assert torch.load(run / "ckpt.pt", weights_only=False)["step"] == 2
    log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    assert any("val/acc0" in r for r in log)
    mod.main(argv(data, run, "--epochs", "2", "--max-steps", "3", "--resume", "--amp", "none"), **(
        {"method": "eagle3"} if script == "train_eagle3" else {}))
    assert torch.load(run / "ckpt.pt", weights_only=False)["step"] == 3
    assert (head / "config.json").is_file() and (head / "draft_vocab.safetensors").is_file()
    greedy_equal(method, head)
    # --heldout scores a checkpoint on the held-out set, unrolled as far as asked
    mod.main(argv(data, tmp_path / "ev", "--heldout", str(run / "ckpt.pt"), "--ttt-steps", "3"), **(
        {"method": "eagle3"} if script == "train_eagle3" else {}))
    ev = json.loads((tmp_path / "ev" / "heldout.json").read_text())
    assert ev["trained_steps"] == 3 and all(0 <= ev[f"val/acc{j}"] <= 1 for j in range(3))
    assert all(ev[f"val/acc_all{j}"] <= ev[f"val/acc{j}"] + 1e-6 for j in range(3))  # misses outside the vocabulary
    # --by-source: the same figures per source; one source here, so they are the overall ones
    mod.main(argv(data, tmp_path / "ev2", "--heldout", str(run / "ckpt.pt"), "--ttt-steps", "3", "--by-source"), **(
        {"method": "eagle3"} if script == "train_eagle3" else {}))
    ev2 = json.loads((tmp_path / "ev2" / "heldout.json").read_text())
    g = ev2["by_source"]["generated"]
    assert g["sequences"] == ev2["val_sequences"] and 0 < g["coverage"] <= 1
    assert all(abs(g[f"val/acc{j}"] - ev2[f"val/acc{j}"]) < 1e-6 for j in range(3))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_exported_head_is_a_warm_start(train, method, data, tmp_path):
    """--heldout and --init take an exported head directory as well as a ckpt.pt: export folded the input
    scale into fc, and the warm start unfolds it, so the exported head scores as its run checkpoint did (up to
    the export's bf16 rounding) and trains on from there."""
    run, head = tmp_path / "run", tmp_path / "head"
    train.main(argv(data, run, "--epochs", "2", "--max-steps", "2", "--export", str(head)), method=method)
    evs = []
    for src, name in ((run / "ckpt.pt", "ev_ckpt"), (head, "ev_head")):
        train.main(argv(data, tmp_path / name, "--heldout", str(src), "--ttt-steps", "2", "--amp", "none"),
                   method=method)
        evs.append(json.loads((tmp_path / name / "heldout.json").read_text()))
    a, b = evs
    assert b["trained_steps"] == 2 and b["vocab"] == a["vocab"]
    losses = [k for k in a if k.startswith(("val/ce", "val/reg"))]
    assert losses and all(abs(a[k] - b[k]) <= 0.02 * abs(a[k]) + 1e-3 for k in losses), (a, b)
    train.main(argv(data, tmp_path / "more", "--init", str(head), "--max-steps", "1"), method=method)
    assert torch.load(tmp_path / "more" / "ckpt.pt", weights_only=False)["step"] == 1
    # --export-train-state writes a small bf16 warm start that scores as the run checkpoint does and trains on
    state = tmp_path / "state" / "train_state.pt"
    train.main(argv(data, run, "--epochs", "2", "--max-steps", "2", "--resume", "--export-train-state", str(state)),
               method=method)
    st = torch.load(state, weights_only=False)
    assert st["step"] == 2 and "opt" not in st and st["args"]["vocab"] == 96
    assert all(v.dtype == torch.bfloat16 for v in st["head"].values() if v.is_floating_point())
    train.main(argv(data, tmp_path / "ev_state", "--heldout", str(state), "--ttt-steps", "2", "--amp", "none"),
               method=method)
    c = json.loads((tmp_path / "ev_state" / "heldout.json").read_text())
    assert c["trained_steps"] == 2 and all(abs(a[k] - c[k]) <= 0.02 * abs(a[k]) + 1e-3 for k in losses), (a, c)
    train.main(argv(data, tmp_path / "more2", "--init", str(state), "--max-steps", "1"), method=method)
    assert torch.load(tmp_path / "more2" / "ckpt.pt", weights_only=False)["step"] == 1
    with pytest.raises(FileNotFoundError, match="draft_vocab"):
        (head / "draft_vocab.safetensors").unlink()
        train.main(argv(data, tmp_path / "bad", "--heldout", str(head)), method=method)


def test_init_grows_the_draft_vocabulary(train, data, tmp_path):
    """--init with a larger --vocab than the start's (EAGLE-3): the ids in both keep their trained LM-head rows,
    the new ids start from the target's rows, d2t/t2d describe the new vocabulary, and the grown head trains,
    exports and keeps greedy output identical."""
    run, grown, head = tmp_path / "run", tmp_path / "grown", tmp_path / "head"
    train.main(argv(data, run, "--max-steps", "2", "--amp", "none"), method="eagle3")
    prev = torch.load(run / "ckpt.pt", weights_only=False)
    a = argv(data, grown, "--init", str(run / "ckpt.pt"), "--max-steps", "1", "--amp", "none", "--lr", "0",
             "--export", str(head))
    a[a.index("--vocab") + 1] = "128"
    train.main(a, method="eagle3")
    st = torch.load(grown / "ckpt.pt", weights_only=False)
    old_ids, new_ids = prev["freq"][:96].sort().values, prev["freq"][:128].sort().values
    assert torch.equal(st["freq"], prev["freq"]) and st["args"]["vocab"] == 128
    W_old, W = prev["head"]["lm_head.weight"], st["head"]["lm_head.weight"]
    assert W.shape[0] == 128 and torch.equal(torch.arange(128) + st["head"]["d2t"], new_ids)
    assert torch.equal(torch.nonzero(st["head"]["t2d"]).flatten(), new_ids)
    _, _, _, lm = train.target_parts("tiny-random-llama")
    for j, t in enumerate(new_ids.tolist()):  # lr 0: the rows are the grown start's
        k = (old_ids == t).nonzero()
        want = W_old[int(k)] if len(k) else lm[t]
        assert torch.allclose(W[j], want.float()), (j, t)
    greedy_equal("proposers.eagle3:Eagle3Proposer", head)
    with pytest.raises(ValueError, match="lm_head has 96 rows for 95 draft ids"):
        train.regrow_draft_vocab(prev["head"], old_ids[:95], new_ids, lm)
