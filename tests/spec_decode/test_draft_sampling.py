"""specdec/spec_decode/draft_sampling.py: the draft sampler every proposer shares. Greedy rows take the
argmax; the others draw from q = the processed distribution and return it; a seeded row's draw depends
only on its generator; the draws follow q (chi-square); the kernel choice is honoured; greedy rows never
advance a generator (greedy_free)."""

import pytest
import torch

from specdec_kernels.testing import chi_square_pvalue, counts_of
from specdec.sampling.sampler import SamplingTensors, make_generators
from specdec.datamodel.sampling_params import SamplingParams as SP
from specdec.spec_decode.draft_sampling import greedy_free, sample_draft

V = 8


def logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 2


def test_all_greedy_is_the_argmax_and_no_q():
    x = logits(3)
    params = [SP(temperature=0.0)] * 3
    tok, q = sample_draft(x.half(), SamplingTensors.from_params(params), [None] * 3)  # any float dtype
    assert q is None and torch.equal(tok, x.half().float().argmax(-1))


def test_mixed_batch_greedy_rows_are_one_hot_and_random_rows_return_the_processed_q():
    x = logits(3, seed=1)
    params = [SP(temperature=0.0), SP(temperature=0.7, top_k=3, seed=1), SP(temperature=1.0, seed=2)]
    st = SamplingTensors.from_params(params)
    tok, q = sample_draft(x, st, greedy_free(params, make_generators(params)))
    torch.testing.assert_close(q, st.to_probs(x))  # exactly the law the verifier will be told
    assert tok[0] == x[0].argmax() and q[0, tok[0]] == 1 and q[0].sum() == 1  # one-hot at the argmax
    assert ((q[1] > 0).sum() == 3) and q[1, tok[1]] > 0  # top-k 3, and the draw lies in its support
    assert q[2, tok[2]] > 0


def test_a_seeded_rows_draw_does_not_depend_on_the_batch():
    x = logits(4, seed=2)
    params = [SP(temperature=1.0, seed=7), SP(temperature=0.9), SP(temperature=0.0), SP(temperature=1.2, seed=3)]
    st = SamplingTensors.from_params(params)
    alone = [sample_draft(x[i:i + 1], SamplingTensors.from_params([params[i]]), make_generators([params[i]]))[0]
             for i in (0, 3)]
    both = sample_draft(x, st, greedy_free(params, make_generators(params)))[0]
    assert both[0] == alone[0][0] and both[3] == alone[1][0]


def test_draws_follow_q():
    """20k rows of the same logits (temperature 0.8, top-p 0.9), shared generator: the tokens' law is q."""
    n = 20_000
    x = logits(1, seed=3).expand(n, V)
    st = SamplingTensors.from_params([SP(temperature=0.8, top_p=0.9)] * n)
    torch.manual_seed(4)
    tok, q = sample_draft(x, st, [None] * n)
    pval = chi_square_pvalue(counts_of(tok, V), q[0].double())
    assert pval > 1e-3, f"chi-square p-value {pval:.2e}"


def test_the_kernel_choice_is_honoured():
    pytest.importorskip("triton")
    x = logits(4, seed=5)
    params = [SP(temperature=0.0), SP(temperature=0.7, top_k=3, seed=1), SP(temperature=1.0, top_p=0.8, seed=2),
              SP(temperature=1.3, min_p=0.05, seed=3)]
    st = SamplingTensors.from_params(params)
    out = {kn: sample_draft(x, st, greedy_free(params, make_generators(params)), kernel=kn)
           for kn in ("torch", "triton")}
    assert torch.equal(out["torch"][0], out["triton"][0])
    torch.testing.assert_close(out["torch"][1], out["triton"][1])
    with pytest.raises(ValueError, match="no_such_backend"):
        sample_draft(x, st, [None] * 4, kernel="no_such_backend")


def test_greedy_free_drops_the_generators_of_greedy_rows():
    g1, g2 = torch.Generator(), torch.Generator()
    params = [SP(temperature=0.0, seed=1), SP(temperature=0.5, seed=2), SP(temperature=0.0)]
    assert greedy_free(params, [g1, g2, None]) == [None, g2, None]
