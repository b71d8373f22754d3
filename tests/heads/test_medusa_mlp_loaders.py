"""Medusa and MLPSpeculator checkpoints written here in exactly the published key layouts load through the
proposers and give the same logits as the formula applied to the raw tensors; heads that do not fit the
target are refused with both sizes named; broken checkpoints fail naming what is wrong.

Medusa layouts: FasterDecoding's ``medusa_lm_head.safetensors`` / ``.pt`` (``{i}.{j}.linear.*``,
``{i}.{L}.weight``), the ``medusa_lm_head.``-prefixed state dict in ``model.safetensors``, vLLM's
``blocks.{i}.layers.{j}`` / ``lm_heads.{i}`` / ``token_map``, and ``original_lm_head`` without LM heads.
MLPSpeculator: config.json + ``emb/proj/head/ln.{i}.*`` (untied; tied, stored once, under ``speculator.``).
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from proposers.medusa import MedusaProposer
from specdec.heads.medusa import load_medusa, random_medusa
from proposers.mlp_speculator import MLPSpeculatorProposer
from specdec.heads.mlp_speculator import load_mlp_speculator, random_mlp_speculator
from specdec.engine.tiny import tiny_random_llama
from specdec.heads.medusa import MedusaConfig, read_medusa, write_medusa
from specdec.heads.mlp_speculator import MLPSpeculatorConfig, read_mlp_speculator, write_mlp_speculator
from specdec.hidden_states import HiddenStates
from specdec.spec_decode.config import SpeculativeConfig
from specdec.spec_decode.proposer import ProposeBatch
from specdec.sampling_params import SamplingParams

D, V = 64, 512  # the tiny target's sizes
MEDUSA = "proposers.medusa:MedusaProposer"
MLP = "proposers.mlp_speculator:MLPSpeculatorProposer"


@pytest.fixture(scope="module")
def target():
    return tiny_random_llama(0, num_slots=2, max_model_len=64)


def rand(*shape, seed=[0]):
    seed[0] += 1
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed[0])) / shape[-1] ** 0.5


def medusa_tensors(H=3, L=1, d=D, rows=V, lm=True, bias=True) -> dict[str, torch.Tensor]:
    """FasterDecoding's medusa_head state dict: {i}.{j}.linear.weight/bias, {i}.{L}.weight."""
    sd = {}
    for i in range(H):
        for j in range(L):
            sd[f"{i}.{j}.linear.weight"] = rand(d, d)
            if bias:
                sd[f"{i}.{j}.linear.bias"] = rand(d)
        if lm:
            sd[f"{i}.{L}.weight"] = rand(rows, d)
    return sd


def medusa_reference(sd: dict, h: torch.Tensor, H: int, L: int, lm=None) -> torch.Tensor:
    """[H, N, rows] Medusa's formula on FasterDecoding-named raw tensors; ``lm`` [rows, D] overrides the
    heads' own LM heads."""
    out = []
    for i in range(H):
        x = h
        for j in range(L):
            b = sd.get(f"{i}.{j}.linear.bias")
            x = x + F.silu(x @ sd[f"{i}.{j}.linear.weight"].T + (0 if b is None else b))
        out.append(x @ (lm if lm is not None else sd[f"{i}.{L}.weight"]).T)
    return torch.stack(out)


def medusa_proposer(target, path, k=3, **kw) -> MedusaProposer:
    return MedusaProposer(target, SpeculativeConfig(method=MEDUSA, model=str(path), num_speculative_tokens=k, **kw))


def write_json(path, obj):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(obj))


# ---------------------------------------------------------------------------------------------- Medusa


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
@pytest.mark.parametrize("layers", [1, 2])
def test_fasterdecoding_medusa_lm_head_file(target, tmp_path, fmt, layers):
    sd = medusa_tensors(3, layers)
    write_json(tmp_path, {"medusa_num_heads": 3, "medusa_num_layers": layers, "base_model_name_or_path": "tiny"})
    if fmt == "safetensors":
        save_file(sd, str(tmp_path / "medusa_lm_head.safetensors"))
    else:
        torch.save(sd, tmp_path / "medusa_lm_head.pt")
    prop = medusa_proposer(target, tmp_path)
    h = torch.randn(5, D)
    torch.testing.assert_close(prop.draft_logits(h, 3), medusa_reference(sd, h, 3, layers), atol=1e-5, rtol=1e-5)
    assert prop.heads.cfg.num_layers == layers and prop.heads.cfg.own_lm_head


