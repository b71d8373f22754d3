"""From a composed config (a Hydra DictConfig or a plain dict) to a typed, checked :class:`RunConfig`.

What each group's ``_target_`` builds, and how:

- ``model``: the class that loads the target (``specdec.entrypoints.llm.LLM``); ``run`` calls it with ``name``
  and ``dtype``.
- ``proposer`` / ``scorer`` / ``verifier``: the class the builder makes. The ``_target_`` goes as it is into
  ``speculative_config`` (``method`` / ``scorer`` / ``acceptance_method``), where the one registry
  (``specdec.spec_decode.registry``) that ``LLM(speculative_config=...)`` uses turns it into the class. A
  registry name works too (``proposer.method=<name>``, ``scorer.name=<name>``: entry-point plug-ins); given
  beside a ``_target_``, both must name the same class. Any other key goes to speculative_config as it is
  (``verifier.posterior_threshold``), so a new SpeculativeConfig field only needs a YAML key.
- ``kernel``: ``_target_`` is ``specdec_kernels.get_ops``, called with ``name`` (speculative_config ``kernel``) when
  the run is composed: it loads the op table, so a backend that cannot load fails here.
- ``dataset`` / ``logger``: ``run`` calls them with their keys, which are checked here against the
  callable's signature.

All four speculative groups merge into one ``speculative_config``, typed by
:class:`~specdec.spec_decode.config.SpeculativeConfig` (msgspec), so a typo fails here, before any model
loads, with the group and key in the message. ``num_speculative_tokens: 0`` (``proposer=none``) is plain
decoding. Whether the parts fit (a tree scorer with a chain-only proposer, ``kernel=triton`` where triton
does not import, k too large for max_model_len) is decided by the builder's
:func:`~specdec.spec_decode.builder.check_parts`, called here too; a draft model proposer without a draft
model is the proposer's own ``check_config``.

Knows nothing about running: it imports the classes named, and builds no model.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
from typing import Any

import msgspec

from specdec.core.arg_types import check_arg_types

log = logging.getLogger("specdec.compose")

SPEC_GROUPS = ("proposer", "scorer", "verifier", "kernel")
# the speculative_config key naming each group's part, and the group key that may hold a registry name
PART_KEY = {"proposer": "method", "scorer": "scorer", "verifier": "acceptance_method", "kernel": "kernel"}
NAME = {"proposer": "method", "scorer": "name", "verifier": "name", "kernel": "name"}
MISSING = "???"  # OmegaConf's mandatory-value marker


class ModelCfg(msgspec.Struct, forbid_unknown_fields=True):
    target: str = msgspec.field(default="specdec.entrypoints.llm.LLM", name="_target_")  # called as cls(name, dtype=...)
    name: str = "smollm2-135m-instruct"  # engine model name, HF directory or .gguf path
    dtype: str = "auto"  # bfloat16 where the CPU has bf16 arithmetic, else float32 (specdec.engine.loader.auto_dtype)


class SamplingCfg(msgspec.Struct, forbid_unknown_fields=True):
    temperature: float = 0.0
    max_tokens: int = 128
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None


def _default(**node: str):
    return msgspec.field(default_factory=lambda: dict(node))


class RunConfig(msgspec.Struct, forbid_unknown_fields=True):
    """The keys of a run, typed: a typo is an error naming the key. The speculative groups stay dicts here
    (any SpeculativeConfig key is allowed in them); :func:`speculative_config` types them."""

    model: ModelCfg = msgspec.field(default_factory=ModelCfg)
    proposer: dict[str, Any] = msgspec.field(default_factory=dict)  # {} / k=0: plain decoding
    scorer: dict[str, Any] = _default(_target_="scorers.mqa.MQAScorer")
    verifier: dict[str, Any] = _default(_target_="specdec.verify.chain.RejectionSampler")
    kernel: dict[str, Any] = _default(_target_="specdec_kernels.get_ops", name="torch")
    dataset: dict[str, Any] = msgspec.field(default_factory=dict)  # _target_ returning list[Prompt]; {} = default
    logger: dict[str, Any] = msgspec.field(default_factory=dict)  # _target_ of a specdec.experiment.loggers class; {} = none
    sampling: SamplingCfg = msgspec.field(default_factory=SamplingCfg)
    seed: int = 0
    num_threads: int | None = None
    max_num_seqs: int = 1  # Spec-Bench measures at batch 1
    num_scheduler_steps: int = 1  # multi-step decoding: decode steps per scheduler call (LLMEngine)
    max_model_len: int = 4096  # Spec-Bench's longest prompts (summarization, rag) are ~3.3k tokens
    turns: int = 2  # MT-bench questions have 2 turns; 1 = first turn only
    measure_baseline: bool = True  # decode the same prompts plainly in the same run
    baseline: str = "auto"  # auto (the cache, else decode and cache) | fresh | a run dir (specdec/experiment/baseline.py)
    baseline_remeasure_tokens: int = 32  # a cached baseline's speed is re-taken on this many tokens per turn
    warmup: bool = True
    debug: bool = False  # tiny-random-llama, 1 prompt per category, 8 tokens: a smoke test in seconds
    output_dir: str | None = None  # where summary.json goes; default: Hydra's run dir or the cwd
    # token traces (specdec/trace.py): trace/ beside summary.json, the input of `python -m specdec.replay`
    trace: bool = False
    trace_features: bool = False  # also the target's hidden state of every committed token (EAGLE/Medusa replay)
    trace_layers: list[int] | None = None  # their target layers (plain runs); None/[] = last layer after the norm
    trace_features_dtype: str = "float16"  # float32: bit-exact replay of feature-reading heads
    trace_top_n: int = 32  # T > 0: the target's top-N next-token probabilities at every committed position
    trace_lookahead: int = 16  # greedy: the target's tokens recorded past each stop (a replayed last step reads them)


# ---------------------------------------------------------------------------------------------- parsing
FLAGSHIP = "eagle"  # conf/experiment/eagle.yaml
NAMES_A_PROPOSER = ("experiment", "proposer", "proposer.method", "proposer._target_")  # keys that replace the flagship


def flagship(argv: list[str]) -> list[str]:
    """``python -m specdec.run`` with no experiment and no proposer named runs the flagship speculative experiment
    (``+experiment=eagle``, its plain baseline beside it); naming either keeps conf/config.yaml's plain defaults
    underneath (``proposer=none`` for plain decoding). A proposer is named by the group (``proposer=ngram``) or by
    ``proposer.method`` / ``proposer._target_``; any other ``proposer.<key>`` tunes the flagship
    (``proposer.speculation_policy=static`` runs the flagship with the static policy: it used to run plain decoding
    with the key ignored). Logged, so a run says what it ran."""
    keys = [a.lstrip("+~").split("=", 1)[0] for a in argv if "=" in a and not a.startswith("-")]
    if any(k in NAMES_A_PROPOSER for k in keys):
        return argv
    print(f"specdec.run: no experiment or proposer named: running the flagship, +experiment={FLAGSHIP} "
          "(proposer=none for plain decoding)", file=sys.stderr)
    return [f"+experiment={FLAGSHIP}", *argv]  # first: after ``--cfg job`` argparse would refuse it


def open_options(argv: list[str]) -> list[str]:
    """Command-line overrides of ``proposer.options.<key>`` made add-or-set (``++``): ``options`` is the
    proposer's open dict of ``__init__`` keyword arguments (checked against its signature when the run is
    composed), which Hydra's struct mode would refuse to extend without a ``+``. Sweeps included
    (``-m proposer.options.nmax=1,2``)."""
    out = []
    for a in argv:
        if a.startswith("proposer.options.") and "=" in a:
            a = "++" + a
        out.append(a)
    return out


def to_container(cfg: Any) -> dict[str, Any]:
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            missing = sorted(OmegaConf.missing_keys(cfg))
            if missing:
                raise ValueError(f"config value(s) {missing} are mandatory (??? in conf/) and not set; give them "
                                 f"on the command line, e.g. {missing[0]}=...")
            return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover
        pass
    return _plain(cfg)


def _plain(cfg: Any) -> Any:
    if isinstance(cfg, dict):
        return {k: _plain(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [_plain(v) for v in cfg]
    return cfg


def _missing_paths(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _missing_paths(v, f"{prefix}{k}.")]
    return [prefix[:-1]] if node == MISSING else []


def parse_config(cfg: Any) -> RunConfig:
    """Type the plain keys, apply ``debug``, and check the combination (imports the classes named)."""
    raw = {k: v for k, v in to_container(cfg).items() if k not in ("hydra", "experiment")}
    missing = _missing_paths(raw)
    if missing:
        raise ValueError(f"config value(s) {missing} are mandatory and not set; e.g. {missing[0]}=...")
    try:
        rc = msgspec.convert(raw, RunConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"invalid run config: {e}. See conf/config.yaml for the valid keys.") from e
    if rc.debug:
        rc = debug_config(rc)
    check(rc)
    if not rc.measure_baseline and rc.baseline != "auto":
        raise ValueError(f"baseline={rc.baseline!r} has no effect with measure_baseline=false; drop one of them")
    if rc.max_num_seqs > 1 and rc.baseline not in ("auto", "fresh"):
        raise ValueError(f"baseline={rc.baseline!r} has no effect at max_num_seqs={rc.max_num_seqs}: a batched run "
                         "decodes its plain baseline at the same batch; drop baseline= or run at max_num_seqs=1")
    check_run_keys(rc)
    return rc


TRACE_KEYS = ("trace_features", "trace_layers", "trace_features_dtype", "trace_top_n", "trace_lookahead")


def check_run_keys(rc: RunConfig) -> None:
    """Run keys that would do nothing, or make an empty run, given the others: refused naming the key."""
    if rc.turns < 1:
        raise ValueError(f"turns={rc.turns} must be >= 1 (1: each question's first turn; 2: MT-bench's two)")
    if rc.baseline_remeasure_tokens < 1:
        raise ValueError(f"baseline_remeasure_tokens={rc.baseline_remeasure_tokens} must be >= 1 (the tokens per "
                         "turn on which a cached baseline's speed is taken again); baseline=fresh decodes it whole")
    if speculative_config(rc) is None and rc.baseline != "auto":
        raise ValueError(f"baseline={rc.baseline!r} has no effect on a plain run (it has no speculation to compare); "
                         "drop baseline=, or name a proposer")
    if not rc.trace:
        defaults = RunConfig()
        set_ = [k for k in TRACE_KEYS if getattr(rc, k) != getattr(defaults, k)]
        if set_:
            raise ValueError(f"{', '.join(f'{k}={getattr(rc, k)!r}' for k in set_)} have no effect without trace=true; "
                             "add trace=true, or drop them")


def debug_config(rc: RunConfig) -> RunConfig:
    """The same pipeline on tiny-random-llama (its draft too), 1 turn of 8 tokens, 1 prompt per category."""
    from specdec.engine.tiny import tiny_config

    tiny = "tiny-random-llama"
    proposer = dict(rc.proposer)
    if proposer.get("model"):
        proposer["model"] = tiny  # a draft must share the target's vocabulary
    if proposer.get("num_layers"):
        proposer["num_layers"] = min(int(proposer["num_layers"]), tiny_config().num_hidden_layers - 1)
    dataset = dict(rc.dataset)
    if dataset.get("_target_"):
        params = _parameters(dataset["_target_"], "dataset")
        if "per_category" in params:
            dataset["per_category"] = 1
        elif "limit" in params:
            dataset["limit"] = min(dataset.get("limit") or 2, 2)
    return msgspec.structs.replace(
        rc, model=msgspec.structs.replace(rc.model, name=tiny), proposer=proposer, dataset=dataset, turns=1,
        sampling=msgspec.structs.replace(rc.sampling, max_tokens=min(rc.sampling.max_tokens, 8)),
    )


# ---------------------------------------------------------------------------------------------- classes
def locate(path: str, what: str) -> Any:
    """``"pkg.module.Name"`` (or ``"pkg.module:Name"``) -> the object; ValueError naming ``what`` if missing."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ValueError(f"{what}={path!r} is not a 'package.module.Name' path")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what}={path!r} cannot be imported ({type(e).__name__}: {e}); is its package "
                         "installed and is the path right?") from e
    return obj


