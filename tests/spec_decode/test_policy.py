"""Speculation policies (specdec/spec_decode/policy.py): each one is lossless end to end (greedy output == plain
decoding, chain and tree), mixed k in one batch, the per-request override, and goodput's choices on scripted cost
tables and acceptance."""

import time

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.spec_decode.cost_model import CALIBRATION_ROWS, CostModel, calibrate, non_decreasing
from specdec.spec_decode.policy import (AcceptanceEMAPolicy, BatchSizePolicy, BatchView, GoodputPolicy,
                                        SpeculationPolicy, StepResult, decreasing_envelope, make_policy)
from specdec.spec_decode.top1_proposer import cut_proposals
from specdec.interfaces import SpeculativeProposals
from tests.spec_decode.helpers import LOSSLESS_SPECS, assert_greedy_equal, greedy, ids, record

POLICIES = ["static", "batch_size", "acceptance_ema", "goodput"]
# repetitive prompts (n-gram and suffix drafts find matches) beside a plain one
PROMPTS = [[5, 6, 7, 8, 9] * 4, list(range(40, 60)), [3, 4] * 6 + [11, 12, 13]]
SPECS = {**LOSSLESS_SPECS, "suffix_tree": lambda: {"method": "suffix", "num_speculative_tokens": 4, "scorer": "tree",
                                                     "tree_depth": 4, "tree_budget": 9}}


@pytest.mark.parametrize("spec", sorted(SPECS))
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_is_greedy_equal(plain_tiny, spec, policy):
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256,
              speculative_config={**SPECS[spec](), "speculation_policy": policy,
                                  "policy_options": {"probe_every": 2} if policy == "goodput" else {}})
    log = record(llm)
    out = llm.generate(ids(PROMPTS), greedy(), use_tqdm=False)
    assert_greedy_equal(llm.engine, PROMPTS, out, plain_tiny.generate(ids(PROMPTS), greedy(), use_tqdm=False),
                        f"{spec}/{policy}")
    assert all(n <= c for step in log for c, n in step), f"{spec}/{policy}: a row drafted past its choice"
    assert sum(llm.worker.chosen_counts.values()) == sum(len(s) for s in log)


class Scripted(SpeculationPolicy):
    """Row b gets ``ks[b]`` (capped by its limit) every step."""

    def __init__(self, ks: list[int]) -> None:
        self.ks = ks

    def choose(self, batch, cost):
        return [min(k, lim) for k, lim in zip(self.ks, batch.limits)]


@pytest.mark.parametrize("spec,ks", [("draft_noisy_k3", [0, 3, 1]), ("eagle_tree", [0, 3, 6]),
                                     ("suffix_tree", [9, 0, 3])])
def test_mixed_k_in_one_batch(plain_tiny, spec, ks):
    """Some rows 0, some 3, a tree's full budget, in one forward per step (chain: mqa; tree: the tree scorer)."""
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256, speculative_config=SPECS[spec]())
    llm.worker.policy = Scripted(ks)
    forwards, fwd = [], llm.engine.forward
    llm.engine.forward = lambda batch: forwards.append(list(batch.query_lens)) or fwd(batch)
    per_step, inner = [], llm.worker.execute_model

    def execute_model(req):  # the target forwards of each decode step
        n = len(forwards)
        out = inner(req)
        if not req.seq_group_metadata_list[0].is_prompt:
            per_step.append(forwards[n:])
        return out

    llm.worker.execute_model = execute_model
    log = record(llm)
    out = llm.generate(ids(PROMPTS), greedy(24), use_tqdm=False)
    assert_greedy_equal(llm.engine, PROMPTS, out, plain_tiny.generate(ids(PROMPTS), greedy(24), use_tqdm=False), spec)
    full = [s for s in log if len(s) == 3]
    assert full, "no step had the three requests together"
    # ragged proposals scored in one target forward: [pending + nodes] per row, rows of 1, 4, ... tokens together
    assert all(len(f) == 1 for f in per_step), per_step[:3]
    for step, (f,) in zip(log, per_step):
        assert f == [n + 1 for _, n in step]
    for step in full:
        assert [c for c, _ in step] == ks and all(n <= c for c, n in step)
    assert any(n == ks[b] for step in full for b, (_, n) in enumerate(step) if ks[b]), "no row drafted its full k"
    assert all(n == 0 for step in full for b, (_, n) in enumerate(step) if ks[b] == 0)


