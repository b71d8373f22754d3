"""specdec/verify/chain.py: proofs that rejection sampling is lossless, exact greedy matching, typical acceptance.

Statistical design. The target and the draft are Markov chains over V = 8 tokens (``P[prev]`` and
``Q[prev]`` are the next-token distributions), so the target's distribution at draft position i depends
on the drafted prefix exactly as a language model's would. N >= 100k independent rows are verified in one
call; for each row we take the first two tokens of the *generated sequence* (the second one comes from
plain sampling in the "next step" when the step emitted only one). Lossless means their joint law is
P[ctx][x0] * P[x0][x1]. Checks, all with fixed seeds (deterministic, so thresholds cannot flake):
- Pearson chi-square p-value > 1e-3 on the 64 joint cells and TV < 0.02 (joint) / 0.01 (first token);
  an exact sampler measures TV ~0.009 (joint, max 0.0104 over 36 seeds) / ~0.003 (first token);
- a deliberately wrong recovery (sampling p instead of norm(max(p - q, 0))) fails the same check with
  p < 1e-6, so the check has power;
- acceptance matches the analytic rate sum_x min(p, q) and E[accepted] = a + a^2 + a^3 within 5 sigma.
"""

import dataclasses

import pytest
import torch

import specdec_kernels
from specdec_kernels.testing import chi_square_pvalue, counts_of, tv_distance
from specdec.datamodel.sampling_params import SamplingParams as SP
from specdec.verify.chain import RejectionSampler, TypicalAcceptanceSampler
from specdec.verify.rows import num_accepted_tokens

T = torch.tensor
V = 8
N = 100_000
CTX = 0  # the token before the step


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def chain(seed: int, sharpness: float = 1.0) -> torch.Tensor:
    """[V, V] random Markov transition matrix; row = previous token."""
    return torch.softmax(torch.randn(V, V, generator=gen(seed)) * sharpness, dim=-1)


def propose(P: torch.Tensor, Q: torch.Tensor, k: int, n: int = N):
    """Draft k tokens from Q; return target_probs [n,k+1,V], draft_probs [n,k,V], drafts [n,k]."""
    prev = torch.full((n,), CTX)
    drafts, q_rows, p_rows = [], [], []
    for _ in range(k):
        q = Q[prev]
        d = torch.multinomial(q, 1)[:, 0]
        p_rows.append(P[prev])
        q_rows.append(q)
        drafts.append(d)
        prev = d
    p_rows.append(P[prev])  # bonus position: after the last draft
    return (torch.stack(p_rows, 1), torch.stack(q_rows, 1) if k else torch.empty(n, 0, V),
            torch.stack(drafts, 1) if k else torch.empty(n, 0, dtype=torch.int64))


