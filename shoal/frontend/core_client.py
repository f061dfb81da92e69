"""`EngineCoreClient`: how the frontend reaches the engine core.

A client is made first, then `start(config)` builds the core, then `wait_until_ready()` waits
for it. A multiprocess client starts the engine-core process when it is made, before the config
exists, so that the process's start-up (seconds of importing torch, transformers and the model
code) overlaps with the frontend building the config and loading the tokenizer.

- `InprocClient`: the core in this process, stepped on demand (tests, simplest offline use).
- `SyncMPClient`: the core in its own process over ZeroMQ; what `LLM` uses by default.
- `AsyncMPClient`: the same for asyncio; what `AsyncLLM` and the server use. A reader thread
  receives and decodes outputs off the event loop and hands them over with
  `call_soon_threadsafe`.

If the engine-core process dies, a monitor thread notices (the process sentinel) and delivers
an ENGINE_DEAD message through the output socket, so every waiting caller gets
`EngineDeadError` instead of hanging.

Over tcp:// both sockets are CURVE-authenticated and encrypted with keys made for this engine
(`shoal/socket_auth.py`); over ipc:// they live in a directory only this user can enter.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import weakref
from abc import ABC, abstractmethod
from collections import deque
from typing import Any

import zmq

from shoal import rl_verbs, socket_auth
from shoal.config import EngineConfig
from shoal.engine_core.utilities import call_utility
from shoal.errors import EngineDeadError
from shoal.protocol import (
    Abort,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    MessageType,
    UtilityOutput,
    UtilityRequest,
    decode,
    encode,
)

logger = logging.getLogger(__name__)

# How often the in-process asyncio client looks whether a "wait" pause has settled.
_SETTLE_POLL_S = 0.01

_MAIN_GUARD_HINT = (
    "shoal starts its engine core in a new process (spawn), which imports your script again. "
    "Create the LLM under `if __name__ == '__main__':` so that the import does not start "
    "another engine."
)


class EngineCoreClient(ABC):
    @abstractmethod
    def start(self, config: EngineConfig) -> None:
        """Build the engine core for `config`; it may still be starting when this returns."""

    @abstractmethod
    def wait_until_ready(self) -> None:
        """Block until the engine core is built and can take requests."""

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs (blocks until the core has some)."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any:
        """Call an `EngineCore` method (collective_rpc, reset_prefix_cache, get_stats, ...)."""

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    core: Any = None
    _finalizer: weakref.finalize | None = None

    def start(self, config: EngineConfig) -> None:
        from shoal.engine_core.engine_core import EngineCore

        self.core = EngineCore(config)
        # The core sits in reference cycles (its executor, worker and model runner point back at
        # each other), so dropping the client would leave the model and the KV cache to some
        # later garbage collection: a second engine made right after `del llm` would find the
        # device still full. The finalizer shuts the core down as soon as the client goes.
        self._finalizer = weakref.finalize(self, self.core.shutdown)

    def wait_until_ready(self) -> None:
        pass  # `start` built the core

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        if self.core.side_outputs:  # landed steps or aborted requests of a pause or sleep
            return self.core.side_outputs.popleft()
        return self.core.step()

    def call_utility(self, method: str, *args: Any) -> Any:
        result = call_utility(self.core, method, args)
        if rl_verbs.settles(method):
            # A "wait" pause returns once its requests have finished: step them here, keeping
            # their outputs for get_output (asleep, nothing could run: return at once).
            while not self.core.settle_pause() and self.core.has_work():
                self.core.side_outputs.append(self.core.step())
        return result

    def shutdown(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs core.shutdown once, however often this is called


# ---- the engine-core process and its sockets --------------------------------------------------


def make_addresses(transport: str = "ipc", host: str = "127.0.0.1") -> tuple[str, str, str | None]:
    """Input and output socket addresses, and the private directory of ipc sockets.

    ipc:// sockets live in a fresh directory only this user can enter (mode 0700); tcp://
    addresses bind to `host` (loopback unless told otherwise) on a port the OS picks at bind
    time (`*`: a port found free beforehand could be taken before the bind), and the sockets on
    them are CURVE-authenticated (see `MPClient`).
    """
    if transport == "ipc":
        directory = tempfile.mkdtemp(prefix="shoal-")
        os.chmod(directory, 0o700)
        return f"ipc://{directory}/input", f"ipc://{directory}/output", directory
    if transport != "tcp":
        raise ValueError(f"engine-core transport must be 'ipc' or 'tcp', got {transport!r}")
    return f"tcp://{host}:*", f"tcp://{host}:*", None


_LIVE_CLIENTS: weakref.WeakSet[MPClient] = weakref.WeakSet()

# How long a shutdown waits for the engine-core process to stop its workers and exit before
# killing it (its Ray actors and placement group then go with its Ray job).
ENGINE_EXIT_TIMEOUT_S = 15.0


@atexit.register
def _shutdown_live_clients() -> None:
    """Stop engine-core processes still running when the interpreter exits (before
    multiprocessing's own exit handler kills them and the monitors report a death)."""
    for client in list(_LIVE_CLIENTS):
        client.shutdown()


class EngineProcessResources:
    """What a multiprocess client owns outside Python's heap: the engine-core process, the
    ZeroMQ context and sockets, the config pipe and the ipc directory.

    The client holds this object, and so do its monitor and reader threads and the finalizer
    that releases it, never the reverse: a thread holding the client (a bound method as its
    target) would keep it alive forever, so that dropping the last reference to an `LLM` would
    stop nothing. `release` runs once, from `shutdown()`, from garbage collection or at exit.
    """

    def __init__(self, context: zmq.Context, ipc_dir: str | None) -> None:
        self.context = context
        self.ipc_dir = ipc_dir
        self.stopping = threading.Event()
        self.sockets: list[zmq.Socket] = []  # the ones this (the caller's) thread closes
        self.authenticator: Any = None
        self.config_sender: multiprocessing.connection.Connection | None = None
        self.process: multiprocessing.process.BaseProcess | None = None
        self.threads: list[threading.Thread] = []  # the monitor and the output reader

    def release(self) -> None:
        """Stop the engine-core process (SIGTERM: it shuts its executor down; killed if it has
        not exited within ENGINE_EXIT_TIMEOUT_S), then close the sockets and the context."""
        self.stopping.set()
        if self.config_sender is not None:
            self.config_sender.close()
        if self.process is not None:
            stop_process(self.process, ENGINE_EXIT_TIMEOUT_S)
        if threading.current_thread() in self.threads:
            # Garbage collection can run this on the reader thread, whose socket term() waits
            # for: finish in a thread of its own once the reader has closed it.
            threading.Thread(target=self._close_sockets, name="shoal-client-close", daemon=True).start()
        else:
            self._close_sockets()

    def _close_sockets(self) -> None:
        for zmq_socket in self.sockets:
            zmq_socket.close(linger=0)
        if self.authenticator is not None:  # its sockets would hold term() up
            self.authenticator.stop()
        # A reader thread's socket is closed by the reader itself when term() wakes its recv
        # (a ZeroMQ socket must only be touched by one thread at a time).
        self.context.term()
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


def stop_process(process: multiprocessing.process.BaseProcess, timeout_s: float) -> None:
    """SIGTERM, wait up to `timeout_s` for the exit, then SIGKILL."""
    if process.is_alive():
        process.terminate()
        process.join(timeout=timeout_s)
    if process.is_alive():
        logger.warning("the engine-core process did not exit within %g s of SIGTERM: killing it", timeout_s)
        process.kill()
        process.join(timeout=5)


class MPClient:
    """Starts the engine-core process and owns the two sockets to it, and the pipe that
    carries the process its config (all in `EngineProcessResources`, released by `shutdown()`
    or when the client is garbage-collected)."""

    def __init__(self, transport: str = "ipc") -> None:
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            raise RuntimeError(_MAIN_GUARD_HINT)
        self._reader_started = False
        # Set once ENGINE_DEAD arrives; every later call raises it.
        self.dead_error: EngineDeadError | None = None
        self.num_kv_blocks: int | None = None
        self.context = zmq.Context()
        input_address, output_address, ipc_dir = make_addresses(transport)
        self._resources = resources = EngineProcessResources(self.context, ipc_dir)
        self._finalizer = weakref.finalize(self, resources.release)
        # tcp:// may be reachable from other hosts: only the engine core's key gets through.
        self._keys = socket_auth.EngineKeys.generate() if input_address.startswith("tcp://") else None
        if self._keys is not None:
            resources.authenticator = socket_auth.start_authenticator(self.context, self._keys)
        self.input_socket = self._bound_socket(zmq.PUSH, input_address)
        self.output_socket = self._bound_socket(zmq.PULL, output_address)
        resources.sockets += [self.input_socket, self.output_socket]
        # The addresses as bound: a tcp:// port the OS picked.
        self.input_address = input_address = self.input_socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.output_address = self.output_socket.getsockopt_string(zmq.LAST_ENDPOINT)
        from shoal.engine_core.process import run_engine_core_process

        spawn = multiprocessing.get_context("spawn")
        config_receiver, self._config_sender = spawn.Pipe(duplex=False)
        resources.config_sender = self._config_sender
        self.process = spawn.Process(
            target=run_engine_core_process,
            # The engine core's keys travel with its arguments (a local pipe), never on a socket.
            args=(config_receiver, input_address, self.output_address, self._core_keys),
            name="shoal-engine-core",
            daemon=True,
        )
        self.process.start()
        resources.process = self.process
        config_receiver.close()
        _LIVE_CLIENTS.add(self)

    @property
    def engine_core_pid(self) -> int | None:
        return self.process.pid

    @property
    def _shutting_down(self) -> bool:
        return self._resources.stopping.is_set()

    @property
    def _core_keys(self) -> socket_auth.EngineCoreKeys | None:
        return None if self._keys is None else self._keys.engine_core

    def _bound_socket(self, kind: int, address: str) -> zmq.Socket:
        socket = self.context.socket(kind)
        if self._keys is not None:
            socket_auth.secure_server(socket, self._keys)
        socket.bind(address)
        return socket

    def start(self, config: EngineConfig) -> None:
        with contextlib.suppress(BrokenPipeError):  # the process died: wait_until_ready reports it
            self._config_sender.send(config)
        self._config_sender.close()

    def wait_until_ready(self) -> None:
        """Wait for READY; a process that dies or reports failure first becomes an error."""
        while True:
            if self.output_socket.poll(timeout=200):
                kind, message = decode(self.output_socket.recv_multipart())
                if kind == MessageType.READY:
                    self.num_kv_blocks = message.num_kv_blocks
                    break
                if kind == MessageType.ENGINE_DEAD:
                    self.shutdown()
                    raise _core_error(message.message, "the engine core failed to start")
            elif not self.process.is_alive():
                code = self.process.exitcode
                self.shutdown()
                raise RuntimeError(
                    f"the engine-core process exited during start-up (exit code {code}). " + _MAIN_GUARD_HINT
                )
        # The monitor gets what it needs, not the client (see EngineProcessResources).
        self._monitor = threading.Thread(
            target=_watch_process,
            args=(self._resources, self.process, self.output_address, self._core_keys),
            name="shoal-core-monitor",
            daemon=True,
        )
        self._resources.threads.append(self._monitor)
        self._monitor.start()

    def _send(self, kind: MessageType, message: Any) -> None:
        """Send to the engine core. A PUSH socket whose peer is gone blocks forever, so wait for
        room in slices and fail once the process has died."""
        frames = encode(kind, message)
        while True:
            try:
                self.input_socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                if not self.process.is_alive():
                    raise EngineDeadError(f"the engine-core process died (exit code {self.process.exitcode})") from None
                self.input_socket.poll(timeout=100, flags=zmq.POLLOUT)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_error is None and not self._shutting_down:
            with contextlib.suppress(EngineDeadError):  # a dead engine has nothing left to abort
                self._send(MessageType.ABORT, Abort(request_ids))

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    def shutdown(self) -> None:
        """Stop the engine-core process and release the sockets (idempotent)."""
        _LIVE_CLIENTS.discard(self)
        self._finalizer()


def _watch_process(
    resources: EngineProcessResources,
    process: multiprocessing.process.BaseProcess,
    output_address: str,
    core_keys: socket_auth.EngineCoreKeys | None,
) -> None:
    """Turn the engine-core process's death into an ENGINE_DEAD message for whoever is waiting."""
    multiprocessing.connection.wait([process.sentinel])
    if resources.stopping.is_set():
        return
    message = f"the engine-core process died (exit code {process.exitcode})"
    logger.error(message)
    try:
        notifier = resources.context.socket(zmq.PUSH)
    except zmq.ZMQError:  # shut down meanwhile
        return
    if core_keys is not None:  # it speaks for the engine core
        socket_auth.secure_client(notifier, core_keys)
    notifier.connect(output_address)
    notifier.send_multipart(encode(MessageType.ENGINE_DEAD, EngineDead(message)))
    notifier.close(linger=1000)


class SyncMPClient(MPClient, EngineCoreClient):
    def __init__(self, transport: str = "ipc") -> None:
        super().__init__(transport)
        self._pending: deque[EngineCoreOutputs] = deque()
        self._call_ids = itertools.count()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self._send(MessageType.ADD, request)

    def get_output(self) -> EngineCoreOutputs:
        if self._pending:
            return self._pending.popleft()
        while True:
            kind, message = self._receive()
            if kind == MessageType.OUTPUTS:
                return message

    def call_utility(self, method: str, *args: Any) -> Any:
        self._check_alive()
        call_id = next(self._call_ids)
        self._send(MessageType.UTILITY, UtilityRequest(call_id, method, list(args)))
        while True:
            kind, message = self._receive()
            if kind == MessageType.OUTPUTS:
                self._pending.append(message)
            elif kind == MessageType.UTILITY_OUTPUT and message.call_id == call_id:
                return _utility_result(message)

    def _receive(self) -> tuple[MessageType, Any]:
        kind, message = decode(self.output_socket.recv_multipart())
        if kind == MessageType.ENGINE_DEAD:
            self.dead_error = EngineDeadError(message.message)
            raise self.dead_error
        return kind, message


class AsyncMPClient(MPClient):
    """The asyncio client. Outputs arrive through `get_output_async`; utility calls are
    matched to their replies by call id."""

    def __init__(self, transport: str = "ipc") -> None:
        super().__init__(transport)
        self._call_ids = itertools.count()
        self._calls: dict[int, asyncio.Future] = {}
        self._outputs: asyncio.Queue[EngineCoreOutputs | EngineDeadError] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _ensure_reader(self) -> asyncio.Queue:
        """Start the reader thread on first use, bound to the running event loop. From then on
        the output socket is the reader's (it closes it), and the reader reaches this client
        through a weak reference only (see EngineProcessResources)."""
        if self._outputs is None:
            self._loop = asyncio.get_running_loop()
            self._outputs = asyncio.Queue()
            self._reader_started = True
            self._resources.sockets.remove(self.output_socket)
            reader = threading.Thread(
                target=_read_outputs,
                args=(self.output_socket, self._loop, weakref.WeakMethod(self._dispatch)),
                name="shoal-output-reader",
                daemon=True,
            )
            self._resources.threads.append(reader)
            reader.start()
        return self._outputs

    def _dispatch(self, kind: MessageType, message: Any) -> None:
        assert self._outputs is not None
        if kind == MessageType.OUTPUTS:
            self._outputs.put_nowait(message)
        elif kind == MessageType.UTILITY_OUTPUT:
            future = self._calls.pop(message.call_id, None)
            if future is not None and not future.done():
                try:
                    future.set_result(_utility_result(message))
                except Exception as exc:
                    future.set_exception(exc)
        elif kind == MessageType.ENGINE_DEAD:
            self.dead_error = EngineDeadError(message.message)
            self._outputs.put_nowait(self.dead_error)
            for future in self._calls.values():
                if not future.done():
                    future.set_exception(self.dead_error)
            self._calls.clear()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._ensure_reader()
        self._check_alive()
        self._send(MessageType.ADD, request)

    async def get_output_async(self) -> EngineCoreOutputs:
        item = await self._ensure_reader().get()
        if isinstance(item, EngineDeadError):
            self._ensure_reader().put_nowait(item)  # every later reader sees it too
            raise item
        return item

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._ensure_reader()
        self._check_alive()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(MessageType.UTILITY, UtilityRequest(call_id, method, list(args)))
        return await future


def _read_outputs(socket: zmq.Socket, loop: asyncio.AbstractEventLoop, dispatch: weakref.WeakMethod) -> None:
    """The output reader thread: receive and decode, then hand each message to the client's
    `_dispatch` on its event loop, until the context is terminated or the client is gone."""
    try:
        while True:
            frames = socket.recv_multipart(copy=False)
            kind, message = decode([f.buffer for f in frames])
            handler = dispatch()
            if handler is None:
                return
            loop.call_soon_threadsafe(handler, kind, message)
            del handler
            if kind == MessageType.ENGINE_DEAD:
                return
    except (zmq.ContextTerminated, zmq.ZMQError, RuntimeError):
        return  # shut down (the loop or the context is closed)
    finally:
        socket.close(linger=0)


def _utility_result(reply: UtilityOutput) -> Any:
    if reply.error is None:
        return reply.result
    raise _core_error(reply.error, "engine-core call failed")


def _core_error(message: str, context: str) -> Exception:
    """The engine core reports a failure as "Type: message"; a bad argument stays a ValueError,
    as it would be in-process, anything else becomes a RuntimeError."""
    if message.startswith("ValueError: "):
        return ValueError(message.removeprefix("ValueError: "))
    return RuntimeError(f"{context}: {message}")


class AsyncInprocClient:
    """The core in this process for `AsyncLLM(multiprocess=False)`: each step runs in a worker
    thread so the event loop stays responsive; a lock keeps the core single-threaded."""

    engine_core_pid = None
    dead_error: EngineDeadError | None = None
    core: Any = None

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._work: asyncio.Event | None = None

    def start(self, config: EngineConfig) -> None:
        from shoal.engine_core.engine_core import EngineCore

        self.core = EngineCore(config)
        self.num_kv_blocks = self.core.num_kv_blocks

    def wait_until_ready(self) -> None:
        pass  # `start` built the core

    def add_request(self, request: EngineCoreRequest) -> None:
        with self._lock:
            self.core.add_request(request)
        self._wake().set()

    def abort_requests(self, request_ids: list[str]) -> None:
        with self._lock:
            self.core.abort_requests(request_ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        while True:
            with self._lock:
                if self.core.side_outputs:  # landed steps or aborted requests of a pause or sleep
                    return self.core.side_outputs.popleft()
                has_work = self.core.has_work()
            if has_work:
                return await asyncio.to_thread(self._locked, self.core.step)
            await self._wake().wait()
            self._wake().clear()

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        try:
            result = await asyncio.to_thread(self._locked, call_utility, self.core, method, args)
            if rl_verbs.settles(method):
                # A "wait" pause returns once its requests have finished; the output handler
                # steps them meanwhile.
                while not await asyncio.to_thread(self._locked, self.core.settle_pause):
                    await asyncio.sleep(_SETTLE_POLL_S)
            return result
        finally:
            self._wake().set()  # the call may have made outputs or work (a resume, a wake-up)

    def _locked(self, fn: Any, *args: Any) -> Any:
        with self._lock:
            return fn(*args)

    def _wake(self) -> asyncio.Event:
        if self._work is None:
            self._work = asyncio.Event()
        return self._work

    def shutdown(self) -> None:
        if self.core is not None:
            self.core.shutdown()
