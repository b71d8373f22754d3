"""The "triton" backend: registered lazily (``import specdec_kernels`` imports neither torch nor triton), every op
a Triton launcher with its reference's signature, the interpreted mode announced once; and a ``gpu``
smoke test that runs the kernels natively where CUDA is present (``TRITON_INTERPRET=0 pytest -m gpu``)."""

import dataclasses
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import specdec_kernels

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=full_env)


def test_import_kernels_is_cheap():
    proc = run_python("import sys, specdec_kernels\n"
                      "print(sorted(m for m in ('torch', 'triton') if m in sys.modules), specdec_kernels.available_kernels())")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[] ['torch', 'triton']"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_triton_backend_without_gpu_runs_interpreted_and_says_so_once():
    proc = run_python("import logging, os; logging.basicConfig(level=logging.INFO)\n"
                      "import specdec_kernels\n"
                      "ops = specdec_kernels.get_ops('triton'); specdec_kernels.get_ops('triton')\n"
                      "import specdec_kernels.triton_ops.tree\n"
                      "print(os.environ['TRITON_INTERPRET'], ops.name)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "1 triton"
    assert proc.stderr.count("triton kernels run interpreted on CPU (no GPU)") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_interpreted_after_triton_was_imported_compiled():
    # e.g. the Hydra runner imports triton to check it is installed before get_ops("triton") runs
    proc = run_python("import triton, torch, specdec_kernels\n"
                      "from specdec_kernels.rejection import sample_recovered_ref\n"
                      "ops = specdec_kernels.get_ops('triton')\n"
                      "p = torch.softmax(torch.randn(3, 2, 50), -1); ids = torch.tensor([[4], [-1], [7]])\n"
                      "pos, e = torch.tensor([0, 0, 1]), -torch.rand(3, 50).log()\n"
                      "assert torch.equal(ops.sample_recovered(p, p[:, :1] * 0.5, ids, pos, e),\n"
                      "                   sample_recovered_ref(p, p[:, :1] * 0.5, ids, pos, e))\n"
                      "print(ops.greedy_verify(torch.tensor([[1, 2]]), torch.tensor([[1]])).tolist())")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[[1, 2]]"


def test_every_op_is_a_triton_launcher_with_the_reference_signature():
    ref, tri = specdec_kernels.get_ops("torch"), specdec_kernels.get_ops("triton")
    for field in dataclasses.fields(specdec_kernels.KernelOps):
        if field.name == "name":
            continue
        fn, ref_fn = getattr(tri, field.name), getattr(ref, field.name)
        assert fn.__module__.startswith("specdec_kernels.triton_ops."), field.name
        assert list(inspect.signature(fn).parameters) == list(inspect.signature(ref_fn).parameters), field.name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernels_on_gpu_match_reference():
    ref, tri = specdec_kernels.get_ops("torch"), specdec_kernels.get_ops("triton")
    g = torch.Generator(device="cuda").manual_seed(0)
    B, k, V = 37, 5, 50_001
    target = torch.softmax(torch.randn(B, k + 1, V, device="cuda", generator=g) * 3, -1)
    draft = torch.softmax(torch.randn(B, k, V, device="cuda", generator=g) * 3, -1)
    ids = torch.multinomial(draft.view(-1, V), 1, generator=g).view(B, k)
    u = torch.rand(B, k, device="cuda", generator=g)
    e = -torch.rand(B, V, device="cuda", generator=g).log()
    for q in (draft, None):
        acc = tri.rejection_accept(target, q, ids, u)
        assert torch.equal(acc, ref.rejection_accept(target, q, ids, u))
        n = tri.num_accepted(acc)
        assert torch.equal(tri.sample_recovered(target, q, ids, n, e), ref.sample_recovered(target, q, ids, n, e))
    logits = torch.randn(2 * (k + 1), V, device="cuda", generator=g) * 2
    top_k = torch.tensor([0, 50, 1, 7, 40_000, 3] * 2, device="cuda")
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.99, 0.3, 0.8] * 2, device="cuda")
    assert torch.equal(tri.apply_top_k_top_p(logits, top_k, top_p), ref.apply_top_k_top_p(logits, top_k, top_p))
    assert torch.equal(tri.typical_accept(target, ids, 0.09, 0.3), ref.typical_accept(target, ids, 0.09, 0.3))
    parents = torch.tensor([[-1, 0, 0, 1, 3, 2, 2]] * 3, device="cuda")
    tokens = torch.randint(0, 2, (3, 7), device="cuda", generator=g)
    argmax = torch.randint(0, 2, (3, 7), device="cuda", generator=g)
    assert torch.equal(tri.build_tree_mask(parents), ref.build_tree_mask(parents))
    for a, b in zip(tri.tree_greedy_accept(parents, tokens, argmax), ref.tree_greedy_accept(parents, tokens, argmax)):
        assert torch.equal(a, b)
    kc, vc = torch.randn(2, 2, 2, 32, 64, device="cuda"), torch.randn(2, 2, 2, 32, 64, device="cuda")
    k2, v2 = kc.clone(), vc.clone()
    src = torch.tensor([10, 12, 13, 17], device="cuda")
    tri.kv_compact(kc, vc, 1, src, 10)
    ref.kv_compact(k2, v2, 1, src, 10)
    assert torch.equal(kc, k2) and torch.equal(vc, v2)
