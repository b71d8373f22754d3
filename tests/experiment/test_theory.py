"""Theory beside the figures: a synthetic run whose alpha, v and c are known gives them back exactly, and the
i.i.d. formula matches a simulated geometric acceptance."""

import math
import random
from types import SimpleNamespace

import pytest

from specdec.experiment.theory import conditional_acceptance, fit_alpha_iid, tau_iid, tau_product, theory

THEORY_FIELDS = ("predicted_tau", "verify_cost", "draft_cost", "predicted_speedup", "efficiency")


def counts_from_alpha(n_steps: int, alphas: list[float]) -> list[int]:
    """spec_token_acceptance_counts of n_steps steps accepting position i with conditional rate alpha_i."""
    counts = [n_steps]
    for a in alphas:
        counts.append(round(counts[-1] * a))
    return counts


def test_conditional_alpha_and_both_tau_forms_on_known_counts():
    # 1000 steps; 800 accept position 1, 400 of those position 2, 100 of those position 3
    counts = counts_from_alpha(1000, [0.8, 0.5, 0.25])
    assert counts == [1000, 800, 400, 100]
    assert conditional_acceptance(counts, 3) == [0.8, 0.5, 0.25]
    # product form: 1 + .8 + .8*.5 + .8*.5*.25, which is the measured tau sum(counts) / counts[0]
    assert tau_product([0.8, 0.5, 0.25]) == pytest.approx(2.3, abs=1e-12) == sum(counts) / counts[0]
    # i.i.d. MLE: accepted positions / reached positions = 1300 / 2200
    assert fit_alpha_iid(counts, 3) == pytest.approx(1300 / 2200, abs=1e-15)
    # counts of an i.i.d. a = 1/2 at k = 4: the fit is a and both forms agree with the measured tau
    iid = [16, 8, 4, 2, 1]
    assert fit_alpha_iid(iid, 4) == 0.5
    assert tau_iid(0.5, 4) == tau_product(conditional_acceptance(iid, 4)) == sum(iid) / 16 == 1.9375
    assert tau_iid(1.0, 4) == 5.0 and tau_iid(0.0, 4) == 1.0


def test_unreached_positions_and_bad_inputs():
    # no step got past position 1: alpha_2.. are undefined (None), not 0, and add nothing to tau
    assert conditional_acceptance([10, 0], 3) == [0.0, None, None]
    assert tau_product([0.0, None, None]) == 1.0
    assert theory([0], 3).predicted_tau is None and theory([0], 3).alpha_iid is None
    with pytest.raises(ValueError, match="have 3 draft positions but k=2"):
        conditional_acceptance([4, 3, 2, 1], 2)
    with pytest.raises(ValueError, match="a=1.5 is not a probability"):
        tau_iid(1.5, 3)
    plain = theory([7], 0, None, None, 0.01, None)  # plain decoding: nothing to predict
    assert all(getattr(plain, f) is None for f in THEORY_FIELDS) and plain.alpha_per_position == []


def test_iid_formula_matches_a_simulated_geometric_acceptance():
    """Each draft accepted with probability a, independently, until the first rejection or k: the fitted a
    is within 4 standard errors of the true one, and (1 - a^(k+1)) / (1 - a) matches the simulated tau."""
    rng = random.Random(0)
    a_true, k, steps = 0.6, 5, 100_000
    counts = [0] * (k + 1)
    for _ in range(steps):
        counts[0] += 1
        for i in range(1, k + 1):
            if rng.random() >= a_true:
                break
            counts[i] += 1
    a = fit_alpha_iid(counts, k)
    trials = sum(counts[:k])
    assert abs(a - a_true) < 4 * math.sqrt(a_true * (1 - a_true) / trials)
    measured_tau = sum(counts) / counts[0]
    # tau per step has std < k / 2; 4 standard errors of the mean over 1e5 steps is < 0.02
    assert measured_tau == pytest.approx(tau_iid(a_true, k), abs=0.02)
    assert tau_iid(a, k) == pytest.approx(measured_tau, abs=0.02)
    # the conditional alphas all estimate a_true (the later positions have fewer trials)
    for alpha, reached in zip(conditional_acceptance(counts, k), counts[:k]):
        assert abs(alpha - a_true) < 4 * math.sqrt(a_true * (1 - a_true) / reached)


# --- a synthetic run through the summary building of specdec/experiment/run.py ------------------------------------
T1 = 0.020  # the plain baseline's decode step (the one-token forward), seconds
K = 3
# per category: known conditional alpha, v, c and measured speedup
KNOWN = {"qa": ([0.8, 0.5, 0.25], 1.5, 0.1, 1.2), "coding": ([0.5, 0.5, 0.5], 2.0, 0.05, 0.9)}


