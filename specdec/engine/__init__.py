"""Model engines: a llama-family model over a per-slot KV cache, and the loaders that build them.

See :mod:`specdec.engine.interface` for the contract every engine (target or draft) meets.
"""

from specdec.engine.config import ModelConfig
from specdec.engine.interface import ForwardBatch, ForwardOutput, ModelEngine
from specdec.engine.kv_cache import SlotKVCache
from specdec.engine.llama import Llama
from specdec.engine.loader import KNOWN_MODELS, load_engine, load_tokenizer, model_info
from specdec.engine.native import NativeEngine
from specdec.engine.tiny import tiny_random_llama, tiny_random_llama_hf, tiny_tokenizer, to_hf_model

__all__ = [
    "KNOWN_MODELS",
    "ForwardBatch",
    "ForwardOutput",
    "Llama",
    "ModelConfig",
    "ModelEngine",
    "NativeEngine",
    "SlotKVCache",
    "load_engine",
    "load_tokenizer",
    "model_info",
    "tiny_random_llama",
    "tiny_random_llama_hf",
    "tiny_tokenizer",
    "to_hf_model",
]
