"""MedusaProposer on the tiny model, with heads built in-process (no trained weights):

- refusal of heads that do not fit the target (naming both sizes) or have fewer heads than k;
- greedy equality with plain decoding, chain (rejection sampler and typical acceptance) and static tree
  (``scorer="tree"``), batch 1 and a ragged batch of 4, in three regimes: random heads, *oracle* heads
  on a target whose next token depends only on the current one (every draft accepted), and corrupted
  oracles (partly accepted; in the tree the right token is then the head's rank-1 candidate, so accepted
  paths go through later siblings);
- the static tree: budget / depth / top-k respected, parents first, tokens = each head's top-k;
- sampling: q sums to 1 and each draft is drawn from it; the first two tokens follow the target's law.
"""

import pytest
import torch

from proposers.medusa import MedusaProposer, medusa_tree
from specdec.heads.medusa import MedusaHeads, random_medusa
from specdec import LLM, SamplingParams
from specdec.engine import ForwardBatch
from specdec.engine.tiny import tiny_config, tiny_random_llama
from specdec.heads.medusa import MedusaConfig
from specdec.datamodel.hidden_states import HiddenStates
from specdec.spec_decode.config import SpeculativeConfig
from specdec.spec_decode.proposer import ProposeBatch
from specdec.spec_decode.proposer import TreeShape
from tests.proposers.helpers import (BATCHES, LEN, generate_and_assert_greedy_equal, corrupt, greedy, per_token_engine,
                                     two_token_pvalue)

METHOD = "proposers.medusa:MedusaProposer"
TREE = {"scorer": "tree", "tree_depth": 3, "tree_topk": 2, "tree_budget": 8}


def heads_cfg(num_heads: int = 3, **kw) -> MedusaConfig:
    c = tiny_config()
    return MedusaConfig(num_heads=num_heads, hidden_size=c.hidden_size, vocab_size=c.vocab_size, **kw)


def spec(heads, k: int = 3, **extra) -> dict:
    return {"method": METHOD, "num_speculative_tokens": k, "options": {"head_module": heads}, **extra}


# ---------------------------------------------------------------------------------------------- refusal


@pytest.mark.parametrize("field, value", [("hidden_size", 32), ("vocab_size", 256)])
def test_heads_that_do_not_fit_are_refused_naming_both(field, value):
    target = tiny_random_llama(0, num_slots=2, max_model_len=64)
    heads = MedusaHeads(MedusaConfig(num_heads=3, **{"hidden_size": 64, "vocab_size": 512, field: value}))
    with pytest.raises(ValueError, match=rf"{field}={value} but the target has {field}={getattr(target, field)}"):
        MedusaProposer(target, SpeculativeConfig(method=METHOD, options={"head_module": heads}))


def test_more_drafts_than_heads_is_refused():
    target = tiny_random_llama(0, num_slots=2, max_model_len=64)
    with pytest.raises(ValueError, match="num_speculative_tokens=4 but .* num_heads=3"):
        MedusaProposer(target, SpeculativeConfig(method=METHOD, num_speculative_tokens=4,
                                                 options={"head_module": random_medusa(heads_cfg(3))}))
    with pytest.raises(ValueError, match="tree_depth=5 but .* num_heads=3"):
        MedusaProposer(target, SpeculativeConfig(method=METHOD, scorer="tree", tree_depth=5,
                                                 options={"head_module": random_medusa(heads_cfg(3))}))


# ---------------------------------------------------------------------------------------------- greedy


MODES = {"chain": {}, "typical": {"acceptance_method": "typical_acceptance"}, "tree": TREE}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("batch", list(BATCHES))
def test_random_heads_are_greedy_equal(tiny, mode, batch):
    prompts, max_tokens = BATCHES[batch]
    llm = generate_and_assert_greedy_equal(tiny, spec(random_medusa(heads_cfg(3, own_lm_head=False)), 3, **MODES[mode]),
                              prompts, max_tokens)
    assert llm.get_metrics().num_draft_tokens > 0


