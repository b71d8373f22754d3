"""Triton kernels vs their torch references on a GPU: rejection sampling, top-k/top-p, typical acceptance.

    python -m experiments.bench.triton_kernels [--quick] [--save-path DIR]

``triton.testing.perf_report`` over batch B (1..256), proposal length k (1..8) and vocabulary V (32,000
and 128,256), one table per (op, k, V) of GB/s per provider. GB/s counts the probability tensors read once
(rejection: target [B, k+1, V] + draft [B, k, V]; filters: logits [B*(k+1), V]; typical: target
[B, k+1, V]), whatever a provider actually reads, so the figures compare time against the same byte
count; the share of the memory-bandwidth limit divides by a measured device-to-device copy bandwidth
(read + write). The issue's target line is printed last: rejection sampling at B=64, k=4, V=128k within
2x of the time to read its probability tensors once.

Without a CUDA GPU it says so and exits 0: the kernels' correctness is tested on CPU under
TRITON_INTERPRET=1 (``pytest tests/specdec_kernels``), but interpreter timings mean nothing.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

BATCHES = [1, 4, 16, 64, 256]
KS = [1, 2, 4, 8]
VOCABS = [32_000, 128_256]  # Llama-2 and Llama-3 vocabularies


def copy_bandwidth_gbps(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy: bytes read + written per second, the practical memory-bandwidth limit."""
    import triton

    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def make_inputs(B: int, k: int, V: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    target = torch.softmax(torch.randn(B, k + 1, V, device="cuda", generator=g) * 3, dim=-1)
    draft = torch.softmax(torch.randn(B, k, V, device="cuda", generator=g) * 3, dim=-1)
    ids = torch.multinomial(draft.view(-1, V), 1, generator=g).view(B, k)
    uniform = torch.rand(B, k, device="cuda", generator=g)
    noise = -torch.rand(B, V, device="cuda", generator=g).log()
    return target, draft, ids, uniform, noise


def rejection_step(ops, target, draft, ids, uniform, noise):
    """What RejectionSampler does per step after drawing the noise: accept, first rejection, sample, place."""
    accepted = ops.rejection_accept(target, draft, ids, uniform)
    n = ops.num_accepted(accepted)
    final = ops.sample_recovered(target, draft, ids, n, noise)
    return ops.create_output(accepted, ids, final, final)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="B in {1, 64}, k in {4}: a smoke run")
    parser.add_argument("--save-path", default=None, help="also write CSV tables (and plots) there")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU and found none; nothing to measure here (the kernels' "
              "correctness runs on CPU: TRITON_INTERPRET=1 pytest tests/specdec_kernels).")
        return 0
    if os.environ.pop("TRITON_INTERPRET", "0") == "1":
        print("bench_kernels: ignoring TRITON_INTERPRET=1 (a GPU is present): timing compiled kernels.")
    import triton

    import specdec_kernels

    ops = {"torch": specdec_kernels.get_ops("torch"), "triton": specdec_kernels.get_ops("triton")}
    batches, ks = ([1, 64], [4]) if args.quick else (BATCHES, KS)
    limit = copy_bandwidth_gbps()
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth (read + write) {limit:.0f} GB/s")
    shares: dict[tuple, float] = {}

    def benchmarks(op: str):
        return [triton.testing.Benchmark(
            x_names=["B"], x_vals=batches, line_arg="provider", line_vals=["torch", "triton"],
            line_names=["torch", "triton"], styles=[("blue", "-"), ("green", "-")], ylabel="GB/s",
            plot_name=f"{op}-k{k}-V{V}", args={"k": k, "V": V}) for k in ks for V in VOCABS]

    def measure(name: str, B: int, k: int, V: int, provider: str, nbytes: int, fn) -> tuple[float, float, float]:
        ms, lo, hi = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8])
        gbps = lambda t: nbytes / t / 1e6  # noqa: E731
        shares[(name, B, k, V, provider)] = gbps(ms) / limit
        return gbps(ms), gbps(hi), gbps(lo)

    @triton.testing.perf_report(benchmarks("rejection"))
    def bench_rejection(B, k, V, provider):
        target, draft, ids, uniform, noise = make_inputs(B, k, V)
        nbytes = (target.numel() + draft.numel()) * target.element_size()
        return measure("rejection", B, k, V, provider, nbytes,
                       lambda: rejection_step(ops[provider], target, draft, ids, uniform, noise))

    @triton.testing.perf_report(benchmarks("top_k_top_p"))
    def bench_filters(B, k, V, provider):
        logits = torch.randn(B * (k + 1), V, device="cuda") * 3
        top_k = torch.full((B * (k + 1),), 50, device="cuda")
        top_p = torch.full((B * (k + 1),), 0.9, device="cuda")
        return measure("top_k_top_p", B, k, V, provider, logits.numel() * 4,
                       lambda: ops[provider].apply_top_k_top_p(logits, top_k, top_p))

    @triton.testing.perf_report(benchmarks("typical"))
    def bench_typical(B, k, V, provider):
        target, _, ids, _, _ = make_inputs(B, k, V)
        return measure("typical", B, k, V, provider, target.numel() * 4,
                       lambda: ops[provider].typical_accept(target, ids, 0.09, 0.3))

    for bench in (bench_rejection, bench_filters, bench_typical):
        bench.run(print_data=True, show_plots=False, save_path=args.save_path)
    print("\nshare of the copy-bandwidth limit (time to read the probability tensors once / time taken):")
    for (name, B, k, V, provider), share in sorted(shares.items()):
        print(f"  {name:12s} B={B:<4d} k={k} V={V:<7d} {provider:7s} {share:6.1%}")
    target_share = shares.get(("rejection", 64, 4, 128_256, "triton"))
    if target_share is not None:
        verdict = "met" if target_share >= 0.5 else "NOT met"
        print(f"target (rejection, B=64, k=4, V=128k, triton within 2x of one read): {1 / target_share:.2f}x "
              f"-> {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
