"""The engine-core process: `EngineCore` plus two socket threads, so the busy loop never
waits on a socket.

    frontend ──PUSH──► input thread ──queue──► busy loop ──queue──► output thread ──PUSH──► frontend
                        (recv, decode)          schedule → execute → update   (encode, send)

The frontend starts this process before it has built the config, so that the seconds this
process spends importing torch, transformers and the model code overlap with the frontend's own
start-up; the config follows through a pipe (`run_engine_core_process`).

The frontend binds both sockets; this process connects (over tcp:// as a CURVE client, with the
keys the frontend handed it: `shoal/socket_auth.py`). Once the engine is built it sends READY;
if anything fails (start-up or a step) it sends ENGINE_DEAD with the reason and exits.
"""

from __future__ import annotations

import gc
import importlib
import logging
import queue
import signal
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from shoal import rl_verbs, socket_auth
from shoal.config import EngineConfig
from shoal.engine_core.engine_core import EngineCore
from shoal.engine_core.utilities import call_utility
from shoal.errors import EngineDeadError
from shoal.protocol import (
    EngineCoreRequest,
    EngineDead,
    EngineReady,
    MessageType,
    UtilityOutput,
    UtilityRequest,
    decode,
    encode,
)

logger = logging.getLogger(__name__)

# What an engine core imports whatever its model: the worker (torch, the model runner, layers
# and kernels), and a Hugging Face config class, since the config carries the model's; Llama's
# stands for all of them, which share the transformers machinery that makes up the cost.
_PRELOAD_MODULES = ("shoal.workers.worker", "transformers.models.llama.configuration_llama")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # Once: a second SIGTERM must not interrupt the shutdown the first one started.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(0)