@pytest.fixture(scope="module")
def table() -> tuple[torch.Tensor, torch.Tensor]:
    """(the per-token target's hidden state of each token [V, D], its next token after each token [V])."""
    engine = per_token_engine(max_model_len=512)
    V = engine.vocab_size
    slot = engine.allocate_slot()
    out = engine.forward(ForwardBatch(torch.arange(V), [slot], [V]))
    engine.free_slot(slot)
    return out.hidden_states.clone(), out.logits.argmax(-1)


class OracleMedusa(MedusaHeads):
    """Head i knows the per-token target: from h_t it finds x_t (nearest state) and returns the target's
    token i+2 steps on. Corrupted pairs rank a wrong token first and the right one second."""

    def __init__(self, table: torch.Tensor, nxt: torch.Tensor, num_heads: int = 3, every: int = 0) -> None:
        super().__init__(heads_cfg(num_heads, own_lm_head=False))
        self.table, self.nxt, self.every, self.calls = table, nxt, every, 0

    def logits(self, h, n=None, target_lm=None):
        self.calls += 1
        x = torch.cdist(h.float(), self.table).argmin(-1)  # [N] the token each state belongs to
        N, V = len(x), len(self.nxt)
        rows, t, out = torch.arange(N), self.nxt[x], []
        for i in range(n or self.cfg.num_heads):
            t = self.nxt[t]  # the token i+2 after x
            lg = torch.zeros(N, V)
            lg[rows, t] = 5.0
            bad = corrupt(x, i, self.calls, self.every)
            lg[rows[bad], (t[bad] + 1) % V] = 10.0
            out.append(lg)
        return torch.stack(out)


@pytest.fixture(scope="module")
def per_token():
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=LEN)
    llm.engine = per_token_engine()  # with_speculation() builds its workers on this engine
    return llm


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("every", [0, 3])
def test_oracle_heads_are_greedy_equal_and_accepted(per_token, table, mode, batch, every):
    prompts, max_tokens = BATCHES[batch]
    table, nxt = table
    llm = generate_and_assert_greedy_equal(per_token, spec(OracleMedusa(table, nxt, every=every), 3, **MODES[mode]),
                              prompts, max_tokens)
    m = llm.get_metrics()
    if every == 0:  # everything accepted: k + 1 = 4 tokens per step but the last of each request
        assert m.mean_acceptance_length > 3.3, m.acceptance_counts
    elif mode == "tree":  # the right token is rank 0 or 1, and the tree holds every depth-2 path of those
        c = m.acceptance_counts
        assert c[0] == c[1] == c[2] > c[3] > 0, c
    else:
        assert 1.3 < m.mean_acceptance_length < 3.3, m.acceptance_counts


# ---------------------------------------------------------------------------------------------- tree


def test_medusa_tree_keeps_the_best_paths_within_the_shape():
    acc = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]]
    paths = medusa_tree(acc, TreeShape(depth=3, topk=2, budget=6))
    # expected acceptance: (0)=.6 (0,0)=.24 (1)=.2 (0,1)=.12 (0,0,0)=.072 (1,0)=.08
    assert paths == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    big = medusa_tree(acc, TreeShape(depth=2, topk=3, budget=100))
    assert len(big) == 3 + 9 and max(map(len, big)) == 2  # capped by depth and top-k, not the budget
    for p in big:
        assert len(p) == 1 or p[:-1] in big


