"""Helpers shared by the spec-decode proofs (no tests here).

- :func:`assert_greedy_equal`: speculative vs plain greedy outputs, token for token. A mismatch is never
  accepted silently: the target's logits are recomputed at the first differing position and the failure
  names the top-2 logit gap there, so a float near-tie (gap ~1e-6) is told apart from a real bug.
- :func:`noisy_tiny_engine`: the tiny target with perturbed weights, a draft that is *partly* right.
- :func:`target_forward`: a fresh, unbatched forward of one token sequence through an engine.
- :class:`CorruptedGreedyProposer`: drafts the target's true greedy continuation, each position
  independently replaced by a wrong token with probability 1 - alpha (acceptance with a known alpha).
- :func:`pit_from_probs`, :func:`uniformity_pvalue` and ``DELTA``: the randomised PIT of every generated
  token under its exact law, and the chi-square p-value (threshold DELTA) that the PIT is uniform
  (test_sampling_lossless.py, test_processors_lossless.py).
"""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.testing import chi_square_pvalue, counts_of
from proposers.draft_model import DraftModelProposer
from specdec.engine import ForwardBatch, ForwardOutput, ModelEngine
from specdec.engine.llama import Llama
from specdec.engine.native import NativeEngine
from specdec.engine.tiny import tiny_config, tiny_random_llama, tiny_random_weights
from specdec.spec_decode.proposer import DraftOutput, ProposeBatch

NEAR_TIE = 1e-3  # a top-2 logit gap below this is a float near-tie (fp32 logits are O(1) here)


def target_forward(engine: ModelEngine, token_ids: list[int]) -> ForwardOutput:
    """Every row of one sequence's forward (logits [n, V], hidden [n, D]) in a fresh slot, then freed."""
    slot = engine.allocate_slot()
    try:
        return engine.forward(ForwardBatch(token_ids=torch.tensor(token_ids, dtype=torch.long, device=engine.device),
                                           slots=[slot], query_lens=[len(token_ids)]))
    finally:
        engine.free_slot(slot)


def mismatch_report(engine: ModelEngine, prompt: list[int], spec: list[int], ref: list[int], label: str) -> str:
    """The failure message for spec != ref: where, which tokens, and the target's logit gap there."""
    i = next((j for j, (a, b) in enumerate(zip(spec, ref)) if a != b), min(len(spec), len(ref)))
    if i == min(len(spec), len(ref)):  # one is a prefix of the other: a stop/length bug, not a tie
        return (f"{label}: speculative output has {len(spec)} tokens, plain has {len(ref)}; they agree on the "
                f"first {i} (a stop-token / max_tokens / max_model_len handling difference). "
                f"spec tail {spec[i - 2:]}, plain tail {ref[i - 2:]}")
    logits = target_forward(engine, prompt + ref[:i]).logits[-1].float()  # [V] at the differing position
    top = logits.topk(2)
    gap = float(top.values[0] - top.values[1])
    pair_gap = float(logits[ref[i]] - logits[spec[i]])
    kind = ("a float near-tie: the batched and unbatched forwards may round differently" if gap < NEAR_TIE
            else "NOT a near-tie: a real bug in the speculative path")
    return (f"{label}: greedy mismatch at output token {i}: speculative {spec[i]} vs plain {ref[i]}. Target "
            f"top-2 there: {top.indices.tolist()} with logit gap {gap:.3g}; logit(plain) - logit(spec) = "
            f"{pair_gap:.3g} -> {kind}. Context: {len(prompt)} prompt tokens + {i} outputs")


def assert_greedy_equal(engine: ModelEngine, prompts: list[list[int]], spec_outs, ref_outs, label: str = "") -> None:
    """Speculative RequestOutputs == plain ones: token ids, finish and stop reasons (never a silent pass)."""
    assert len(spec_outs) == len(ref_outs) == len(prompts)
    for r, (prompt, s, p) in enumerate(zip(prompts, spec_outs, ref_outs)):
        a, b = s.outputs[0], p.outputs[0]
        if a.token_ids != b.token_ids:
            pytest.fail(mismatch_report(engine, list(prompt), list(a.token_ids), list(b.token_ids),
                                        f"{label} request {r}"))
        assert (a.finish_reason, a.stop_reason) == (b.finish_reason, b.stop_reason), f"{label} request {r}"