def run_engine_core_process(
    config_pipe: Connection,
    input_address: str,
    output_address: str,
    keys: socket_auth.EngineCoreKeys | None = None,
) -> None:
    """The process's entry point (spawned by the multiprocess clients before the frontend has
    a config): import the heavy modules meanwhile, then run the engine core for the config that
    arrives through `config_pipe`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the frontend's to handle
    for name in _PRELOAD_MODULES:
        importlib.import_module(name)
    try:
        config = config_pipe.recv()
    except EOFError:  # the frontend stopped before it had a config (e.g. a bad argument)
        return
    finally:
        config_pipe.close()
    run_engine_core(config, input_address, output_address, keys)


def freeze_start_up_heap() -> None:
    """Take what start-up left alive (the modules of torch, transformers and Ray, the model, the
    CUDA graphs' Python objects) out of the garbage collector's reach. A full collection walks
    every tracked object, millions of them after start-up: a stall of a few hundred ms in the
    middle of a run (a profile of the Qwen3-0.6B nano run on one H200 showed the device idle
    236-296 ms at once while the host ran no recorded op). Frozen, the collector walks only
    what the steps allocate."""
    gc.collect()
    gc.freeze()


def run_engine_core(
    config: EngineConfig, input_address: str, output_address: str, keys: socket_auth.EngineCoreKeys | None = None
) -> None:
    """Run the engine core and its socket threads until SIGTERM or a failure; `keys` (tcp://)
    make both sockets CURVE clients of the frontend."""
    from shoal.logger import configure_logging

    configure_logging()
    # SIGTERM from the frontend ends the loop through SystemExit, so the executor shuts down.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the frontend's to handle
    context = zmq.Context()
    output_socket = _connected_socket(context, zmq.PUSH, output_address, keys)
    output_socket.setsockopt(zmq.LINGER, 2000)
    core: EngineCore | None = None
    proc: EngineCoreProc | None = None
    try:
        core = EngineCore(config)
        freeze_start_up_heap()
        proc = EngineCoreProc(core, context, input_address, output_socket, keys)
        proc.run_busy_loop()
    except SystemExit:
        pass
    except BaseException as exc:
        if isinstance(exc, EngineDeadError):  # workers died past what may be restarted: no bug
            logger.error("engine core stopped: %s", exc)
        else:
            logger.error("engine core failed:\n%s", traceback.format_exc())
        message = f"{type(exc).__name__}: {exc}"
        if proc is not None:
            proc.send_dead(message)
        else:
            output_socket.send_multipart(encode(MessageType.ENGINE_DEAD, EngineDead(message)))
        raise SystemExit(1) from exc
    finally:
        # The executor goes before the process does: its worker actors and placement group are
        # released now, not when Ray notices that this job has ended.
        if proc is not None:
            proc.shutdown()
        elif core is not None:
            shutdown_core(core)
        output_socket.close()
        context.term()


def _connected_socket(
    context: zmq.Context, kind: int, address: str, keys: socket_auth.EngineCoreKeys | None
) -> zmq.Socket:
    socket = context.socket(kind)
    if keys is not None:
        socket_auth.secure_client(socket, keys)
    socket.connect(address)
    return socket


class EngineCoreProc:
    def __init__(
        self,
        core: EngineCore,
        context: zmq.Context,
        input_address: str,
        output_socket: zmq.Socket,
        keys: socket_auth.EngineCoreKeys | None = None,
    ):
        self.core = core
        self._keys = keys
        self.input_queue: queue.Queue[tuple[MessageType, Any]] = queue.Queue()
        self.output_queue: queue.Queue[list[bytes] | None] = queue.Queue()
        self._output_socket = output_socket
        self._input_thread = threading.Thread(
            target=self._receive, args=(context, input_address), name="shoal-core-input", daemon=True
        )
        self._output_thread = threading.Thread(target=self._send, name="shoal-core-output", daemon=True)
        # Replies of pause calls not settled yet (`Verb.settles` in shoal/rl_verbs.py).
        self._unsettled_replies: list[list[bytes]] = []
        self._input_thread.start()
        self._output_thread.start()
        self.output_queue.put(encode(MessageType.READY, EngineReady(num_kv_blocks=core.num_kv_blocks)))

    # ---- the loop ---------------------------------------------------------------------------

    def run_busy_loop(self) -> None:
        """Take every waiting message (block only when idle: nothing to run, or generation
        held), then run one step."""
        while True:
            self._process_input(block=not self.core.has_work())
            if self.core.has_work():
                outputs = self.core.step()
                self.output_queue.put(encode(MessageType.OUTPUTS, outputs))
                if self._unsettled_replies:
                    self._reply_if_settled()

    def _process_input(self, block: bool) -> None:
        while block:
            try:
                # A timeout, not a bare get(): a wait with no timeout can hold off SIGTERM's
                # handler, which only runs between bytecodes of this (the main) thread.
                self._handle(*self.input_queue.get(timeout=0.5))
                break
            except queue.Empty:
                continue
        while not self.input_queue.empty():
            self._handle(*self.input_queue.get_nowait())

    def _handle(self, kind: MessageType, message: Any) -> None:
        if kind == MessageType.ADD:
            self._add_request(message)
        elif kind == MessageType.ABORT:
            self.core.abort_requests(message.request_ids)
        elif kind == MessageType.UTILITY:
            self._call_utility(message)

    def _add_request(self, request: EngineCoreRequest) -> None:
        try:
            self.core.add_request(request)
        except ValueError as exc:  # a duplicate id: refuse this request, keep serving
            logger.warning("refused request %s: %s", request.request_id, exc)

    def _call_utility(self, call: UtilityRequest) -> None:
        settling = False
        try:
            result = call_utility(self.core, call.method, call.args)
            reply = UtilityOutput(call_id=call.call_id, result=result)
            frames = encode(MessageType.UTILITY_OUTPUT, reply)
            settling = rl_verbs.settles(call.method)
        except EngineDeadError:
            raise  # a failed health check ends the engine: the loop reports ENGINE_DEAD
        except Exception as exc:  # the caller gets the error; the engine keeps serving
            reply = UtilityOutput(call_id=call.call_id, error=f"{type(exc).__name__}: {exc}")
            frames = encode(MessageType.UTILITY_OUTPUT, reply)
        self._send_side_outputs()  # what the call landed or aborted reaches the frontend first
        if settling:
            self._unsettled_replies.append(frames)
        else:
            self.output_queue.put(frames)
        if self._unsettled_replies:
            self._reply_if_settled()  # this call may have settled an earlier pause (resume, abort)

    def _send_side_outputs(self) -> None:
        while self.core.side_outputs:
            self.output_queue.put(encode(MessageType.OUTPUTS, self.core.side_outputs.popleft()))

    def _reply_if_settled(self) -> None:
        if self.core.settle_pause():
            self._send_side_outputs()
            for frames in self._unsettled_replies:
                self.output_queue.put(frames)
            self._unsettled_replies = []

    # ---- socket threads ---------------------------------------------------------------------

    def _receive(self, context: zmq.Context, input_address: str) -> None:
        socket = _connected_socket(context, zmq.PULL, input_address, self._keys)
        try:
            while True:
                frames = socket.recv_multipart(copy=False)
                try:
                    self.input_queue.put(decode([f.buffer for f in frames]))
                except (msgspec.DecodeError, ValueError) as exc:
                    logger.error("dropped an undecodable message: %s", exc)
        except zmq.ContextTerminated:
            pass
        finally:
            socket.close(linger=0)

    def _send(self) -> None:
        while True:
            frames = self.output_queue.get()
            if frames is None:
                return
            self._output_socket.send_multipart(frames, copy=False)

    def send_dead(self, message: str) -> None:
        self.output_queue.put(encode(MessageType.ENGINE_DEAD, EngineDead(message)))

    def shutdown(self) -> None:
        self.output_queue.put(None)
        self._output_thread.join(timeout=5)
        shutdown_core(self.core)


def shutdown_core(core: EngineCore) -> None:
    try:
        core.shutdown()
    except Exception:  # best effort while exiting
        logger.exception("error while shutting the executor down")
