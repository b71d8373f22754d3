"""Tests of specdec/spec_decode/, one module per source module: test_builder.py, test_config.py,
test_draft_sampling.py, test_proposer.py, test_registry.py, test_top1_proposer.py, test_worker.py.

The cross-module suite lives here too: end-to-end proofs through ``LLM`` that span proposers, scorers,
verifiers and the worker at once, so no single source module owns them:
- test_greedy_equality.py: every proposer x scorer is token-identical to plain greedy decoding;
- test_sampling_lossless.py (and test_processors_lossless.py): speculative sampling follows the target;
- test_tree_e2e.py: tree speculation (scorer="tree") end to end;
- test_acceptance_theory.py: measured acceptance matches alpha-theory;
- test_greedy_matrix_smollm2.py (slow): greedy equality on the real model, fp32 and bf16.
helpers.py holds what they share (assert_greedy_equal with the logit-gap report, noisy targets, a
corrupted-greedy proposer); my_proposer.py is the researcher's plug-in of test_registry.py.
"""
