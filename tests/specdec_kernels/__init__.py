"""Tests of specdec_kernels/, one module per torch op module (test_expand.py, test_greedy_verify.py,
test_kv_compact.py, test_noise.py, test_output.py, test_rejection.py, test_sampling_filters.py,
test_testing.py, test_tree.py, test_typical.py); specdec_kernels/__init__.py's backend registry is
test_kernel_registry.py (and test_transformers_compat.py for the package's import name).

The Triton backend (specdec_kernels/triton_ops/) is tested against those references by op family, because
several tests drive more than one launcher at once: test_triton_verify.py (greedy_verify, output,
rejection, typical), test_triton_tree.py (tree, kv_compact), test_triton_sampling.py (sampling_filters,
expand), test_triton_registry.py (triton_ops/__init__.py), test_triton_compile.py (every kernel compiles
for sm_90) and test_triton_lossless.py (end to end).
"""
