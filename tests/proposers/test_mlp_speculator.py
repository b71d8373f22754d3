"""MLPSpeculatorProposer on the tiny model, with speculators built in-process (no trained weights):

- refusal of a speculator that does not fit the target (naming both sizes), of k > n_predict and of
  ``scorer="tree"``;
- each stage is IBM's formula (checked against a literal transcription of vLLM's ``generate_proposals``);
- greedy equality with plain decoding, batch 1 and a ragged batch of 4, with the rejection sampler and
  with typical acceptance, for random weights, an oracle on the per-token target (everything accepted)
  and a corrupted oracle (partly accepted);
- sampling: q sums to 1, each draft is drawn from it, stage i+1 reads the token drawn at stage i.
"""

import math

import pytest
import torch

from proposers.mlp_speculator import MLPSpeculatorProposer
from specdec.heads.mlp_speculator import MLPSpeculator, random_mlp_speculator
from specdec import LLM, SamplingParams
from specdec.engine import ForwardBatch
from specdec.engine.tiny import tiny_random_llama
from specdec.heads.mlp_speculator import MLPSpeculatorConfig
from specdec.datamodel.hidden_states import HiddenStates
from specdec.spec_decode.config import SpeculativeConfig
from specdec.spec_decode.proposer import ProposeBatch
from tests.proposers.helpers import (BATCHES, LEN, generate_and_assert_greedy_equal, corrupt, greedy, per_token_engine,
                                     two_token_pvalue)

METHOD = "proposers.mlp_speculator:MLPSpeculatorProposer"


def mlp_cfg(n_predict: int = 3, **kw) -> MLPSpeculatorConfig:
    return MLPSpeculatorConfig(**{"n_predict": n_predict, "emb_dim": 64, "inner_dim": 48, "vocab_size": 512, **kw})


def spec(model, k: int = 3, **extra) -> dict:
    return {"method": METHOD, "num_speculative_tokens": k, "options": {"head_module": model}, **extra}


def vllm_reference(m: MLPSpeculator, h: torch.Tensor, tokens: torch.Tensor, n: int) -> list[torch.Tensor]:
    """vLLM's MLPSpeculator.generate_proposals, greedy, written out: [n] logits [b, V]."""
    sw = 0.5 ** (0.5 / m.cfg.n_predict)
    ew = math.sqrt((1 - sw ** 2) * (m.cfg.inner_dim / 2))
    state = h.unsqueeze(1)  # b x 1 x d
    if m.cfg.scale_input:
        state = state * torch.rsqrt(state.pow(2).mean(-1, keepdim=True) + 1e-6) / 2 ** 0.5
    last = tokens.unsqueeze(1)
    out = []
    for i in range(n):
        z = m.emb[i].weight[last]  # b 1 d
        s = state @ m.proj[i].weight.T
        s = s + z * (ew / sw)
        s = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * m.ln[i].weight + m.ln[i].bias
        state = torch.nn.functional.gelu(s)
        logits = state.flatten(0, 1) @ m.head[i].weight.T
        out.append(logits)
        last = logits.argmax(-1).unsqueeze(1)
    return out


# ---------------------------------------------------------------------------------------------- refusal


@pytest.mark.parametrize("field, value, named", [("emb_dim", 32, "hidden_size"), ("vocab_size", 256, "vocab_size")])
def test_a_speculator_that_does_not_fit_is_refused_naming_both(field, value, named):
    target = tiny_random_llama(0, num_slots=2, max_model_len=64)
    m = MLPSpeculator(mlp_cfg(**{field: value}))
    with pytest.raises(ValueError, match=rf"{field}={value}.* but the target has {named}={getattr(target, named)}"):
        MLPSpeculatorProposer(target, SpeculativeConfig(method=METHOD, num_speculative_tokens=3,
                                                        options={"head_module": m}))


def test_too_many_tokens_and_trees_are_refused():
    target = tiny_random_llama(0, num_slots=2, max_model_len=64)
    with pytest.raises(ValueError, match="num_speculative_tokens=4 but .* n_predict=3"):
        MLPSpeculatorProposer(target, SpeculativeConfig(method=METHOD, num_speculative_tokens=4,
                                                        options={"head_module": random_mlp_speculator(mlp_cfg())}))
    with pytest.raises(ValueError, match="chain-only"):  # the builder refuses a tree scorer for it
        LLM("tiny-random-llama", max_num_seqs=2, max_model_len=64, speculative_config={
            "method": METHOD, "num_speculative_tokens": 3, "scorer": "tree",
            "options": {"head_module": random_mlp_speculator(mlp_cfg())}})


# ---------------------------------------------------------------------------------------------- the stages


