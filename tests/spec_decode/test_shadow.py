"""Shadow acceptance (specdec/spec_decode/policy.py): a row that drafts nothing under a proposer with free drafts
(n-gram) is still observed, by comparing what it would have drafted with what it then emitted; the policy's
estimate converges to the true acceptance and needs no probes. Only estimates change: outputs are untouched."""

import random

import numpy as np
import pytest

from specdec import LLM, SamplingParams
from specdec.spec_decode.cost_model import CostModel
from specdec.spec_decode.policy import BatchView, GoodputPolicy, ShadowDrafts, StepResult
from proposers.ngram import ngram_lookup
from tests.spec_decode.helpers import LOSSLESS_SPECS, assert_greedy_equal, ids

PROMPTS = [[5, 6, 7, 8, 9] * 4, list(range(40, 60)), [3, 4] * 6 + [11, 12, 13]]


def greedy(max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def matched(draft: list[int], after: list[int]) -> int:
    a = 0
    while a < min(len(draft), len(after)) and draft[a] == after[a]:
        a += 1
    return a


def record_shadow_drafts(llm) -> list[tuple[int, list[int], list[int]]]:
    """Every shadow draft the worker asks for, (seq id, its tokens then, the draft), in call order."""
    started: list[tuple[int, list[int], list[int]]] = []
    inner = llm.worker.top1.shadow_drafts

    def shadow_drafts(req, rows, ks):
        out = inner(req, rows, ks)
        metas = req.seq_group_metadata_list
        started.extend((metas[b].get_first_seq_id(), list(metas[b].first_seq_data().get_token_ids()), d)
                       for b, d in zip(rows, out))
        return out

    llm.worker.top1.shadow_drafts = shadow_drafts
    return started


def test_a_shadow_resolves_at_its_first_mismatch_or_when_fully_matched():
    sh = ShadowDrafts()
    sh.start(1, [10, 11, 12, 13])
    sh.start(1, [99])  # one pending draft per sequence: ignored
    assert sh.emitted(1, [10]) is None and sh.emitted(1, [11]) is None  # k = 0 steps: one token each
    assert sh.emitted(1, [12, 7, 8]) == (4, 3, 0, None) and 1 not in sh  # a speculative step emitted several
    sh.start(2, [5, 6])
    assert sh.emitted(2, [4]) == (2, 0, 0, None)  # rejected at the first position
    sh.start(3, [5, 6])
    assert sh.emitted(3, [5, 6, 7]) == (2, 2, 0, None)  # all accepted
    sh.start(4, [])  # nothing drafted: nothing to observe (a real step would propose nothing either)
    assert 4 not in sh and len(sh) == 0
    sh.start(5, [5, 6], 0, 3)  # the row's draft class when it started comes back with the outcome
    assert sh.emitted(5, [5, 7]) == (2, 1, 0, 3)


def test_a_tail_shadow_reports_only_past_the_rows_own_drafts():
    """A row that drafts k = 2 of its limit 4 (skip 2): past its own drafts, or nothing when it did not accept them."""
    sh = ShadowDrafts()
    sh.start(1, [10, 11, 12, 13], 2)
    assert sh.emitted(1, [10, 11, 12]) is None and sh.emitted(1, [5]) == (4, 3, 2, None)  # position 3 right, 4 wrong
    sh.start(2, [10, 11, 12, 13], 2)
    assert sh.emitted(2, [10, 9]) is None and 2 not in sh  # its own second draft was rejected: nothing past it
    sh.start(3, [10, 11], 2)  # no longer than what the row drafts itself: nothing to shadow
    assert 3 not in sh


def test_the_estimate_converges_to_a_known_acceptance():
    """Drafts right at each position with probability alpha given the ones before (as CorruptedGreedyProposer):
    the conditional acceptance the policy learns from shadows alone is alpha at every position."""
    rng = random.Random(0)
    alpha, k = 0.7, 4
    pol = GoodputPolicy(prior=0.1, ema=0.02, probe_every=0)
    sh = ShadowDrafts()
    for _ in range(4000):
        truth = [rng.randrange(100) for _ in range(k)]
        draft = [t if rng.random() < alpha else t + 100 for t in truth]
        sh.start(0, draft)
        for t in truth:  # k = 0 steps, one emitted token each
            seen = sh.emitted(0, [t])
            if seen is not None:
                pol.observe_shadow(0, *seen)
                break
    assert pol.alpha[0][:k] == pytest.approx([alpha] * k, abs=0.1)


def test_the_estimate_converges_to_one_where_the_continuation_repeats_the_prompt():
    """n-gram drafts on a text whose continuation repeats its prompt: every draft is right, and the shadow estimate
    climbs from a pessimistic prior to ~1 at every position, the row never drafting."""
    prompt = list(range(100, 124))
    text = prompt * 4
    k = 6
    pol = GoodputPolicy(prior=0.1, ema=0.3, probe_every=0)
    sh = ShadowDrafts()
    for L in range(len(prompt), len(text)):
        sh.start(0, ngram_lookup(np.asarray(text[:L]), k, 1, 3).tolist())
        if 0 in sh:
            seen = sh.emitted(0, [text[L]])
            if seen is not None:
                pol.observe_shadow(0, *seen)
    assert min(pol.alphas(0, k)[:k]) > 0.95, pol.alphas(0, k)


def test_no_probe_for_a_shadowed_batch():
    cost = CostModel({r: 0.02 + 0.002 * (r - 1) for r in (1, 2, 4, 8, 16, 32)})  # drafting never pays at alpha 0.02
    for shadow, want_probe in ((False, True), (True, False)):
        pol = GoodputPolicy(prior=0.02, probe_every=2)
        seen = []
        for _ in range(8):
            ks = pol.choose(BatchView([0], [4], depth=4, shadow=shadow), cost)
            seen.append(ks[0])
            pol.observe(StepResult([0], ks, ks, [0]))
        assert (1 in seen) == want_probe, (shadow, seen)


class NeverDrafts(GoodputPolicy):
    """Goodput's estimates, but every row at k = 0: only shadows teach it; each resolved shadow is recorded."""

    def __init__(self) -> None:
        super().__init__(probe_every=1)
        self.shadows: list[tuple[int, int, int]] = []
        self.views: list[BatchView] = []

    def choose(self, batch, cost):
        self.views.append(batch)
        return [0] * len(batch.limits)

    def observe_shadow(self, seq_id, proposed, accepted, start=0, cls=None):
        self.shadows.append((seq_id, proposed, accepted))
        super().observe_shadow(seq_id, proposed, accepted, start, cls)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_shadows_of_a_live_run_are_exact(plain_tiny, method):
    """Every resolved shadow equals what verifying that draft against the emitted tokens decides (greedy: exact);
    the rows never draft (no probe), every step runs the plain path, and the output is plain greedy decoding. For
    the n-gram and suffix proposers, whose drafts are free."""
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256,
              speculative_config={"method": method, "num_speculative_tokens": 4})
    pol = llm.worker.policy = NeverDrafts()
    assert llm.worker.top1.free_drafts
    started = record_shadow_drafts(llm)
    out = llm.generate(ids(PROMPTS), greedy(), use_tqdm=False)
    assert_greedy_equal(llm.engine, PROMPTS, out, plain_tiny.generate(ids(PROMPTS), greedy(), use_tqdm=False), "shadow")
    assert llm.get_metrics().num_draft_tokens == 0 and llm.worker.plain_steps > 0
    assert pol.views and all(v.shadow for v in pol.views)
    assert pol.shadows, "no shadow resolved"
    final = {}
    for o, p in zip(out, PROMPTS):  # seq id -> its whole token list (prompt + output)
        final[tuple(p)] = p + list(o.outputs[0].token_ids)
    pending: dict[int, list[tuple[int, int]]] = {}
    for s, toks, d in started:
        if not d:
            continue
        full = next(v for k, v in final.items() if toks[:len(k)] == list(k))
        pending.setdefault(s, []).append((len(d), matched(d, full[len(toks):])))
    for s, n, a in pol.shadows:
        assert pending[s].pop(0) == (n, a), (s, n, a)
    assert max(a for _, _, a in pol.shadows) > 0, "no shadow draft was ever right: the check is too weak"