def test_static_tree_tokens_are_each_heads_topk():
    target = tiny_random_llama(0, num_slots=2, max_model_len=64)
    heads = random_medusa(heads_cfg(3, own_lm_head=False), seed=3)
    choices = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    prop = MedusaProposer(target, SpeculativeConfig(method=METHOD, scorer="tree", tree_depth=3, tree_budget=6,
                                                    options={"head_module": heads, "medusa_choices": choices}))
    h = torch.randn(2, 64)
    tree = prop.propose_tree(ProposeBatch([7, 9], [[1, 2], [3, 4]], 3, [greedy(1)] * 2, [None] * 2,
                                          HiddenStates(h, _seq_ids=[7, 9])), TreeShape(3, 2, 6))
    top = prop.draft_logits(h, 3).topk(2, -1).indices  # [3, 2, 2]
    assert tree.parents[0].tolist() == [-1, -1, 0, 0, 1, 2]
    for b in range(2):
        assert tree.token_ids[b].tolist() == [top[0, b, 0], top[0, b, 1], top[1, b, 0], top[1, b, 1], top[1, b, 0],
                                              top[2, b, 0]]
    assert tree.num_nodes.tolist() == [6, 6] and tree.draft_probs is None
    with pytest.raises(ValueError, match="exceed tree_budget=4"):
        prop.static_tree(TreeShape(3, 2, 4))


def test_the_last_row_of_a_bonus_sequence_is_used():
    """After a bonus step a sequence has rows (second-last, last): the draft comes from the last."""
    target = tiny_random_llama(0, num_slots=2, max_model_len=64)
    prop = MedusaProposer(target, SpeculativeConfig(method=METHOD, options={
        "head_module": random_medusa(heads_cfg(4, own_lm_head=False))}))
    h = torch.randn(3, 64)
    both = prop.propose(ProposeBatch([4], [[5, 6]], 4, [greedy(1)], [None], HiddenStates(h[:2], _seq_ids=[4, 4])))
    last = prop.propose(ProposeBatch([4], [[5, 6]], 4, [greedy(1)], [None], HiddenStates(h[1:2], _seq_ids=[4])))
    assert torch.equal(both.token_ids, last.token_ids)


# ---------------------------------------------------------------------------------------------- sampling


def test_sampled_drafts_come_with_their_q():
    target = tiny_random_llama(0, num_slots=2, max_model_len=64)
    prop = MedusaProposer(target, SpeculativeConfig(method=METHOD, num_speculative_tokens=3, options={
        "head_module": random_medusa(heads_cfg(3, own_lm_head=False))}))
    params = [SamplingParams(temperature=0.8, top_k=20, seed=1), SamplingParams(temperature=0.0)]
    h = torch.randn(2, 64)
    out = prop.propose(ProposeBatch([0, 1], [[1, 5], [1, 2]], 3, params, [torch.Generator().manual_seed(1), None],
                                    HiddenStates(h, _seq_ids=[0, 1])))
    q = out.probs
    assert q.shape == (2, 3, 512)
    torch.testing.assert_close(q.sum(-1), torch.ones(2, 3))
    picked = q.gather(2, out.token_ids[..., None])[..., 0]
    assert (picked > 0).all()  # each draft was drawn from its own q
    assert ((q[0] > 0).sum(-1) <= 20).all()  # top-k applied to q
    assert (picked[1] == 1).all()  # the greedy row's q is one-hot at its draft
    logits = prop.draft_logits(h[:1], 3)[:, 0]  # [3, V] head j's logits for row 0
    for j in range(3):  # q_j is exactly head j's processed distribution (temperature 0.8, top-20)
        keep = torch.topk(logits[j], 20).indices
        want = torch.zeros(512)
        want[keep] = torch.softmax(logits[j, keep] / 0.8, -1)
        torch.testing.assert_close(q[0, j], want, atol=1e-5, rtol=1e-4)


def test_first_two_tokens_follow_the_target():
    """Random heads (q != p, yet the first draft is kept ~40% of the time): the law of t1 and the joint law
    of (t1, t2) over 4096 requests are the target's (chi-square p > 1e-3). Claiming a uniform q for the
    same drafts gives p ~ 1e-9 here."""
    pval, m = two_token_pvalue(spec(random_medusa(heads_cfg(2, own_lm_head=False), scale=0.3), 2), n=4096)
    assert pval > 1e-3, f"(t1, t2) chi-square p-value {pval:.2e}"
    assert m.num_draft_tokens == 2 * 4096 and m.acceptance_rate > 0.05  # drafts were proposed and some kept
