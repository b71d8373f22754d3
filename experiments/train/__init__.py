"""Draft-head training, one Hydra app per script (``python -m experiments.train.<name> key=value ...``; the keys
and their defaults are conf/<name>.yaml): eagle, eagle3, medusa, mlp_speculator, tune_eagle_tree (EAGLE-2's
tree shape by replay) and gen_distill_data (the target's own responses). common.py holds what they share.
Each ``main`` is a thin wrapper around a plain ``run(cfg)`` that tests call with ``common.compose(name, [...])``.
"""