def qualname(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def _parameters(target: str, group: str) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(locate(target, f"{group}._target_")).parameters)


def check_kwargs(group: str, node: dict[str, Any]) -> None:
    """The keys of a group called with them (dataset, logger) must be parameters of its ``_target_``."""
    if not node.get("_target_"):
        raise ValueError(f"{group} has no _target_; pick an option, e.g. {group}=<option> (see conf/{group}/)")
    params = _parameters(node["_target_"], group)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(node) - {"_target_"} - set(params))
    if unknown:
        raise ValueError(f"{group}: {unknown} are not parameters of {node['_target_']}; valid: {sorted(params)}")
    check_arg_types(locate(node["_target_"], f"{group}._target_"), {k: v for k, v in node.items() if k != "_target_"},
                    group)


def _resolve(kind: str, where: str, value: str) -> type:
    """The registry's class for ``value`` (a name or an import path); ValueError naming the config key."""
    from specdec.spec_decode.registry import resolve

    try:
        return resolve(kind, value)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None


# ---------------------------------------------------------------------------------------------- mapping
def _merge_spec(rc: RunConfig) -> tuple[dict[str, Any], dict[str, str]]:
    """All four speculative groups -> one dict of speculative_config keys, and key -> the group key it came
    from. A part is its ``_target_`` as it is (the kernel's: its ``name``), or a registry name."""
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for group in SPEC_GROUPS:
        node = dict(getattr(rc, group))
        target, name = node.pop("_target_", None), node.pop(NAME[group], None)
        part, where = name, f"{group}.{NAME[group]}"
        if target and group != "kernel":  # the kernel's _target_ builds its ops (check_parts' get_ops)
            if name is not None:  # both: they must name one class
                named = _resolve(group, where, name)
                if named is not _resolve(group, f"{group}._target_", target):
                    raise ValueError(f"{where}={name!r} is {qualname(named)} but {group}._target_ is {target!r}; "
                                     f"give one of them (conf/{group}/)")
            part, where = target, f"{group}._target_"
        keys = [(PART_KEY[group], part, where)] if part is not None else []
        for dest, val, where in keys + [(key, val, f"{group}.{key}") for key, val in node.items()]:
            if dest in origin:
                raise ValueError(f"{where} and {origin[dest]} both set speculative_config {dest!r}; set it "
                                 f"once (choose {dest} through its own group: {_group_of(dest)}=<option>)")
            origin[dest] = where
            if val is not None:
                merged[dest] = val
    return merged, origin


