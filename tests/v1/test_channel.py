"""The front end <-> engine-core channel against a forged local peer (#46): a process of the same user that finds
the core's sockets can neither read requests, nor inject outputs into a request's stream, nor make the front
end believe the core dead. Real ZeroMQ sockets and a real core process, under CURVE and under the HMAC
fallback; the forger tries what the issue's probes did (a second PULL on the input, a PUSH of a forged
EngineCoreOutput and of engine_dead, garbage frames) and the CURVE-aware attacks on top."""

import asyncio
import os
import stat
import time

import pytest
import zmq

from specdec import LLM, AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from specdec.entrypoints.engine_args import EngineArgs
from specdec.v1.channel import Sealer
from specdec.v1.client import MPClient
from specdec.v1.core import EngineCore
from specdec.v1.protocol import (
    EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType, FinishReason, UtilityOutput,
    encode,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 9], [1, 2, 3], [40, 41, 42, 43, 44]]
MODES = [pytest.param(True, id="curve", marks=pytest.mark.skipif(not zmq.has("curve"), reason="no CURVE")),
         pytest.param(False, id="hmac")]


def forged_outputs() -> list[list[bytes]]:
    """What a forger pushes at the front end: tokens into r0's stream and its finish, the core's death, garbage."""
    inject = EngineCoreOutputs(outputs=[EngineCoreOutput("r0", [66, 66, 66], finish_reason=FinishReason.STOP)],
                               finished_requests=["r0"])
    dead = EngineCoreOutputs(engine_dead=True, utility_output=UtilityOutput(-1, failure_message="forged death"))
    return [[encode(inject)], [encode(dead)], [b"\xc1 not msgpack"], [b"\x00" * 32, encode(dead)],
            [b"a", b"b", b"c"]]


def rogues(ctx, client: MPClient) -> dict[str, tuple]:
    """Forged peers on both sockets: (socket, address); CURVE ones with their own keys, and one that even
    knows the server's public key (CURVE mode) but not the core's secret key."""
    out = {}
    for name, kind in (("pull_in", zmq.PULL), ("pair_in", zmq.PAIR)):
        out[name] = (ctx.socket(kind), client.input_addr)
    for name, kind in (("push_out", zmq.PUSH), ("pair_out", zmq.PAIR)):
        out[name] = (ctx.socket(kind), client.output_addr)
    if client.channel.curve:
        for name, addr in (("curve_in", client.input_addr), ("curve_out", client.output_addr)):
            s = ctx.socket(zmq.PAIR)
            pub, sec = zmq.curve_keypair()
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = client.channel.server_public, pub, sec
            out[name] = (s, addr)
    for s, addr in out.values():
        s.linger = 0
        s.connect(addr)
    return out


def drain(client, ids, timeout=60.0):
    toks = {i: [] for i in ids}
    done = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(ids) and time.monotonic() < deadline:
        for o in client.get_output(timeout=1.0).outputs:
            toks[o.request_id] += o.new_token_ids
            if o.finished:
                done[o.request_id] = o
    return toks, done


@pytest.fixture(scope="module")
def reference():
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=128)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                         use_tqdm=False)]


@pytest.mark.parametrize("curve", MODES)
def test_a_forged_peer_can_neither_read_nor_inject_nor_kill(curve, reference):
    client = MPClient(EngineArgs(model="tiny-random-llama", max_num_seqs=4, max_model_len=128), 120, curve=curve)
    ctx = zmq.Context()
    try:
        assert client.channel.curve is curve
        # the sockets sit in a directory only this user can enter, made for this launch
        d = client.channel.dir
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700 and client.input_addr == f"ipc://{d}/in"
        # the secrets are in neither the core's command line nor its environment (both readable in /proc)
        for what in ("cmdline", "environ"):
            seen = open(f"/proc/{client.pid}/{what}", "rb").read()
            for secret in client.channel._secrets.values():
                assert not isinstance(secret, str) or secret.encode() not in seen, what
        peers = rogues(ctx, client)
        time.sleep(0.5)  # let every forger connect (or be refused) before the requests go out
        for i, p in enumerate(PROMPTS):
            client.add_request(EngineCoreRequest(f"r{i}", p, GREEDY, time.time()))
        first = client.get_output(timeout=30)  # r0 is running: now try to inject into it and to kill the core
        for name in ("push_out", "pair_out", "curve_out"):
            if name in peers:
                for frames in forged_outputs():
                    try:
                        peers[name][0].send_multipart(frames, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        pass  # refused before it could queue anything: as good
        toks, done = drain(client, [f"r{i}" for i in range(4)])
        for o in first.outputs:
            toks[o.request_id][:0] = o.new_token_ids
        # every request served whole, by the core, with the core's tokens: nothing read away, nothing injected
        assert [toks[f"r{i}"] for i in range(4)] == reference
        assert all(done[f"r{i}"].finish_reason is FinishReason.LENGTH for i in range(4))
        assert client.is_alive() and client.dead_reason is None and client.call_utility("ping") == "pong"
        # the forgers on the input side got nothing
        for name in ("pull_in", "pair_in", "curve_in"):
            if name in peers:
                assert not peers[name][0].poll(200), name
        # they did knock: the gatekeeper refused each one it was asked about (under CURVE a forger without the
        # server's key fails the handshake before ZAP is asked; one with it is refused for its key and pid)
        assert client.channel.gate.refused
    finally:
        ctx.destroy(linger=0)
        client.shutdown()
    assert not os.path.exists(d)  # the private directory goes with the client


def test_a_forged_engine_dead_does_not_restart_the_engine():
    """The async front end, the server's: a forged engine_dead and garbage pushed at its output socket while a
    request runs neither fail that request nor mark the engine dead (which would make the server restart it)."""
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def main():
        engine = await AsyncLLMEngine.from_engine_args(
            AsyncEngineArgs(model="tiny-random-llama", max_num_seqs=2, max_model_len=128, multiprocess=True))
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.PUSH)
            sock.linger = 0
            sock.connect(engine.client.output_addr)
            outs = []
            async for o in engine.generate({"prompt_token_ids": PROMPTS[0]}, long, "victim"):
                if not outs:
                    for frames in forged_outputs():
                        try:
                            sock.send_multipart(frames, flags=zmq.NOBLOCK)
                        except zmq.Again:
                            pass
                    await asyncio.sleep(0.3)
                outs.append(o)
            await engine.check_health()
            return outs[-1], engine.dead_error, engine.num_restarts
        finally:
            ctx.destroy(linger=0)
            await engine.shutdown_async()

    final, dead, restarts = asyncio.run(main())
    ref = LLM("tiny-random-llama", max_num_seqs=2, max_model_len=128).generate({"prompt_token_ids": PROMPTS[0]}, long,
                                                                               use_tqdm=False)[0]
    assert final.outputs[0].token_ids == ref.outputs[0].token_ids and final.outputs[0].finish_reason == "length"
    assert dead is None and restarts == 0


