"""The engine core in its own process: the synchronous client behind `LLM`, the asyncio client
behind `AsyncLLM`, what happens when the process dies, and over tcp:// that only the engine's own
keys get through its sockets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import zmq

from shoal import LLM, SamplingParams
from shoal.config import EngineArgs
from shoal.errors import EngineDeadError
from shoal.frontend.async_llm import AsyncLLM
from shoal.frontend.output_processor import OutputKind
from shoal.protocol import EngineCoreOutput, EngineCoreOutputs, MessageType, encode
from shoal.socket_auth import EngineCoreKeys, secure_client

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Hello world! This is", "one two three four"]


@pytest.fixture(scope="module")
def llama(tiny_checkpoints: dict) -> str:
    return str(tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def expected(llama: str) -> list[list[int]]:
    llm = LLM(llama, multiprocess=False)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.timeout(120)  # a stolen request would never finish
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_multiprocess_llm_equals_in_process(llama: str, expected: list, transport: str, monkeypatch) -> None:
    """Over tcp:// with intruders at both sockets: peers with no key, or a key pair of their own,
    that try to take requests off the input socket and to forge outputs into the output socket;
    they get nothing through, and the engine serves its frontend as if they were not there."""
    from shoal.frontend import core_client

    real = core_client.make_addresses
    monkeypatch.setattr(core_client, "make_addresses", lambda *a: real(transport))
    with LLM(llama) as llm:
        assert isinstance(llm.engine_core, core_client.SyncMPClient)
        assert llm.engine_core.engine_core_pid != os.getpid()
        intruders = Intruders(llm.engine_core) if transport == "tcp" else None
        try:
            outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        finally:
            stolen = intruders.stop() if intruders is not None else []
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert stolen == []
        assert llm.collective_rpc("report_device") == ["cpu"]
        assert llm.get_stats()["num_used_blocks"] == 0


class Intruders:
    """A thread of peers without the engine core's keys: at the input socket, PULLs that would
    take requests; at the output socket, PUSHes that keep sending outputs finishing request "0"
    (the first of `LLM.generate`) with made-up tokens, every 10 ms."""

    def __init__(self, client: object) -> None:
        public_key, secret_key = zmq.curve_keypair()
        # It knows the frontend's public key (no secret), but has a key pair of its own.
        own_keys = EngineCoreKeys(client._keys.public_key, public_key, secret_key)  # type: ignore[attr-defined]
        self._keys = [None, own_keys]
        self._addresses = (client.input_address, client.output_address)  # type: ignore[attr-defined]
        self._stop = threading.Event()
        self._stolen: list[bytes] = []
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        context = zmq.Context()
        input_address, output_address = self._addresses
        thieves = [self._socket(context, zmq.PULL, input_address, keys) for keys in self._keys]
        forgers = [self._socket(context, zmq.PUSH, output_address, keys) for keys in self._keys]
        forged = encode(
            MessageType.OUTPUTS, EngineCoreOutputs([EngineCoreOutput("0", [1, 2, 3], finish_reason="stop")])
        )
        time.sleep(0.5)  # their handshakes are tried (and refused) before the requests go out
        self._ready.set()
        while not self._stop.wait(0.01):
            for forger in forgers:
                with contextlib.suppress(zmq.Again):  # no connection to send on
                    forger.send_multipart(forged, flags=zmq.NOBLOCK)
            for thief in thieves:
                while thief.poll(timeout=0):
                    self._stolen.append(thief.recv())
        context.destroy(linger=0)

    @staticmethod
    def _socket(context: zmq.Context, kind: int, address: str, keys: EngineCoreKeys | None) -> zmq.Socket:
        socket = context.socket(kind)
        if keys is not None:
            secure_client(socket, keys)
        socket.connect(address)
        return socket

    def stop(self) -> list[bytes]:
        """Stop; what the thieves received."""
        self._stop.set()
        self._thread.join(10)
        return self._stolen


def test_killed_engine_process_raises_engine_dead_quickly(llama: str) -> None:
    llm = LLM(llama)
    try:
        os.kill(llm.engine_core.engine_core_pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="died"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=10_000, ignore_eos=True), use_tqdm=False)
        assert time.monotonic() - start < 5
        with pytest.raises(EngineDeadError):
            llm.get_stats()
    finally:
        llm.shutdown()


def test_requests_after_the_engine_process_is_gone_fail_instead_of_hanging(llama: str) -> None:
    """Once the process is gone, its input socket has no peer, and a plain send would block."""
    llm = LLM(llama)
    try:
        os.kill(llm.engine_core.engine_core_pid, signal.SIGKILL)
        llm.engine_core.process.join(timeout=10)
        time.sleep(0.5)  # ZeroMQ notices the disconnect
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="died"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        with pytest.raises(EngineDeadError):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 5
    finally:
        llm.shutdown()


def test_unguarded_script_gets_a_clear_message(tmp_path, llama: str) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(f"""
        from shoal import LLM
        llm = LLM({llama!r})
    """)
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "if __name__ == '__main__':" in result.stderr


@pytest.fixture(scope="module")
def runner():
    """One event loop for the module: an AsyncLLM serves the loop it was first used in."""
    with asyncio.Runner() as loop_runner:
        yield loop_runner


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def async_llm(llama: str, request: pytest.FixtureRequest):
    """The server's engine, with the engine core scheduling one step at a time and, as on a GPU,
    one step ahead (`async_scheduling`): streams, aborts and n>1 must behave the same."""
    engine = AsyncLLM(EngineArgs(model=llama, async_scheduling=request.param))
    yield engine
    engine.shutdown()


async def collect(engine: AsyncLLM, prompt, params, request_id: str, kind=OutputKind.DELTA) -> list:
    return [out async for out in engine.generate(prompt, params, request_id, output_kind=kind)]


def test_async_llm_streams_the_same_tokens(async_llm: AsyncLLM, expected: list, runner) -> None:
    async def main() -> list:
        return await asyncio.gather(*(collect(async_llm, p, GREEDY, f"r{i}") for i, p in enumerate(PROMPTS)))

    streams = runner.run(main())
    for stream, tokens in zip(streams, expected):
        assert len(stream) > 1  # really streamed, not one final output
        assert [t for out in stream for t in out.outputs[0].token_ids] == tokens
        assert stream[-1].finished and not any(out.finished for out in stream[:-1])


def test_async_llm_cancelling_a_stream_aborts_the_request(async_llm: AsyncLLM, runner) -> None:
    async def main() -> dict:
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        stream = async_llm.generate("The quick brown fox", long, "to-cancel")
        await stream.__anext__()
        await stream.aclose()
        for _ in range(100):  # the abort reaches the core within a step or two
            stats = await async_llm.get_stats()
            if stats["num_running_reqs"] == 0:
                break
            await asyncio.sleep(0.05)
        return stats

    stats = runner.run(main())
    assert stats["num_running_reqs"] == 0 and stats["num_used_blocks"] == 0


def test_async_llm_n_and_bad_input(async_llm: AsyncLLM, runner) -> None:
    async def main() -> list:
        params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)
        final = await collect(async_llm, "Hello", params, "n2", OutputKind.FINAL_ONLY)
        with pytest.raises(ValueError, match="out of the vocabulary"):
            await collect(async_llm, [10**9], GREEDY, "bad")
        return final

    (final,) = runner.run(main())
    assert [c.index for c in final.outputs] == [0, 1]
    assert all(len(c.token_ids) == 5 for c in final.outputs)


def test_async_llm_engine_death_fails_open_streams(llama: str) -> None:
    engine = AsyncLLM(EngineArgs(model=llama))

    async def main() -> float:
        stream = engine.generate("Hello", SamplingParams(max_tokens=100_000, ignore_eos=True), "doomed")
        await stream.__anext__()
        os.kill(engine.engine_core_pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        return time.monotonic() - start

    try:
        assert asyncio.run(main()) < 5
        assert engine.errored
    finally:
        engine.shutdown()


def test_async_llm_refuses_a_second_event_loop(async_llm: AsyncLLM, runner) -> None:
    runner.run(collect(async_llm, "Hello", GREEDY, "first-loop"))
    with pytest.raises(RuntimeError, match="event loop"):
        asyncio.run(collect(async_llm, "Hello", GREEDY, "other-loop"))
