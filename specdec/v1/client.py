"""Clients of the engine core, one interface: ``add_request``, ``abort_requests``, ``get_output``,
``call_utility``, ``shutdown``, ``is_alive``.

- :class:`InprocClient`: the core in this process; ``get_output()`` runs one step. Messages are queued and
  applied before the step, as the spawned core applies them between steps, so a thread may step it while
  the event loop adds requests.
- :class:`MPClient`: the core in a spawned process (``run_engine_core``), over ZeroMQ ipc sockets with
  msgpack frames. ``get_output`` (blocking) and ``get_output_async`` (asyncio) read the same stream;
  ``is_alive`` watches the process, so a killed core is noticed instead of waited on.

Knows nothing about text or HTTP.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

from specdec.entrypoints.engine_args import EngineArgs
from specdec.v1.core import READY, EngineCore
from specdec.v1.protocol import (
    OUTPUTS_DECODER, EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType, UtilityRequest, encode,
)


class EngineDeadError(RuntimeError):
    """The engine core is gone (killed, crashed or failed to start); restart it to serve again."""


class InprocClient:
    def __init__(self, engine_args: EngineArgs, llm=None) -> None:
        self.core = EngineCore(engine_args, llm)
        self._pending: collections.deque = collections.deque()  # (type, payload); deque ops are thread-safe
        self._wake = threading.Event()
        self._lock = threading.Lock()  # one of step / utility at a time (the loop may step in a thread)

    def add_request(self, req: EngineCoreRequest) -> None:
        self._pending.append((EngineCoreRequestType.ADD, req))
        self._wake.set()

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._pending.append((EngineCoreRequestType.ABORT, list(request_ids)))
            self._wake.set()

    def _apply_pending(self) -> None:
        while self._pending:
            kind, payload = self._pending.popleft()
            if kind is EngineCoreRequestType.ADD:
                self.core.add_request(payload)
            else:
                self.core.abort_requests(payload)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """One step's outputs; with nothing to do, waits up to ``timeout`` seconds for a message first."""
        with self._lock:
            self._apply_pending()
            busy = self.core.has_work()
        if not busy:
            self._wake.clear()
            if not self._pending:
                self._wake.wait(timeout)
        with self._lock:
            self._apply_pending()
            if not self.core.has_work():
                return EngineCoreOutputs(timestamp=time.monotonic())
            return self.core.step()

    def call_utility(self, method: str, *args: Any) -> Any:
        with self._lock:
            return self.core.call_utility(method, list(args))

    def is_alive(self) -> bool:
        return True

    def shutdown(self) -> None:
        self._wake.set()


class MPClient:
    def __init__(self, engine_args: EngineArgs, startup_timeout_s: float = 300.0) -> None:
        import zmq

        base = os.path.join(tempfile.gettempdir(), f"specdec-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.input_addr, self.output_addr = f"ipc://{base}-in", f"ipc://{base}-out"
        self._ctx = zmq.Context()
        self.input = self._ctx.socket(zmq.PUSH)
        self.input.bind(self.input_addr)
        self.output = self._ctx.socket(zmq.PULL)  # blocking reads (get_output)
        self.output.bind(self.output_addr)
        self._aoutput = None  # an asyncio view of the same socket, made on first get_output_async
        self._call_ids = itertools.count()
        args = {f: getattr(engine_args, f) for f in EngineArgs.__struct_fields__}
        # a fresh interpreter (not fork: torch's threads and locks do not survive it; not multiprocessing's
        # spawn: it re-imports the caller's __main__, which a script without a main guard re-runs)
        self.proc = subprocess.Popen([sys.executable, "-m", "specdec.v1.core", json.dumps(args), self.input_addr,
                                      self.output_addr, str(os.getpid())])
        self.dead_reason: str | None = None
        self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.output.poll(500):
                msg = OUTPUTS_DECODER.decode(self.output.recv())
                u = msg.utility_output
                if u is not None and u.call_id == READY:
                    if u.failure_message:
                        self.shutdown()
                        raise EngineDeadError(u.failure_message)
                    return
            elif self.proc.poll() is not None:
                self.shutdown()
                raise EngineDeadError(f"the engine core process exited with code {self.proc.returncode} before it "
                                      "was ready; see its log above")
        self.shutdown()
        raise EngineDeadError(f"the engine core was not ready after {timeout_s:.0f} s; raise startup_timeout_s "
                              "if the model is slow to load")

    # ------------------------------------------------------------------ sending (never blocks: PUSH queues)
    def _send(self, kind: EngineCoreRequestType, obj: Any) -> None:
        if not self.is_alive():
            raise EngineDeadError(self.dead_reason or "the engine core process is not running")
        self.input.send_multipart([kind.value, encode(obj)], copy=False)

    def add_request(self, req: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, req)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.is_alive():
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def send_utility(self, method: str, *args: Any) -> int:
        """Send a utility call; its answer arrives in the output stream with this call id."""
        call_id = next(self._call_ids)
        self._send(EngineCoreRequestType.UTILITY, UtilityRequest(call_id, method, list(args)))
        return call_id

    def call_utility(self, method: str, *args: Any) -> Any:
        """Blocking utility call (for synchronous use only: other outputs read meanwhile are dropped)."""
        call_id = self.send_utility(method, *args)
        while True:
            out = self.get_output(timeout=60)
            u = out.utility_output
            if u is not None and u.call_id == call_id:
                if u.failure_message:
                    raise RuntimeError(u.failure_message)
                return u.result

    # ------------------------------------------------------------------ receiving
    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.output.poll(200):
            if not self.is_alive():
                raise EngineDeadError(self.dead_reason or f"the engine core process died (exit code {self.proc.returncode})")
            if deadline is not None and time.monotonic() > deadline:
                return EngineCoreOutputs(timestamp=time.monotonic())
        return self._decode(self.output.recv())

    async def get_output_async(self) -> EngineCoreOutputs:
        import zmq.asyncio

        if self._aoutput is None:
            self._aoutput = zmq.asyncio.Socket.from_socket(self.output)  # the same socket, awaitable
        while True:
            if await self._aoutput.poll(200):
                return self._decode(await self._aoutput.recv())
            if not self.is_alive():
                raise EngineDeadError(self.dead_reason or f"the engine core process died (exit code {self.proc.returncode})")

    def _decode(self, buf: bytes) -> EngineCoreOutputs:
        out = OUTPUTS_DECODER.decode(buf)
        if out.engine_dead:
            self.dead_reason = (out.utility_output.failure_message if out.utility_output else None) or "engine core died"
        return out

    def is_alive(self) -> bool:
        return self.dead_reason is None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def shutdown(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for sock in (self.input, self.output):
            sock.close(linger=0)
        for addr in (self.input_addr, self.output_addr):
            try:
                os.unlink(addr[len("ipc://"):])
            except OSError:
                pass


def make_client(engine_args: EngineArgs, multiprocess: bool, startup_timeout_s: float = 300.0):
    return MPClient(engine_args, startup_timeout_s) if multiprocess else InprocClient(engine_args)


__all__ = ["EngineDeadError", "InprocClient", "MPClient", "make_client"]
