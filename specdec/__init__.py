"""specdec: a speculative-decoding research framework.

Vocabulary (used everywhere in this code base, written once here):

- **k** (``num_speculative_tokens``): draft tokens proposed per sequence per step; 0 = no speculation.
- **proposal**: the k draft token ids (+ the draft's probabilities where it has them).
- **accepted**: draft tokens the verifier keeps (a prefix of the proposal, or a path in a tree).
- **recovered**: the token the verifier samples at the first rejected position, from
  ``norm(max(p - q, 0))``.
- **bonus**: the extra token sampled from the target at position k+1 when all k drafts are accepted.
- **emitted**: accepted + (recovered or bonus) = 1 .. k+1 tokens per step.
- **tau, mean acceptance length**: emitted tokens / steps, bonus included (1.0 = plain decoding).
- **acceptance rate**: accepted / proposed draft tokens.
- **spec_token_acceptance_counts** (in ``RequestMetrics``): one counter per position 0..k; position 0
  is the target's own token and counts every step; ``[10, 8, 4, 2]`` = 10 steps, 8 steps accepted the
  1st draft, 4 the 2nd, 2 the 3rd.

The public entry points are :class:`specdec.llm.LLM` and :class:`specdec.sampling_params.SamplingParams`.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy: `import specdec` stays cheap and does not import torch/transformers until needed.
    if name == "LLM":
        from specdec.llm import LLM

        return LLM
    if name == "SamplingParams":
        from specdec.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
