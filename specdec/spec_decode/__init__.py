"""Speculative decoding: config, the proposer plug-in contract, the Top1Proposer wrapper and the worker.

A researcher's proposer subclasses :class:`specdec.spec_decode.proposer.Proposer` and only makes tokens;
the per-step edge cases (k per sequence, padding, batch-size cut-off) live once in Top1Proposer.
"""
