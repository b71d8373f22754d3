"""Sampling from target logits: ``sampler`` (one token per row, and the per-request tensors the verifiers
reuse), ``logits_process`` (the SamplingParams fields that reshape logits, at every scored position given its
drafted prefix) and ``logprobs`` (what a request's ``logprobs`` fields report, from the raw logits).
Knows nothing about models, KV caches or speculation's bookkeeping.
"""