@pytest.mark.parametrize("policy", POLICIES)
def test_per_request_override(plain_tiny, policy):
    """SamplingParams.num_speculative_tokens: 0 = never drafts, 2 = at most 2, None = the policy's choice."""
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "speculation_policy": policy})
    log = record(llm)
    params = [greedy(num_speculative_tokens=0), greedy(num_speculative_tokens=2), greedy()]
    out = llm.generate(ids(PROMPTS), params, use_tqdm=False)
    assert_greedy_equal(llm.engine, PROMPTS, out, plain_tiny.generate(ids(PROMPTS), greedy(), use_tqdm=False), policy)
    full = [s for s in log if len(s) == 3]
    assert full and all(s[0] == (0, 0) and s[1][0] <= 2 and s[1][1] <= 2 for s in full)


def test_the_override_is_validated():
    with pytest.raises(ValueError, match="num_speculative_tokens=-1 is invalid: must be None or an int in \\[0, 2\\*\\*31\\)"):
        SamplingParams(num_speculative_tokens=-1)
    with pytest.raises(TypeError, match="num_speculative_tokens=1.5"):
        SamplingParams(num_speculative_tokens=1.5)


# ---------------------------------------------------------------------------------------------- pruning


def test_cut_keeps_a_prefix_of_each_row():
    chain = SpeculativeProposals.chain(torch.tensor([[1, 2, 3], [4, 5, 6], [7, -1, -1]]), None, torch.tensor([3, 3, 1]))
    cut_proposals(chain, [0, 2, 3])
    assert chain.num_nodes.tolist() == [0, 2, 1] and chain.token_ids.tolist() == [[-1] * 3, [4, 5, -1], [7, -1, -1]]
    assert chain.token_ids.shape == (3, 3) and chain.is_chain  # the width is the configured one
    # a tree whose nodes branch: a prefix in creation order keeps every kept node's parent
    par = torch.tensor([[-1, -1, 0, 0, 1, 2]])
    tree = SpeculativeProposals(torch.arange(10, 16)[None], par.clone(), torch.tensor([6]))
    for n in range(7):
        t = SpeculativeProposals(tree.token_ids.clone(), tree.parents.clone(), tree.num_nodes.clone())
        cut_proposals(t, [n])
        kept = t.parents[0, :n].tolist()
        assert t.num_nodes.tolist() == [n] and all(p < i for i, p in enumerate(kept))
        assert t.token_ids[0, n:].eq(-1).all() and t.token_ids.shape == (1, 6)


# ---------------------------------------------------------------------------------------------- goodput


def table(t1: float, per_row: float, knee: int = 1) -> CostModel:
    """A forward of ``rows`` costs t1 up to ``knee`` rows (memory-bound), then + per_row each (compute-bound)."""
    return CostModel({r: t1 + per_row * max(r - knee, 0) for r in (1, 2, 4, 8, 16, 32, 64, 128, 256)})


def view(B: int, k: int = 8) -> BatchView:
    return BatchView(list(range(B)), [k] * B, depth=k)


def goodput(alpha: float, B: int) -> GoodputPolicy:
    pol = GoodputPolicy(prior=alpha, probe_every=0)
    for s in range(B):
        pol.alphas(s, 8)
    return pol


def test_goodput_drafts_nothing_when_nothing_is_accepted():
    assert goodput(0.02, 1).choose(view(1), table(0.020, 0.002)) == [0]


def test_goodput_drafts_long_when_verifying_is_cheap_and_drafts_are_accepted():
    assert goodput(0.9, 1).choose(view(1), table(0.020, 0.0002, knee=16)) == [8]


def test_goodput_drafts_less_at_large_batch_on_a_compute_bound_table():
    cost = table(0.020, 0.0015, knee=8)  # ~memory-bound to 8 rows, then each row costs 7.5% of a forward
    small = goodput(0.7, 1).choose(view(1), cost)
    large = goodput(0.7, 16).choose(view(16), cost)
    assert small[0] >= 3 and sum(large) / 16 < small[0], (small, large)