class OneDraft(GoodputPolicy):
    """Goodput's estimates, every row at k = 1 of its limit: positions past 1 are learnt from tail shadows only."""

    def __init__(self) -> None:
        super().__init__(probe_every=0, tail_every=1)
        self.shadows: list[tuple[int, int, int, int]] = []

    def choose(self, batch, cost):
        return [min(1, lim) for lim in batch.limits]

    def observe_shadow(self, seq_id, proposed, accepted, start=0, cls=None):
        self.shadows.append((seq_id, proposed, accepted, start))
        super().observe_shadow(seq_id, proposed, accepted, start, cls)


def test_tail_shadows_of_a_live_run_are_exact(plain_tiny):
    """n-gram rows drafting 1 of their 4: each resolved tail shadow (start 1) is what verifying the whole draft
    against the emitted tokens decides, resolved only where the step accepted its own draft; the estimate past the
    first position moves; the output is plain greedy decoding."""
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    pol = llm.worker.policy = OneDraft()
    pol.shadow_rows = None
    started = record_shadow_drafts(llm)
    out = llm.generate(ids(PROMPTS), greedy(), use_tqdm=False)
    assert_greedy_equal(llm.engine, PROMPTS, out, plain_tiny.generate(ids(PROMPTS), greedy(), use_tqdm=False), "tail")
    final = {tuple(p): p + list(o.outputs[0].token_ids) for o, p in zip(out, PROMPTS)}
    want: dict[int, list[tuple[int, int, int]]] = {}
    for s, toks, d in started:
        full = next(v for k, v in final.items() if toks[:len(k)] == list(k))
        a = matched(d, full[len(toks):])
        if len(d) > 1 and a >= 1:  # resolved only past the row's own accepted draft
            want.setdefault(s, []).append((len(d), a, 1))
    got: dict[int, list[tuple[int, int, int]]] = {}
    for s, n, a, start in pol.shadows:
        got.setdefault(s, []).append((n, a, start))
    for s, seen in got.items():  # the last of a sequence may still be pending when it finished
        assert seen == want[s][:len(seen)] and len(want[s]) - len(seen) <= 1, (s, seen, want[s])
    assert any(a > 1 for _, _, a, _ in pol.shadows), "no tail position was ever accepted: the check is too weak"
    # learnt past position 1 (per n-gram match length: the draft classes)
    assert any(len(g) > 1 and g[1] != pol.prior for g in pol.class_alpha.values()) and not pol.global_alpha


