"""CURVE authentication and encryption of the frontend ↔ engine-core sockets over tcp://.

The frontend binds both sockets, so it is the CURVE server; the engine core connects, as the
CURVE client. For every engine the frontend makes two key pairs (`EngineKeys.generate`): its own,
and one for the engine core, which it hands over with the core's start-up arguments (out of band:
never on a socket). The frontend's sockets then talk only to a peer that proves it holds the
engine core's secret key (ZeroMQ's ZAP handler checks the client's public key) and that knows
the frontend's public key; everything on the wire is encrypted. A peer without the keys never
completes the handshake, so it can neither receive requests nor inject outputs.

ipc:// sockets are not encrypted; they live in a directory only their user can enter (0700).
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator

logger = logging.getLogger(__name__)

# The ZAP domain of shoal's engine sockets.
ZAP_DOMAIN = "shoal-engine"


@dataclass(frozen=True)
class EngineCoreKeys:
    """What the engine core needs to reach its frontend: the frontend's public key and the
    core's own key pair (z85 text, as ZeroMQ writes keys)."""

    server_public_key: bytes
    public_key: bytes
    secret_key: bytes

    def __repr__(self) -> str:  # never a secret key in a log line or a traceback
        return f"EngineCoreKeys(public_key={self.public_key!r})"


@dataclass(frozen=True)
class EngineKeys:
    """One engine's keys, as the frontend holds them: its own pair and the engine core's."""

    public_key: bytes
    secret_key: bytes
    engine_core: EngineCoreKeys

    @classmethod
    def generate(cls) -> EngineKeys:
        require_curve()
        public_key, secret_key = zmq.curve_keypair()
        core_public_key, core_secret_key = zmq.curve_keypair()
        return cls(public_key, secret_key, EngineCoreKeys(public_key, core_public_key, core_secret_key))

    def __repr__(self) -> str:
        return f"EngineKeys(public_key={self.public_key!r})"


def require_curve() -> None:
    """CURVE needs libzmq built with libsodium (pyzmq's wheels are)."""
    if not zmq.has("curve"):
        raise RuntimeError(
            "this pyzmq/libzmq has no CURVE support, which the engine sockets need over tcp://; "
            "install a pyzmq wheel (they bundle libsodium) or use the ipc transport"
        )


def secure_server(socket: zmq.Socket, keys: EngineKeys) -> None:
    """Make `socket` (before it binds) a CURVE server that `start_authenticator` vets."""
    socket.curve_server = True
    socket.curve_publickey = keys.public_key
    socket.curve_secretkey = keys.secret_key
    socket.zap_domain = ZAP_DOMAIN.encode()


def secure_client(socket: zmq.Socket, keys: EngineCoreKeys) -> None:
    """Make `socket` (before it connects) a CURVE client of the frontend, as the engine core."""
    socket.curve_serverkey = keys.server_public_key
    socket.curve_publickey = keys.public_key
    socket.curve_secretkey = keys.secret_key


class _EngineCoreKeyOnly:
    """The ZAP check: the client must present the engine core's public key."""

    def __init__(self, allowed_public_key: bytes) -> None:
        self.allowed_public_key = allowed_public_key
        self.num_refused = 0

    def callback(self, domain: str, client_public_key: bytes) -> bool:
        allowed = hmac.compare_digest(client_public_key, self.allowed_public_key)
        if not allowed:
            self.num_refused += 1
            # A refused peer reconnects every 100 ms: log the 1st, 10th, 100th, ... refusal.
            if str(self.num_refused).strip("0") == "1":
                logger.warning("refused %d connection(s) to the engine sockets: unknown CURVE key", self.num_refused)
        return allowed


def start_authenticator(context: zmq.Context, keys: EngineKeys) -> ThreadAuthenticator:
    """The ZAP handler of `context` (a thread): CURVE clients other than the engine core are
    refused. Stop it before the context is terminated."""
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve_callback(ZAP_DOMAIN, _EngineCoreKeyOnly(keys.engine_core.public_key))
    return authenticator
