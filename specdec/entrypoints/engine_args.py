"""EngineArgs / AsyncEngineArgs: everything that builds an engine, as one plain record (after vLLM's).

``EngineArgs.add_cli_args(parser)`` adds one ``--flag`` per field; ``EngineArgs.from_cli_args(ns)`` reads
them back; ``create_llm()`` builds the :class:`specdec.entrypoints.llm.LLM` that owns the target, the worker and the
step loop. The record is plain data (msgspec), so it crosses to the engine-core process as it is.
Knows nothing about how an engine steps.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import msgspec


class EngineArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str = "smollm2-135m-instruct"  # engine model name, HF directory or .gguf path
    max_num_seqs: int = 8  # requests decoded together
    max_model_len: int = 2048  # prompt + output tokens per request
    dtype: str = "auto"  # bfloat16 where the CPU has bf16 arithmetic (AMX, AVX512_BF16), else float32
    seed: int = 0
    speculative_config: dict[str, Any] | None = None  # None: plain decoding
    spec_method: str | None = None  # alias of speculative_config["method"]
    spec_model: str | None = None  # alias of speculative_config["model"]
    spec_tokens: int | None = None  # alias of speculative_config["num_speculative_tokens"]
    num_threads: int | None = None  # torch intra-op threads in the engine; None = torch's default, less reserve_cores
    # cores the engine leaves to the rest of its process tree when num_threads is None (AsyncEngineArgs: 1, for the
    # server's front end: the forward's threads then never wait on a core the HTTP loop holds, #43 item 3)
    reserve_cores: int = 0
    # decode steps per scheduler decision (multi-step decoding, specdec/core/multi_step.py); 1 = every step
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        """Each field against its type (a Struct built in Python is not checked by msgspec): max_num_seqs="4" or
        reserve_cores="x" used to pass here and fail later, or never."""
        import typing

        for name, hint in typing.get_type_hints(type(self)).items():
            value = getattr(self, name)
            try:
                msgspec.convert(value, hint)
            except msgspec.ValidationError as e:
                raise TypeError(f"{type(self).__name__}: {name}={value!r:.60} is invalid: {e}") from None
        if self.reserve_cores < 0:
            raise ValueError(f"{type(self).__name__}: reserve_cores={self.reserve_cores} must be >= 0 (cores left to "
                             "the rest of the process tree)")

    def llm_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``LLM(model, ...)``: reserve_cores folded into num_threads."""
        kw = {f: getattr(self, f) for f in EngineArgs.__struct_fields__}
        reserve = kw.pop("reserve_cores")
        if kw["num_threads"] is None and reserve:
            kw["num_threads"] = max(1, torch_threads() - reserve)
        return kw

    def create_llm(self):
        from specdec.entrypoints.llm import LLM

        kw = self.llm_kwargs()
        return LLM(kw.pop("model"), **kw)

    @property
    def is_speculative(self) -> bool:
        spec = self.speculative_config or {}
        k = self.spec_tokens if self.spec_tokens is not None else spec.get("num_speculative_tokens", 1)
        return bool(spec or self.spec_method) and bool(k)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One ``--field-name`` per field (``--speculative-config`` takes JSON)."""
        defaults = cls()
        for name in cls.__struct_fields__:
            flag = "--" + name.replace("_", "-")
            default = getattr(defaults, name)
            if name == "speculative_config":
                parser.add_argument(flag, type=json.loads, default=default,
                                    help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
            elif isinstance(default, bool):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
            elif name in ("seed", "max_num_seqs", "max_model_len", "num_threads", "spec_tokens", "reserve_cores",
                          "num_scheduler_steps"):
                parser.add_argument(flag, type=int, default=default)
            elif isinstance(default, float):
                parser.add_argument(flag, type=float, default=default)
            else:
                parser.add_argument(flag, type=str, default=default)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace):
        return cls(**{f: getattr(args, f) for f in cls.__struct_fields__ if hasattr(args, f)})


class AsyncEngineArgs(EngineArgs, kw_only=True, forbid_unknown_fields=True):
    # True: the engine core runs in its own spawned process (ZeroMQ); False: in this process, stepped in a
    # worker thread (no hop; for tests and notebooks)
    multiprocess: bool = True
    reserve_cores: int = 1  # the engine core's process leaves one core to the server's front end (0: every core)

    def llm_kwargs(self) -> dict[str, Any]:
        # in this process (multiprocess=False) the front end steps the engine itself: no core to leave, and torch's
        # thread count is the caller's
        return EngineArgs.llm_kwargs(self if self.multiprocess else msgspec.structs.replace(self, reserve_cores=0))
    # seconds to wait for a spawned engine core to load its model and report ready
    startup_timeout_s: float = 300.0


def torch_threads() -> int:
    """The intra-op threads torch would use here (its default: the cores this process may run on), without
    importing torch."""
    import os

    n = os.environ.get("OMP_NUM_THREADS", "")
    return int(n) if n.isdigit() and int(n) > 0 else len(os.sched_getaffinity(0))
