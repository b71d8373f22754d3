"""specdec_kernels/noise.py: per-row generators make a row's noise independent of the rest of the batch."""

import pytest
import torch

from specdec_kernels.noise import draw_exponential, draw_uniform


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("draw", [draw_uniform, draw_exponential])
def test_seeded_row_independent_of_batch(draw):
    alone = draw(1, 7, [gen(42)])
    # same seed, as row 2 of a bigger batch with other seeded and unseeded rows, list or mapping form
    batch = draw(4, 7, [None, gen(1), gen(42), None])
    mapped = draw(4, 7, {2: gen(42), 0: gen(5)})
    assert torch.equal(batch[2], alone[0])
    assert torch.equal(mapped[2], alone[0])
    assert not torch.equal(batch[1], alone[0])  # a different seed differs
    assert not torch.equal(batch[0], batch[3])  # unseeded rows get distinct noise


def test_shared_generator_for_unseeded_rows():
    a = draw_uniform(3, 5, None, generator=gen(7))
    b = draw_uniform(3, 5, [None, None, None], generator=gen(7))
    assert torch.equal(a, b)


def test_exponential_noise_is_exp1():
    e = draw_exponential(1, 200_000, [gen(0)])
    assert bool((e > 0).all())
    # Exp(1): mean 1, var 1; P(E > 1) = e^-1. 5-sigma bounds for 200k draws
    assert abs(float(e.mean()) - 1.0) < 5 / 200_000 ** 0.5
    assert abs(float((e > 1).float().mean()) - 0.36788) < 5 * (0.2325 / 200_000) ** 0.5


def test_generator_count_mismatch():
    with pytest.raises(ValueError, match="one entry per row"):
        draw_uniform(3, 2, [None, None])
    with pytest.raises(ValueError, match="row 5"):
        draw_uniform(3, 2, {5: gen(0)})
