"""The plain baseline decoded once: its tokens cached by what determines them, its speed re-taken beside each run.

A sweep's jobs and later sweeps on the same machine decode the same prompts plainly with the same model,
dtype, kernels, sampling and code; the tokens are the same every time (greedy; a seeded sampler too), so
they are decoded once and kept under ``$SPECDEC_CACHE/baselines/<key>.json`` (and ``baseline.json`` in the
run directory that decoded them). What cannot be cached is the speed: the machine's load drifts between jobs.
So each job re-measures plain decoding beside its own speculative decoding, prompt by prompt and interleaved:
a short plain decode of each turn (``baseline_remeasure_tokens`` tokens, the first ones of the cached
output) gives this moment's prefill time and time per token, and the turn's plain seconds are estimated as
``ttft + (n - 1) * tpot`` for the cached turn's n tokens (exact when n is within the re-measure).

``baseline: auto`` (default) uses a matching cache entry or decodes and stores one; ``fresh`` always
decodes (and stores); ``baseline=RUN_DIR`` reads that run's ``baseline.json`` and refuses it, naming the
fields, if it was decoded under another key. A file lock makes concurrent jobs of one sweep (joblib) wait
for the job that is decoding the baseline instead of decoding it twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import msgspec

log = logging.getLogger("specdec.baseline")
CODE_ROOT = Path(__file__).resolve().parents[1]  # specdec/: whatever it holds decides the plain tokens


class TurnOutput(msgspec.Struct):
    token_ids: list[int]
    text: str
    seconds: float  # the plain decode's wall time when it was decoded (informative: timings are re-taken)


class CachedBaseline(msgspec.Struct, kw_only=True):
    key: str
    fields: dict[str, Any]  # what the key hashes (to name the difference when a named run does not match)
    created: str
    questions: dict[str, list[TurnOutput]]  # question_id -> its turns in order


@functools.cache
def code_version() -> str:
    """A hash of specdec's sources (.py, .cpp): a change to any of them may change the plain tokens. Taken once
    per process (the code this process runs, not files edited since it started)."""
    h = hashlib.sha256()
    for p in sorted(CODE_ROOT.rglob("*")):
        if p.suffix in (".py", ".cpp", ".h") and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(CODE_ROOT)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def key_fields(rc, engine: dict[str, str], prompts) -> dict[str, Any]:
    """Everything that decides the plain tokens: model, dtype and kernels as built, the CPU's ISA, the prompts
    (their text), sampling, turns, context length, seed and the code."""
    prompts_hash = hashlib.sha256(msgspec.json.encode([(p.question_id, p.category, p.turns) for p in prompts]))
    return {
        "model": rc.model.name, "dtype": engine.get("dtype"), "kernels": engine.get("kernels"),
        "cpu_capability": engine.get("cpu_capability"), "dataset": rc.dataset,
        "prompts": prompts_hash.hexdigest()[:16], "sampling": msgspec.to_builtins(rc.sampling), "turns": rc.turns,
        "max_model_len": rc.max_model_len, "seed": rc.seed, "code": code_version(),
    }


def key_of(fields: dict[str, Any]) -> str:
    return hashlib.sha256(msgspec.json.encode(fields, order="sorted")).hexdigest()[:20]


def cache_dir() -> Path:
    """``$SPECDEC_BASELINE_CACHE``, else ``baselines/`` in specdec's cache (``$SPECDEC_CACHE``, ~/.cache/specdec)."""
    from specdec.engine.paths import cache_root

    return Path(os.environ.get("SPECDEC_BASELINE_CACHE") or cache_root() / "baselines")


