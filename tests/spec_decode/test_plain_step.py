"""A decode step where the speculation policy chose 0 for every row runs the plain worker's path
(SpecDecodeWorker._plain_decode): greedy output stays token-for-token plain decoding for a chain proposer (n-gram)
and the feature proposers (EAGLE chain and tree, whose feature rows must survive the plain steps), the step is
counted as k = 0 everywhere, and a seeded sampling row never takes that path (its draws must not depend on its
neighbours' choices)."""

import pytest

from specdec import LLM, SamplingParams
from specdec.spec_decode.policy import SpeculationPolicy
from tests.spec_decode.helpers import LOSSLESS_SPECS, assert_greedy_equal, greedy, ids, record

PROMPTS = [[5, 6, 7, 8, 9] * 4, list(range(40, 60)), [3, 4] * 6 + [11, 12, 13]]
SPECS = {
    "ngram_k4": LOSSLESS_SPECS["ngram_k4"],
    "eagle_chain": lambda: {"method": "eagle", "model": "tiny-random-llama", "num_speculative_tokens": 3},
    "eagle_tree": LOSSLESS_SPECS["eagle_tree"],
}


class OnOff(SpeculationPolicy):
    """Every row drafts its limit on steps where ``step % period`` is in ``on``, else nothing (a whole step at 0)."""

    def __init__(self, period: int = 3, on: tuple[int, ...] = (0,)) -> None:
        self.period, self.on, self.step = period, on, 0

    def choose(self, batch, cost):
        self.step += 1
        return list(batch.limits) if self.step % self.period in self.on else [0] * len(batch.limits)


class FirstRowOff(SpeculationPolicy):
    """Row 0 of every step drafts nothing; the others draft their limit."""

    def choose(self, batch, cost):
        return [0 if b == 0 else lim for b, lim in enumerate(batch.limits)]


@pytest.mark.parametrize("period,on", [(3, (0,)), (2, (1,))])
@pytest.mark.parametrize("spec", sorted(SPECS))
def test_all_zero_steps_run_plain_and_stay_greedy_equal(plain_tiny, spec, period, on):
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256, speculative_config=SPECS[spec]())
    llm.worker.policy = OnOff(period, on)
    holes = watch_feature_rows(llm.worker.top1.proposer)
    drafted, propose = [], llm.worker.top1.get_spec_proposals
    llm.worker.top1.get_spec_proposals = lambda *a, **kw: drafted.append(1) or propose(*a, **kw)
    log = record(llm)
    out = llm.generate(ids(PROMPTS), greedy(), use_tqdm=False)
    assert_greedy_equal(llm.engine, PROMPTS, out, plain_tiny.generate(ids(PROMPTS), greedy(), use_tqdm=False),
                        f"{spec} on/off {period}/{on}")
    w = llm.worker
    zero = [s for s in log if all(c == 0 for c, _ in s)]
    assert w.plain_steps == len(zero) > 0, (w.plain_steps, len(zero))
    assert len(drafted) == len(log) - len(zero), "an all-zero step called the proposer"
    assert any(n > 0 for s in log for _, n in s), "no step drafted"
    assert all(n == 0 for s in zero for _, n in s)
    assert w.chosen_counts.get(0, 0) >= sum(len(s) for s in zero)
    assert sum(w.chosen_counts.values()) == sum(len(s) for s in log)
    assert llm.engine.num_free_slots() == llm.engine.num_slots
    assert holes == [], f"{spec}: feature rows missing before a draft (seq id, first row's token, expected)"


def watch_feature_rows(proposer) -> list[tuple[int, int, int]]:
    """A feature proposer's threaded rows must cover every token since it last read (ProposeBatch: row j of m is
    token len - 1 - m + j): each draft call's first row follows the last call's last row. -> the holes seen."""
    holes: list[tuple[int, int, int]] = []
    if proposer.features is None:
        return holes
    last: dict[int, int] = {}

    def check(batch):
        for s, toks, rows in zip(batch.seq_ids, batch.token_ids, batch.feature_rows()):
            first = len(toks) - 1 - rows.shape[0]
            if first != last.get(s, -1) + 1:
                holes.append((s, first, last.get(s, -1) + 1))
            last[s] = len(toks) - 2

    for name in ("propose", "propose_tree"):
        inner = getattr(proposer, name)
        setattr(proposer, name, lambda batch, *a, _inner=inner: check(batch) or _inner(batch, *a))
    return holes


def test_an_unseeded_sampling_row_takes_the_plain_path():
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256, speculative_config=SPECS["ngram_k4"]())
    llm.worker.policy = OnOff(2, (1,))
    llm.generate(ids(PROMPTS[:1]), SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert llm.worker.plain_steps > 0


@pytest.mark.parametrize("spec", ["ngram_k4", "draft_noisy_k3"])
def test_a_seeded_row_draws_the_same_alone_or_beside_a_drafting_neighbour(spec):
    """Alone, the seeded row's steps are all-zero steps; beside a greedy neighbour that drafts, they are not.
    Its tokens must not change: a seeded row always takes the speculative path."""
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    outs = []
    for prompts, params in (([PROMPTS[0]], [seeded]), ([PROMPTS[0], PROMPTS[2]], [seeded, greedy(24)])):
        llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256, speculative_config=SPECS.get(
            spec, LOSSLESS_SPECS.get(spec))())
        llm.worker.policy = FirstRowOff()
        outs.append(llm.generate(ids(prompts), params, use_tqdm=False)[0].outputs[0].token_ids)
        assert llm.worker.plain_steps == 0, "a step with a seeded row ran the plain path"
    assert outs[0] == outs[1]


