"""Every Triton kernel compiles for an H100 (sm_90, PTX and cubin via the ptxas bundled with triton), with
no GPU present: the CPU interpreter accepts code the compiler rejects (types of loop-carried values,
constexpr branches, 3-D tiles), so this is CI's check that ``kernel=triton`` builds on a GPU. One variant
per kernel (the constexpr flags that change the code are covered); compiled kernels land in Triton's
cache, so only a first run pays (~15 s of CPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import os
os.environ.pop("TRITON_INTERPRET", None)
import torch
torch.cuda.is_available = lambda: True  # compile, never launch: specdec_kernels.triton_ops must not pick the interpreter
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specdec_kernels.triton_ops import expand, greedy_verify, kv_compact, output, rejection, sampling_filters, tree, typical

def build(fn, types, consts):
    names = fn.arg_names
    sig = {{n: "constexpr" if n in consts else types.get(n, "i32") for n in names}}
    triton.compile(ASTSource(fn, sig, {{(names.index(k),): v for k, v in consts.items()}}),
                   target=GPUTarget("cuda", 90, 32))

I64, F32 = "*i64", "*fp32"
build(greedy_verify._greedy_verify_kernel, dict(argmax_ptr=I64, draft_ptr=I64, out_ptr=I64),
      dict(BLOCK_B=64, BLOCK_K=8))
build(output._num_accepted_kernel, dict(acc_ptr="*i1", out_ptr=I64), dict(BLOCK_B=64, BLOCK_K=8))
build(output._create_output_kernel, dict(acc_ptr="*i1", draft_ptr=I64, rec_ptr=I64, bonus_ptr=I64, out_ptr=I64),
      dict(BLOCK_B=64, BLOCK_K=8))
build(rejection._rejection_accept_kernel, dict(p_ptr=F32, q_ptr=F32, ids_ptr=I64, u_ptr=F32, out_ptr="*i1"),
      dict(HAS_Q=True, BLOCK=1024))
build(rejection._recovered_partial_kernel, dict(p_ptr="*bf16", q_ptr="*bf16", ids_ptr=I64, pos_ptr=I64, e_ptr=F32,
      val_ptr=F32, idx_ptr="*i32"), dict(HAS_Q=False, SPLIT=8192, BLOCK_B=1, BLOCK_V=4096))
build(rejection._recovered_combine_kernel, dict(val_ptr=F32, idx_ptr="*i32", out_ptr=I64),
      dict(BLOCK_B=256, BLOCK_S=16))
build(typical._typical_accept_kernel, dict(p_ptr=F32, ids_ptr=I64, out_ptr="*i1", posterior_threshold="fp32",
      posterior_alpha="fp32"), dict(EPS=1e-5, BLOCK_R=1, BLOCK_V=4096))
build(expand._expand_kernel, dict(x_ptr=F32, counts_ptr=I64, starts_ptr=I64, out_ptr=F32),
      dict(HAS_COUNTS=True, BLOCK_D=16))
build(sampling_filters._temperature_kernel, dict(x_ptr=F32, t_ptr=F32, out_ptr=F32), dict(BLOCK_N=1, BLOCK_V=4096))
build(sampling_filters._top_k_top_p_kernel, dict(x_ptr="*fp16", k_ptr=I64, p_ptr=F32, out_ptr="*fp16"),
      dict(HAS_K=True, HAS_P=True, KEY_MIN=-2**31, KEY_END=2**31, RADIX=16, PASSES=8, BLOCK_N=1, BLOCK_V=256))
build(sampling_filters._min_p_kernel, dict(x_ptr=F32, minp_ptr=F32, out_ptr=F32), dict(BLOCK_N=1, BLOCK_V=4096))
build(tree._tree_mask_kernel, dict(parents_ptr=I64, out_ptr="*i1"), dict(BLOCK_I=64, BLOCK_J=64))
build(tree._tree_greedy_kernel, dict(parents_ptr=I64, tokens_ptr=I64, argmax_ptr=I64, path_ptr=I64, out_ptr=I64),
      dict(BLOCK_N=64))
build(kv_compact._kv_compact_kernel, dict(k_ptr="*bf16", v_ptr="*bf16", src_ptr=I64), dict(BLOCK_N=8, BLOCK_D=128))
print("OK")
"""


def test_every_kernel_compiles_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format()], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})  # our kernels package, from ROOT
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