def test_goodput_prices_a_drafted_rows_context():
    """A drafted row's attention reads its context (CostModel.ctx_slope): the same acceptance drafts less after 4000
    tokens than after 100, nothing where every row costs more than it returns, and a live step's context price is
    not learnt as the level."""
    cost = table(0.010, 0.0001, knee=16)
    cost.ctx_slope = 1e-6  # 1 ms per drafted row per 1000 tokens of its context
    pol = goodput(0.6, 1)
    pol.margin = 0.0  # the argmax itself (short: 7 of 8 is within 3% of 8, which the margin would take)
    short = pol.choose(BatchView([0], [8], depth=8, contexts=[100]), cost)
    long = pol.choose(BatchView([0], [8], depth=8, contexts=[4000]), cost)
    unknown = pol.choose(BatchView([0], [8], depth=8), cost)  # no contexts given: the table alone
    assert long == [1] and short == [7] and unknown == [8], (long, short, unknown)
    assert pol.choose(BatchView([0], [8], depth=8, contexts=[20000]), cost) == [0]
    cost.observe(5, 1, 0.010 + 4 * 4000 * 1e-6, 0.0, 0.0, 4, 0, row_contexts=4 * 4000)
    assert cost.offset(1) == pytest.approx(0.0, abs=1e-12)
    assert CostModel.from_dict(cost.to_dict()).ctx_slope == 1e-6
    with pytest.raises(ValueError, match="ctx_slope"):
        CostModel(ctx_slope=-1.0)


def test_goodput_keeps_every_candidate_within_its_margin_of_the_argmax():
    """``margin``: where drafting every candidate is predicted within 3% of the best rate, the step drafts them all
    (the static choice); a clear gain from cutting (a compute-bound batch of 16) still cuts."""
    cost = table(0.010, 0.0001, knee=16)
    cost.ctx_slope = 1e-6
    near = BatchView([0], [8], depth=8, contexts=[100])
    assert goodput(0.6, 1).choose(near, cost) == [8]
    argmax = goodput(0.6, 1)
    argmax.margin = 0.0
    assert argmax.choose(near, cost) == [7]
    far = BatchView([0], [8], depth=8, contexts=[4000])  # 1 node predicted far ahead of 8: the margin does not apply
    assert goodput(0.6, 1).choose(far, cost) == [1]
    steep = table(0.020, 0.0015, knee=8)
    large = goodput(0.7, 16).choose(view(16), steep)
    assert sum(large) < 16 * 8, large
    with pytest.raises(ValueError, match="margin"):
        GoodputPolicy(margin=1.5)


def test_goodput_gives_the_tokens_to_the_rows_that_accept():
    pol = GoodputPolicy(prior=0.5, probe_every=0)
    pol.alpha[0], pol.alpha[1] = [0.95] * 8, [0.05] * 8
    ks = pol.choose(BatchView([0, 1], [8, 8], depth=8), table(0.020, 0.001, knee=4))
    assert ks[0] > 0 and ks[1] == 0


def test_goodput_learns_acceptance_and_probes_a_switched_off_row():
    pol = GoodputPolicy(prior=0.9, ema=0.5, probe_every=3)
    cost = table(0.020, 0.002)
    v = BatchView([7], [4], depth=4)
    for _ in range(8):  # every proposal rejected at its first position
        ks = pol.choose(v, cost)
        pol.observe(StepResult([7], ks, ks, [0]))
    assert pol.alpha[7][0] < 0.05
    seen = []
    for _ in range(8):
        ks = pol.choose(v, cost)
        seen.append(ks[0])
        pol.observe(StepResult([7], ks, ks, [0]))
    assert 0 in seen and 1 in seen  # off, and a one-token probe every probe_every steps


def tree_table(t1: float, per_node: float, draft: float) -> CostModel:
    cost = table(t1, per_node)
    cost.per_row = draft  # a tree's draft: per drafting row, whatever its budget
    return cost