@pytest.mark.parametrize("spec", ["ngram_k4", "eagle_tree"])
@pytest.mark.parametrize("guide", ["json", "regex"])
def test_guided_rows_take_the_plain_path_and_stay_equal(plain_tiny, spec, guide):
    """The plain sampler applies the same grammar masks (specdec/sampling/guided.py): guided rows may go plain."""
    from tests.spec_decode.test_guided_lossless import GUIDES
    from tests.spec_decode.test_guided_lossless import PROMPTS as GUIDED_PROMPTS

    guided = SamplingParams(temperature=0.0, max_tokens=48, guided_decoding=GUIDES[guide])
    params = [guided, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), guided, guided]
    want = plain_tiny.generate(ids(GUIDED_PROMPTS), params, use_tqdm=False)
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256, speculative_config=SPECS[spec]())
    llm.worker.policy = OnOff(2, (1,))
    got = llm.generate(ids(GUIDED_PROMPTS), params, use_tqdm=False)
    assert_greedy_equal(plain_tiny.engine, GUIDED_PROMPTS, got, want, f"{spec} / {guide}")
    assert llm.worker.plain_steps > 0 and llm.get_metrics().num_draft_tokens > 0
    assert llm.engine.num_free_slots() == llm.engine.num_slots


def test_the_plain_step_prices_zero_drafts_apart():
    """CostModel.plain: S = 0 costs the measured plain step when the step would go plain; the goodput policy then
    stops drafting where a speculative step of no drafts (forward + verify overhead) made one draft look worth it."""
    from specdec.spec_decode.cost_model import CostModel
    from specdec.spec_decode.policy import BatchView, GoodputPolicy

    cost = CostModel({1: 0.020, 2: 0.021, 4: 0.023, 8: 0.027}, overhead=0.004)
    pol = GoodputPolicy(prior=0.2, probe_every=0)
    view = BatchView([0], [4], depth=4, plain=True)
    assert pol.choose(view, cost) == [1]  # 1.2 tokens / 25 ms beat 1 token / 24 ms
    cost.observe_plain(1, 0.018)
    assert cost.step_curve(1, 2, True, plain=True)[0] == 0.018 and cost.step_curve(1, 2, True)[0] == 0.024
    assert pol.choose(view, cost) == [0]  # 1 token / 18 ms
    assert pol.choose(BatchView([0], [4], depth=4), cost) == [1]  # a seeded row in the batch: no plain path
    cost.observe_plain(1, 0.028)
    assert cost.plain[1] == 0.018 + 0.1 * 0.010
    assert CostModel.from_dict(cost.to_dict()).plain == cost.plain


def test_trace_records_plain_steps_as_chosen_zero():
    """The trace's ``chosen`` of a decode step the policy took plainly is 0 (the run's chosen-k histogram counts it
    at 0 too); speculative steps keep their k, prefills null."""
    from specdec.experiment.trace import install

    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256, speculative_config=SPECS["ngram_k4"]())
    llm.worker.policy = OnOff(3, (0,))
    tracer, _ = install(llm)
    llm.generate(ids(PROMPTS[:2]), greedy(16), use_tqdm=False)
    rows = tracer.rows
    assert all(r["chosen"] is None for r in rows if r["kind"] == "prefill")
    decode = [r for r in rows if r["kind"] == "decode"]
    assert decode and all(r["chosen"] == 0 and r["draft_ids"] == [] for r in decode)
    assert all(1 <= r["chosen"] <= 4 and len(r["draft_ids"]) <= r["chosen"] for r in rows if r["kind"] == "spec")
    assert llm.worker.chosen_counts.get(0, 0) == len(decode)


@pytest.mark.parametrize("spec", ["eagle_tree", "eagle_chain", "ngram_k4"])
def test_the_draft_price_is_learnt_from_steady_steps_only(spec):
    """CostModel.per_row / per_token learn from steps where every drafting row drafted in the step before too: a
    row's first draft after its prompt or after steps at 0 catches its proposer up over those tokens (an EAGLE head
    over a whole prompt), which one EMA sample turned into a price that stopped the goodput policy for good.
    One request at a time: its first speculative step follows its prefill (left out), every later one drafts
    (learnt; an EAGLE head always drafts); then drafting on every other step only: no step is steady, nothing is learnt."""
    tree = spec == "eagle_tree"
    llm = LLM("tiny-random-llama", max_num_seqs=1, max_model_len=256, speculative_config=SPECS[spec]())
    seen = []  # the draft counts each step's observation passes (tree: drafting rows; chain: draft tokens)
    observe = llm.worker.cost.observe
    llm.worker.cost.observe = lambda *a: seen.append(a[6] if tree else a[5]) or observe(*a)
    llm.generate(ids(PROMPTS), greedy(12), use_tqdm=False)
    if spec != "ngram_k4":  # (n-gram drafts nothing where no n-gram matches: its next step is not steady either)
        assert seen.count(0) == len(PROMPTS) and len(seen) > 2 * len(PROMPTS), seen  # each request's first step only
    assert seen[0] == 0 and (llm.worker.cost.per_row if tree else llm.worker.cost.per_token) > 0
    llm.worker.policy = OnOff(2, (1,))
    llm.worker.cost.per_row = llm.worker.cost.per_token = 0.0
    seen.clear()
    llm.generate(ids(PROMPTS), greedy(12), use_tqdm=False)
    assert seen and not any(seen) and llm.worker.cost.per_row == llm.worker.cost.per_token == 0.0
    assert llm.worker.plain_steps > 0 and not llm.worker._drafted_at  # finished requests leave no entry