def _group_of(key: str) -> str:
    return {v: k for k, v in PART_KEY.items()}.get(key, "proposer")


def _typed(rc: RunConfig):
    """(merged keys, their origins, the SpeculativeConfig they make): typed even for plain runs, so a typo in
    the scorer/verifier/kernel keys never goes unnoticed."""
    from specdec.spec_decode.config import SpeculativeConfig

    merged, origin = _merge_spec(rc)
    probe = {**merged, "method": merged.get("method") or "none",
             "num_speculative_tokens": merged.get("num_speculative_tokens") or 1}
    try:
        return merged, origin, msgspec.convert(probe, SpeculativeConfig)
    except msgspec.ValidationError as e:
        fields = ", ".join(f for f in SpeculativeConfig.__struct_fields__ if f != "method")
        hint = (f" Keys the proposer, scorer, verifier and kernel groups may set: {fields}"
                if "unknown field" in str(e) else "")
        raise ValueError(f"{_where(str(e), origin)}invalid speculative config: {e}.{hint}") from e


def speculative_config(rc: RunConfig) -> dict[str, Any] | None:
    """The ``speculative_config`` for ``LLM``; None for plain decoding (no proposer, or k = 0)."""
    merged, _, _ = _typed(rc)
    method, k = merged.get("method"), merged.get("num_speculative_tokens")
    if method == "none":  # proposer=none: plain decoding, also in a sweep that sets k for the other proposers
        if k:
            log.warning("proposer=none: proposer.num_speculative_tokens=%s has no effect (plain decoding)", k)
        return None
    if method is None and k:
        raise ValueError(f"proposer.num_speculative_tokens={k} but no proposer is named; give proposer.method=<name> "
                         "or proposer._target_=<pkg.module.Class>, or pick one: proposer=ngram|draft_model|layer_skip")
    if method is None or k == 0:
        return None
    return {"method": method, **merged}