def test_goodput_tree_learns_each_node_and_chooses_the_best_prefix():
    """Trees: node j's estimate is its rate of "on the accepted path" (node_outcomes); the budget is the best
    prefix of nodes under the cost table."""
    pol = GoodputPolicy(prior=0.5, probe_every=0, strength=1.0)
    v = BatchView([3], [6], tree=True, depth=3)
    for _ in range(40):  # nodes 0 and 2 are always accepted (a path 0 -> 2), the others never
        pol.observe(StepResult([3], [6], [6], [2], node_outcomes=[[1, 0, 1, 0, 0, 0]]))
    q = pol.node_qs(3, 6)
    assert q[0] > 0.95 and q[2] > 0.95 and max(q[1], q[3], q[4], q[5]) < 0.05, q
    # cheap extra rows, a cheap draft: the first three nodes (node 1 rides along: its envelope shares node 2's gain)
    assert pol.choose(v, tree_table(0.020, 0.0005, 0.001)) == [3]
    # each extra row costing half a forward: node 0 (sure) pays, nodes 1-2 (~0.5 each on the envelope) do not
    assert pol.choose(v, tree_table(0.020, 0.010, 0.001)) == [1]
    # each extra row costing more than a forward: 2 tokens for 2.25 forwards, so none
    assert pol.choose(v, tree_table(0.020, 0.025, 0.001)) == [0]


def test_goodput_tree_learns_unscored_nodes_and_probes_a_row_at_zero():
    """Nodes past the chosen budget keep being learnt (their outcomes come from the emitted tokens); a row at 0
    scores its whole tree every probe_every steps."""
    pol = GoodputPolicy(prior=0.5, probe_every=3, strength=1.0)
    for _ in range(20):  # budget 2 scored, but the outcomes say node 4 is always right
        pol.observe(StepResult([1], [2], [2], [0], node_outcomes=[[0, 0, -1, -1, 1, -1]]))
    q = pol.node_qs(1, 6)
    assert q[4] > 0.9 and q[0] < 0.1 and abs(q[2] - 0.5 ** 3) < 0.05, q  # unknown: the prior's value
    pol2 = GoodputPolicy(prior=0.5, probe_every=3, probe_share=1.0)  # probes as cheap as the credit allows
    pol2.observe(StepResult([1], [6], [6], [0], node_outcomes=[[0] * 6]))
    v, cost = BatchView([1], [6], tree=True, depth=3), tree_table(0.020, 0.010, 0.010)
    seen = []
    for _ in range(8):
        ks = pol2.choose(v, cost)
        seen.append(ks[0])
        pol2.observe(StepResult([1], ks, ks, [0], node_outcomes=[[0] * ks[0]]))
    assert 0 in seen and 6 in seen, seen


def test_goodput_does_not_probe_where_even_a_perfect_row_would_not_pay():
    """A probe buys information; where a row's whole limit drafted and accepted would still not raise the step's
    rate (a large batch on a slow forward), nothing it could learn changes a choice, so it is not probed, whatever
    the credit. The same rows alone (batch 1) are probed."""
    B = 12
    cost = tree_table(0.030, 0.012, 0.040)  # a probe at B = 12: +72 ms rows + 40 ms draft on a 162 ms step, for 6 of 12
    cost.plain[B] = cost.forward(B, B)
    pol = GoodputPolicy(prior=0.5, probe_every=2, probe_share=1.0)
    pol.credit = 10.0
    v = BatchView(list(range(B)), [6] * B, tree=True, depth=3, plain=True)
    pol.observe(StepResult(list(range(B)), [6] * B, [6] * B, [0] * B, node_outcomes=[[0] * 6] * B))
    for _ in range(20):
        ks = pol.choose(v, cost)
        assert not any(ks), ks
        pol.observe(StepResult(list(range(B)), ks, ks, [0] * B, node_outcomes=[[]] * B))
    v1, seen = BatchView([0], [6], tree=True, depth=3, plain=True), []
    cost.plain[1] = cost.forward(1)
    for _ in range(6):
        ks = pol.choose(v1, cost)
        seen.append(ks[0])
        pol.observe(StepResult([0], ks, ks, [0], node_outcomes=[[0] * ks[0]]))
    assert 6 in seen, seen


