"""dtype="auto", the default everywhere (#43 item 1): bfloat16 where the CPU has bf16 arithmetic (AMX or AVX512_BF16),
float32 elsewhere, decided from the CPU's flags (injected here: the resolution, not the engine, is what varies); the
engine records the resolved dtype; greedy speculation under the default equals plain decoding."""

import inspect

import pytest
import torch
import yaml

from specdec import LLM, SamplingParams
from specdec.engine.cpu.build import BF16_ISAS, ISAS, choose_isa, cpu_flags
from specdec.engine.loader import auto_dtype, load_engine

@pytest.fixture(autouse=True)
def _unpinned(monkeypatch):
    """The suite pins auto to fp32 (tests/conftest.py); this module tests what auto means on this CPU."""
    monkeypatch.delenv("SPECDEC_AUTO_DTYPE", raising=False)


def test_the_pin_names_its_value_and_refuses_others(monkeypatch):
    monkeypatch.setenv("SPECDEC_AUTO_DTYPE", "bfloat16")
    assert auto_dtype() == (torch.bfloat16, "bfloat16: SPECDEC_AUTO_DTYPE=bfloat16")
    monkeypatch.setenv("SPECDEC_AUTO_DTYPE", "int8")
    with pytest.raises(ValueError, match="SPECDEC_AUTO_DTYPE='int8'; use float32 or bfloat16"):
        auto_dtype()


# an x86-64-v4 CPU's flags (what choose_isa asks for AVX-512) without and with bf16 arithmetic
AVX512 = {"avx2", "fma", "f16c", "bmi2", "movbe", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}
ZEN3 = {"avx2", "fma", "f16c", "bmi2", "movbe"}  # AVX2 only, as on the project's EPYC boxes


@pytest.mark.parametrize("flags, want", [
    (ZEN3, torch.float32),  # no bf16 arithmetic
    (AVX512, torch.float32),  # AVX-512 without BF16: widening bf16 loads only
    (AVX512 | {"avx512_bf16"}, torch.bfloat16),  # Cooper Lake, Zen 4
    (AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile"}, torch.bfloat16),  # Sapphire Rapids
    (ZEN3 | {"amx_bf16"}, torch.float32),  # bf16 flag but no build of ours runs it: fp32, said so
    (set(), torch.float32),
])
def test_auto_follows_the_cpu_flags(flags, want, monkeypatch):
    monkeypatch.delenv("SPECDEC_CPU_ISA", raising=False)
    dt, why = auto_dtype(flags)
    assert dt == want, why
    assert why.startswith(str(want).removeprefix("torch."))


def test_auto_on_this_cpu_matches_its_flags_and_the_engine_records_the_resolved_dtype():
    f = cpu_flags()
    want = torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & f and choose_isa() in BF16_ISAS else torch.float32
    assert auto_dtype()[0] == want
    eng = load_engine("tiny-random-llama", num_slots=1, max_model_len=32)  # the default dtype: auto
    assert eng.dtype == want and eng.describe()["dtype"] == str(want).removeprefix("torch.")  # not "auto"
    assert "avx512bf16" in ISAS


def test_auto_is_the_default_everywhere():
    from specdec.entrypoints.engine_args import AsyncEngineArgs, EngineArgs

    assert inspect.signature(LLM).parameters["dtype"].default == "auto"
    assert inspect.signature(load_engine).parameters["dtype"].default == "auto"
    assert EngineArgs().dtype == "auto" and AsyncEngineArgs().dtype == "auto"
    for name in ("smollm2", "tiny"):  # the Hydra model group: the experiments' and the server's default
        with open(f"conf/model/{name}.yaml") as fh:
            assert yaml.safe_load(fh)["dtype"] == "auto", name


def test_greedy_speculation_equals_plain_under_the_default_dtype(one_thread):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["the cat sat on the mat, the cat sat on the", "abcabcabcabc", {"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5]}]
    plain = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=128)
    spec = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=128,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert plain.engine.dtype == spec.engine.dtype == auto_dtype()[0]
    a = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert a == b
