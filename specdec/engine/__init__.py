"""Model engines: a llama-family model over a per-slot KV cache, and the loaders that build them.

See :mod:`specdec.engine.interface` for the contract every engine (target or draft) meets.
"""

from specdec.engine.interface import ForwardBatch, ForwardOutput, ModelEngine

__all__ = ["ForwardBatch", "ForwardOutput", "ModelEngine"]