@pytest.mark.parametrize("underpriced", [1.0, 2.5])
def test_goodput_probes_of_a_switched_off_batch_cost_at_most_their_share(underpriced):
    """B = 12 tree rows, all switched off (every node rejected): unsynchronised probes made nearly every step
    speculative; priced ones keep the batch on the plain path, their extra seconds within ``probe_share`` of the
    steps' seconds, and still probe every row now and then (longest idle first). A probe step that really costs
    ``underpriced`` x what the table says (a long idle row's catch-up) teaches the policy its scale."""
    B, share = 12, 0.02
    cost = tree_table(0.030, 0.004, 0.008)
    cost.plain[B] = cost.forward(B, B)  # the plain path's step
    pol = GoodputPolicy(prior=0.5, probe_every=4, probe_share=share)
    v = BatchView(list(range(B)), [6] * B, tree=True, depth=3, plain=True)
    pol.observe(StepResult(list(range(B)), [6] * B, [6] * B, [0] * B, node_outcomes=[[0] * 6] * B))
    spec_steps, extra, total, probed = 0, 0.0, 0.0, set()
    plain_s = cost.plain[B]
    last_probe = -1
    for step in range(600):
        ks = pol.choose(v, cost)
        drafting = [b for b, k in enumerate(ks) if k]
        t = plain_s
        if drafting:
            spec_steps, last_probe = spec_steps + 1, step
            probed.update(drafting)
            curve = cost.step_curve(B, sum(ks), per_draft_token=False, plain=True)
            table_s = curve[sum(ks)] + cost.per_row * len(drafting)
            t = plain_s + underpriced * (table_s - plain_s)
            extra += t - plain_s
        total += t
        pol.observe(StepResult(list(range(B)), ks, ks, [0] * B, times={"score": t} if drafting else {},
                               node_outcomes=[[0] * k for k in ks]))
    assert 0 < spec_steps < 600 * 0.1, spec_steps  # unpriced: ~3 probes per step (12 rows / probe_every 4)
    assert extra <= share * total * 1.2, (extra / total, pol.probe_scale)  # the first probes, before the scale
    if underpriced == 1.0:
        assert pol.probe_scale == pytest.approx(underpriced, rel=0.1)
        assert probed == set(range(B)), probed  # every row is probed in turn
    else:  # the scale learnt until a probe's best case (6 tokens) no longer pays at B = 12: no probes after that
        assert pol.probe_scale > 1.3 and last_probe < 300, (pol.probe_scale, last_probe)


def test_node_outcomes_from_the_path_and_the_emitted_tokens():
    from specdec.spec_decode.policy import node_outcomes

    # nodes: 0:a 1:b (roots), 2:c under 0, 3:d under 2, 4:e under 1, 5:f under 3; tokens 10..15
    toks, pars = [10, 11, 12, 13, 14, 15], [-1, -1, 0, 2, 1, 3]
    # two scored nodes (0, 1), node 0 accepted; the target then emitted 12 (the final token): node 2 would have
    # been accepted, node 3 (depth 3) and node 5 are past the emitted tokens, node 4 hangs off a rejected node
    assert node_outcomes(toks, pars, 2, [0], [10, 12]) == [1, 0, 1, -1, 0, -1]
    assert node_outcomes(toks, pars, 2, [0], None) == [1, 0, -1, -1, -1, -1]  # sampled: scored nodes only
    assert node_outcomes(toks, pars, 6, [0, 2, 3], [10, 12, 13, 99]) == [1, 0, 1, 1, 0, 0]


def test_decreasing_envelope_pools_rising_runs():
    assert decreasing_envelope([0.9, 0.1, 0.5, 0.2]) == pytest.approx([0.9, 0.3, 0.3, 0.2])
    assert decreasing_envelope([0.1, 0.2, 0.3]) == pytest.approx([0.2, 0.2, 0.2])
    g = [0.5, 0.05, 0.4, 0.01, 0.3]
    env = decreasing_envelope(g)
    assert all(a >= b for a, b in zip(env, env[1:])) and sum(env) == pytest.approx(sum(g))


