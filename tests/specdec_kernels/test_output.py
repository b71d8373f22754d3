"""specdec_kernels/output.py: create_output places the accepted drafts, then the recovered token at the first
rejection or the bonus after k acceptances; num_accepted counts the accepted prefix."""

import torch

import specdec_kernels

OPS = specdec_kernels.get_ops("torch")
T = torch.tensor


def test_create_output_places_recovered_and_bonus():
    accepted = T([[True, True, True],  # all accepted -> bonus at position k
                  [True, False, True],  # first rejection at 1 -> recovered at 1; later True ignored
                  [False, True, True]])  # rejected at 0 -> recovered only
    drafts = T([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    recovered = T([70, 71, 72])
    bonus = T([90, 91, 92])
    out = OPS.create_output(accepted, drafts, recovered, bonus)
    assert torch.equal(out, T([[1, 2, 3, 90], [1, 71, -1, -1], [72, -1, -1, -1]]))
    assert torch.equal(OPS.num_accepted(accepted), T([3, 1, 0]))