def synthetic_record(cat: str, n_steps: int, qid: str):
    from specdec.experiment.summary import RequestRecord

    alphas, v, c, speed = KNOWN[cat]
    counts = counts_from_alpha(n_steps, alphas)
    propose, score, verify = K * c * T1, v * T1, 0.001  # mean seconds per speculative step
    toks = sum(counts)
    base_steps = toks - 1  # the plain baseline: one prefill token, then one decode step per token
    seconds = 1.0
    return RequestRecord(
        question_id=qid, category=cat, num_prompt_tokens=10, num_generated_tokens=toks, seconds=seconds,
        baseline_seconds=seconds * speed, baseline_num_generated_tokens=toks, finish_reason="length", text="",
        greedy_match=True, acceptance_counts=counts, num_draft_tokens=n_steps * K,
        step_seconds={"propose": n_steps * propose, "score": n_steps * score, "verify": n_steps * verify,
                      "step": n_steps * (propose + score + verify)},
        step_counts={"propose": n_steps, "score": n_steps, "verify": n_steps, "step": n_steps},
        baseline_step_seconds=base_steps * T1, baseline_num_steps=base_steps)


def synthetic_summary():
    from specdec.experiment.compose import RunConfig
    from specdec.experiment.run import summarize

    records = [synthetic_record("qa", 1000, "1"), synthetic_record("qa", 2000, "2"),
               synthetic_record("coding", 4000, "3")]
    llm = SimpleNamespace(speculative_config={"method": "ngram"}, llm_engine=SimpleNamespace(num_speculative_tokens=K),
                          get_metrics=lambda: SimpleNamespace(mean_step_time_s={}),
                          engine=SimpleNamespace(describe=dict))  # a ModelEngine describes itself
    return summarize(RunConfig(), llm, records, 1.0, True), records


def test_synthetic_run_gives_back_its_alpha_v_and_c_per_category():
    summary, _ = synthetic_summary()
    for cat, (alphas, v, c, speed) in KNOWN.items():
        s = summary.per_category[cat]
        assert s.alpha_per_position == pytest.approx(alphas, abs=1e-12)
        tau = 1 + sum(math.prod(alphas[:i + 1]) for i in range(K))
        assert s.predicted_tau == pytest.approx(tau, abs=1e-9) == s.mean_acceptance_length
        assert s.verify_cost == pytest.approx(v, abs=1e-9) and s.draft_cost == pytest.approx(c, abs=1e-9)
        assert s.predicted_speedup == pytest.approx(tau / (v + K * c), abs=1e-9)
        assert s.speedup == pytest.approx(speed, abs=1e-9)
        assert s.efficiency == pytest.approx(speed / (tau / (v + K * c)), abs=1e-9)
    # coding's alphas are i.i.d.: the fitted a is 0.5 and the i.i.d. form equals the product form
    coding = summary.per_category["coding"]
    assert coding.alpha_iid == pytest.approx(0.5, abs=1e-12)
    assert coding.predicted_tau_iid == pytest.approx(coding.predicted_tau, abs=1e-9)


def test_synthetic_run_overall_pools_steps_and_counts():
    summary, records = synthetic_summary()
    # overall: counts summed over the questions, phase times pooled over all 7000 speculative steps
    counts = [sum(col) for col in zip(*(r.acceptance_counts for r in records))]
    assert counts == [7000, 4400, 2200, 800]
    alphas = [4400 / 7000, 2200 / 4400, 800 / 2200]
    tau = 1 + sum(math.prod(alphas[:i + 1]) for i in range(K))
    v = (3000 * 1.5 + 4000 * 2.0) / 7000
    c = (3000 * 0.1 + 4000 * 0.05) / 7000
    speed = (1.2 + 1.2 + 0.9) / 3  # measured: mean over questions of the tokens/s ratios
    assert summary.alpha_per_position == pytest.approx(alphas, abs=1e-12)
    assert summary.predicted_tau == pytest.approx(tau, abs=1e-9) == summary.mean_acceptance_length
    assert summary.alpha_iid == pytest.approx(sum(counts[1:]) / sum(counts[:K]), abs=1e-12)
    a = summary.alpha_iid
    assert summary.predicted_tau_iid == pytest.approx((1 - a ** (K + 1)) / (1 - a), abs=1e-9)
    assert summary.verify_cost == pytest.approx(v, abs=1e-9) and summary.draft_cost == pytest.approx(c, abs=1e-9)
    assert summary.predicted_speedup == pytest.approx(tau / (v + K * c), abs=1e-9)
    assert summary.efficiency == pytest.approx(speed / (tau / (v + K * c)), abs=1e-9)
    assert summary.baseline_step_time_s["step"] == pytest.approx(T1, abs=1e-12)
    assert summary.per_task["qa"].verify_cost == pytest.approx(1.5, abs=1e-9)  # Spec-Bench task rows too


def test_summary_without_theory_fields_still_reads(tmp_path):
    """summary.json files written before the theory fields existed load with them as None."""
    import json

    from specdec.experiment.summary import read_summary, write_summary

    summary, _ = synthetic_summary()
    path = tmp_path / "summary.json"
    write_summary(summary, path)
    data = json.loads(path.read_text())
    for f in (*THEORY_FIELDS, "alpha_per_position", "alpha_iid", "predicted_tau_iid"):
        data.pop(f)
        for cat in data["per_category"].values():
            cat.pop(f)
    path.write_text(json.dumps(data))
    old = read_summary(path)
    assert old.predicted_tau is None and old.per_category["qa"].efficiency is None