def test_goodput_without_a_cost_table_is_static():
    assert GoodputPolicy().choose(view(2, 5), CostModel()) == [5, 5]


def test_policy_overhead_is_printed(capsys):
    """The policy's own cost per step at B = 16, k = 10 (printed, never asserted on time)."""
    cost = table(0.020, 0.0005, knee=16)
    for name, pol in (("goodput", GoodputPolicy(probe_every=0)), ("acceptance_ema", AcceptanceEMAPolicy()),
                      ("batch_size", BatchSizePolicy())):
        v = BatchView(list(range(16)), [10] * 16, depth=10)
        pol.choose(v, cost)
        n, t0 = 200, time.perf_counter()
        for _ in range(n):
            ks = pol.choose(v, cost)
            pol.observe(StepResult(v.seq_ids, ks, ks, [min(k, 2) for k in ks]))
        with capsys.disabled():
            print(f"\n{name}: {(time.perf_counter() - t0) / n * 1e6:.0f} us per step (choose + observe), B=16 k=10")


# ---------------------------------------------------------------------------------------------- baselines


def test_batch_size_schedule():
    pol = BatchSizePolicy([[1, 6], [4, 3], [8, 1]])
    assert pol.choose(view(1), CostModel()) == [6]
    assert pol.choose(view(3), CostModel()) == [3] * 3
    assert pol.choose(view(9), CostModel()) == [0] * 9
    assert pol.choose(BatchView([0, 1], [2, 0]), CostModel()) == [2, 0]  # capped by each row's limit
    with pytest.raises(ValueError, match="ascending max batch"):
        BatchSizePolicy([[8, 1], [2, 4]])


def test_acceptance_ema_tiers():
    pol = AcceptanceEMAPolicy(tiers=[1, 3, 7], ema=1.0)
    v = BatchView([0], [10])
    assert pol.choose(v, CostModel()) == [3]  # a new request: the middle tier
    pol.observe(StepResult([0], [3], [3], [3]))
    assert pol.choose(v, CostModel()) == [7]
    pol.observe(StepResult([0], [7], [7], [0]))
    assert pol.choose(v, CostModel()) == [1]
    assert pol.choose(BatchView([0], [0]), CostModel()) == [0]


def test_make_policy_names_the_way_out():
    assert isinstance(make_policy("goodput", {"prior": 0.3}), GoodputPolicy)
    assert isinstance(make_policy("tests.spec_decode.test_policy:Scripted", {"ks": [1]}), Scripted)
    with pytest.raises(ValueError, match=r"speculation_policy='fast' is unknown: one of \['acceptance_ema'"):
        make_policy("fast")
    with pytest.raises(ValueError, match=r"policy_options \['alpha'\] are not options of .*goodput.* it takes"):
        make_policy("goodput", {"alpha": 1})
    with pytest.raises(ValueError, match="speculation_policy='fast'"):
        LLM("tiny-random-llama", speculative_config={"method": "ngram", "speculation_policy": "fast"})


