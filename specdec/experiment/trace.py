"""Token traces: what every step of a run proposed, what the target said, what was kept (issue #15).

``python -m specdec.run ... trace=true`` installs a :class:`Tracer` on the worker's observers (read-only
hooks, specdec/core/plain_worker.py) and writes ``trace/`` beside summary.json; ``load_trace(dir)`` reads it back and
``specdec.experiment.replay`` reruns any drafter against it. Parquet through pyarrow, so
``pandas.read_parquet("<run>/trace/steps.parquet")`` reads any table too.

Schema (version 1; positions are token indices in prompt + output, 0-based; ids int32)
- ``requests.parquet``, one row per request (a turn of a question):
  request_id, question_id, category, turn; prompt_ids list; output_ids list (what the request emitted,
  after its stop); target_ids list (every token the worker produced, in order: output_ids then, when the
  last step ran past the stop, the target's greedy tokens there: ``trace_lookahead`` of them, decoded
  plainly after the request, else the rest of that step's tokens);
  finish_reason; temperature, top_p, top_k, min_p, seed, max_tokens; acceptance_counts list (the
  request's spec_token_acceptance_counts, empty when plain).
- ``steps.parquet``, one row per worker step of a request: request_id, step (0 = the prefill), kind
  (prefill | decode | spec), position (the pending token's index: the step predicts position + 1 on),
  draft_ids / draft_parents lists (the proposal's nodes; parents -1 = the pending token, a chain's are
  i-1), target_ids list (num nodes + 1: the target's argmax after the pending token and after each node),
  draft_target_probs list or null (T > 0: the target's processed probability of each node's token after
  its parent), accepted (drafts on the accepted path), path list (accepted node indices, root excluded),
  emitted list (the tokens the worker produced: accepted drafts then one target token), final_token,
  bonus (the path ended at a leaf: the final token is the bonus token), chosen (spec steps: the speculation
  policy's k, or a tree's node budget, for the request that step; the proposal has at most that many nodes;
  0 on a decode step that a speculative run took plainly, the policy having chosen 0 for every row; null on
  prefills, in plain runs and in traces recorded before it existed).
- ``features.parquet`` (``trace_features=true``): request_id, position, feature (fixed-size list of
  ``trace_features_dtype``): the target's hidden state of every committed token (not the last pending
  one) in ``meta.json``'s ``feature_layers`` (() = the last layer after the final norm, EAGLE-1/Medusa).
- ``topn.parquet`` (T > 0): request_id, position, ids, probs: the target's N most probable next tokens
  after each committed position, from its processed distribution (the verifier's p), and their p.
- ``meta.json``: schema_version, model, dtype, max_model_len, vocab_size, seed, feature_layers,
  feature_size, features_dtype, top_n, speculative_config, the run's config; cost_table (speculative runs whose
  policy measured one: the engine's step costs as the run ended, specdec/spec_decode/cost_model.py).

Knows nothing about proposers, verification rules or Hydra: it records what the worker shows it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

SCHEMA_VERSION = 1
TRACE_DIR = "trace"
META_KEYS = ("model", "dtype", "max_model_len", "vocab_size")  # what a replay reads of meta.json, at least
REQUEST_COLUMNS = ("request_id", "prompt_ids", "output_ids", "target_ids")
_FEATURE_DTYPES = {"float16": (torch.float16, np.float16), "float32": (torch.float32, np.float32)}


@dataclass
class _Request:
    prompt_ids: list[int]
    params: Any  # SamplingParams
    target_ids: list[int] = field(default_factory=list)
    steps: int = 0
    feats: list[torch.Tensor] = field(default_factory=list)  # [n_i, F] chunks, positions in order
    next_feat: int = 0  # the position the next feature row is for
    top_pos: list[int] = field(default_factory=list)
    top_ids: list[np.ndarray] = field(default_factory=list)  # [N] int32 per position
    top_probs: list[np.ndarray] = field(default_factory=list)  # [N] float32
    label: dict[str, Any] | None = None  # question_id, category, turn, output_ids, finish_reason, counts


class Tracer:
    """A read-only observer of a PlainWorker / SpecDecodeWorker (``worker.observers``)."""

    def __init__(self, features: bool = False, features_dtype: str = "float16", top_n: int = 32,
                 lookahead: int = 0, llm=None) -> None:
        if features_dtype not in _FEATURE_DTYPES:
            raise ValueError(f"Tracer: trace_features_dtype={features_dtype!r}; one of {sorted(_FEATURE_DTYPES)} "
                             "(float32 keeps replay of feature-reading heads bit-exact)")
        if top_n < 1:
            raise ValueError(f"Tracer: trace_top_n={top_n} must be >= 1")
        self.features = features
        self.features_dtype = features_dtype
        self.top_n = top_n
        self.reqs: dict[str, _Request] = {}
        self.rows: list[dict[str, Any]] = []  # steps table, row by row
        self.feature_size = 0
        self.lookahead = lookahead  # greedy: the target's tokens recorded past each request's stop
        self.llm = llm  # where the continuation past the stop is decoded (a plain twin of it)
        self._plain = None
        self.tail_mismatches = 0  # continuations that disagreed with the last step's own tokens past the stop
        self.worker = None  # the traced worker (install): a speculative one's cost table is written to meta.json

    # ------------------------------------------------------------------ observer hooks
    def plain_step(self, metas, logits: torch.Tensor,  # [B, V] raw, each group's last fed row
                   features: torch.Tensor,  # [T, F] every fed token's row
                   qlens: list[int], out) -> None:
        start = 0
        # a speculative worker's decode step that ran plainly: its policy chose 0 for every row (spec_decode_worker)
        spec = getattr(self.worker, "policy", None) is not None
        for b, meta in enumerate(metas):
            data = meta.first_seq_data()
            if meta.is_prompt:
                self.reqs[meta.request_id] = _Request(list(data.get_prompt_token_ids()), meta.sampling_params)
            req = self.reqs[meta.request_id]
            n = qlens[b]
            pos = data.get_len() - 1  # the last fed token
            gout = out.outputs[b]
            self._keep(req, features[start: start + n], pos - n + 1)
            self._top(req, logits[b: b + 1], [pos])
            start += n
            self._row(meta.request_id, req, "prefill" if meta.is_prompt else "decode", pos, [], [],
                      logits[b: b + 1].argmax(-1).tolist(), None, [], gout.token_ids, False,
                      0 if spec and not meta.is_prompt else None)

    def spec_step(self, metas, proposals, scores, verdict, out) -> None:
        from specdec.verify.tree import ends_at_leaf

        leaf = ends_at_leaf(proposals, verdict).tolist()
        argmax = scores.logits.argmax(-1).tolist()  # [B, N+1]
        n_acc = verdict.num_accepted.tolist()
        for b, meta in enumerate(metas):
            req = self.reqs[meta.request_id]
            data = meta.first_seq_data()
            pos = data.get_len() - 1  # the pending token
            n, a = int(proposals.num_nodes[b]), n_acc[b]
            path = verdict.path[b, : a + 1]  # root-inclusive
            drafts = proposals.token_ids[b, :n].tolist()
            parents = proposals.parents[b, :n].tolist()
            p_draft = None
            if not req.params.greedy:
                probs = self._probs(scores.logits[b], req.params)  # [N+1, V] processed
                par = torch.tensor(parents, dtype=torch.long) + 1
                p_draft = probs[par, torch.tensor(drafts, dtype=torch.long)].tolist() if n else []
                self._top(req, None, list(range(pos, pos + a + 1)), probs[path])
            self._keep(req, scores.hidden_states[b, path], pos)
            self._row(meta.request_id, req, "spec", pos, drafts, parents, argmax[b][: n + 1], p_draft,
                      (path[1:] - 1).tolist(), out.outputs[b].token_ids, bool(leaf[b]), out.outputs[b].num_chosen)

    # ------------------------------------------------------------------ run.py's side
    def label(self, output, question_id: str, category: str, turn: int) -> None:
        """The request finished (a RequestOutput): its question, category, turn and emitted tokens."""
        req = self.reqs.get(output.request_id)
        if req is None:
            raise KeyError(f"Tracer.label: request {output.request_id} was never seen by the tracer; install it "
                           "on the worker that runs the request (specdec.experiment.trace.install)")
        comp = output.outputs[0]
        counts = list(output.metrics.spec_token_acceptance_counts or []) if output.metrics is not None else []
        req.label = dict(question_id=str(question_id), category=str(category), turn=turn,
                         output_ids=list(comp.token_ids), finish_reason=comp.finish_reason, acceptance_counts=counts)
        if req.params.greedy and self.lookahead > 0 and self.llm is not None and comp.token_ids:
            more = self._continue(req.prompt_ids + list(comp.token_ids))
            tail = req.target_ids[len(comp.token_ids):]
            n = min(len(tail), len(more))
            if tail[:n] != more[:n]:
                self.tail_mismatches += 1
            if len(more) >= len(tail):
                req.target_ids = list(comp.token_ids) + more

    def _continue(self, ids: list[int]) -> list[int]:
        """The target's next ``lookahead`` greedy tokens after ``ids`` (EOS ignored), decoded plainly on a twin
        of the traced LLM (its own counters and workers; the traced run's figures do not see it). A replayed
        drafter's last step compares its drafts with them, as the live verifier compares them with the
        target's argmax past the stop."""
        from specdec.datamodel.sampling_params import SamplingParams

        if self._plain is None:
            self._plain = self.llm.without_speculation()
        n = min(self.lookahead, self._plain.llm_engine.max_model_len - len(ids) - 1)
        if n < 1:
            return []
        out = self._plain.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=n, temperature=0.0,
                                   ignore_eos=True), use_tqdm=False)[0]
        return list(out.outputs[0].token_ids)

    # ------------------------------------------------------------------ recording
    def _row(self, rid, req, kind, pos, drafts, parents, target_ids, p_draft, path, emitted, bonus,
             chosen: int | None = None) -> None:
        self.rows.append(dict(request_id=rid, step=req.steps, kind=kind, position=pos, draft_ids=drafts,
                              draft_parents=parents, target_ids=target_ids, draft_target_probs=p_draft,
                              accepted=len(path), path=path, emitted=list(emitted),
                              final_token=emitted[-1] if emitted else -1, bonus=bonus, chosen=chosen))
        req.steps += 1
        req.target_ids.extend(emitted)

    def _keep(self, req: _Request, rows: torch.Tensor,  # [n, F] features of positions first, first+1, ...
              first: int) -> None:
        if not self.features:
            return
        if first != req.next_feat:
            raise RuntimeError(f"Tracer: feature rows start at position {first} but position {req.next_feat} was "
                               "expected next; a step was not shown to the tracer")
        req.feats.append(rows.detach().to("cpu", _FEATURE_DTYPES[self.features_dtype][0]))
        req.next_feat += rows.shape[0]
        self.feature_size = rows.shape[-1]

    @staticmethod
    def _probs(logits: torch.Tensor, params) -> torch.Tensor:  # [M, V] raw -> [M, V] the verifier's p
        from specdec.sampling.sampler import SamplingTensors

        st = SamplingTensors.from_params([params] * logits.shape[0], device=logits.device)
        return st.to_probs(logits.float())

    def _top(self, req: _Request, logits: torch.Tensor | None, positions: list[int],
             probs: torch.Tensor | None = None) -> None:
        if req.params.greedy:
            return
        if probs is None:
            probs = self._probs(logits, req.params)
        n = min(self.top_n, probs.shape[-1])
        vals, ids = probs.topk(n, dim=-1)  # [M, N]
        for i, p in enumerate(positions):
            req.top_pos.append(p)
            req.top_ids.append(ids[i].to(torch.int32).numpy())
            req.top_probs.append(vals[i].float().numpy())

    # ------------------------------------------------------------------ writing
    def write(self, out_dir: str | Path, meta: dict[str, Any]) -> Path:
        """Write ``<out_dir>/trace/`` (module docstring); returns that directory."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        d = Path(out_dir) / TRACE_DIR
        d.mkdir(parents=True, exist_ok=True)
        reqs = [(rid, r) for rid, r in self.reqs.items()]
        unlabeled = [rid for rid, r in reqs if r.label is None]
        if unlabeled:
            raise RuntimeError(f"Tracer.write: requests {unlabeled[:5]} never finished through Tracer.label; "
                               "label every request (run_prompt does) before writing")
        i32 = pa.list_(pa.int32())
        cols: dict[str, list] = {k: [] for k in (
            "request_id", "question_id", "category", "turn", "prompt_ids", "output_ids", "target_ids",
            "finish_reason", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "acceptance_counts")}
        for rid, r in reqs:
            p, lab = r.params, r.label
            for k, v in dict(request_id=rid, question_id=lab["question_id"], category=lab["category"],
                             turn=lab["turn"], prompt_ids=r.prompt_ids, output_ids=lab["output_ids"],
                             target_ids=r.target_ids, finish_reason=lab["finish_reason"],
                             temperature=float(p.temperature), top_p=float(p.top_p), top_k=int(p.top_k),
                             min_p=float(p.min_p), seed=p.seed, max_tokens=p.max_tokens,
                             acceptance_counts=lab["acceptance_counts"]).items():
                cols[k].append(v)
        schema = pa.schema([("request_id", pa.string()), ("question_id", pa.string()), ("category", pa.string()),
                            ("turn", pa.int32()), ("prompt_ids", i32), ("output_ids", i32), ("target_ids", i32),
                            ("finish_reason", pa.string()), ("temperature", pa.float32()), ("top_p", pa.float32()),
                            ("top_k", pa.int32()), ("min_p", pa.float32()), ("seed", pa.int64()),
                            ("max_tokens", pa.int32()), ("acceptance_counts", pa.list_(pa.int64()))])
        pq.write_table(pa.table(cols, schema=schema), d / "requests.parquet")
        step_schema = pa.schema([("request_id", pa.string()), ("step", pa.int32()), ("kind", pa.string()),
                                 ("position", pa.int32()), ("draft_ids", i32), ("draft_parents", i32),
                                 ("target_ids", i32), ("draft_target_probs", pa.list_(pa.float32())),
                                 ("accepted", pa.int32()), ("path", i32), ("emitted", i32),
                                 ("final_token", pa.int32()), ("bonus", pa.bool_()), ("chosen", pa.int32())])
        pq.write_table(pa.Table.from_pylist(self.rows, schema=step_schema), d / "steps.parquet")
        if self.features:
            self._write_features(d, reqs)
        if any(r.top_pos for _, r in reqs):
            ids = np.concatenate([np.stack(r.top_ids) for _, r in reqs if r.top_pos])  # [R, N]
            probs = np.concatenate([np.stack(r.top_probs) for _, r in reqs if r.top_pos])  # [R, N]
            n = ids.shape[1]
            pq.write_table(pa.table({
                "request_id": pa.array([rid for rid, r in reqs for _ in r.top_pos], pa.string()),
                "position": pa.array([p for _, r in reqs for p in r.top_pos], pa.int32()),
                "ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1)), n),
                "probs": pa.FixedSizeListArray.from_arrays(pa.array(probs.reshape(-1)), n),
            }), d / "topn.parquet")
        meta = {**meta, "schema_version": SCHEMA_VERSION, "features": self.features,
                "features_dtype": self.features_dtype if self.features else None,
                "feature_size": self.feature_size if self.features else None, "top_n": self.top_n,
                "lookahead": self.lookahead, "tail_mismatches": self.tail_mismatches}
        cost = getattr(self.worker, "cost", None)  # a speculative worker's (specdec/spec_decode/cost_model.py)
        if cost is not None and cost.calibrated:
            meta["cost_table"] = cost.to_dict()  # as the run ended: replay reads it (policy replay)
        (d / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
        return d

    def _write_features(self, d: Path, reqs) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        np_dtype = _FEATURE_DTYPES[self.features_dtype][1]
        chunks = [torch.cat(r.feats) for _, r in reqs if r.feats]
        F = self.feature_size
        flat = torch.cat(chunks).numpy().astype(np_dtype).reshape(-1) if chunks else np.zeros(0, np_dtype)
        pq.write_table(pa.table({
            "request_id": pa.array([rid for rid, r in reqs for _ in range(r.next_feat)], pa.string()),
            "position": pa.array([p for _, r in reqs for p in range(r.next_feat)], pa.int32()),
            "feature": pa.FixedSizeListArray.from_arrays(pa.array(flat), max(F, 1)),
        }), d / "features.parquet")


def install(llm, features: bool = False, layers: list[int] | tuple[int, ...] | None = None,
            features_dtype: str = "float16", top_n: int = 32, lookahead: int = 0) -> tuple[Tracer, tuple[int, ...]]:
    """A Tracer on ``llm``'s worker; returns it and the target layers its features come from.

    A speculative worker's forwards return its proposer's FeatureSpec layers (() without one), so the
    trace records those, and ``layers`` must agree; a plain worker returns ``layers`` (None = ())."""
    worker = llm.worker
    plain = getattr(worker, "plain", worker)  # SpecDecodeWorker wraps a PlainWorker
    want = tuple(layers) if layers is not None else None
    if hasattr(worker, "layers"):  # speculative: its forwards fix the layers
        got = tuple(worker.layers)
        if features and want is not None and want != got:
            raise ValueError(f"trace_layers={list(want)}: this speculative run's forwards return target layers "
                             f"{list(got)} (its proposer's FeatureSpec; [] = the last layer after the norm); record "
                             "the trace with proposer=none (plain decoding, any layers) or drop trace_layers")
    else:
        got = want or ()
        if features:
            plain.hidden_layers = got
    tracer = Tracer(features, features_dtype, top_n, lookahead, llm)
    tracer.worker = worker  # its cost table (speculation policy) goes into meta.json when the trace is written
    plain.observers.append(tracer)
    return tracer, got


# ---------------------------------------------------------------------------------------------- loading
@dataclass
class Trace:
    """A loaded trace: pyarrow tables (``.to_pandas()`` where pandas is installed) and meta.json."""

    path: Path
    meta: dict[str, Any]
    requests: Any  # pyarrow.Table
    steps: Any  # pyarrow.Table
    features: Any | None = None  # pyarrow.Table
    topn: Any | None = None  # pyarrow.Table

    def request_rows(self) -> list[dict[str, Any]]:
        return self.requests.to_pylist()

    def features_of(self, request_id: str) -> torch.Tensor:  # [n, F] positions 0..n-1
        """The target's features of the request's committed tokens, position by position."""
        if self.features is None:
            raise ValueError(f"trace {self.path}: no features.parquet; record the trace with trace_features=true "
                             "(and the layers the head reads: trace_layers=[...] on a plain run)")
        return self._fixed(self.features, request_id, "feature")[1]

    def topn_of(self, request_id: str) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """(positions [R], ids [R, N] int64, probs [R, N] float32) of the request's top-N target p."""
        if self.topn is None:
            raise ValueError(f"trace {self.path}: no topn.parquet; it is recorded for runs at temperature > 0")
        pos, ids = self._fixed(self.topn, request_id, "ids")
        _, probs = self._fixed(self.topn, request_id, "probs")
        return pos, ids.long(), probs.float()

    def _index(self, table) -> dict[str, tuple[int, int]]:
        key = id(table)
        cache = self.__dict__.setdefault("_idx", {})
        if key not in cache:
            rids = table.column("request_id").to_pylist()
            spans: dict[str, tuple[int, int]] = {}
            for i, r in enumerate(rids):
                a, _ = spans.get(r, (i, i))
                spans[r] = (a, i + 1)
            cache[key] = spans
        return cache[key]

    def _fixed(self, table, request_id: str, column: str) -> tuple[np.ndarray, torch.Tensor]:
        a, b = self._index(table).get(request_id, (0, 0))
        sl = table.slice(a, b - a)
        col = sl.column(column).combine_chunks()
        width = col.type.list_size
        values = col.values.to_numpy(zero_copy_only=False).reshape(-1, width)
        return sl.column("position").to_numpy(), torch.from_numpy(values.copy())