class Baseline:
    """Where the plain baseline of a run comes from. ``cached`` is None while it is being decoded (then
    :meth:`record` collects the turns and :meth:`store` writes them)."""

    def __init__(self, fields: dict[str, Any], cached: CachedBaseline | None, source: str,
                 remeasure_tokens: int) -> None:
        self.fields, self.key, self.cached, self.source = fields, key_of(fields), cached, source
        self.remeasure_tokens = remeasure_tokens
        self.decoded: dict[str, list[TurnOutput]] = {}
        self._lock: Any = None

    def turn(self, question_id: str, index: int) -> TurnOutput | None:
        """The cached turn (None: decode it)."""
        if self.cached is None:
            return None
        turns = self.cached.questions.get(question_id)
        if turns is None or index >= len(turns):
            raise ValueError(f"baseline {self.source}: question {question_id!r} turn {index + 1} is not in the cached "
                             "baseline; decode it again with baseline=fresh")
        return turns[index]

    def record(self, question_id: str, turn: TurnOutput) -> None:
        self.decoded.setdefault(question_id, []).append(turn)

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "key": self.key,
                "remeasure_tokens": self.remeasure_tokens if self.cached is not None else None}

    def store(self, run_dir: Path) -> Path | None:
        """Write what was decoded to the run dir and the cache (atomically); releases the lock."""
        try:
            if self.cached is not None or not self.decoded:
                return None
            entry = CachedBaseline(key=self.key, fields=self.fields, created=time.strftime("%Y-%m-%dT%H:%M:%S"),
                                   questions=self.decoded)
            data = msgspec.json.encode(entry)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "baseline.json").write_bytes(data)
            path = cache_dir() / f"{self.key}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
            log.info("plain baseline decoded once and cached: %s (and %s)", path, run_dir / "baseline.json")
            return path
        finally:
            self.release()

    def release(self) -> None:
        if self._lock is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock, fcntl.LOCK_UN)
                self._lock.close()
            self._lock = None


def _read(path: Path) -> CachedBaseline:
    try:
        return msgspec.json.decode(path.read_bytes(), type=CachedBaseline)
    except (OSError, msgspec.DecodeError) as e:
        raise ValueError(f"baseline {path}: cannot read it ({e}); use baseline=fresh to decode the baseline again") from e


def open_baseline(spec: str, fields: dict[str, Any], remeasure_tokens: int) -> Baseline:
    """``spec``: ``auto`` | ``fresh`` | a run directory (or its baseline.json)."""
    if remeasure_tokens < 2:
        raise ValueError(f"baseline_remeasure_tokens={remeasure_tokens}: at least 2 (a prefill and one decode step "
                         "give the time per token)")
    key = key_of(fields)
    if spec not in ("auto", "fresh"):
        path = Path(spec)
        path = path / "baseline.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"baseline={spec!r}: no baseline.json there; name the run directory of a run that decoded "
                             "its baseline, or use baseline=auto (the cache) or baseline=fresh")
        cached = _read(path)
        if cached.key != key:
            diff = sorted(k for k in set(fields) | set(cached.fields) if fields.get(k) != cached.fields.get(k))
            raise ValueError(f"baseline={spec!r} was decoded with other settings: {diff} differ "
                             f"({ {k: cached.fields.get(k) for k in diff} } there, { {k: fields.get(k) for k in diff} } "
                             "here); use baseline=auto or fresh")
        log.info("plain baseline: tokens from %s (decoded %s); plain speed re-measured on %d tokens per turn",
                 path, cached.created, remeasure_tokens)
        return Baseline(fields, cached, str(path), remeasure_tokens)
    path = cache_dir() / f"{key}.json"
    base = Baseline(fields, None, "decoded", remeasure_tokens)
    if spec == "auto":
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "w")  # noqa: SIM115 - held until store() or release()
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("plain baseline %s is being decoded by another job; waiting for it", key)
            fcntl.flock(lock, fcntl.LOCK_EX)
        base._lock = lock
        if path.is_file():
            cached = _read(path)
            base.release()
            log.info("plain baseline: cache hit %s (decoded %s), not decoded again; plain speed re-measured on %d "
                     "tokens per turn", path, cached.created, remeasure_tokens)
            return Baseline(fields, cached, f"cache:{path}", remeasure_tokens)
    log.info("plain baseline: decoding it (key %s)", key)
    return base