def test_tail_shadows_start_on_every_tail_every_th_step_that_has_one(plain_tiny):
    """tail_every = 3: a third of the steps with a row below its limit ask for its whole draft; 0: none."""
    for every in (3, 0):
        llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 4})
        pol = llm.worker.policy = OneDraft()
        pol.tail_every, pol.shadow_rows = every, None
        asked, inner = [], llm.worker.top1.shadow_drafts
        llm.worker.top1.shadow_drafts = lambda req, rows, ks: asked.append(len(rows)) or inner(req, rows, ks)
        out = llm.generate(ids(PROMPTS[:1]), greedy(), use_tqdm=False)
        assert_greedy_equal(llm.engine, PROMPTS[:1], out, plain_tiny.generate(ids(PROMPTS[:1]), greedy(),
                                                                               use_tqdm=False), "tail_every")
        clock = llm.worker._tail_clock
        assert (len(asked) == clock // 3 > 0) if every else (not asked and clock == 0), (every, asked, clock)
    with pytest.raises(ValueError, match="tail_every"):
        GoodputPolicy(tail_every=-1)


def test_pick_takes_those_asked_longest_ago_first():
    sh = ShadowDrafts()
    assert sh.pick([7, 8, 9], None) == [0, 1, 2]  # no bound: every row
    assert sh.pick([7, 8, 9, 10, 11], 2) == [3, 4]  # 10 and 11 were never asked
    assert sh.pick([7, 8, 9, 10, 11], 2) == [0, 1]  # then 7 and 8 (asked at the first pick), in batch order
    assert sh.pick([11, 9, 8], 1) == [1]  # 9 was asked before 8 and 11
    sh.free(11)
    assert sh.pick([8, 11], 1) == [1]  # a freed sequence starts afresh


def test_at_most_shadow_rows_start_a_shadow_per_step(plain_tiny):
    """A batch of 3 with ``shadow_rows`` = 1: one row asked per step, in turn; every row still learns, and the output
    is plain greedy decoding."""
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    pol = llm.worker.policy = NeverDrafts()
    pol.shadow_rows = 1
    asked: list[list[int]] = []
    inner = llm.worker.top1.shadow_drafts

    def shadow_drafts(req, rows, ks):
        metas = req.seq_group_metadata_list
        asked.append([metas[b].get_first_seq_id() for b in rows])
        return inner(req, rows, ks)

    llm.worker.top1.shadow_drafts = shadow_drafts
    out = llm.generate(ids(PROMPTS), greedy(), use_tqdm=False)
    assert_greedy_equal(llm.engine, PROMPTS, out, plain_tiny.generate(ids(PROMPTS), greedy(), use_tqdm=False), "shadow")
    assert asked and max(len(a) for a in asked) == 1
    assert {s for s, _, _ in pol.shadows} == {s for a in asked for s in a} and len({s for a in asked for s in a}) == 3


@pytest.mark.parametrize("spec", ["draft_noisy_k3", "eagle_tree"])
def test_costly_proposers_keep_their_probes(spec):
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256, speculative_config=LOSSLESS_SPECS[spec]())
    pol = llm.worker.policy = NeverDrafts()
    assert not llm.worker.top1.free_drafts
    llm.generate(ids(PROMPTS[:2]), greedy(12), use_tqdm=False)
    assert pol.views and not any(v.shadow for v in pol.views) and not pol.shadows and not llm.worker.shadows


