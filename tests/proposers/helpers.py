"""Helpers the proposer tests import by name (no tests here; the fixtures are in conftest.py).

A plain module rather than conftest.py, because tests import these by name: pytest imports a conftest
itself (possibly under another module name than ``tests.proposers.conftest``), so importing one from a
test can load it twice. Shared by:

- every family: ``LEN``, the ragged batch (``RAGGED``, ``RAGGED_MAX``, ``BATCHES``), :func:`greedy` and
  :func:`generate_and_assert_greedy_equal` (speculative vs plain greedy through ``LLM.with_speculation``);
- EAGLE-1 and EAGLE-3 (test_eagle.py, test_eagle3.py): :func:`features`, :func:`from_scratch_kv` and
  :func:`simulate`, a minimal worker that threads feature rows as SpecDecodeWorker does;
- Medusa and the MLP speculator (test_medusa.py, test_mlp_speculator.py): :func:`per_token_engine` (an
  untied 1-layer target whose next token depends on the current one only), :func:`corrupt` and
  :func:`two_token_pvalue`. test_eagle.py has its own per-token target (tied, unit final norm: what an
  EAGLE-1 head can compute).
"""

from __future__ import annotations

import copy
import random

import torch

from specdec_kernels.testing import chi_square_pvalue, counts_of
from specdec import LLM, SamplingParams
from specdec.engine import ForwardBatch
from specdec.engine.llama import Llama
from specdec.engine.native import NativeEngine
from specdec.engine.testing import rand_tokens
from specdec.engine.tiny import tiny_config, tiny_random_llama, tiny_random_weights
from specdec.datamodel.hidden_states import HiddenStates
from specdec.spec_decode.proposer import ProposeBatch