def test_prefixed_state_dict_and_write_round_trip(target, tmp_path):
    sd = medusa_tensors(3, 1)
    write_json(tmp_path / "a", {"medusa_num_heads": 3, "medusa_num_layers": 1, "hidden_size": D, "vocab_size": V})
    save_file({f"medusa_lm_head.{k}": v for k, v in sd.items()}, str(tmp_path / "a" / "model.safetensors"))
    h = torch.randn(4, D)
    ref = medusa_reference(sd, h, 3, 1)
    torch.testing.assert_close(medusa_proposer(target, tmp_path / "a").draft_logits(h, 3), ref, atol=1e-5, rtol=1e-5)
    heads = load_medusa(tmp_path / "a")
    write_medusa(tmp_path / "b", heads.cfg, heads.state_dict(), dtype=torch.float32)
    with open(tmp_path / "b" / "model.safetensors", "rb"):
        from safetensors import safe_open

        with safe_open(str(tmp_path / "b" / "model.safetensors"), "pt") as f:
            assert set(f.keys()) == {f"medusa_lm_head.{k}" for k in sd}  # exactly the published names
    torch.testing.assert_close(medusa_proposer(target, tmp_path / "b").draft_logits(h, 3), ref, atol=1e-5, rtol=1e-5)


def test_vllm_layout_with_token_map(target, tmp_path):
    Vt, H = 100, 2
    token_map = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:Vt]
    raw = {"token_map": token_map}
    for i in range(H):
        raw[f"blocks.{i}.layers.0.weight"] = rand(D, D)  # vLLM: no bias unless medusa_fc_bias
        raw[f"lm_heads.{i}.weight"] = rand(Vt, D)
    write_json(tmp_path, {"model_type": "medusa", "num_heads": H, "num_hidden_layers": 1, "hidden_size": D,
                          "vocab_size": V, "truncated_vocab_size": Vt})
    save_file(raw, str(tmp_path / "model.safetensors"))
    prop = medusa_proposer(target, tmp_path, k=2)
    h = torch.randn(3, D)
    ref = torch.stack([(h + F.silu(h @ raw[f"blocks.{i}.layers.0.weight"].T)) @ raw[f"lm_heads.{i}.weight"].T
                       for i in range(H)])  # [H, 3, Vt]
    torch.testing.assert_close(prop.draft_logits(h, 2), ref, atol=1e-5, rtol=1e-5)
    out = prop.propose(ProposeBatch([0, 1, 2], [[1]] * 3, 2, [SamplingParams(temperature=0.0)] * 3, [None] * 3,
                                    HiddenStates(h, _seq_ids=[0, 1, 2])))
    assert out.token_ids.tolist() == token_map[ref.argmax(-1)].T.tolist()  # draft ids mapped to target ids