@pytest.mark.parametrize("kw", [{}, {"tie_weights": True}, {"scale_input": True}])
def test_greedy_drafts_follow_ibms_formula(kw):
    target = tiny_random_llama(0, num_slots=2, max_model_len=64)
    m = random_mlp_speculator(mlp_cfg(**kw), seed=2)
    prop = MLPSpeculatorProposer(target, SpeculativeConfig(method=METHOD, num_speculative_tokens=3,
                                                           options={"head_module": m}))
    h, pending = torch.randn(2, 64), torch.tensor([11, 300])
    out = prop.propose(ProposeBatch([0, 1], [[1, 11], [2, 300]], 3, [greedy(1)] * 2, [None] * 2,
                                    HiddenStates(h, _seq_ids=[0, 1])))
    ref = vllm_reference(m, h, pending, 3)
    assert out.token_ids.tolist() == torch.stack([r.argmax(-1) for r in ref], 1).tolist()
    state, tok = m.first_state(h), pending
    for i in range(3):  # the stage function itself, against the reference logits
        state, logits = m.stage(i, state, tok)
        torch.testing.assert_close(logits, ref[i], atol=1e-5, rtol=1e-5)
        tok = logits.argmax(-1)


# ---------------------------------------------------------------------------------------------- greedy


MODES = {"chain": {}, "typical": {"acceptance_method": "typical_acceptance"}}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("batch", list(BATCHES))
def test_random_speculator_is_greedy_equal(tiny, mode, batch):
    llm = generate_and_assert_greedy_equal(tiny, spec(random_mlp_speculator(mlp_cfg()), 3, **MODES[mode]), *BATCHES[batch])
    assert llm.get_metrics().num_draft_tokens > 0


class OracleMLP(MLPSpeculator):
    """Stage i returns the per-token target's next token after the token it is given (corrupted triples
    rank a wrong token first)."""

    def __init__(self, nxt: torch.Tensor, every: int = 0) -> None:
        super().__init__(mlp_cfg())
        self.nxt, self.every, self.calls = nxt, every, 0

    def stage(self, i, state, tokens):
        self.calls += i == 0
        t = self.nxt[tokens]
        lg = torch.zeros(len(t), len(self.nxt))
        lg[torch.arange(len(t)), t] = 5.0
        bad = corrupt(tokens, i, self.calls, self.every)
        lg[torch.arange(len(t))[bad], (t[bad] + 1) % len(self.nxt)] = 10.0
        return state, lg


@pytest.fixture(scope="module")
def per_token():
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=LEN)
    llm.engine = per_token_engine()
    eng = per_token_engine(max_model_len=512)
    slot = eng.allocate_slot()
    nxt = eng.forward(ForwardBatch(torch.arange(512), [slot], [512])).logits.argmax(-1)
    return llm, nxt


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("every", [0, 3])
def test_oracle_is_greedy_equal_and_accepted(per_token, mode, batch, every):
    llm, nxt = per_token
    m = generate_and_assert_greedy_equal(llm, spec(OracleMLP(nxt, every), 3, **MODES[mode]), *BATCHES[batch]).get_metrics()
    if every == 0:
        assert m.mean_acceptance_length > 3.3, m.acceptance_counts
    else:
        assert 1.3 < m.mean_acceptance_length < 3.3 and m.acceptance_counts[3] > 0, m.acceptance_counts


# ---------------------------------------------------------------------------------------------- sampling


def test_sampled_drafts_come_with_their_q():
    target = tiny_random_llama(0, num_slots=2, max_model_len=64)
    m = random_mlp_speculator(mlp_cfg(), seed=1)
    prop = MLPSpeculatorProposer(target, SpeculativeConfig(method=METHOD, num_speculative_tokens=3,
                                                           options={"head_module": m}))
    h = torch.randn(2, 64)
    params = [SamplingParams(temperature=0.8, top_k=20, seed=1), SamplingParams(temperature=0.0)]
    out = prop.propose(ProposeBatch([0, 1], [[1, 5], [1, 2]], 3, params, [torch.Generator().manual_seed(1), None],
                                    HiddenStates(h, _seq_ids=[0, 1])))
    q = out.probs
    assert q.shape == (2, 3, 512)
    torch.testing.assert_close(q.sum(-1), torch.ones(2, 3))
    picked = q.gather(2, out.token_ids[..., None])[..., 0]
    assert (picked > 0).all() and ((q[0] > 0).sum(-1) <= 20).all() and (picked[1] == 1).all()
    # stage 1's q for row 0 is the processed distribution after the token drawn at stage 0
    s0, _ = m.stage(0, m.first_state(h[:1]), torch.tensor([5]))
    _, lg1 = m.stage(1, s0, out.token_ids[0, :1])
    keep = torch.topk(lg1[0] / 0.8, 20).indices
    want = torch.zeros(512)
    want[keep] = torch.softmax(lg1[0, keep] / 0.8, -1)
    torch.testing.assert_close(q[0, 1], want, atol=1e-5, rtol=1e-4)


def test_first_two_tokens_follow_the_target():
    """Stage 1 reads the token drawn at stage 0; the joint law of (t1, t2) over 2048 requests at
    temperature 1 is still the target's (chi-square p > 1e-3)."""
    pval, m = two_token_pvalue(spec(random_mlp_speculator(mlp_cfg(2)), 2))
    assert pval > 1e-3, f"(t1, t2) chi-square p-value {pval:.2e}"
    assert m.num_draft_tokens == 2 * 2048
