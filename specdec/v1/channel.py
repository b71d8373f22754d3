"""The front end <-> engine-core channel: private, authenticated, one peer per socket.

Two ZeroMQ PAIR sockets over ipc, bound by the front end and connected by the core it spawned: ``in`` carries
the front end's messages to the core, ``out`` the core's outputs back. What keeps other processes out:

- **a private directory**: the socket files live in a ``mkdtemp`` directory (mode 0700), so no other user can
  reach them, whatever the umask;
- **one peer per socket**: a PAIR socket attaches exactly one peer and refuses later ones;
- **the peer is the core**: a ZAP handler (:class:`_Gatekeeper`) admits a connection only from the core's
  process id and our user id (the kernel's peer credentials of the ipc socket, which libzmq hands to ZAP) and,
  under CURVE, only with the core's public key;
- **a per-launch secret**: with CURVE (``zmq.has("curve")``) the front end generates the server's and the
  core's key pairs; the session then encrypts and authenticates every frame, and a peer without the keys
  cannot finish the handshake. Without CURVE every message carries an HMAC-SHA256 over (direction, sequence
  number, frames) under a random key: a forged, garbled or replayed message fails it and is dropped;
- the secrets reach the core through an inherited pipe, never argv or the environment (both readable in
  /proc by every process of the user);
- before sending anything the front end waits for an authenticated hello on ``in`` and the core's ready on
  ``out``, so a request never goes to a peer that has not proven it is the core.

A frame that fails to open is the caller's protocol error to log and drop, never a reason to think the core
dead. Knows nothing about what the messages mean (protocol.py does).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import shutil
import tempfile
import threading
import weakref
from typing import Any

HMAC_SIZE = 32  # bytes of the HMAC-SHA256 frame in front of each message when CURVE is unavailable
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler (RFC 27)


class Sealer:
    """One direction of one socket: ``seal`` adds the HMAC frame, ``open`` checks and strips it (None when it
    fails). Each side counts the messages, so the sequence number is never sent and a replay fails. Without a
    key (CURVE authenticates the session) both are the identity."""

    def __init__(self, key: bytes | None, label: bytes) -> None:
        self.key, self.label, self.seq = key, label, 0

    def _mac(self, frames: list[bytes]) -> bytes:
        h = hmac.new(self.key, self.label + self.seq.to_bytes(8, "little"), hashlib.sha256)
        for f in frames:
            h.update(len(f).to_bytes(8, "little"))
            h.update(f)
        return h.digest()

    def seal(self, frames: list[bytes]) -> list[bytes]:
        if self.key is None:
            return frames
        mac = self._mac(frames)
        self.seq += 1
        return [mac, *frames]

    def open(self, frames: list[bytes]) -> list[bytes] | None:
        if self.key is None:
            return frames
        if len(frames) < 2 or not hmac.compare_digest(frames[0], self._mac(frames[1:])):
            return None
        self.seq += 1
        return frames[1:]


HELLO = b"specdec-core-hello"  # the core's first message on ``in``: proves the peer there is the core


class _Gatekeeper(threading.Thread):
    """The context's ZAP handler: admits a connection only from ``peer_pid`` under our user id (where the
    transport gives peer credentials: ipc on Linux, as ``host:uid:gid:pid``) and, under CURVE, only with the
    core's public key. Until ``peer_pid`` is set (the core is being spawned) it refuses everyone."""

    def __init__(self, ctx, client_public: bytes | None) -> None:
        import zmq

        super().__init__(name="specdec-core-zap", daemon=True)
        self.client_public = client_public  # raw 32 bytes under CURVE, None under HMAC
        self.peer_pid: int | None = None
        self.refused: list[str] = []  # the addresses refused, for the log and the tests
        self._sock = ctx.socket(zmq.REP)
        self._sock.linger = 0
        self._sock.bind(_ZAP_ENDPOINT)
        self._halt = threading.Event()

    def admits(self, address: str, mechanism: bytes, credentials: list[bytes]) -> bool:
        if self.peer_pid is None:
            return False
        parts = address.rsplit(":", 3)
        if len(parts) == 4 and all(p.isdigit() for p in parts[1:]):
            if int(parts[1]) != os.getuid() or int(parts[3]) != self.peer_pid:
                return False
        if self.client_public is None:
            return mechanism == b"NULL"
        return mechanism == b"CURVE" and len(credentials) == 1 and hmac.compare_digest(credentials[0],
                                                                                         self.client_public)

    def run(self) -> None:
        import zmq

        while not self._halt.is_set():
            try:
                if not self._sock.poll(100):
                    continue
                msg = self._sock.recv_multipart()
            except zmq.ZMQError:
                return  # the context is going away
            if len(msg) < 6:
                continue  # not a ZAP request; REP needs a reply, but libzmq never sends these
            version, request_id, _domain, address, _identity, mechanism = msg[:6]
            ok = version == b"1.0" and self.admits(address.decode("utf-8", "replace"), mechanism, msg[6:])
            if not ok:
                self.refused.append(address.decode("utf-8", "replace"))
            self._sock.send_multipart([b"1.0", request_id, b"200" if ok else b"400",
                                       b"OK" if ok else b"not the engine core", b"", b""])

    def stop(self) -> None:
        self._halt.set()
        self.join(2)
        self._sock.close(linger=0)