LEN = 256  # max_model_len of the tiny LLMs
RAGGED = [[5, 6, 7], rand_tokens(12, seed=1), [40, 41, 42, 43] * 6 + [7, 8, 9], rand_tokens(50, seed=2)]
RAGGED_MAX = [37, 20, 45, 9]  # max_tokens of each RAGGED prompt
BATCHES = {"batch1": ([[1, 17, 42, 99, 3]], [40]), "ragged4": (RAGGED, RAGGED_MAX)}  # (prompts, max_tokens)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def generate_and_assert_greedy_equal(llm: LLM, cfg: dict, prompts: list[list[int]],
                        params: SamplingParams | list[SamplingParams] | list[int]) -> LLM:
    """``llm.with_speculation(cfg)`` gives plain greedy's tokens for every prompt and leaks no slot; returns
    the speculative LLM (for its metrics). ``params``: SamplingParams (one, or one per prompt), or the
    max_tokens of each prompt (greedy)."""
    if isinstance(params, list) and params and isinstance(params[0], int):
        params = [greedy(m) for m in params]
    spec_llm = llm.with_speculation(cfg)
    got = spec_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    want = llm.without_speculation().generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for r, (a, b) in enumerate(zip(got, want)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"request {r}: speculative != plain greedy"
    assert llm.engine.num_free_slots() == llm.engine.num_slots
    return spec_llm


# ---------------------------------------------------------------------------------------------- EAGLE


def features(engine, tokens: list[int], layers=()) -> torch.Tensor:
    """[len, F] the target's features of ``tokens`` from a fresh slot (last layer, or ``layers`` fused)."""
    slot = engine.allocate_slot()
    out = engine.forward(ForwardBatch(torch.tensor(tokens), [slot], [len(tokens)], hidden_layers=tuple(layers)))
    engine.free_slot(slot)
    return torch.cat(out.aux_hidden_states, -1) if layers else out.hidden_states


def from_scratch_kv(head, tokens: list[int], feats: torch.Tensor, embed) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [nkv, L-1, hd] of a copy of ``head`` fed the pairs of tokens 1..L-1 (feature of token i-1,
    position i-1) in one forward on an empty cache."""
    ref = copy.deepcopy(head)
    ref.init_cache(1, LEN, torch.float32, "cpu")
    slot = ref.cache.allocate()
    n = len(tokens) - 1
    ref.forward_cached(embed(torch.tensor(tokens[1:])), feats[:n], torch.arange(n), [slot], [n])
    return ref.cache.k[0, slot, :, :n], ref.cache.v[0, slot, :, :n]


def simulate(prop, target, prompts, k: int, steps: int, check=None, seed: int = 0):
    """A minimal worker around ``prop``: prefill, then per step propose -> score (target forward of pending +
    drafts) -> accept a random prefix (all k every third step: a bonus) -> roll back -> thread the rows of
    every committed token (the prompt's, then the pending token's and the accepted drafts') as
    SpecDecodeWorker does for a FeatureSpec with history=None. ``check(seq_id, tokens, bonus)`` runs after
    every propose."""
    rng = random.Random(seed)
    layers = prop.features.layers

    def forward(tokens, slot):
        out = target.forward(ForwardBatch(torch.tensor(tokens), [slot], [len(tokens)], hidden_layers=layers))
        return out.logits, out.features

    seqs, slots, rows, bonus = {}, {}, {}, {}
    for s, p in enumerate(prompts):
        slots[s] = target.allocate_slot()
        logits, h = forward(p, slots[s])
        seqs[s] = list(p) + [int(logits[-1].argmax())]
        rows[s] = h  # every prompt token's state
        bonus[s] = False
    for step in range(steps):
        ids = list(seqs)
        hs = HiddenStates(torch.cat([rows[s] for s in ids]), _seq_ids=[s for s in ids for _ in range(len(rows[s]))])
        out = prop.propose(ProposeBatch(seq_ids=ids, token_ids=[list(seqs[s]) for s in ids], k=k,
                                        sampling_params=[SamplingParams(temperature=0.0)] * len(ids),
                                        generators=[None] * len(ids), hidden_states=hs))
        for b, s in enumerate(ids):
            if check is not None:
                check(s, seqs[s], bonus[s])
            drafts = out.token_ids[b].tolist()
            base = len(seqs[s])
            _, h = forward([seqs[s][-1]] + drafts, slots[s])  # [k+1, F]
            a = k if step % 3 == 1 else rng.choice([0, 1, k - 1])
            target.rollback(slots[s], base + a)
            prop.accepted(s, base, list(range(a)))
            seqs[s] += drafts[:a] + [rng.randrange(3, 512)]
            bonus[s] = a == k
            rows[s] = h[:a + 1]
    return seqs


# ---------------------------------------------------------------------------------------------- Medusa, MLP


def per_token_engine(max_model_len: int = LEN) -> NativeEngine:
    """A 1-layer tiny llama whose attention adds nothing (v = 0): its hidden state, hence its next token,
    is a function of the current token only (position and context drop out)."""
    cfg = tiny_config(num_hidden_layers=1, tie_word_embeddings=False)
    sd = tiny_random_weights(cfg, 0)
    sd["model.layers.0.self_attn.v_proj.weight"].zero_()
    return NativeEngine(Llama.from_hf_state_dict(cfg, sd), num_slots=4, max_model_len=max_model_len)


def corrupt(x: torch.Tensor, i: int, call: int, every: int) -> torch.Tensor:
    """[N] bool: about 1 in ``every`` (token, head, call) triples is wrong (0: none). The call count is in
    the key because the per-token target falls into short cycles: a rule on tokens alone would make a
    whole cycle right or wrong."""
    if not every:
        return torch.zeros_like(x, dtype=torch.bool)
    key = (x * 1103515245 + i * 12345 + call * 265443) % 2**31  # an LCG step: independent-looking bits
    return (key >> 16) % every == 0


FIRST_TWO_PROMPT = [1, 17, 42, 99, 3]


def exact_first_two(prompt: list[int] = FIRST_TWO_PROMPT) -> tuple[torch.Tensor, torch.Tensor]:
    """(p1 [V], joint [V * V]) float64: the tiny target's (seed 0) law of the first token after ``prompt``
    and of the first two, temperature 1, every cell computed (one batched forward of the V continuations)."""
    V = 512
    ref = tiny_random_llama(0, num_slots=V, max_model_len=8)
    slot = ref.allocate_slot()
    p1 = torch.softmax(ref.forward(ForwardBatch(torch.tensor(prompt), [slot], [len(prompt)])).logits[-1].double(), -1)
    ref.free_slot(slot)
    slots = [ref.allocate_slot() for _ in range(V)]
    m = len(prompt) + 1
    logits = ref.forward(ForwardBatch(torch.tensor([t for x in range(V) for t in prompt + [x]]), slots, [m] * V,
                                      logits_indices=torch.arange(V) * m + m - 1)).logits  # [V, V]
    return p1, (p1[:, None] * torch.softmax(logits.double(), -1)).reshape(-1)


def two_token_pvalue(speculative_config: dict, n: int = 2048):
    """(chi-square p-values of the first token's law (512 cells: the more powerful test of position 1)
    and of the joint law of the first two (512 x 512 cells) over n requests at temperature 1 against
    the target's exact laws, the run's metrics)."""
    V, prompt = 512, FIRST_TWO_PROMPT
    p1, joint = exact_first_two()
    llm = LLM("tiny-random-llama", max_num_seqs=256, max_model_len=16, speculative_config=speculative_config)
    outs = llm.generate([{"prompt_token_ids": prompt}] * n,
                        SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    toks = torch.tensor([o.outputs[0].token_ids for o in outs])
    first = chi_square_pvalue(counts_of(toks[:, 0], V), p1)
    return min(first, chi_square_pvalue(counts_of(toks[:, 0] * V + toks[:, 1], V * V), joint)), llm.get_metrics()