def test_cost_table_calibrates_refreshes_and_round_trips(tmp_path):
    from specdec.engine.tiny import tiny_random_llama

    eng = tiny_random_llama(0, num_slots=4, max_model_len=128)
    measured = calibrate(eng)
    assert measured.rows == list(CALIBRATION_ROWS) and all(s > 0 for s in measured.secs)
    assert sorted(measured.offsets) == [2, 4]  # the batch sizes 4 free slots allow (8 does not fit)
    assert eng.num_free_slots() == 4  # the scratch slots went back
    assert calibrate(eng).to_dict() == measured.to_dict()  # cached per engine
    assert measured.ctx_slope == 0.0  # 120 tokens of context at most: too short to time the slope
    long_eng = tiny_random_llama(0, num_slots=2, max_model_len=600)
    slope = calibrate(long_eng).ctx_slope  # after 512 tokens: measured (a tiny model's attention: ~0, never < 0)
    assert slope >= 0.0 and slope < 1e-3 and long_eng.num_free_slots() == 2
    assert non_decreasing([3.0, 5.0, 4.0, 6.0, 2.0]) == pytest.approx([3.0, 4.25, 4.25, 4.25, 4.25])
    assert non_decreasing([3.0, 5.0, 4.0, 7.0]) == pytest.approx([3.0, 4.5, 4.5, 7.0])
    assert non_decreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert all(a <= b for a, b in zip(measured.secs, measured.secs[1:]))  # the start-up table never falls
    cost = CostModel({1: 0.010, 9: 0.018})
    assert cost.forward(5) == pytest.approx(0.014) and cost.forward(17) == pytest.approx(0.026)
    cost.observe(5, 1, 0.034, 0.002, 0.001, 4, 0)  # a live step of one sequence: the level moves 10% of the way
    assert cost.forward(5) == pytest.approx(0.014 + 0.1 * 0.020) and cost.per_token == pytest.approx(0.0005)
    cost.observe(5, 1, 0.034, 0.004, 0.001, 4, 2)  # the draft's first sample was taken whole, then an EMA
    assert cost.per_token == pytest.approx(0.0005 + 0.1 * 0.0005) and cost.per_row == pytest.approx(0.002)
    cost.offsets[1] = 0.002  # (as before the second step)
    # ... at every width alike: the table's shape (what one more row costs) is the start-up one
    assert cost.forward(9) - cost.forward(5) == pytest.approx(0.004) and cost.base(5) == pytest.approx(0.014)
    fresh = CostModel()  # no start-up table (no free slot): live steps of one sequence at two widths make one
    fresh.observe(3, 1, 0.012, 0.0, 0.0, 2, 0)
    assert not fresh.calibrated
    fresh.observe(5, 1, 0.014, 0.0, 0.0, 4, 0)
    assert fresh.calibrated and fresh.forward(4) == pytest.approx(0.013)
    for _ in range(200):  # 4 sequences: their cost beyond one sequence's 20 rows, learnt
        cost.observe(20, 4, 0.050, 0.0, 0.0, 0, 0)
    assert cost.forward(20, 4) == pytest.approx(0.050) and 0 < cost.offset(2) < cost.offset(4)
    cost.save(tmp_path / "cost.json")
    again = CostModel.load(tmp_path / "cost.json")
    assert again.to_dict() == cost.to_dict()


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_chain_proposers_draft_no_further_than_row_k(method):
    """ProposeBatch.row_k (the policy's k per row): n-gram and suffix look up at most that many tokens."""
    from specdec.spec_decode.builder import make_proposer
    from specdec.spec_decode.config import parse_speculative_config
    from specdec.spec_decode.proposer import ProposeBatch
    from specdec.spec_decode.registry import resolve

    cfg = parse_speculative_config({"method": method, "num_speculative_tokens": 5})
    prop = make_proposer(resolve("proposer", method), None, cfg)
    toks = [5, 6, 7, 8, 9, 10, 11] * 3 + [5, 6]  # after "5 6" comes "7 8 9 10 11": five tokens to draft
    batch = ProposeBatch(seq_ids=[0, 1, 2], token_ids=[toks] * 3, k=5, sampling_params=[greedy()] * 3,
                         generators=[None] * 3, row_k=[1, 3, 5])
    out = prop.propose(batch)
    lens = out.lens.tolist()
    assert lens == [1, 3, 5] and out.token_ids[2].tolist() == [7, 8, 9, 10, 11]
    assert out.token_ids[1, :3].tolist() == [7, 8, 9]


class Mixed(SpeculationPolicy):
    """Row b drafts (b mod (k+1)) tokens: 0 .. k side by side in every step."""

    def choose(self, batch, cost):
        return [min(b % (lim + 1) if lim else 0, lim) for b, lim in enumerate(batch.limits)]


