"""`python -m specdec.serve [+experiment=NAME] [group=option] [serve.port=8000]`: an OpenAI-compatible server.

Composed by the same Hydra groups as ``specdec.experiment.run`` (``conf/serve.yaml`` = ``conf/config.yaml`` + the
``serve`` group: host, port, api_key), typed and checked by ``specdec.experiment.compose`` before any model loads.
:func:`serve` takes any mapping (a DictConfig or a plain dict), so tests call it without Hydra;
:func:`build_server` gives the FastAPI app without listening (tests drive it in-process).

- ``app.py``: the routes; ``openai_protocol.py``: request bodies -> SamplingParams (400s naming the
  field); ``prom.py``: the /metrics counters.

Knows nothing about how tokens are made: it talks to an AsyncLLMEngine.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import msgspec

from specdec.serve.limits import ServeLimits

log = logging.getLogger("specdec.serve")


class ServeCfg(msgspec.Struct, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # also SPECDEC_API_KEY or api_key_file; None and unset: no key
    api_key_file: str | None = None  # a file holding the key (its first line), e.g. mode 0600
    protect_docs: bool = True  # with a key: /metrics, /docs and /openapi.json need it too (/health never does)
    allowed_hosts: list[str] | None = None  # Host names accepted beyond loopback's on a loopback bind
    cors_origins: list[str] = []  # origins a browser may call from (CORS); [] = none (no CORS headers)
    limits: ServeLimits = msgspec.field(default_factory=ServeLimits)
    served_model_name: str | None = None
    multiprocess: bool = True
    restart_on_failure: bool = True
    log_level: str = "info"
    strict_fields: bool = False  # a declared request field the server ignores: 400 instead of a warning
    num_scheduler_steps: int = 1  # decode steps per scheduler decision (multi-step decoding: core/multi_step.py)


def split_config(cfg: Any) -> tuple[ServeCfg, dict[str, Any]]:
    """(the serve group, typed; the rest: a specdec.experiment.run config)."""
    from specdec.experiment.compose import to_container

    raw = dict(to_container(cfg))
    try:
        serve_cfg = msgspec.convert(raw.pop("serve", {}) or {}, ServeCfg)
    except msgspec.ValidationError as e:
        raise ValueError(f"invalid serve config: {e}; see conf/serve/default.yaml for the keys") from e
    return serve_cfg, raw


def engine_args_from(run_cfg: dict[str, Any], multiprocess: bool, num_scheduler_steps: int = 1):
    """AsyncEngineArgs from the run groups (model, proposer, scorer, verifier, kernel, sizes) and the serve group's
    num_scheduler_steps."""
    from specdec.experiment.compose import parse_config, speculative_config
    from specdec.entrypoints.engine_args import AsyncEngineArgs

    rc = parse_config(run_cfg)
    return AsyncEngineArgs(model=rc.model.name, dtype=rc.model.dtype, max_num_seqs=rc.max_num_seqs,
                           max_model_len=rc.max_model_len, seed=rc.seed, num_threads=rc.num_threads,
                           speculative_config=speculative_config(rc), multiprocess=multiprocess,
                           num_scheduler_steps=num_scheduler_steps)


def resolve_api_key(serve_cfg: ServeCfg, argv: list[str] | None = None) -> str | None:
    """serve.api_key, else the first line of serve.api_key_file, else env SPECDEC_API_KEY, else None. A key on
    the command line is readable by every user of the machine (/proc/PID/cmdline): warned."""
    argv = sys.argv if argv is None else argv
    if any(a.lstrip("+~").startswith("serve.api_key=") for a in argv[1:]):
        log.warning("serve.api_key was given on the command line, where every user of this machine can read it "
                    "(ps, /proc/PID/cmdline); pass it in env SPECDEC_API_KEY or serve.api_key_file instead")
    if serve_cfg.api_key:
        return serve_cfg.api_key
    if serve_cfg.api_key_file:
        path = Path(serve_cfg.api_key_file).expanduser()
        try:
            lines = path.read_text().strip().splitlines()
        except OSError as e:
            raise ValueError(f"serve.api_key_file={str(path)!r} cannot be read ({e}); point it at a file "
                             "holding the key") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"serve.api_key_file={str(path)!r} is empty; write the key on its first line")
        return key
    return os.environ.get("SPECDEC_API_KEY") or None


def build_server(cfg: Any):
    """(FastAPI app, ServeCfg) for a composed config; the engine core starts with the app (lifespan)."""
    from specdec.v1.async_engine import AsyncLLMEngine
    from specdec.serve.app import OpenAIServer

    serve_cfg, run_cfg = split_config(cfg)
    args = engine_args_from(run_cfg, serve_cfg.multiprocess, serve_cfg.num_scheduler_steps)
    api_key = resolve_api_key(serve_cfg)
    engine = AsyncLLMEngine(args)
    name = serve_cfg.served_model_name or args.model
    server = OpenAIServer(engine, name, api_key=api_key, restart_on_failure=serve_cfg.restart_on_failure,
                          strict_fields=serve_cfg.strict_fields, limits=serve_cfg.limits, bind_host=serve_cfg.host,
                          allowed_hosts=serve_cfg.allowed_hosts, protect_docs=serve_cfg.protect_docs,
                          cors_origins=serve_cfg.cors_origins)
    log.info("serving %s (speculative_config: %s) on http://%s:%d%s", name, args.speculative_config or "none",
             serve_cfg.host, serve_cfg.port, " (API key required)" if api_key else "")
    return server.build(), serve_cfg


def serve(cfg: Any) -> None:
    import uvicorn

    app, serve_cfg = build_server(cfg)
    uvicorn.run(app, host=serve_cfg.host, port=serve_cfg.port, log_level=serve_cfg.log_level)


def main() -> None:
    import hydra

    from pathlib import Path

    conf = Path(__file__).resolve().parents[2] / "conf"  # the repository's conf/ (an absolute path: found
    # whatever the calling module's package is)

    @hydra.main(version_base="1.3", config_path=str(conf), config_name="serve")
    def _main(cfg) -> None:
        serve(cfg)

    _main()