class FrontEndChannel:
    """The front end's side: makes the directory, the secrets and both sockets; ``secret_fd()`` is the pipe the
    core reads them from; ``expect_peer(pid)`` once the core is spawned."""

    def __init__(self, curve: bool | None = None) -> None:
        import zmq
        from zmq.utils import z85

        self.curve = zmq.has("curve") if curve is None else curve
        if self.curve and not zmq.has("curve"):
            raise ValueError("curve=True but this pyzmq's libzmq has no CURVE (zmq.has('curve') is False); "
                             "pass curve=None to fall back to per-message HMAC")
        base = tempfile.gettempdir()
        if len(base) > 80:  # ipc paths must fit sockaddr_un (~107 bytes)
            base = "/tmp"
        self.dir = tempfile.mkdtemp(prefix="specdec-core-", dir=base)  # mode 0700: this user only
        self._rmdir = weakref.finalize(self, shutil.rmtree, self.dir, True)  # at close, or at exit without one
        self.input_addr, self.output_addr = f"ipc://{self.dir}/in", f"ipc://{self.dir}/out"
        self.ctx = zmq.Context()
        if self.curve:
            server_public, server_secret = zmq.curve_keypair()
            client_public, client_secret = zmq.curve_keypair()
            self._secrets = {"curve": True, "server_public": server_public.decode(),
                             "public": client_public.decode(), "secret": client_secret.decode()}
            key = None
            self.server_public = server_public  # z85; for the tests' forged peers that know it
        else:
            key = secrets.token_bytes(32)
            self._secrets = {"curve": False, "key": key.hex()}
        self.gate = _Gatekeeper(self.ctx, z85.decode(client_public) if self.curve else None)
        self.gate.start()
        self.input = self._bind(zmq, self.input_addr, server_secret if self.curve else None)
        self.output = self._bind(zmq, self.output_addr, server_secret if self.curve else None)
        self.to_core = Sealer(key, b"in>core")
        self.hello = Sealer(key, b"in>front")
        self.from_core = Sealer(key, b"out>front")

    def _bind(self, zmq, addr: str, server_secret: bytes | None):
        sock = self.ctx.socket(zmq.PAIR)
        sock.zap_domain = b"specdec"  # ask the gatekeeper under NULL too (CURVE always asks)
        if server_secret is not None:
            sock.curve_server = True
            sock.curve_secretkey = server_secret
        sock.bind(addr)
        return sock

    def secret_fd(self) -> int:
        """The read end of a pipe holding the secrets (for ``Popen(pass_fds=...)``; close it after spawning)."""
        r, w = os.pipe()
        with os.fdopen(w, "w") as f:
            f.write(json.dumps(self._secrets))  # well under a pipe's buffer: never blocks
        return r

    def expect_peer(self, pid: int) -> None:
        self.gate.peer_pid = pid

    def close(self) -> None:
        self.gate.stop()
        for sock in (self.input, self.output):
            sock.close(linger=0)
        self.ctx.destroy(linger=0)
        self._rmdir()


class CoreChannel:
    """The core's side: reads the secrets from the inherited pipe, connects both sockets, says hello."""

    def __init__(self, input_addr: str, output_addr: str, secret_fd: int) -> None:
        import zmq

        with os.fdopen(secret_fd, "r") as f:
            s: dict[str, Any] = json.loads(f.read())
        self.ctx = zmq.Context()
        self.input = self._connect(zmq, input_addr, s)
        self.output = self._connect(zmq, output_addr, s)
        key = None if s["curve"] else bytes.fromhex(s["key"])
        self.from_front = Sealer(key, b"in>core")
        self.to_front = Sealer(key, b"out>front")
        self.input.send_multipart(Sealer(key, b"in>front").seal([HELLO]))

    def _connect(self, zmq, addr: str, s: dict[str, Any]):
        sock = self.ctx.socket(zmq.PAIR)
        if s["curve"]:
            sock.curve_serverkey = s["server_public"].encode()
            sock.curve_publickey = s["public"].encode()
            sock.curve_secretkey = s["secret"].encode()
        sock.connect(addr)
        return sock


__all__ = ["CoreChannel", "FrontEndChannel", "HELLO", "HMAC_SIZE", "Sealer"]