@pytest.mark.parametrize("policy", ["mixed", "goodput"])
def test_sampling_stays_lossless_under_a_policy(plain_tiny, policy, tmp_path):
    """Every sampled token follows the target (randomised PIT, as test_sampling_lossless.py) when the drafts of a
    model with its own law q are cut per row: cut rows' q are cut with them."""
    from specdec.engine.testing import rand_tokens
    from tests.spec_decode.helpers import DELTA, uniformity_pvalue
    from tests.spec_decode.test_sampling_lossless import pit_values

    prompts = [rand_tokens(3 + 5 * (i % 7), seed=100 + i) for i in range(32)]
    # goodput decides from a fixed table (no live refresh, no probes), so what it cuts does not depend on this
    # machine's timings: a row drafts what its estimates say pays at 0.05 ms a scored row
    CostModel({r: 0.010 + 0.00005 * r for r in (1, 2, 4, 8, 16, 32, 64, 128)}).save(tmp_path / "cost.json")
    llm = LLM("tiny-random-llama", max_num_seqs=32, max_model_len=128, speculative_config={
        "method": "draft_model", "model": "tiny-random-llama", "num_speculative_tokens": 3, "options": {"seed": 1},
        "speculation_policy": "static" if policy == "mixed" else "goodput",
        **({"policy_options": {"cost_table": str(tmp_path / "cost.json"), "refresh_cost": False, "probe_every": 0}}
           if policy == "goodput" else {})})
    if policy == "mixed":
        llm.worker.policy = Mixed()
    sp = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(ids(prompts), sp, use_tqdm=False)]
    m = llm.get_metrics()
    assert m.num_draft_tokens > 0 and m.num_accepted_tokens > 0, "nothing was speculated or accepted"
    u = pit_values(plain_tiny.engine, prompts, outs, 1.0, -1, torch.Generator().manual_seed(0))
    assert uniformity_pvalue(u) > DELTA, f"{policy}: chosen {llm.worker.chosen_counts}"
    if policy == "mixed":
        assert set(llm.worker.chosen_counts) == {0, 1, 2, 3}
    else:  # the policy cut some rows and not others
        assert len([k for k, n in llm.worker.chosen_counts.items() if n]) >= 2, llm.worker.chosen_counts


def test_goodput_calibrates_at_start_up_even_with_one_slot():
    """max_num_seqs = 1: the running request holds the only KV slot, so the cost table must be measured before it
    (a lazy calibration found no free slot and left goodput choosing the static k at batch 1)."""
    from specdec import LLM, SamplingParams

    llm = LLM("tiny-random-llama", max_num_seqs=1, max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "speculation_policy": "goodput"})
    assert llm.worker.cost.calibrated and llm.engine.num_free_slots() == llm.engine.num_slots == 1
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8] * 5}], SamplingParams(temperature=0, max_tokens=12),
                 use_tqdm=False)
    assert llm.worker.cost.calibrated and llm.engine.num_free_slots() == 1


def test_a_cost_table_from_another_engine_is_refused(tmp_path):
    """A tiny model's table (0.3 ms forwards) read by a SmolLM2 run priced its forwards 30x too low, silently."""
    from specdec.spec_decode.cost_model import CostModel, cost_table_key

    tiny = LLM("tiny-random-llama", max_num_seqs=1, max_model_len=64).engine  # a NativeEngine
    path = tmp_path / "cost.json"
    CostModel({1: 0.0003, 2: 0.0004}).save(path, made_on=cost_table_key(tiny))
    assert CostModel.load(path, made_on=cost_table_key(tiny)).secs == [0.0003, 0.0004]
    other = {**cost_table_key(tiny), "vocab_size": 49152, "threads": 7}
    with pytest.raises(ValueError, match=r"measured on another engine \(vocab_size: 512 there, 49152 here, threads"):
        CostModel.load(path, made_on=other)
    # a run pointed at that table measures its own (warned), never prices its forwards with the tiny model's
    import json
    d = json.loads(path.read_text())
    d["made_on"]["vocab_size"] = 49152
    path.write_text(json.dumps(d))
    llm = LLM("tiny-random-llama", max_num_seqs=1, max_model_len=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "speculation_policy": "goodput",
        "policy_options": {"cost_table": str(path)}})
    llm.generate([{"prompt_token_ids": [1, 2, 3, 1, 2, 3]}], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert llm.worker.cost.calibrated and llm.worker.cost.secs != [0.0003, 0.0004]
    assert CostModel.load(path).rows == [1, 2]  # replay reads a table without an engine