def test_a_large_batch_holds_an_all_zero_choice():
    """consult_every = 3, large_batch = 2: an all-zero choice of 2 rows is reused for the next 2 steps of the same
    rows, then chosen afresh; a batch of 1, a changed batch or a shadow that would have gained 2 tokens ends the
    hold."""
    cost = CostModel({r: 0.02 + 0.002 * (r - 1) for r in (1, 2, 4, 8, 16, 32)})  # drafting never pays at alpha 0.02
    pol = GoodputPolicy(prior=0.02, consult_every=3, large_batch=2)
    pair = BatchView([0, 1], [4, 4], depth=4, shadow=True)
    assert pol.choose(pair, cost) == [0, 0]
    assert [pol.reuses_zeros([0, 1]) for _ in range(3)] == [True, True, False]
    assert pol.choose(pair, cost) == [0, 0] and not pol.reuses_zeros([0, 2])  # another batch: a new choice
    assert pol.choose(BatchView([0], [4], depth=4, shadow=True), cost) == [0] and not pol.reuses_zeros([0])
    pol.choose(pair, cost)
    pol.observe_shadow(1, 4, 1)  # row 1 would have gained one token: the hold stays
    assert pol.reuses_zeros([0, 1])
    pol.observe_shadow(0, 4, 2)  # row 0 two: the next step chooses afresh
    assert not pol.reuses_zeros([0, 1])
    assert pol.consults == 4
    with pytest.raises(ValueError, match="consult_every=0 an int >= 1"):
        GoodputPolicy(consult_every=0)


def test_held_steps_run_plain_and_stay_greedy_equal(plain_tiny, tmp_path):
    """A live batch of 3 under goodput with drafting priced out (a fixed cost table where every scored row costs
    ten one-token forwards): steps that reuse the held choice make no choice and start no shadow; shadows still
    resolve; the output is plain greedy decoding."""
    table = tmp_path / "cost.json"
    CostModel({1: 0.01, 2: 0.1, 8: 0.7, 64: 6.3}).save(table)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "speculation_policy": "goodput",
            "policy_options": {"cost_table": str(table), "refresh_cost": False, "consult_every": 4, "large_batch": 2}}
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256, speculative_config=spec)
    w, pol = llm.worker, llm.worker.policy
    events = []  # per step: "held" or "chose", then "shadow" for each shadow_drafts call
    reuses, choose, shadow = pol.reuses_zeros, pol.choose, w.top1.shadow_drafts
    pol.reuses_zeros = lambda ids_: (lambda r: events.append("held" if r else "asked") or r)(reuses(ids_))
    pol.choose = lambda b, c: events.append("chose") or choose(b, c)
    w.top1.shadow_drafts = lambda req, rows, ks: events.append("shadow") or shadow(req, rows, ks)
    resolved = []
    inner = pol.observe_shadow
    pol.observe_shadow = lambda s, n, a, start=0, cls=None: resolved.append(a) or inner(s, n, a, start, cls)
    out = llm.generate(ids(PROMPTS), greedy(), use_tqdm=False)
    assert_greedy_equal(llm.engine, PROMPTS, out, plain_tiny.generate(ids(PROMPTS), greedy(), use_tqdm=False), "held")
    assert llm.get_metrics().num_draft_tokens == 0 and resolved
    held = [i for i, e in enumerate(events) if e == "held"]
    assert held and pol.consults + len(held) == w.plain_steps + w.spec_steps, (pol.consults, len(held))
    assert all(events[i + 1:i + 2] in ([], ["held"], ["asked"]) for i in held)  # nothing chosen or drafted after