def ids(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def noisy_tiny_engine(scale: float = 0.15, *, num_slots: int = 4, max_model_len: int = 256,
                      noise_seed: int = 123) -> NativeEngine:
    """The tiny target (seed 0) with every weight perturbed by ``scale`` x its std: greedy drafts agree
    with the target often but not always (scale 0.15 -> about half of the first drafts accepted)."""
    cfg = tiny_config()
    g = torch.Generator().manual_seed(noise_seed)
    sd = {k: v + scale * v.std() * torch.randn(v.shape, generator=g)
          for k, v in tiny_random_weights(cfg, 0).items()}
    return NativeEngine(Llama.from_hf_state_dict(cfg, sd), num_slots=num_slots, max_model_len=max_model_len)


class CorruptedGreedyProposer(DraftModelProposer):
    """Greedy drafts of a copy of the tiny target (seed 0), so each is the target's own greedy token;
    then each position is independently replaced by a different token with probability 1 - alpha.

    Under greedy verification position i is accepted iff positions 0..i are all clean, so
    P(accept position i) = alpha^(i+1) and E[emitted per step] = (1 - alpha^(k+1)) / (1 - alpha).
    options (its __init__ arguments): alpha, corrupt_seed. Greedy requests only.
    """

    def __init__(self, target, config, alpha: float = 0.7, corrupt_seed: int = 0) -> None:
        super().__init__(target, config)
        self.alpha = float(alpha)
        self.gen = torch.Generator().manual_seed(int(corrupt_seed))

    def build_engine(self, target, config):
        return tiny_random_llama(0, num_slots=target.num_slots, max_model_len=target.max_model_len)

    def propose(self, batch: ProposeBatch) -> DraftOutput:
        out = super().propose(batch)
        clean = out.token_ids  # [B, k] the target's greedy continuation
        bad = torch.rand(clean.shape, generator=self.gen) >= self.alpha  # [B, k] corrupt w.p. 1 - alpha
        shift = torch.randint(1, self.engine.vocab_size, clean.shape, generator=self.gen)  # never 0: always wrong
        wrong = (clean + shift) % self.engine.vocab_size
        return DraftOutput(token_ids=torch.where(bad, wrong, clean), probs=None)


# ----------------------------------------------------------------------------------- randomised PIT

DELTA = 1e-3  # significance level of the statistical checks (p-value > DELTA passes)


def pit_from_probs(p: torch.Tensor, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Randomised PIT: p [n, V] laws, x [n] observed tokens -> u [n] = F(x) - U p(x), with F the
    cumulative mass in descending-probability order; Uniform(0, 1) when each x ~ its p."""
    p = p.double()
    order = p.argsort(dim=-1, descending=True)
    rank = order.argsort(dim=-1)  # rank[i, t]: position of token t in descending order
    cdf = p.gather(1, order).cumsum(-1)  # [n, V]
    x = x.reshape(-1, 1)
    fx = cdf.gather(1, rank.gather(1, x))[:, 0]
    u = fx - torch.rand(x.shape[0], generator=gen, dtype=torch.float64) * p.gather(1, x)[:, 0]
    return u.clamp(0, 1 - 1e-12)


def uniformity_pvalue(u: torch.Tensor, bins: int = 20) -> float:
    return chi_square_pvalue(counts_of((u * bins).long(), bins), torch.full((bins,), 1.0 / bins))


# the speculative configs the logits-processor and guided-decoding lossless tests share: a chain proposer, a noisy
# draft model and an EAGLE tree on the tiny model (factories: each test builds its own engine)
LOSSLESS_SPECS = {
    "ngram_k4": lambda: {"method": "ngram", "num_speculative_tokens": 4},
    "draft_noisy_k3": lambda: {"method": "draft_model", "num_speculative_tokens": 3,
                               "options": {"engine": noisy_tiny_engine(0.15, num_slots=4)}},
    "eagle_tree": lambda: {"method": "eagle", "model": "tiny-random-llama", "num_speculative_tokens": 3,
                           "scorer": "tree", "tree_depth": 3, "tree_topk": 2, "tree_budget": 6},
}


def greedy(max_tokens: int = 32, **kw):
    """SamplingParams for greedy decoding of exactly ``max_tokens`` tokens (EOS ignored)."""
    from specdec import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def record(llm) -> list[list[tuple[int, int]]]:
    """Wrap ``llm``'s worker so each decode step logs (num_chosen, num_proposed) of every group; returns the log."""
    log, inner = [], llm.worker.execute_model

    def execute_model(req):
        out = inner(req)
        if not req.seq_group_metadata_list[0].is_prompt:
            log.append([(g.num_chosen, g.num_proposed) for g in out.outputs])
        return out

    llm.worker.execute_model = execute_model
    llm.llm_engine.worker = llm.worker
    return log