def test_the_hmac_rejects_forged_tampered_and_replayed_messages():
    key = os.urandom(32)
    tx, rx = Sealer(key, b"out>front"), Sealer(key, b"out>front")
    m1, m2 = tx.seal([b"one"]), tx.seal([b"two"])
    assert rx.open([m2[0], b"two"]) is None  # out of order: m2's MAC is for the second message
    assert rx.open(m1) == [b"one"]
    assert rx.open(m1) is None  # replayed
    assert rx.open([m2[0], b"tw0"]) is None  # tampered
    assert rx.open([b"\x00" * 32, b"two"]) is None and rx.open([b"two"]) is None  # forged, unsealed
    assert Sealer(os.urandom(32), b"out>front").open(tx.seal([b"three"])) is None  # another launch's key
    assert Sealer(key, b"in>core").open(Sealer(key, b"out>front").seal([b"x"])) is None  # the other direction
    assert rx.open(m2) == [b"two"]  # the failures did not advance the count


def test_the_core_drops_a_malformed_message_and_goes_on():
    core = EngineCore(EngineArgs(model="tiny-random-llama", max_num_seqs=2, max_model_len=64))
    for frames in ([b"\x07", b"x"], [EngineCoreRequestType.ADD.value, b"\xc1"], [b"\x00"],
                   [EngineCoreRequestType.ABORT.value, encode({"not": "a list"})]):
        assert core.handle(frames) is None
    assert core.num_dropped == 4
    ok = core.handle([EngineCoreRequestType.UTILITY.value, encode([3, "ping", []])])
    assert ok.utility_output.result == "pong"


@pytest.mark.parametrize("curve", MODES)
def test_a_peer_that_connects_before_the_core_does_not_take_its_place(curve):
    """A forger racing the core to the sockets (PAIR keeps the first peer it admits) is refused by the
    gatekeeper, so the core, spawned after it, still gets in and says hello; nothing of the forger's arrives."""
    import subprocess
    import sys

    from specdec.v1.channel import HELLO, FrontEndChannel

    ch = FrontEndChannel(curve)
    ctx = zmq.Context()
    proc = None
    try:
        for knows_server_key in ([False, True] if curve else [False]):
            early = ctx.socket(zmq.PAIR)
            early.linger = 0
            if knows_server_key:  # passes the CURVE handshake, so the gatekeeper is asked (and says no)
                pub, sec = zmq.curve_keypair()
                early.curve_serverkey, early.curve_publickey, early.curve_secretkey = ch.server_public, pub, sec
            early.connect(ch.input_addr)
            early.send(b"\x00forged", flags=zmq.NOBLOCK)  # queued: delivered the moment it were admitted
        time.sleep(0.3)
        fd = ch.secret_fd()
        code = ("import sys, time; from specdec.v1.channel import CoreChannel; "
                "CoreChannel(sys.argv[1], sys.argv[2], int(sys.argv[3])); time.sleep(10)")
        proc = subprocess.Popen([sys.executable, "-c", code, ch.input_addr, ch.output_addr, str(fd)], pass_fds=(fd,))
        os.close(fd)
        ch.expect_peer(proc.pid)
        assert ch.input.poll(20000), "the core's hello never arrived: the early peer holds the socket"
        assert ch.hello.open(ch.input.recv_multipart()) == [HELLO]
        assert not ch.input.poll(300)  # and the forger's message never does
        assert ch.gate.refused
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        ctx.destroy(linger=0)
        ch.close()