def first_two(out: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """[n] joint cell x0 * V + x1 of the first two generated tokens (x1 by plain sampling if needed)."""
    x0 = out[:, 0]
    assert bool((x0 >= 0).all())  # a step always emits at least one token
    x1 = out[:, 1] if out.shape[1] > 1 else torch.full_like(x0, -1)
    next_step = torch.multinomial(P[x0], 1)[:, 0]
    return x0 * V + torch.where(x1 >= 0, x1, next_step)


def joint_law(P: torch.Tensor) -> torch.Tensor:
    return (P[CTX][:, None] * P).reshape(-1)  # [V*V]


def run_forward(sampler, P, Q, k, one_hot=False):
    target, draft_probs, drafts = propose(P, Q, k)
    bonus = torch.multinomial(target[:, k], 1)  # [n, 1] the scorer's sample at position k
    return sampler(target, bonus, None if one_hot else draft_probs, drafts), drafts


# ------------------------------------------------------------------------------------------ lossless


@pytest.mark.parametrize("k", [1, 2, 3])
def test_lossless_first_two_tokens(k):
    P, Q = chain(1), chain(2)
    torch.manual_seed(100 + k)
    out, _ = run_forward(RejectionSampler(), P, Q, k)
    cells = counts_of(first_two(out, P), V * V)
    law = joint_law(P)
    assert chi_square_pvalue(cells, law) > 1e-3
    assert tv_distance(cells, law) < 0.02
    assert tv_distance(counts_of(out[:, 0], V), P[CTX]) < 0.01
    # every row is a prefix of accepted drafts, one emitted token, then -1
    emitted = (out != -1).sum(1)
    assert bool((out[torch.arange(k + 1) >= emitted[:, None]] == -1).all())


def test_wrong_recovery_is_detected():
    """Sampling the recovered token from p instead of max(p - q, 0) is lossy: the check must say so."""
    torch_ops = specdec_kernels.get_ops("torch")

    def recover_from_p(target_probs, draft_probs, draft_token_ids, position, exp_noise):
        return torch_ops.sample_recovered(target_probs, None, torch.full_like(draft_token_ids, -1),
                                          position, exp_noise)

    specdec_kernels.register_ops("wrong-recovery", lambda: dataclasses.replace(
        torch_ops, name="wrong-recovery", sample_recovered=recover_from_p), overwrite=True)
    try:
        P, Q = chain(1), chain(2)
        torch.manual_seed(102)
        out, _ = run_forward(RejectionSampler(kernel="wrong-recovery"), P, Q, 2)
        assert chi_square_pvalue(counts_of(first_two(out, P), V * V), joint_law(P)) < 1e-6
    finally:
        specdec_kernels._LOADERS.pop("wrong-recovery", None)
        specdec_kernels._CACHE.pop("wrong-recovery", None)


def test_lossless_through_verify_with_sampling_params():
    """The worker's entry: raw logits + SamplingParams; the law is that of the *processed* target."""
    P_raw, Q = chain(3, sharpness=1.5), chain(4)
    params = SP(temperature=0.8, top_k=6)
    logits_rows = torch.log(P_raw)
    kth = logits_rows.topk(6, dim=-1).values[:, -1:]
    P = torch.softmax((logits_rows / 0.8).masked_fill(logits_rows < kth, float("-inf")), -1)
    torch.manual_seed(7)
    target, draft_probs, drafts = propose(P, Q, 2)
    target_logits = torch.log(propose_rows(P_raw, drafts))
    out = RejectionSampler().verify(target_logits, drafts, draft_probs, [params] * N)
    cells = counts_of(first_two(out, P), V * V)
    assert chi_square_pvalue(cells, joint_law(P)) > 1e-3
    assert tv_distance(cells, joint_law(P)) < 0.02


def propose_rows(P: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """[n, k+1, V] rows of P after CTX, d0, ..., d_{k-1}."""
    prev = torch.cat([torch.full((drafts.shape[0], 1), CTX), drafts], 1)
    return P[prev]


def test_p_equals_q_accepts_everything():
    P = chain(5)
    torch.manual_seed(8)
    k = 3
    target, draft_probs, drafts = propose(P, P, k)
    bonus = torch.multinomial(target[:, k], 1)
    out = RejectionSampler()(target, bonus, draft_probs, drafts)
    assert torch.equal(out, torch.cat([drafts, bonus], 1))  # all accepted, bonus at rate 1
    # through verify() the bonus is sampled inside: it follows P[d_{k-1}]
    out = RejectionSampler().verify(torch.log(target), drafts, draft_probs, [SP()] * N)
    assert torch.equal(out[:, :k], drafts)
    bonus_cells = counts_of(drafts[:, -1] * V + out[:, k], V * V)
    last_law = (counts_of(drafts[:, -1], V).double() / N)[:, None] * P.double()
    assert chi_square_pvalue(bonus_cells, last_law.reshape(-1)) > 1e-3


def test_disjoint_supports_accept_nothing():
    p = torch.zeros(V)
    p[4:] = T([0.1, 0.2, 0.3, 0.4])
    q = torch.zeros(V)
    q[:4] = 0.25
    torch.manual_seed(9)
    k = 2
    target = p.expand(N, k + 1, V)
    drafts = torch.multinomial(q, N * k, replacement=True).view(N, k)
    out = RejectionSampler()(target, torch.zeros(N, 1, dtype=torch.int64), q.expand(N, k, V), drafts)
    assert bool((out[:, 1:] == -1).all())
    counts = counts_of(out[:, 0], V)
    assert chi_square_pvalue(counts, p) > 1e-3 and tv_distance(counts, p) < 0.01


def test_one_hot_drafts_ngram_style():
    """No draft probabilities: accept with p(x); the recovered token is p with x removed."""
    p = torch.softmax(torch.randn(V, generator=gen(10)), -1)
    x = 3
    drafts = torch.full((N, 1), x)
    target = p.expand(N, 2, V)
    torch.manual_seed(11)
    out = RejectionSampler()(target, torch.full((N, 1), 7), None, drafts)
    accepted = (num_accepted_tokens(out) == 1).double().mean().item()
    assert abs(accepted - p[x].item()) < 5 * (p[x].item() * (1 - p[x].item()) / N) ** 0.5
    counts = counts_of(out[:, 0], V)
    assert chi_square_pvalue(counts, p) > 1e-3 and tv_distance(counts, p) < 0.01
    # an explicit one-hot q is the same rule, draw for draw
    one_hot = torch.nn.functional.one_hot(drafts, V).float()
    torch.manual_seed(11)
    assert torch.equal(RejectionSampler()(target, torch.full((N, 1), 7), one_hot, drafts), out)


def test_acceptance_rate_is_analytic():
    """iid positions: P(accept) = sum min(p, q) = a per position, E[accepted] = a + a^2 + a^3 (k=3)."""
    p = torch.softmax(torch.randn(V, generator=gen(12)), -1)
    q = torch.softmax(torch.randn(V, generator=gen(13)), -1)
    a = torch.minimum(p, q).sum().item()
    P, Q = p.expand(V, V), q.expand(V, V)
    torch.manual_seed(14)
    out, _ = run_forward(RejectionSampler(), P, Q, 3)
    n_acc = num_accepted_tokens(out).double()
    first = (n_acc >= 1).double().mean().item()
    assert abs(first - a) < 5 * (a * (1 - a) / N) ** 0.5
    expected = a + a ** 2 + a ** 3
    assert abs(n_acc.mean().item() - expected) < 5 * (n_acc.var().item() / N) ** 0.5


def test_short_proposals_padded_with_minus_one():
    """proposal_len 0 rows are plain sampling from p_0; proposal_len 1 rows stop after position 1."""
    P, Q = chain(15), chain(16)
    torch.manual_seed(17)
    k = 3
    target, draft_probs, drafts = propose(P, Q, k)
    drafts = drafts.clone()
    half = N // 2
    drafts[:half] = -1  # proposal_len 0
    drafts[half:, 1:] = -1  # proposal_len 1
    out = RejectionSampler().verify(torch.log(target), drafts, draft_probs, [SP()] * N)
    assert bool((out[:half, 1:] == -1).all()) and bool((out[half:, 2:] == -1).all())
    c0 = counts_of(out[:half, 0], V)
    assert chi_square_pvalue(c0, P[CTX]) > 1e-3 and tv_distance(c0, P[CTX]) < 0.015
    cells = counts_of(first_two(out[half:], P), V * V)  # x1 = plain sample from P[d0] when d0 accepted
    assert chi_square_pvalue(cells, joint_law(P)) > 1e-3


# -------------------------------------------------------------------------------------------- seeds


def test_seeded_rows_reproducible_and_batch_independent():
    P, Q = chain(18, sharpness=0.5), chain(19, sharpness=0.5)
    torch.manual_seed(20)
    n = 6
    target, draft_probs, drafts = propose(P, Q, 3, n)
    bonus = torch.zeros(n, 1, dtype=torch.int64)
    rs = RejectionSampler()

    def run(rows, seeds):
        seeded = {i: gen(s) for i, s in enumerate(seeds) if s is not None}
        return rs(target[rows], bonus[rows], draft_probs[rows], drafts[rows], seeded)

    base = run([0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15])
    assert torch.equal(run([0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15]), base)
    # row 3 alone, reordered, or beside unseeded rows: same output
    assert torch.equal(run([3], [13])[0], base[3])
    assert torch.equal(run([5, 3, 0], [None, 13, None])[1], base[3])
    # the seed matters: across 30 seeds, row 3's output is not constant
    assert len({tuple(run([3], [s])[0].tolist()) for s in range(30)}) > 1
    # the worker entry with per-request SamplingParams seeds
    logits = torch.log(target)
    params = [SP(seed=100 + i) for i in range(n)]
    gens = lambda idx: [gen(100 + i) for i in idx]  # noqa: E731
    full = rs.verify(logits, drafts, draft_probs, [params[i] for i in range(n)], gens(range(n)))
    # rows 1 and 4 again, now beside a greedy row: each keeps its output; the greedy row is exact
    idx = [0, 1, 4]
    part = rs.verify(logits[idx], drafts[idx], draft_probs[idx], [SP(temperature=0), params[1], params[4]],
                     [None, gen(101), gen(104)])
    assert torch.equal(part[1], full[1]) and torch.equal(part[2], full[4])
    assert torch.equal(part[0], rs.forward_greedy(logits[0].argmax(-1)[None], drafts[:1])[0])


# ------------------------------------------------------------------------------------------- greedy


def one_hot_logits(argmax_rows: list[list[int]]) -> torch.Tensor:
    """[B, k+1, V] logits whose argmax at each position is given."""
    ids = T(argmax_rows)
    return torch.nn.functional.one_hot(ids, V).float() * 5.0


def test_greedy_rows_match_exactly():
    logits = one_hot_logits([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    drafts = T([[1, 2],  # all accepted: 1, 2 and the bonus argmax 3
                [0, 2],  # first rejected: the target's 1
                [1, 5],  # second rejected: 1, then the target's 2
                [1, -1]])  # short proposal: 1 accepted, then the target's 2
    params = [SP(temperature=0)] * 4
    out = RejectionSampler().verify(logits, drafts, None, params)
    assert out.tolist() == [[1, 2, 3], [1, -1, -1], [1, 2, -1], [1, 2, -1]]
    # mixed with random rows, greedy rows are unchanged and ignore draft probabilities
    mixed = RejectionSampler().verify(torch.cat([logits, logits]), torch.cat([drafts, drafts]),
                                      torch.full((8, 2, V), 1.0 / V), params + [SP(seed=1)] * 4,
                                      [None] * 4 + [gen(1)] * 4)
    assert mixed[:4].tolist() == out.tolist()


def test_greedy_k0_and_k1():
    # k = 0: plain greedy decoding, one token
    assert RejectionSampler().verify(one_hot_logits([[4]]), torch.empty(1, 0, dtype=torch.int64), None,
                                     [SP(temperature=0)]).tolist() == [[4]]
    # k = 1: accepted -> draft + bonus; rejected -> target's token
    out = RejectionSampler().verify(one_hot_logits([[4, 6], [4, 6]]), T([[4], [5]]), None,
                                    [SP(temperature=0)] * 2)
    assert out.tolist() == [[4, 6], [4, -1]]


def test_random_k0_is_plain_sampling():
    p = torch.softmax(torch.randn(V, generator=gen(21)), -1)
    torch.manual_seed(22)
    out = RejectionSampler().verify(torch.log(p).expand(N, 1, V), torch.empty(N, 0, dtype=torch.int64),
                                    None, [SP()] * N)
    assert out.shape == (N, 1)
    assert chi_square_pvalue(counts_of(out[:, 0], V), p) > 1e-3


def test_shape_errors_name_the_expected_shape():
    with pytest.raises(ValueError, match=r"expected \[2, 3\]"):
        RejectionSampler()(torch.ones(2, 4, V) / V, torch.zeros(2, 1, dtype=torch.int64), None,
                           torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="pass None for proposers without probabilities"):
        RejectionSampler()(torch.ones(2, 3, V) / V, torch.zeros(2, 1, dtype=torch.int64),
                           torch.ones(2, 2, V - 1), torch.zeros(2, 2, dtype=torch.int64))


# ------------------------------------------------------------------------------------------ typical


def test_typical_acceptance_hand_written():
    p_peak = [0.7, 0.1, 0.1, 0.1, 0, 0, 0, 0]  # threshold min(0.09, 0.3 e^-H = 0.117) = 0.09
    p_flat = [0.125] * 8  # H = ln 8: threshold 0.3 / 8 = 0.0375
    target = T([[p_peak, p_flat, p_peak],
                [p_peak, p_flat, p_peak],
                [p_peak, p_flat, p_peak]])
    drafts = T([[1, 6],  # 0.1 > 0.09 and 0.125 > 0.0375: all accepted, bonus 7
                [5, 6],  # p = 0 at position 0: rejected, emit argmax 0
                [0, -1]])  # padded position 1: rejected, emit argmax of the flat row (lowest index 0)
    bonus = T([[7], [7], [7]])
    tas = TypicalAcceptanceSampler()
    assert tas(target, bonus, None, drafts).tolist() == [[1, 6, 7], [0, -1, -1], [0, 0, -1]]
    # a stricter threshold rejects 0.1 at position 0 in row 0 (min(0.2, 0.117) = 0.117)
    strict = TypicalAcceptanceSampler(posterior_threshold=0.2)
    assert strict(target, bonus, None, drafts)[0].tolist() == [0, -1, -1]


def test_typical_verify_entry():
    logits = torch.log(T([[[0.7, 0.1, 0.1, 0.1, 0, 0, 0, 0]] * 3]).clamp_min(1e-30))  # [1, 3, V]
    drafts = T([[1, 2]])
    # random row: both accepted, bonus ~ p_2 drawn from the row's generator (reproducible)
    a = TypicalAcceptanceSampler().verify(logits, drafts, None, [SP(seed=3)], [gen(3)])
    b = TypicalAcceptanceSampler().verify(logits, drafts, None, [SP(seed=3)], [gen(3)])
    assert a.tolist() == b.tolist() and a[0, :2].tolist() == [1, 2] and 0 <= a[0, 2].item() < 4
    # greedy row: exact matching, draft 1 != argmax 0
    assert TypicalAcceptanceSampler().verify(logits, drafts, None, [SP(temperature=0)]).tolist() == [[0, -1, -1]]
    with pytest.raises(ValueError, match="posterior_threshold"):
        TypicalAcceptanceSampler(posterior_threshold=0.0)


def test_num_accepted_tokens():
    assert num_accepted_tokens(T([[1, 2, 3], [4, -1, -1], [5, 6, -1]])).tolist() == [2, 0, 1]


def test_the_small_greedy_chain_path_equals_the_kernel_path():
    """verify_proposals' list path for a step's few greedy rows (greedy_chain_verdict) against the torch kernel's,
    on seeded random drafts that match for a random length, then padding (-1) or a wrong token."""
    from specdec.interfaces import SpeculativeProposals
    from specdec.verify.chain import greedy_chain_verdict

    g = torch.Generator().manual_seed(0)
    rs = RejectionSampler("torch")
    for trial in range(200):
        B, k = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 11, (1,), generator=g))
        argmax = torch.randint(0, 5, (B, k + 1), generator=g)
        lens = torch.randint(0, k + 1, (B,), generator=g)
        drafts = torch.where(torch.rand(B, k, generator=g) < 0.7, argmax[:, :k], torch.randint(0, 5, (B, k), generator=g))
        drafts = torch.where(torch.arange(k)[None, :] < lens[:, None], drafts, -1)
        props = SpeculativeProposals.chain(drafts, None, lens)
        fast = greedy_chain_verdict(argmax, drafts)
        logits = torch.nn.functional.one_hot(argmax, 5).float()  # [B, k+1, V]: argmax is the kernel's
        out = rs.verify(logits, drafts, None, [SP(temperature=0.0)] * B)
        n = num_accepted_tokens(out)
        assert torch.equal(fast.out, out), trial
        assert torch.equal(fast.path, torch.where(torch.arange(k + 1)[None, :] <= n[:, None], torch.arange(k + 1), -1))
        routed = rs.verify_proposals(logits, props, torch.zeros(B, dtype=torch.long), [SP(temperature=0.0)] * B,
                                     [None] * B, target_argmax=argmax)
        assert torch.equal(routed.out, out) and torch.equal(routed.path, fast.path)