def load_trace(path: str | Path) -> Trace:
    """A run directory (holding ``trace/``) or the trace directory itself -> :class:`Trace`."""
    import pyarrow.parquet as pq

    d = Path(path)
    if (d / TRACE_DIR / "meta.json").exists():
        d = d / TRACE_DIR
    if not (d / "meta.json").exists():
        raise FileNotFoundError(f"load_trace: no trace under {path} (expected {Path(path) / TRACE_DIR}/meta.json); "
                                "record one with `python -m specdec.run ... trace=true`")
    redo = "re-record it with `python -m specdec.run ... trace=true`"
    try:
        meta = json.loads((d / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"load_trace: {d / 'meta.json'} is unreadable ({type(e).__name__}: {e}); {redo}") from None
    if not isinstance(meta, dict) or meta.get("schema_version") != SCHEMA_VERSION:
        got = meta.get("schema_version") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"load_trace: {d} has schema_version {got}, this specdec reads {SCHEMA_VERSION}; {redo}")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise ValueError(f"load_trace: {d / 'meta.json'} lacks {missing}; {redo}")

    def table(name: str, required: bool, columns: tuple[str, ...] = ()):
        f = d / f"{name}.parquet"
        if not f.exists():
            if required:
                raise ValueError(f"load_trace: {f} is missing; {redo}")
            return None
        try:
            t = pq.read_table(f)
        except Exception as e:  # noqa: BLE001 - pyarrow's errors (ArrowInvalid, OSError, ...): the file is damaged
            raise ValueError(f"load_trace: {f} is unreadable ({type(e).__name__}: {e}); {redo}") from None
        lacking = [c for c in columns if c not in t.column_names]
        if lacking:
            raise ValueError(f"load_trace: {f} lacks the columns {lacking}; {redo}")
        return t

    opt = {name: table(name, False) for name in ("features", "topn")}
    requests, steps = table("requests", True, REQUEST_COLUMNS), table("steps", True)
    bad = inconsistency(requests, steps, meta["vocab_size"])
    if bad:
        raise ValueError(f"load_trace: {d} does not hold together: {bad}; a replay of it would report wrong figures; "
                         f"{redo}")
    return Trace(d, meta, requests, steps, **opt)


