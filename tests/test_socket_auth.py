"""CURVE on the engine sockets (`shoal/socket_auth.py`): the installed pyzmq has it; a server
socket lets through only the engine core's key pair (no key, or a key pair of one's own, gets
nothing through, in either direction), and all of it is encrypted."""

from __future__ import annotations

import contextlib
import os
import stat
import time

import zmq

from shoal import socket_auth
from shoal.frontend.core_client import make_addresses


def test_installed_pyzmq_has_curve() -> None:
    assert zmq.has("curve")
    socket_auth.require_curve()


def test_ipc_sockets_live_in_a_private_directory() -> None:
    _, _, directory = make_addresses("ipc")
    assert directory is not None
    try:
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    finally:
        os.rmdir(directory)


def _client(context: zmq.Context, kind: int, address: str, keys: socket_auth.EngineCoreKeys | None) -> zmq.Socket:
    socket = context.socket(kind)
    socket.linger = 0
    if keys is not None:
        socket_auth.secure_client(socket, keys)
    socket.connect(address)
    return socket


def test_only_the_engine_core_key_gets_through() -> None:
    keys = socket_auth.EngineKeys.generate()
    public_key, secret_key = zmq.curve_keypair()
    # A peer that knows the frontend's public key (it is no secret) but has a key pair of its own.
    impostor = socket_auth.EngineCoreKeys(keys.public_key, public_key, secret_key)
    context = zmq.Context()
    authenticator = socket_auth.start_authenticator(context, keys)
    try:
        inbox = context.socket(zmq.PULL)  # as the frontend's output socket
        outbox = context.socket(zmq.PUSH)  # as its input socket
        for socket in (inbox, outbox):
            socket.linger = 0
            socket_auth.secure_server(socket, keys)
        inbox_address, outbox_address = "tcp://127.0.0.1:0", "tcp://127.0.0.1:0"
        inbox.bind(inbox_address)
        outbox.bind(outbox_address)
        inbox_address, outbox_address = inbox.last_endpoint.decode(), outbox.last_endpoint.decode()

        peers = {"no key": None, "own key pair": impostor, "engine core": keys.engine_core}
        senders = {name: _client(context, zmq.PUSH, inbox_address, k) for name, k in peers.items()}
        readers = {name: _client(context, zmq.PULL, outbox_address, k) for name, k in peers.items()}
        time.sleep(0.5)  # every handshake is tried (and all but one refused)
        for name, sender in senders.items():
            _try_send(sender, name)
        received = []
        while inbox.poll(timeout=500):
            received.append(inbox.recv().decode())
        assert received == ["engine core"]

        # PUSH round-robins over the peers it has: the engine core is the only one.
        requests = [f"request {i}" for i in range(6)]
        for request in requests:
            outbox.send(request.encode())
        assert [readers["engine core"].recv().decode() for _ in requests] == requests
        assert not readers["no key"].poll(timeout=300) and not readers["own key pair"].poll(timeout=300)
        assert authenticator.is_alive()
    finally:
        authenticator.stop()
        context.destroy(linger=0)


def _try_send(socket: zmq.Socket, text: str) -> None:
    """A refused peer has no connection: its message may queue locally, it never arrives."""
    with contextlib.suppress(zmq.Again):
        socket.send(text.encode(), flags=zmq.NOBLOCK)