def _where(msg: str, origin: dict[str, str]) -> str:
    """'proposer.prompt_lookup_mx: ' for msgspec's "unknown field `prompt_lookup_mx`" (which group set it)."""
    import re

    m = re.search(r"`(?:\$\.)?([A-Za-z_]\w*)`|speculative_config ([A-Za-z_]\w*)=", msg)
    key = m and (m.group(1) or m.group(2))
    return f"{origin[key]}: " if key in origin else ""


# ---------------------------------------------------------------------------------------------- checks
def check(rc: RunConfig) -> None:
    """Fail before any model loads when a part cannot be built or two parts do not go together (the
    builder's check_parts decides the latter)."""
    import specdec_kernels
    from specdec.spec_decode.builder import check_parts
    from specdec.spec_decode.registry import resolve

    locate(rc.model.target, "model._target_")
    for group in ("scorer", "verifier", "kernel"):
        node = getattr(rc, group)
        if not node.get("name") and not (group != "kernel" and node.get("_target_")):
            raise ValueError(f"{group} has no {'name' if group == 'kernel' else '_target_'}; pick an option, e.g. "
                             f"{group}=<option> (see conf/{group}/)")
    merged, origin, cfg = _typed(rc)
    spec = speculative_config(rc)
    proposer_cls = _resolve("proposer", origin.get("method", ""), merged["method"]) if spec is not None else None
    get_ops = locate(rc.kernel["_target_"], "kernel._target_") if rc.kernel.get("_target_") else specdec_kernels.get_ops
    try:
        parts = check_parts(cfg, proposer_cls, rc.max_model_len, get_ops)
    except ValueError as e:
        raise ValueError(f"{_where(str(e), origin)}{e}") from e
    depth, k = cfg.tree_depth, cfg.num_speculative_tokens
    if spec is not None and parts.shape is not None and depth is not None and depth != k:
        # a tree drafts tree_depth levels and reads no other k: a different k was logged and recorded while doing
        # nothing (a sweep over proposer.num_speculative_tokens measured one tree again and again)
        raise ValueError(f"proposer.num_speculative_tokens={k} with scorer.tree_depth={depth}: a tree drafts "
                         f"tree_depth levels and reads no other k; set both (scorer.tree_depth={k} "
                         f"proposer.num_speculative_tokens={k}), or leave num_speculative_tokens at {depth}")
    if spec is not None:
        check_read(proposer_cls, cfg, spec, parts, origin)
    if spec is not None:
        proposer_cls.check_config(spec)  # the proposer's own refusals (e.g. a draft model proposer without a model)
    for group in ("dataset", "logger"):
        if getattr(rc, group):
            check_kwargs(group, getattr(rc, group))
    lossy = issubclass(parts.verifier, resolve("verifier", "typical_acceptance"))
    if spec is not None and lossy and rc.sampling.temperature > 0:
        log.warning("verifier=typical_acceptance is lossy: at temperature %s the output is not distributed as the "
                    "target's (greedy runs stay exact)", rc.sampling.temperature)
    elif spec is not None and lossy:
        log.warning("verifier=typical_acceptance changes nothing at temperature 0: greedy rows are verified by exact "
                    "match whatever the verifier (its thresholds apply to sampled rows)")


