"""specdec_kernels/expand.py: expand_per_token repeats each row's value (a fixed count or one count per row)."""

import pytest
import torch

import specdec_kernels

OPS = specdec_kernels.get_ops("torch")
T = torch.tensor


def test_expand_per_token():
    x = T([1.0, 2.0, 3.0])
    assert OPS.expand_per_token(x, 2).tolist() == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert OPS.expand_per_token(x, T([1, 0, 3])).tolist() == [1.0, 3.0, 3.0, 3.0]
    assert OPS.expand_per_token(x, 0).numel() == 0
    with pytest.raises(ValueError, match="one count per row"):
        OPS.expand_per_token(x, T([1, 2]))
