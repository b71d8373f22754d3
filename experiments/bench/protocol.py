"""Encode + decode cost of one engine-core step's messages (specdec/v1/protocol.py) at batch 1/16/64.

    python -m experiments.bench.protocol [--iters 2000]

Per batch size: one EngineCoreOutputs per step (each request emitting k+1 = 3 tokens, scheduler stats with
per-position counters), and the ADD messages of that many requests (a 200-token prompt each). Compared
with the same structs declared without array_like/gc=False, so the options are measured, not assumed.
"""

from __future__ import annotations

import argparse
import gc
import time

import msgspec

from specdec.datamodel.sampling_params import SamplingParams
from specdec.v1 import protocol as P


def _plain_twin(cls: type, seen: dict) -> type:
    """``cls`` re-declared as a map-encoded, GC-tracked struct (the msgspec defaults)."""
    if cls in seen:
        return seen[cls]
    import typing

    hints = typing.get_type_hints(cls)
    fields = []
    for name in cls.__struct_fields__:
        t = hints[name]
        t = _swap(t, seen)
        fields.append((name, t))
    nreq = len(cls.__struct_fields__) - len(cls.__struct_defaults__)
    fields = [f if i < nreq else (f[0], f[1], cls.__struct_defaults__[i - nreq]) for i, f in enumerate(fields)]
    twin = msgspec.defstruct(cls.__name__ + "Map", fields, omit_defaults=True)
    seen[cls] = twin
    return twin


def _swap(t, seen):
    import typing

    if isinstance(t, type) and issubclass(t, msgspec.Struct) and t.__module__ == P.__name__:
        return _plain_twin(t, seen)
    args = typing.get_args(t)
    if not args:
        return t
    origin = typing.get_origin(t)
    new = tuple(_swap(a, seen) for a in args)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        return typing.Union[new]
    return origin[new]


def _to_dict(obj):
    if isinstance(obj, msgspec.Struct):
        return {k: _to_dict(v) for k, v in msgspec.structs.asdict(obj).items()}
    if isinstance(obj, list):
        return [_to_dict(v) for v in obj]
    return obj


def step_outputs(batch: int) -> P.EngineCoreOutputs:
    outs = [P.EngineCoreOutput(request_id=f"req-{i}", new_token_ids=[101 + i, 7, 42], num_draft_tokens=4,
                               num_accepted_tokens=2) for i in range(batch)]
    stats = P.SchedulerStats(num_running_reqs=batch, step_time=0.03, num_drafts=batch, num_draft_tokens=4 * batch,
                             num_accepted_tokens=2 * batch, num_accepted_tokens_per_pos=[batch, batch, 0, 0])
    return P.EngineCoreOutputs(outputs=outs, scheduler_stats=stats, timestamp=time.monotonic())


def add_requests(batch: int) -> list[P.EngineCoreRequest]:
    sp = SamplingParams(temperature=0.0, max_tokens=128)
    return [P.EngineCoreRequest(f"req-{i}", list(range(1000, 1200)), sp, time.time()) for i in range(batch)]


def time_roundtrip(obj, typ, iters: int) -> float:
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(typ)
    buf = enc.encode(obj)
    dec.decode(buf)
    t0 = time.perf_counter()
    for _ in range(iters):
        dec.decode(enc.encode(obj))
    return (time.perf_counter() - t0) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    seen: dict = {}
    Map = _plain_twin(P.EngineCoreOutputs, seen)
    gc.collect()
    print(f"{'batch':>5} {'step us (array_like,gc=False)':>30} {'step us (map)':>14} {'bytes':>7} {'bytes map':>9}"
          f" {'ADD us/req':>10}")
    for batch in (1, 16, 64):
        msg = step_outputs(batch)
        as_map = msgspec.convert(_to_dict(msg), Map)
        t_fast = time_roundtrip(msg, P.EngineCoreOutputs, args.iters)
        t_map = time_roundtrip(as_map, Map, args.iters)
        reqs = add_requests(batch)
        t_add = sum(time_roundtrip(r, P.EngineCoreRequest, max(1, args.iters // batch)) for r in reqs) / batch
        print(f"{batch:>5} {t_fast * 1e6:>30.2f} {t_map * 1e6:>14.2f} {len(P.encode(msg)):>7} "
              f"{len(msgspec.msgpack.encode(as_map)):>9} {t_add * 1e6:>10.2f}")


if __name__ == "__main__":
    main()
