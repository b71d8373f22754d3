"""Clients of the engine core, one interface: ``add_request``, ``abort_requests``, ``get_output``,
``call_utility``, ``shutdown``, ``is_alive``.

- :class:`InprocClient`: the core in this process; ``get_output()`` runs one step. Messages are queued and
  applied before the step, as the spawned core applies them between steps, so a thread may step it while
  the event loop adds requests.
- :class:`MPClient`: the core in a spawned process (``run_engine_core``), over a private, authenticated pair
  of ZeroMQ ipc sockets (channel.py) with msgpack frames. ``get_output`` (blocking) and ``get_output_async``
  (asyncio) read the same stream; ``is_alive`` watches the process, so a killed core is noticed instead of
  waited on. A message that fails authentication or decoding is logged and dropped, never taken for a death.

Knows nothing about text or HTTP.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

import msgspec

from specdec.entrypoints.engine_args import EngineArgs
from specdec.v1.channel import HELLO, FrontEndChannel
from specdec.v1.core import READY, EngineCore
from specdec.v1.protocol import (
    OUTPUTS_DECODER, EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType, UtilityRequest, encode,
)

logger = logging.getLogger(__name__)


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
            self.core.admit_compiled()
            busy, compiling = self.core.has_work(), self.core.compiling
        if not busy:
            self._wake.clear()
            if not self._pending:  # a grammar compiling in the core's thread: look again soon
                self._wake.wait(0.005 if compiling and (timeout is None or timeout > 0.005) else timeout)
        with self._lock:
            self._apply_pending()
            self.core.admit_compiled()
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
    def __init__(self, engine_args: EngineArgs, startup_timeout_s: float = 300.0, curve: bool | None = None) -> None:
        """Spawn a core and wait for it. ``curve``: None = CURVE where libzmq has it, else per-message HMAC
        (channel.py); False forces HMAC (the tests run both)."""
        self.channel = FrontEndChannel(curve)
        self.input_addr, self.output_addr = self.channel.input_addr, self.channel.output_addr
        self.input, self.output = self.channel.input, self.channel.output
        self._aoutput = None  # an asyncio view of the same socket, made on first get_output_async
        self._call_ids = itertools.count()
        self.num_dropped = 0  # messages that failed to open or decode (logged and dropped)
        args = {f: getattr(engine_args, f) for f in EngineArgs.__struct_fields__}
        # a fresh interpreter (not fork: torch's threads and locks do not survive it; not multiprocessing's
        # spawn: it re-imports the caller's __main__, which a script without a main guard re-runs); the
        # channel's secrets go through an inherited pipe, not argv or the environment
        secret_fd = self.channel.secret_fd()
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "specdec.v1.core", json.dumps(args), self.input_addr,
                                          self.output_addr, str(os.getpid()), str(secret_fd)], pass_fds=(secret_fd,))
        except BaseException:
            self.channel.close()
            raise
        finally:
            os.close(secret_fd)
        self.channel.expect_peer(self.proc.pid)
        self.dead_reason: str | None = None
        self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        """Until the core's hello on ``in`` and its ready on ``out``: nothing is sent to a peer before it has
        proven to be the core."""
        deadline = time.monotonic() + timeout_s
        hello = ready = False
        while time.monotonic() < deadline:
            if not hello and self.input.poll(0):
                hello = self.channel.hello.open(self.input.recv_multipart()) == [HELLO]
                if not hello:
                    self._drop("a message on the input socket that is not the core's hello")
            if self.output.poll(250):
                msg = self._decode(self.output.recv_multipart())
                u = msg.utility_output if msg is not None else None
                if u is not None and u.call_id == READY:
                    if u.failure_message:
                        self.shutdown()
                        raise EngineDeadError(u.failure_message)
                    ready = True
            elif self.proc.poll() is not None:
                self.shutdown()
                raise EngineDeadError(f"the engine core process exited with code {self.proc.returncode} before it "
                                      "was ready; see its log above")
            if hello and ready:
                return
        self.shutdown()
        raise EngineDeadError(f"the engine core was not ready after {timeout_s:.0f} s (its hello seen: {hello}, its "
                              f"ready seen: {ready}); raise startup_timeout_s if the model is slow to load")

    # ------------------------------------------------------------------ sending (never blocks: PAIR queues)
    def _send(self, kind: EngineCoreRequestType, obj: Any) -> None:
        if not self.is_alive():
            raise EngineDeadError(self.dead_reason or "the engine core process is not running")
        self.input.send_multipart(self.channel.to_core.seal([kind.value, encode(obj)]), copy=False)

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
        while True:
            while not self.output.poll(200):
                if not self.is_alive():
                    raise EngineDeadError(self.dead_reason or f"the engine core process died (exit code {self.proc.returncode})")
                if deadline is not None and time.monotonic() > deadline:
                    return EngineCoreOutputs(timestamp=time.monotonic())
            out = self._decode(self.output.recv_multipart())
            if out is not None:
                return out

    async def get_output_async(self) -> EngineCoreOutputs:
        import zmq.asyncio

        if self._aoutput is None:
            self._aoutput = zmq.asyncio.Socket.from_socket(self.output)  # the same socket, awaitable
        while True:
            if await self._aoutput.poll(200):
                out = self._decode(await self._aoutput.recv_multipart())
                if out is not None:
                    return out
            elif not self.is_alive():
                raise EngineDeadError(self.dead_reason or f"the engine core process died (exit code {self.proc.returncode})")

    def _drop(self, what: str) -> None:
        self.num_dropped += 1
        logger.warning("engine-core channel: dropped %s (%d dropped so far); the core is not affected", what,
                       self.num_dropped)

    def _decode(self, frames: list[bytes]) -> EngineCoreOutputs | None:
        """The core's message, or None (logged) for one that fails authentication or decoding: a protocol
        error to drop, never a sign that the core died."""
        opened = self.channel.from_core.open(frames)
        if opened is None or len(opened) != 1:
            self._drop(f"a {len(frames)}-frame message that failed authentication")
            return None
        try:
            out = OUTPUTS_DECODER.decode(opened[0])
        except msgspec.MsgspecError as e:
            self._drop(f"an undecodable message ({e})")
            return None
        if out.engine_dead:  # believed: the channel admits only our own core
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
        self.channel.close()  # the sockets, the gatekeeper and the private directory


def make_client(engine_args: EngineArgs, multiprocess: bool, startup_timeout_s: float = 300.0):
    return MPClient(engine_args, startup_timeout_s) if multiprocess else InprocClient(engine_args)


__all__ = ["EngineDeadError", "InprocClient", "MPClient", "make_client"]
