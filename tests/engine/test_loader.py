"""Loaders: names, local directories, the GGUF conversion cache; slow tests on the real SmolLM2-135M."""

from __future__ import annotations

import pytest
import torch
import transformers

from specdec.engine import loader
from specdec.engine.loader import KNOWN_MODELS, load_engine, load_tokenizer, model_info
from specdec.engine.testing import hf_logits, rand_tokens, run
from specdec.engine.tiny import tiny_random_llama, tiny_tokenizer, to_hf_model


def test_unknown_model_lists_known_names():
    with pytest.raises(ValueError, match="unknown model 'gpt-17'") as e:
        load_engine("gpt-17")
    for name in KNOWN_MODELS:
        assert name in str(e.value)
    assert ".gguf" in str(e.value) and "directory" in str(e.value)


def test_tiny_is_deterministic_per_seed():
    toks = rand_tokens(5, 1)
    a, b, c = (load_engine("tiny-random-llama", seed=s, max_model_len=32) for s in (3, 3, 4))
    la, lb, lc = (run(e, {e.allocate_slot(): toks}).logits for e in (a, b, c))
    assert torch.equal(la, lb) and not torch.allclose(la, lc)
    assert model_info("tiny-random-llama") == a.config


def test_bad_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype='int8'"):
        load_engine("tiny-random-llama", dtype="int8")


def test_tiny_tokenizer_round_trips_and_has_chat_template():
    tok = load_tokenizer("tiny-random-llama")
    cfg = model_info("tiny-random-llama")
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg.bos_token_id, cfg.eos_token_id)
    assert len(tok) <= cfg.vocab_size
    text = "héllo, wörld 🙂"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text.encode()) and tok.decode(ids) == text  # one token per byte
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_local_hf_directory_loads_same_weights(tmp_path):
    engine = tiny_random_llama(0, max_model_len=32, tie_word_embeddings=False)
    to_hf_model(engine).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    loaded = load_engine(str(tmp_path), max_model_len=32, dtype="float32")  # auto is bf16 on AVX512-BF16 CPUs
    assert loaded.config == engine.config
    toks = rand_tokens(6, 2)
    got = run(loaded, {loaded.allocate_slot(): toks}).logits
    torch.testing.assert_close(got, run(engine, {engine.allocate_slot(): toks}).logits)
    assert load_tokenizer(str(tmp_path)).chat_template is not None


class _FakeGGUF:
    """Stands in for transformers' GGUF loading with the tiny model, so conversion runs in a second."""

    def __init__(self, monkeypatch):
        self.calls = 0
        hf = to_hf_model(tiny_random_llama(0, max_model_len=32))

        def model(*a, **k):
            self.calls += 1
            return hf

        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model)
        monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer())


def test_gguf_conversion_is_cached_and_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not really gguf")
    fake = _FakeGGUF(monkeypatch)
    # a conversion killed half way leaves nothing behind
    monkeypatch.setattr("safetensors.torch.save_file", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        loader.resolve_model_dir(str(gguf))
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    fake = _FakeGGUF(monkeypatch)
    e1 = load_engine(str(gguf), max_model_len=32)
    e2 = load_engine(str(gguf), max_model_len=32)  # from the cache
    assert fake.calls == 1
    (out,) = (tmp_path / "cache" / "gguf").iterdir()
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert "quantization_config" not in (out / "config.json").read_text()
    toks = rand_tokens(4, 3)
    assert torch.equal(run(e1, {e1.allocate_slot(): toks}).logits, run(e2, {e2.allocate_slot(): toks}).logits)


# ---- slow: the real default model ------------------------------------------------------------------
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, and then list three colours.",
]


@pytest.fixture(scope="module")
def smollm2():
    engine = load_engine("smollm2-135m-instruct", num_slots=4, max_model_len=256)  # converts once if needed
    path = loader.resolve_model_dir("smollm2-135m-instruct")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = load_tokenizer("smollm2-135m-instruct")
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)["input_ids"] for p in PROMPTS]
    return engine, hf, ids


@pytest.mark.slow
def test_smollm2_second_load_uses_the_cache(smollm2, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the cached conversion should have been used")

    monkeypatch.setattr(loader, "convert_gguf", refuse)
    engine = load_engine("smollm2-135m-instruct", num_slots=1, max_model_len=64)
    assert engine.config == smollm2[0].config and engine.num_layers == 30


@pytest.mark.slow
def test_smollm2_ragged_batch_matches_transformers(smollm2):
    engine, hf, ids = smollm2
    slots = [engine.allocate_slot() for _ in ids]
    try:
        out = run(engine, dict(zip(slots, ids)))
        ends = torch.tensor([len(p) for p in ids]).cumsum(0) - 1
        nxt = {s: [int(out.logits[e].argmax())] for s, e in zip(slots, ends)}
        step = run(engine, nxt)  # one decode step for all three
        row = 0
        for i, (s, p) in enumerate(zip(slots, ids)):
            ref = hf_logits(hf, p + nxt[s])
            assert (out.logits[row : row + len(p)] - ref[:-1]).abs().max() <= 1e-3, f"prompt {i} prefill"
            assert (step.logits[i] - ref[-1]).abs().max() <= 1e-3, f"prompt {i} decode"
            row += len(p)
    finally:
        for s in slots:
            engine.free_slot(s)


@pytest.mark.slow
def test_smollm2_greedy_32_tokens_equal_transformers_generate(smollm2):
    engine, hf, ids = smollm2
    want = []
    for p in ids:
        with torch.no_grad():
            want.append(hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)[0, len(p) :].tolist())
    # ours: the three prompts decoded together, as a batch, each until eos or 32 tokens
    slots = [engine.allocate_slot() for _ in ids]
    ends = torch.tensor([len(p) for p in ids]).cumsum(0) - 1
    out = run(engine, dict(zip(slots, ids)), logits_indices=ends)
    got: dict[int, list[int]] = {s: [] for s in slots}
    live = list(slots)
    while live:
        for s, row in zip(live, out.logits):
            got[s].append(int(row.argmax()))
        live = [s for s in live if len(got[s]) < 32 and got[s][-1] not in engine.config.eos_token_ids]
        if live:
            out = run(engine, {s: got[s][-1:] for s in live})
    for s in slots:
        engine.free_slot(s)
    for i, s in enumerate(slots):
        assert got[s] == want[i], f"prompt {i}"
        assert len(got[s]) >= 8  # an early eos would make this test weak
