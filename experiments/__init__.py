"""The experiments around the library: ``train`` (draft-head training, Hydra apps), ``bench`` (benchmarks),
``distill`` (the distillation prompt pool and features), ``examples``; their dated results in LOG.md.

Run from the repository root as modules, e.g. ``python -m experiments.train.eagle data=... out=...`` or
``python -m experiments.bench.decode``. The library (specdec, proposers, scorers, specdec_kernels) never imports this
package.
"""
