"""The distillation prompt pool (build_prompts, magpie, templates, docs, self_instruct, dedup) and the target's
features on the pool's responses (prefill). Run as ``python -m experiments.distill.<name>``.
"""
