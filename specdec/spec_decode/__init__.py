"""Speculative decoding: config, the proposer plug-in contract, the registry, Top1Proposer and the worker.

A researcher's proposer subclasses :class:`specdec.spec_decode.proposer.Proposer` and only makes tokens;
the per-step edge cases (which rows draft, k, padding, row scatter, the batch-size cut-off) live once in
Top1Proposer, and one worker (worker.py) runs every step, chain or tree, propose -> score -> verify ->
commit. Every part is built through registry.py, from a name, an import path or an entry point.
"""
