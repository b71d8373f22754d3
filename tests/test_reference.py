"""specdec/reference.py, the one-screen loop, against the batched worker: ``LLM(...).generate`` with the same
speculative_config at batch 1 gives the same tokens, token for token.

- tiny seeded model: chain (ngram; draft_model and layer_skip drafting with their own KV) and tree
  (proposers/tree_draft.py, scorer="tree"), each greedy, sampled (temperature 1) and sampled with top-p, the
  sampled ones with a seed: the reference draws its randomness exactly as the worker does for a seeded request,
  so the same seed gives the same tokens. Greedy output also equals plain decoding.
- SmolLM2-135M-Instruct (slow): chain (ngram) and tree (tree_draft over the target's first 8 layers), greedy,
  two chat prompts, 32 tokens, stopping at EOS.

The drafts are chosen to be partly right (a noisy copy of the target, a layer-skip draft, n-grams of a random
model), so that both accepted and rejected drafts, recovered and bonus tokens, and (for trees) paths through
later siblings occur; each case checks that they did, so an agreement is never vacuous.
"""

import msgspec
import pytest

from specdec import LLM, SamplingParams
from specdec.reference import generate
from specdec.spec_decode.config import parse_speculative_config
from specdec.spec_decode.proposer import TreeShape
from specdec.spec_decode.registry import resolve
from tests.spec_decode.helpers import noisy_tiny_engine

TREE = "proposers.tree_draft:TreeDraftProposer"
NOISY = object()  # stands for a fresh noisy copy of the tiny target: the worker and the reference each own one

# a random prompt, and a repetitive one the n-gram proposer can match
PROMPTS = [[1, 17, 42, 99, 3], [40, 41, 42, 43] * 6 + [7, 8, 9]]

CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "options": {"engine": NOISY}},
    "layer_skip": {"method": "layer_skip", "num_layers": 2, "num_speculative_tokens": 3},
    "tree_draft": {"method": TREE, "scorer": "tree", "tree_depth": 4, "tree_topk": 2, "tree_budget": 8,
                   "options": {"engine": NOISY}},
}

PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    "sampled": SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True),
    "top_p": SamplingParams(temperature=0.7, top_p=0.9, seed=8, max_tokens=40, ignore_eos=True),
}


def build(spec: dict) -> dict:
    """``spec`` with a fresh noisy draft engine wherever it says NOISY."""
    opts = {k: noisy_tiny_engine(0.15, num_slots=1) if v is NOISY else v for k, v in spec.get("options", {}).items()}
    return {**spec, "options": opts} if opts else dict(spec)


def run_reference(llm: LLM, spec: dict, prompt: list[int], params: SamplingParams) -> list[int]:
    """The reference loop on the LLM's own target engine (idle between generate calls), with a fresh proposer
    built from ``spec`` through the same registry the worker uses."""
    cfg = parse_speculative_config(spec)
    proposer = resolve("proposer", cfg.method)(llm.engine, cfg)
    shape = None
    if resolve("scorer", cfg.scorer).drafts_trees:
        shape = TreeShape(cfg.tree_depth or cfg.num_speculative_tokens, cfg.tree_topk, cfg.tree_budget)
    eos = None if params.ignore_eos else llm.tokenizer.eos_token_id
    return generate(llm.engine, proposer, prompt, params, k=cfg.num_speculative_tokens, shape=shape,
                    eos_token_id=eos)


def first_difference(a: list[int], b: list[int]) -> str:
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return (f"first difference at output token {i}: worker {a[i:i + 4]} vs reference {b[i:i + 4]} "
            f"({len(a)} / {len(b)} tokens)")


class CountCompacts:
    """Counts ``compact`` calls on an engine: the worker and the reference move a tree's accepted path into
    place only when it goes through a later sibling (a prefix of the nodes is a rollback)."""

    def __init__(self, engine, monkeypatch) -> None:
        self.n, inner = 0, engine.compact

        def compact(*args, **kwargs):
            self.n += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(engine, "compact", compact)


# one thread (tests/conftest.py): under load SmolLM2's two tests took 15-30 s and 5-9 s on one thread, 60-88 s and
# 32-50 s on two
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_llms() -> dict[str, LLM]:
    return {}


def tiny_llm(cache: dict, name: str) -> LLM:
    if name not in cache:
        cache[name] = LLM("tiny-random-llama", max_num_seqs=1, max_model_len=256,
                          speculative_config=build(CONFIGS[name]))
    return cache[name]


@pytest.mark.parametrize("mode", list(PARAMS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_reference_matches_worker_on_tiny(name, mode, tiny_llms, monkeypatch):
    llm, params = tiny_llm(tiny_llms, name), PARAMS[mode]
    compacts = CountCompacts(llm.engine, monkeypatch)
    llm.reset_metrics()
    for prompt in PROMPTS:
        worker = list(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids)
        ref = run_reference(llm, build(CONFIGS[name]), prompt, params)
        assert worker == ref, f"{name}/{mode}, prompt {prompt[:6]}...: {first_difference(worker, ref)}"
        if mode == "greedy":  # and both equal plain decoding
            plain = llm.without_speculation().generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            plain_ids = list(plain[0].outputs[0].token_ids)
            assert plain_ids == ref, f"{name}, plain decoding: {first_difference(plain_ids, ref)}"
        else:  # the seed matters: another one gives other tokens
            other = msgspec.structs.replace(params, seed=params.seed + 1)
            assert run_reference(llm, build(CONFIGS[name]), prompt, other) != ref, f"{name}/{mode}: seed ignored"
    m = llm.get_metrics()
    # not vacuous: drafts were accepted and rejected (so recovered tokens were drawn); trees took later siblings
    assert 0 < m.acceptance_rate < 1, f"{name}/{mode}: acceptance rate {m.acceptance_rate}, {m.acceptance_counts}"
    if CONFIGS[name].get("scorer") == "tree":
        assert compacts.n > 0, f"{name}/{mode}: no accepted path went through a later sibling"


SMOL_QUESTIONS = [
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",  # n-gram friendly
    "What is 12 times 12?",  # a short answer: stops at EOS before 32 tokens
]


@pytest.fixture(scope="module")
def smol():
    return LLM("smollm2-135m-instruct", max_num_seqs=1, max_model_len=512)


def smol_spec(smol: LLM, name: str) -> dict:
    if name == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3}
    # a tree drafted by the target's first 8 of 30 layers: partly right
    return {"method": TREE, "scorer": "tree", "tree_depth": 3, "tree_topk": 2, "tree_budget": 6,
            "options": {"engine": smol.engine.truncated(8)}}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ngram", "tree_draft"])
def test_reference_matches_worker_on_smollm2(name, smol):
    llm = smol.with_speculation(smol_spec(smol, name))
    params = SamplingParams(temperature=0.0, max_tokens=32)
    stopped = 0
    for q in SMOL_QUESTIONS:
        prompt = smol.chat_prompt_ids([{"role": "user", "content": q}])
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        ref = run_reference(llm, smol_spec(smol, name), prompt, params)
        assert list(out.token_ids) == ref, f"SmolLM2 {name}, {q!r}: {first_difference(list(out.token_ids), ref)}"
        stopped += out.finish_reason == "stop"
    m = llm.get_metrics()
    assert m.num_accepted_tokens > 0 and m.acceptance_rate < 1, f"{name}: counts {m.acceptance_counts}"
    assert stopped, "no prompt stopped at EOS: the stop rule went untested"
