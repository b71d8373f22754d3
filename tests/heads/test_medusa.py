"""specdec/heads/medusa.py: Medusa checkpoints written here in exactly the published key layouts load
through the proposer and give the same logits as Medusa's formula applied to the raw tensors; heads that
do not fit the target are refused with both sizes named; broken checkpoints fail naming what is wrong;
random heads write and read back exactly.

Layouts: FasterDecoding's ``medusa_lm_head.safetensors`` / ``.pt`` (``{i}.{j}.linear.*``, ``{i}.{L}.weight``),
the ``medusa_lm_head.``-prefixed state dict in ``model.safetensors``, vLLM's ``blocks.{i}.layers.{j}`` /
``lm_heads.{i}`` / ``token_map``, and ``original_lm_head`` without LM heads.
"""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from proposers.medusa import MedusaProposer
from specdec.heads.medusa import MedusaConfig, load_medusa, random_medusa, read_medusa, write_medusa
from specdec.datamodel.hidden_states import HiddenStates
from specdec.datamodel.sampling_params import SamplingParams
from specdec.spec_decode.config import SpeculativeConfig
from specdec.spec_decode.proposer import ProposeBatch
from tests.heads.helpers import D, V, rand, write_json

MEDUSA = "proposers.medusa:MedusaProposer"


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
