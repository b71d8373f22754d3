"""A live server on a free port (uvicorn in a thread, the engine core in its own process), per module."""

import socket
import threading
import time
from pathlib import Path

import httpx
import pytest


CONF = str(Path(__file__).resolve().parents[2] / "conf")


def composed(*overrides: str):
    """conf/serve.yaml composed with Hydra overrides, as `python -m specdec.serve ...` would."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="serve", overrides=list(overrides))


class LiveServer:
    def __init__(self, overrides: dict | None = None, cfg=None):
        """``overrides`` on the tiny default config, or a whole composed ``cfg`` (see composed())."""
        import uvicorn

        from specdec.serve import build_server

        if cfg is None:
            cfg = {"model": {"_target_": "specdec.entrypoints.llm.LLM", "name": "tiny-random-llama", "dtype": "float32"},
                   "max_num_seqs": 4, "max_model_len": 256, "serve": {"restart_on_failure": True}}
            for key, val in (overrides or {}).items():
                cfg[key] = {**cfg.get(key, {}), **val} if isinstance(val, dict) else val
        app, _ = build_server(cfg)
        self.server_obj = app.state.openai_server
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.uvicorn.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)

    @property
    def engine(self):
        return self.server_obj.engine

    def wait_health(self, status: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if httpx.get(self.url + "/health").status_code == status:
                return
            time.sleep(0.1)
        raise AssertionError(f"/health did not turn {status} within {timeout} s")

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(30)


NGRAM = {"proposer": {"_target_": "proposers.ngram.NGramProposer", "num_speculative_tokens": 3,
                      "prompt_lookup_max": 3, "prompt_lookup_min": 1}}


DRAFT = {"proposer": {"_target_": "proposers.draft_model.DraftModelProposer", "num_speculative_tokens": 3,
                      "model": "tiny-random-llama"}}


@pytest.fixture(scope="module")
def draft_server():
    srv = LiveServer(DRAFT)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def plain_server():
    srv = LiveServer({})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ngram_server():
    srv = LiveServer(NGRAM)
    yield srv
    srv.stop()