def test_original_lm_head_uses_the_targets(target, tmp_path):
    sd = medusa_tensors(2, 1, lm=False)
    write_json(tmp_path, {"medusa_num_heads": 2, "medusa_num_layers": 1, "hidden_size": D, "vocab_size": V,
                          "original_lm_head": True})
    save_file(sd, str(tmp_path / "medusa_lm_head.safetensors"))
    h = torch.randn(3, D)
    x = medusa_reference(sd, h, 2, 1, lm=torch.eye(D))  # the ResBlocks' outputs
    want = torch.stack([target.compute_logits(x[i]) for i in range(2)])
    torch.testing.assert_close(medusa_proposer(target, tmp_path, k=2).draft_logits(h, 2), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("field, d, rows, lm", [("hidden_size", 32, V, True), ("vocab_size", D, 256, True)])
def test_medusa_that_does_not_fit_is_refused_naming_both(target, tmp_path, field, d, rows, lm):
    write_json(tmp_path, {"medusa_num_heads": 3, "medusa_num_layers": 1})
    save_file(medusa_tensors(3, 1, d=d, rows=rows, lm=lm), str(tmp_path / "medusa_lm_head.safetensors"))
    value = d if field == "hidden_size" else rows
    with pytest.raises(ValueError, match=rf"has {field}={value} but the target has {field}={getattr(target, field)}"):
        medusa_proposer(target, tmp_path)


def test_broken_medusa_checkpoints_say_what_is_wrong(tmp_path):
    write_json(tmp_path / "nolm", {"medusa_num_heads": 2, "medusa_num_layers": 1})
    save_file(medusa_tensors(2, 1, lm=False), str(tmp_path / "nolm" / "medusa_lm_head.safetensors"))
    with pytest.raises(KeyError, match="original_lm_head"):
        read_medusa(tmp_path / "nolm")
    write_json(tmp_path / "count", {"medusa_num_heads": 5, "medusa_num_layers": 1})
    save_file(medusa_tensors(2, 1), str(tmp_path / "count" / "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match="5 heads x 1 ResBlocks but the weights hold 2"):
        read_medusa(tmp_path / "count")
    write_json(tmp_path / "eagle", {"hidden_size": D})
    save_file({"fc.weight": rand(D, 2 * D), "layers.0.mlp.up_proj.weight": rand(D, D)},
              str(tmp_path / "eagle" / "model.safetensors"))
    with pytest.raises(KeyError, match="is this a Medusa checkpoint"):
        read_medusa(tmp_path / "eagle")
    with pytest.raises(FileNotFoundError, match="no weight file"):
        read_medusa(tmp_path / "missing")


def test_random_heads_write_and_read_back_exactly(tmp_path):
    heads = random_medusa(MedusaConfig(num_heads=2, num_layers=2, hidden_size=D, vocab_size=V, draft_vocab_size=50,
                                       own_lm_head=False, topk_accuracy=[[0.5, 0.2], [0.3, 0.1]]), seed=4)
    heads.token_map.copy_(torch.arange(50) * 3)
    write_medusa(tmp_path, heads.cfg, heads.state_dict(), dtype=torch.float32)
    cfg, sd, conf = read_medusa(tmp_path)
    assert cfg == heads.cfg and conf["original_lm_head"] is True and conf["truncated_vocab_size"] == 50
    for k, v in heads.state_dict().items():
        assert torch.equal(sd[k], v), k


# ---------------------------------------------------------------------------------------------- MLPSpeculator


def mlp_tensors(n=3, emb=D, inner=48, vocab=V) -> dict[str, torch.Tensor]:
    sd = {}
    for i in range(n):
        sd[f"emb.{i}.weight"] = rand(vocab, inner) * inner ** 0.5
        sd[f"proj.{i}.weight"] = rand(inner, emb if i == 0 else inner)
        sd[f"head.{i}.weight"] = rand(vocab, inner)
        sd[f"ln.{i}.weight"] = 1 + 0.1 * rand(inner)
        sd[f"ln.{i}.bias"] = 0.1 * rand(inner)
    return sd


def mlp_config(n=3, emb=D, inner=48, vocab=V, tie=False, scale=False) -> dict:
    return {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator", "n_predict": n,
            "emb_dim": emb, "inner_dim": inner, "vocab_size": vocab, "tie_weights": tie, "scale_input": scale,
            "top_k_tokens_per_head": [5, 4, 3][:n], "n_candidates": 5, "torch_dtype": "float32"}


def mlp_reference(sd, h, tokens, n, inner, scale=False, tied=False) -> list[torch.Tensor]:
    """IBM's stages (vLLM generate_proposals, greedy) on the raw tensors: [n] logits [b, V]."""
    sw = 0.5 ** (0.5 / n)
    ew = math.sqrt((1 - sw ** 2) * (inner / 2))
    state = h
    if scale:
        state = state * torch.rsqrt(state.pow(2).mean(-1, keepdim=True) + 1e-6) / math.sqrt(2)
    out = []
    for i in range(n):
        g = 0 if tied else i
        p = (0 if i == 0 else 1) if tied else i
        s = state @ sd[f"proj.{p}.weight"].T + sd[f"emb.{g}.weight"][tokens] * (ew / sw)
        s = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * sd[f"ln.{g}.weight"] + sd[f"ln.{g}.bias"]
        state = F.gelu(s)
        logits = state @ sd[f"head.{g}.weight"].T
        out.append(logits)
        tokens = logits.argmax(-1)
    return out


def mlp_stage_logits(prop: MLPSpeculatorProposer, h, tokens, n) -> list[torch.Tensor]:
    m, out = prop.model, []
    state = m.first_state(h)
    for i in range(n):
        state, logits = m.stage(i, state, tokens)
        out.append(logits)
        tokens = logits.argmax(-1)
    return out


def mlp_proposer(target, path, k=3) -> MLPSpeculatorProposer:
    return MLPSpeculatorProposer(target, SpeculativeConfig(method=MLP, model=str(path), num_speculative_tokens=k))


@pytest.mark.parametrize("inner", [48, 0])
def test_mlp_speculator_untied(target, tmp_path, inner):
    width = inner or D  # inner_dim 0 means emb_dim
    sd = mlp_tensors(inner=width)
    write_json(tmp_path, mlp_config(inner=inner))
    save_file(sd, str(tmp_path / "model.safetensors"))
    prop = mlp_proposer(target, tmp_path)
    h, tok = torch.randn(4, D) * 3, torch.tensor([1, 7, 99, 300])
    for got, want in zip(mlp_stage_logits(prop, h, tok, 3), mlp_reference(sd, h, tok, 3, width)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    out = prop.propose(ProposeBatch([0, 1, 2, 3], [[t] for t in tok.tolist()], 3, [SamplingParams(temperature=0.0)] * 4,
                                    [None] * 4, HiddenStates(h, _seq_ids=[0, 1, 2, 3])))
    ref = mlp_reference(sd, h, tok, 3, width)
    assert out.token_ids.tolist() == torch.stack([r.argmax(-1) for r in ref], 1).tolist()


def test_mlp_speculator_tied_stored_once_under_a_prefix(target, tmp_path):
    full = mlp_tensors()
    stored = {f"speculator.{k}": v for k, v in full.items()
              if k.split(".")[1] == "0" or k == "proj.1.weight"}  # what a deduplicating save keeps
    write_json(tmp_path, mlp_config(tie=True, scale=True))
    torch.save(stored, tmp_path / "pytorch_model.bin")
    prop = mlp_proposer(target, tmp_path)
    h, tok = torch.randn(3, D) * 5, torch.tensor([3, 4, 5])
    for got, want in zip(mlp_stage_logits(prop, h, tok, 3), mlp_reference(full, h, tok, 3, 48, scale=True, tied=True)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert prop.model.emb[2] is prop.model.emb[0] and prop.model.proj[2] is prop.model.proj[1]


def test_mlp_speculator_write_round_trip(tmp_path):
    for tie in (False, True):
        m = random_mlp_speculator(MLPSpeculatorConfig(n_predict=3, emb_dim=D, inner_dim=32, vocab_size=V,
                                                      tie_weights=tie), seed=5)
        write_mlp_speculator(tmp_path / str(tie), m.cfg, m.state_dict(), dtype=torch.float32)
        back = load_mlp_speculator(tmp_path / str(tie))
        assert back.cfg == m.cfg
        for k, v in m.state_dict().items():
            assert torch.equal(back.state_dict()[k], v), k


@pytest.mark.parametrize("field, kw, named", [("emb_dim", {"emb": 32}, "hidden_size"),
                                               ("vocab_size", {"vocab": 256}, "vocab_size")])
def test_mlp_speculator_that_does_not_fit_is_refused_naming_both(target, tmp_path, field, kw, named):
    write_json(tmp_path, mlp_config(**kw))
    save_file(mlp_tensors(**kw), str(tmp_path / "model.safetensors"))
    value = next(iter(kw.values()))
    with pytest.raises(ValueError, match=rf"{field}={value}.* but the target has {named}={getattr(target, named)}"):
        mlp_proposer(target, tmp_path)


def test_broken_mlp_speculator_checkpoints_say_what_is_wrong(tmp_path):
    sd = mlp_tensors()
    del sd["head.2.weight"]
    write_json(tmp_path / "a", mlp_config())
    save_file(sd, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(KeyError, match=r"missing head\.2"):
        read_mlp_speculator(tmp_path / "a")
    write_json(tmp_path / "b", mlp_config(inner=32))
    save_file(mlp_tensors(), str(tmp_path / "b" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"emb\.0\.weight is \(512, 48\), expected \[512, 32\]"):
        read_mlp_speculator(tmp_path / "b")
    write_json(tmp_path / "c", {"hidden_size": D})
    save_file(mlp_tensors(), str(tmp_path / "c" / "model.safetensors"))
    with pytest.raises(KeyError, match="lacks .*n_predict"):
        read_mlp_speculator(tmp_path / "c")