def check_read(proposer_cls: type, cfg, spec: dict[str, Any], parts, origin: dict[str, str]) -> None:
    """Refuse what the built parts would not read (specdec.spec_decode.builder.unread_keys, which the library only
    warns about): a proposer-specific key (model, num_layers, prompt_lookup_*) the proposer does not read
    (``+experiment=ngram ++proposer.model=foo`` was recorded and did nothing), a tree key on a chain."""
    from specdec.spec_decode.builder import TREE_KEYS, unread_keys
    from specdec.spec_decode.proposer import PROPOSER_KEYS

    unread = {k: v for k, v, _ in unread_keys(cfg, proposer_cls, spec, parts)}

    def named(keys) -> str:
        return ", ".join(f"{origin.get(k, k)}={unread[k]!r}" for k in keys)

    own = [k for k in PROPOSER_KEYS if k in unread]
    if own:
        it = "it" if len(own) == 1 else "them"
        reads = proposer_cls.config_keys(spec)
        raise ValueError(f"{named(own)}: {proposer_cls.__name__} does not read {it} (of {', '.join(PROPOSER_KEYS)} it "
                         f"reads {', '.join(sorted(reads)) or 'none'}); drop {it}")
    tree = [k for k in TREE_KEYS if k in unread]
    if tree:
        raise ValueError(f"{named(tree)}: only a tree scorer reads them, and this run's is {qualname(parts.scorer)}; "
                         "drop them, or scorer=tree with a tree proposer")


def components(rc: RunConfig, spec: dict[str, Any] | None) -> dict[str, str]:
    """group -> what the run builds for it (class paths), for the log and the summary."""
    out = {"model": f"{rc.model.target}({rc.model.name!r})"}
    if spec is None:
        out["proposer"] = "none (plain decoding)"
    else:
        out["proposer"] = qualname(_resolve("proposer", "proposer", spec["method"]))
        out["scorer"] = str(rc.scorer.get("_target_"))
        out["verifier"] = str(rc.verifier.get("_target_"))
        out["kernel"] = f"{rc.kernel.get('_target_')}({rc.kernel.get('name')!r})"
    for group in ("dataset", "logger"):
        node = getattr(rc, group)
        out[group] = str(node.get("_target_")) if node else "default"
    return out
