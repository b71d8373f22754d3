"""specdec/heads/mlp_speculator.py: MLPSpeculator checkpoints written here in exactly the published key
layout (config.json + ``emb/proj/head/ln.{i}.*``; untied, or tied and stored once under ``speculator.``)
load through the proposer and give the same logits as IBM's formula applied to the raw tensors; a
speculator that does not fit the target is refused naming both sizes; broken checkpoints fail naming
what is wrong; written speculators read back exactly. Target-tied checkpoints (proj/ln only) take emb /
head from the target's input embedding / LM head (an untied target, so a swap would show) and are refused
naming both sizes on a target they do not fit.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from proposers.mlp_speculator import MLPSpeculatorProposer
from specdec.engine.tiny import tiny_random_llama
from specdec.heads.mlp_speculator import (TARGET_TIED, MLPSpeculatorConfig, load_mlp_speculator,
                                          random_mlp_speculator, read_mlp_speculator, write_mlp_speculator)
from specdec.datamodel.hidden_states import HiddenStates
from specdec.datamodel.sampling_params import SamplingParams
from specdec.spec_decode.config import SpeculativeConfig
from specdec.spec_decode.proposer import ProposeBatch
from tests.heads.helpers import D, V, rand, write_json

MLP = "proposers.mlp_speculator:MLPSpeculatorProposer"


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


@pytest.mark.parametrize("tie", [False, True])
def test_target_tied_takes_emb_and_head_from_the_target(tmp_path, tie):
    target = tiny_random_llama(0, num_slots=2, max_model_len=64, tie_word_embeddings=False)
    emb, lm = target.model.embed_weight, target.model.lm_head.w_t  # [V, D] each, different
    assert not torch.equal(emb, lm)
    m = random_mlp_speculator(MLPSpeculatorConfig(n_predict=3, emb_dim=D, inner_dim=D, vocab_size=V,
                                                  tie_weights=tie), seed=3)
    with torch.no_grad():  # the trainer's frozen copies
        for i in range(3):
            m.emb[i].weight.copy_(emb)
            m.head[i].weight.copy_(lm)
    write_mlp_speculator(tmp_path, m.cfg, m.state_dict(), dtype=torch.float32, target_tied=True)
    cfg, sd, conf = read_mlp_speculator(tmp_path)
    assert conf[TARGET_TIED] == ["emb", "head"] and {k.split(".")[0] for k in sd} == {"proj", "ln"}
    assert conf["model_type"] == "mlp_speculator" and cfg == m.cfg
    with pytest.raises(ValueError, match="target-tied .* load_mlp_speculator\\(path, target\\)"):
        load_mlp_speculator(tmp_path)
    prop = mlp_proposer(target, tmp_path)
    for i in range(3):
        assert torch.equal(prop.model.emb[i].weight, emb) and torch.equal(prop.model.head[i].weight, lm)
    for k, v in m.state_dict().items():
        assert torch.equal(prop.model.state_dict()[k], v), k
    h, tok = torch.randn(4, D) * 3, torch.tensor([1, 7, 99, 300])
    ref = mlp_reference(m.state_dict(), h, tok, 3, D, tied=tie)
    for got, want in zip(mlp_stage_logits(prop, h, tok, 3), ref):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    if not tie:  # untied stages with a table of their own: it cannot be left out
        m.emb[1].weight.data.add_(1)
        with pytest.raises(ValueError, match=r"emb\.1\.weight differs from emb\.0\.weight"):
            write_mlp_speculator(tmp_path / "x", m.cfg, m.state_dict(), target_tied=True)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("field, kw, named", [("emb_dim", {"emb": 32}, "hidden_size"),
                                               ("vocab_size", {"vocab": 256}, "vocab_size")])
def test_mlp_speculator_that_does_not_fit_is_refused_naming_both(target, tmp_path, field, kw, named, tied):
    if tied:  # no emb/head stored: the sizes come from config.json alone
        c = MLPSpeculatorConfig(n_predict=3, emb_dim=kw.get("emb", D), inner_dim=kw.get("emb", D),
                                vocab_size=kw.get("vocab", V), tie_weights=True)
        write_mlp_speculator(tmp_path, c, random_mlp_speculator(c).state_dict(), target_tied=True)
    else:
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
