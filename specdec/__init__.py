"""specdec: a speculative-decoding research framework.

Vocabulary (used everywhere in this code base, written once here):

- **k** (``num_speculative_tokens``): draft tokens proposed per sequence per step; 0 = no speculation.
- **proposal**: the draft tokens of one step (+ the draft's probabilities where it has them): a token tree
  hanging off the pending token; a chain of k is the tree whose parents are i-1.
- **features**: the target's hidden states a proposer reads (its ``FeatureSpec``), threaded to it in
  ``HiddenStates``.
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

The public entry points (after the seed's ``vllm`` package):

- offline: :class:`LLM`, :class:`SamplingParams`, :class:`LLMEngine` (the step loop);
- online: :class:`AsyncLLMEngine` (``async for out in engine.generate(prompt, params, request_id)``) over
  an engine core in its own process (``specdec.v1``), and ``python -m specdec.serve`` (OpenAI API);
- :class:`EngineArgs` / :class:`AsyncEngineArgs` (``EngineArgs.add_cli_args(parser)``);
- outputs and inputs: :class:`RequestOutput`, :class:`CompletionOutput`, :class:`TextPrompt`,
  :class:`TokensPrompt`.
"""

from __future__ import annotations

import importlib
import os

# OpenMP threads spin briefly, then block, between the CPU kernels' phases (#43). Blocking at once cost 2x on a
# quiet one-token forward (19.9 vs 10.0 ms, 2-core Zen 4: a wake-up per barrier); spinning without end made it
# ~100x slower beside one busy process on an Intel box. A short spin keeps the quiet speed, and
# engine/cpu/threads.py takes a thread away while another process wants the cores. libgomp reads these once,
# when torch loads it, so they are set here, before any torch import; GOMP_SPINCOUNT takes precedence over the
# policy (0: block at once; 300000: libgomp's own default spin).
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

__version__ = "0.1.0"

# name -> module; imported on first use: `import specdec` stays cheap (no torch/transformers until needed)
_EXPORTS = {
    "LLM": "specdec.entrypoints.llm",
    "SamplingParams": "specdec.datamodel.sampling_params",
    "LLMEngine": "specdec.core.llm_engine",
    "AsyncLLMEngine": "specdec.v1.async_engine",
    "EngineArgs": "specdec.entrypoints.engine_args",
    "AsyncEngineArgs": "specdec.entrypoints.engine_args",
    "RequestOutput": "specdec.datamodel.outputs",
    "CompletionOutput": "specdec.datamodel.outputs",
    "TextPrompt": "specdec.datamodel.inputs",
    "TokensPrompt": "specdec.datamodel.inputs",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
