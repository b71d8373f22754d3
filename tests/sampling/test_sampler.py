"""specdec/sampling/sampler.py: the plain sampler, logits_to_probs and SamplingTensors."""

import math

import pytest
import torch

from specdec_kernels.testing import chi_square_pvalue, counts_of, tv_distance
from specdec.sampling.sampler import Sampler, SamplingTensors, argmax_last, logits_to_probs, make_generators
from specdec.datamodel.sampling_params import SamplingParams as SP

T = torch.tensor


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_with_raw_logprob():
    logits = T([[0.0, 3.0, 3.0, 1.0],  # tie between 1 and 2 -> lowest index 1
                [5.0, -1.0, 2.0, 4.9]])
    out = Sampler()(logits, [SP(temperature=0), SP(temperature=0)], [None, None])
    assert out.token_ids.tolist() == [1, 0]
    expected = torch.log_softmax(logits, -1)[[0, 1], [1, 0]]
    assert torch.allclose(out.logprobs, expected)
    assert out.top_logprobs is None and out.finite.all()


def test_logprob_is_of_raw_logits_not_tempered():
    # a hot temperature changes what is sampled from, never the reported logprob
    logits = T([[2.0, 1.0, 0.0]])
    out = Sampler()(logits, [SP(temperature=5.0, seed=1)], make_generators([SP(seed=1)]))
    assert out.logprobs.item() == pytest.approx(torch.log_softmax(logits, -1)[0, out.token_ids.item()].item())


def test_top_logprobs():
    logits = T([[0.0, 2.0, 1.0, 3.0], [1.0, 0.5, 0.0, -1.0]])
    out = Sampler()(logits, [SP(temperature=0, logprobs=2), SP(temperature=0)], None)
    ids, values = out.top_logprobs
    assert ids.tolist() == [[3, 1], [0, 1]]  # n = max over requests = 2 for every row
    assert torch.allclose(values, torch.log_softmax(logits, -1).gather(1, ids))


def test_seeded_row_independent_of_batch_composition():
    torch.manual_seed(0)
    logits = torch.randn(5, 100)
    p = SP(temperature=1.0, seed=1234)
    alone = Sampler()(logits[2:3], [p], [gen(1234)]).token_ids.item()
    # the same row and seed at another index, beside greedy, filtered and unseeded rows, many times
    draws = []
    for perm in ([2, 0, 1, 3, 4], [4, 3, 2, 1, 0], [1, 2]):
        params = [p if i == 2 else SP(temperature=0.7, top_k=5) for i in perm]
        gens = [gen(1234) if i == 2 else None for i in perm]
        out = Sampler()(logits[perm], params, gens)
        draws.append(out.token_ids[perm.index(2)].item())
    assert draws == [alone] * 3
    # and the seed matters: 20 other seeds do not all give the same token
    others = {Sampler()(logits[2:3], [p], [gen(s)]).token_ids.item() for s in range(20)}
    assert len(others) > 1


def test_non_finite_row_is_isolated():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [SP(seed=7), SP(seed=8), SP(temperature=0, logprobs=1)]
    clean = Sampler()(logits, params, make_generators(params))
    bad = logits.clone()
    bad[1, 3] = float("nan")
    bad[2, 0] = float("inf")
    out = Sampler()(bad, params, make_generators(params))
    assert out.finite.tolist() == [True, False, False]
    assert out.token_ids.tolist() == [clean.token_ids[0].item(), -1, -1]
    assert out.logprobs[0].item() == clean.logprobs[0].item() and out.logprobs[1:].isnan().all()
    assert out.top_logprobs[0][1:].eq(-1).all()


def test_filters_restrict_support():
    logits = torch.log(T([[0.4, 0.3, 0.2, 0.1]])).expand(3000, 4)
    params = [SP(top_k=2)] * 1000 + [SP(top_p=0.5)] * 1000 + [SP(min_p=0.6)] * 1000
    torch.manual_seed(0)
    tokens = Sampler()(logits, params, None).token_ids
    assert set(tokens[:1000].tolist()) == {0, 1}  # top-2
    assert set(tokens[1000:2000].tolist()) == {0, 1}  # 0.4 < 0.5 needs the 2nd token
    assert set(tokens[2000:].tolist()) == {0, 1}  # min_p 0.6 * 0.4 = 0.24 keeps p = 0.4 and 0.3


