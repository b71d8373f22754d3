"""specdec_kernels/__init__.py: backend registry and dispatch through it."""

import dataclasses

import pytest
import torch

import specdec_kernels
from specdec.verify.chain import RejectionSampler


def test_unknown_backend_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown kernel backend 'cuda-magic'.*\['torch'"):
        specdec_kernels.get_ops("cuda-magic")
    with pytest.raises(ValueError, match="known"):
        RejectionSampler(kernel="nope")


def test_registered_backend_is_dispatched_to():
    calls = []
    torch_ops = specdec_kernels.get_ops("torch")

    def spy_greedy(target_argmax, draft_token_ids):
        calls.append(tuple(draft_token_ids.shape))
        return torch_ops.greedy_verify(target_argmax, draft_token_ids)

    specdec_kernels.register_ops("spy", lambda: dataclasses.replace(torch_ops, name="spy", greedy_verify=spy_greedy),
                         overwrite=True)
    try:
        assert "spy" in specdec_kernels.available_kernels()
        with pytest.raises(ValueError, match="already registered"):
            specdec_kernels.register_ops("spy", lambda: torch_ops)
        out = RejectionSampler(kernel="spy").forward_greedy(torch.tensor([[1, 2]]), torch.tensor([[1]]))
        assert out.tolist() == [[1, 2]] and calls == [(1, 1)]
    finally:
        specdec_kernels._LOADERS.pop("spy", None)
        specdec_kernels._CACHE.pop("spy", None)