def test_a_large_batch_drafts_nothing_while_requests_wait():
    """off_while_queued: a batch of >= large_batch rows chooses 0 for every row while the queue holds requests (and
    holds that choice); a smaller batch, an empty queue or the option off: the ordinary choice."""
    cost = CostModel({r: 0.02 + 0.0001 * (r - 1) for r in (1, 2, 4, 8, 16, 32)})  # drafting nearly free
    def view(B, queued):
        return BatchView(list(range(B)), [4] * B, depth=4, num_waiting=queued)
    pol = GoodputPolicy(prior=0.9, large_batch=4)
    assert all(pol.choose(view(4, 0), cost)) and all(pol.choose(view(3, 5), cost))
    assert pol.choose(view(4, 5), cost) == [0] * 4 and pol.reuses_zeros(list(range(4)))
    assert all(GoodputPolicy(prior=0.9, large_batch=4, off_while_queued=False).choose(view(4, 5), cost))
    with pytest.raises(ValueError, match="off_while_queued=1 must be true or false"):
        GoodputPolicy(off_while_queued=1)


def test_goodput_keeps_its_estimates_per_draft_class():
    """With draft classes (n-gram's match length), outcomes of one class do not move another's estimate: drafts of
    class 3 always accepted, of class 1 always rejected at once -> a long draft for the row at class 3 and none for
    the row at class 1 in the same step; without classes (None) the same outcomes mix into one estimate."""
    cost = CostModel({r: 0.01 + 0.0005 * (r - 1) for r in (1, 2, 4, 8, 16, 32)})
    pol = GoodputPolicy(prior=0.5, ema=0.3, probe_every=0)
    for _ in range(30):
        pol.observe(StepResult([0, 1], [4, 4], [4, 4], [4, 0], classes=[3, 1]))
    assert pol.class_alpha[3][:4] == pytest.approx([1.0] * 4, abs=0.01) and pol.class_alpha[1][0] < 0.01
    assert not pol.global_alpha and 0 not in pol.alpha
    view = BatchView([0, 1], [4, 4], depth=4, shadow=True, classes=[3, 1])
    assert pol.choose(view, cost) == [4, 0]
    view = BatchView([0, 1], [4, 4], depth=4, shadow=True, classes=[1, 3])  # the rows swap classes: so do the choices
    assert pol.choose(view, cost) == [0, 4]
    pol.observe_shadow(0, 4, 4, 0, 1)  # a shadow of class 1 teaches class 1
    assert pol.class_alpha[1][0] > 0.2
    pol.free(0)
    assert 0 not in pol.alpha_by_class


def test_a_live_goodput_run_sees_the_ngram_classes_and_drafts_nothing_without_a_match(plain_tiny):
    """The worker asks the n-gram proposer for its classes before the choice: every observed row carries one, a row of
    class 0 (no match) is chosen 0 and drafts nothing, the others draft; the output is plain greedy decoding."""
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "speculation_policy": "goodput"})
    pol, seen = llm.worker.policy, []
    inner = pol.observe
    pol.observe = lambda r: seen.append(r) or inner(r)
    out = llm.generate(ids(PROMPTS), greedy(), use_tqdm=False)
    assert_greedy_equal(llm.engine, PROMPTS, out, plain_tiny.generate(ids(PROMPTS), greedy(), use_tqdm=False), "cls")
    rows = [(c, k, n) for r in seen for c, k, n in zip(r.classes, r.chosen, r.proposed)]
    assert rows and all(c is not None for c, _, _ in rows)
    assert all(k == 0 and n == 0 for c, k, n in rows if c == 0)
    assert {c for c, _, _ in rows} - {0} and any(n for _, _, n in rows)  # matches were found and drafted
    assert set(pol.class_alpha) <= {1, 2, 3, 4}  # SpeculativeConfig.prompt_lookup_max = 4: classes 1..4 only