def test_logits_to_probs_hand_written():
    logits = torch.log(T([[0.4, 0.3, 0.2, 0.1]])).expand(5, 4)
    probs = logits_to_probs(logits, temperature=T([1.0, 0.0, 1.0, 1.0, 1.0]), top_k=T([0, 0, 2, 0, 0]),
                            top_p=T([1.0, 1.0, 1.0, 0.85, 1.0]), min_p=T([0.0, 0.0, 0.0, 0.0, 0.6]))
    expected = T([[0.4, 0.3, 0.2, 0.1],  # no filter
                  [1.0, 0.0, 0.0, 0.0],  # greedy: one-hot argmax
                  [4 / 7, 3 / 7, 0.0, 0.0],  # top-2 renormalised
                  [4 / 9, 3 / 9, 2 / 9, 0.0],  # nucleus 0.85 needs 3 tokens (0.4 + 0.3 < 0.85)
                  [4 / 7, 3 / 7, 0.0, 0.0]])  # min_p 0.6: keep p >= 0.24
    assert torch.allclose(probs, expected, atol=1e-6)
    # temperature 2 flattens: softmax(log p / 2) = sqrt(p) / sum sqrt(p)
    hot = logits_to_probs(logits[:1], T([2.0]))
    assert torch.allclose(hot, T([[0.4, 0.3, 0.2, 0.1]]).sqrt() / T([0.4, 0.3, 0.2, 0.1]).sqrt().sum())


def test_sampling_tensors_expand_and_flags():
    st = SamplingTensors.from_params([SP(temperature=0, top_k=3), SP(temperature=0.5, top_p=0.9)])
    assert not st.all_greedy and not st.all_random
    assert st.top_k is None  # the only top-k is on a greedy row: off for the batch
    assert st.min_p is None
    ex = st.expand(3)
    assert ex.temperature.tolist() == [0.0, 0.0, 0.0, 0.5, 0.5, 0.5]
    assert ex.top_p.tolist() == pytest.approx([1.0, 1.0, 1.0, 0.9, 0.9, 0.9])
    assert SamplingTensors.from_params([SP(temperature=0)] * 2).all_greedy


@pytest.mark.parametrize("params,reference", [
    (SP(temperature=1.0), lambda l: torch.softmax(l, -1)),
    # temperature 0.7 and top-k 5: softmax(l / 0.7) over the 5 largest logits
    (SP(temperature=0.7, top_k=5),
     lambda l: torch.softmax((l / 0.7).masked_fill(l < l.topk(5).values[-1], float("-inf")), -1)),
])
def test_sampling_matches_distribution(params, reference):
    """>= 100k draws of a 12-token distribution: chi-square p > 1e-3 (fixed seed) and TV < 0.01."""
    V, N = 12, 120_000
    logits = torch.randn(V, generator=gen(3))
    torch.manual_seed(11)
    out = Sampler()(logits.expand(N, V), [params] * N, None)
    counts = counts_of(out.token_ids, V)
    probs = reference(logits)
    assert chi_square_pvalue(counts, probs) > 1e-3
    assert tv_distance(counts, probs) < 0.01


def test_sampling_check_has_power():
    """The same check rejects a sampler that is slightly off (temperature 1.1 instead of 1)."""
    V, N = 12, 120_000
    logits = torch.randn(V, generator=gen(3))
    torch.manual_seed(11)
    out = Sampler()(logits.expand(N, V), [SP(temperature=1.1)] * N, None)
    assert chi_square_pvalue(counts_of(out.token_ids, V), torch.softmax(logits, -1)) < 1e-6


def test_shape_error_names_the_fix():
    with pytest.raises(ValueError, match=r"expected \[2, vocab_size\]"):
        Sampler()(torch.zeros(3, 5), [SP(), SP()], None)


def test_all_greedy_fast_path_matches_general_path():
    torch.manual_seed(1)
    logits = torch.randn(4, 300)
    greedy = Sampler()(logits, [SP(temperature=0)] * 4, None)
    mixed = Sampler()(logits, [SP(temperature=0)] * 3 + [SP(seed=0)], make_generators([SP()] * 3 + [SP(seed=0)]))
    assert torch.equal(greedy.token_ids[:3], mixed.token_ids[:3])
    assert torch.allclose(greedy.logprobs[:3], mixed.logprobs[:3])
    assert not math.isnan(mixed.logprobs[3].item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_argmax_last_is_torch_argmax(dtype):
    """The numpy fast path gives torch.argmax's indices: random rows, ties (first wins), +-inf, NaN (the first
    NaN wins), signed zeros, strided and 3-D inputs, and the inference-mode tensors the engine hands out."""
    g = torch.Generator().manual_seed(0)
    cases = [torch.randn(7, 49152, generator=g), torch.randn(2, 3, 4096, generator=g), torch.randn(1, 1, generator=g),
             torch.randn(5, 8, generator=g)[:, ::2],
             torch.tensor([[1.0, 3.0, 3.0, 0.0], [float("nan"), 1.0, float("nan"), 2.0], [-float("inf")] * 4,
                           [1.0, float("inf"), float("inf"), float("nan")], [0.0, -0.0, 0.0, 0.0]])]
    with torch.inference_mode():
        cases.append(torch.randn(4, 100, generator=g))
    for x in cases:
        x = x.to(dtype)
        got = argmax_last(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(-1)), x
    # the fallback (no numpy view) keeps torch's answer
    x = torch.randn(3, 10, generator=g, requires_grad=True)
    assert torch.equal(argmax_last(x), x.argmax(-1))
    h = torch.randn(3, 10, generator=g).half()
    assert torch.equal(argmax_last(h), h.argmax(-1))