def inconsistency(requests, steps, vocab_size) -> str | None:
    """What makes a readable trace lie, or None: a request id twice, a request whose ``target_ids`` do not begin with
    its ``output_ids`` (cut short or edited: a replay would verify drafts against the wrong tokens), a token id outside
    [0, vocab_size), a step of a request the requests table lacks. One pass over the requests, the steps' ids once."""
    import pyarrow.compute as pc

    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        return f"meta.json's vocab_size is {vocab_size!r}, not a positive int"
    rids = requests.column("request_id").to_pylist()
    seen: set = set()
    for r in rids:
        if r in seen:
            return f"request {r!r} appears twice in requests.parquet"
        seen.add(r)
    for col in ("prompt_ids", "output_ids", "target_ids"):
        flat = pc.list_flatten(requests.column(col))
        if not len(flat):
            continue
        bounds = pc.min_max(flat)
        lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
        if lo < 0 or hi >= vocab_size:
            return (f"requests.parquet's {col} hold ids in [{lo}, {hi}], outside the vocabulary [0, {vocab_size}) "
                    "of meta.json")
    outs, targets = requests.column("output_ids").to_pylist(), requests.column("target_ids").to_pylist()
    for r, out, tgt in zip(rids, outs, targets):
        if out is None or tgt is None or list(tgt[: len(out)]) != list(out):
            n_out, n_tgt = len(out or ()), len(tgt or ())
            return (f"request {r!r}: its target_ids ({n_tgt} tokens) do not begin with its output_ids ({n_out} "
                    "tokens), as a recorded trace's always do")
    if "request_id" in steps.column_names:
        stray = set(pc.unique(steps.column("request_id")).to_pylist()) - seen
        if stray:
            return f"steps.parquet has steps of requests {sorted(stray, key=str)[:3]} that requests.parquet lacks"
    return None
