"""`Router`: shoal's HTTP front for several engine replicas. Each completion or chat request
is tokenized here, its prompt hashed into blocks as the engines' KV managers hash them, and sent
to the replica the routing policy picks (shoal/routing/policy.py); the replica's answer, streamed
or not, is passed back as it comes.

The router knows each replica's prefix cache from its KV-cache events (one `EventSubscriber`
per replica feeding a `PrefixIndex`), and its load from the requests it has sent there and
not seen finish. A replica that refuses connections is marked dead, its blocks forgotten, and
the request goes to another; a health check every `health_interval_s` marks replicas dead or
alive again from their `/health`. Other routes (`/v1/models`, `/tokenize`, ...) go to any live
replica; `/metrics` joins every replica's under a `replica` label; `/router/replicas` shows the
router's view.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.requests import Request

from shoal.kv_events.events import KVEventBatch
from shoal.kv_events.subscriber import EventSubscriber
from shoal.routing.policy import ReplicaState, RoutingPolicy, RoutingRequest
from shoal.routing.prefix_index import prompt_block_hashes

logger = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
# Hop-by-hop headers, and those the forwarded body or answer sets anew.
_DROPPED_HEADERS = {
    "host",
    "date",
    "server",
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "upgrade",
}
# Errors that say the replica never got the request: safe to send it elsewhere.
_UNREACHABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError)


@dataclass
class ReplicaEndpoint:
    """Where one replica answers HTTP and publishes its KV-cache events."""

    url: str
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    name: str = field(default="")
    pid: int | None = None  # the replica's process, when the router started it


class Router:
    def __init__(
        self,
        replicas: Sequence[ReplicaEndpoint],
        policy: RoutingPolicy,
        block_size: int,
        tokenizer: Any = None,
        chat_template: str | None = None,
        session_header: str = SESSION_HEADER,
        health_interval_s: float = 2.0,
        request_timeout_s: float | None = None,
        base_model_names: Collection[str] = (),
    ) -> None:
        if not replicas:
            raise ValueError("the router needs at least one replica")
        self.policy = policy
        self.block_size = block_size
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.session_header = session_header.lower()
        # Any other `model` names a LoRA adapter, whose blocks the replicas key under it.
        self.base_model_names = frozenset(base_model_names)
        self.health_interval_s = health_interval_s
        self.replicas = [
            ReplicaState(name=r.name or f"replica-{i}", url=r.url.rstrip("/")) for i, r in enumerate(replicas)
        ]
        self._endpoints = list(replicas)
        self._subscribers: list[EventSubscriber] = []
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=5.0))
        self._health_task: asyncio.Task | None = None
        self._turn = 0

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Subscribe to every replica's events and start the health checks (in the event loop)."""
        for state, endpoint in zip(self.replicas, self._endpoints, strict=True):
            if endpoint.events_endpoint is None:
                continue
            self._subscribers.append(
                EventSubscriber(
                    endpoint.events_endpoint,
                    self._on_events(state.name),
                    replay_endpoint=endpoint.replay_endpoint,
                    on_gap=functools.partial(self.policy.index.clear, state.name),
                )
            )
        self._health_task = asyncio.get_running_loop().create_task(self._check_health_forever())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        for subscriber in self._subscribers:
            subscriber.close()
        await self._client.aclose()

    def _on_events(self, name: str) -> Any:
        def apply(seq: int, batch: KVEventBatch) -> None:
            self.policy.index.apply(name, batch)

        return apply

    # ---- routing --------------------------------------------------------------------------------

    async def routing_request(self, path: str, body: bytes, headers: dict[str, str]) -> RoutingRequest:
        """The prompt's block hashes and the session of one request (no hashes for a body that
        cannot be read: the replica will answer it with its 400)."""
        session_id = headers.get(self.session_header)
        try:
            request = json.loads(body)
        except ValueError:
            return RoutingRequest([], session_id)
        if not isinstance(request, dict):
            return RoutingRequest([], session_id)
        token_ids = await asyncio.to_thread(self._prompt_token_ids, path, request)
        return RoutingRequest(prompt_block_hashes(token_ids, self.block_size, self._adapter(request)), session_id)

    def _adapter(self, request: dict[str, Any]) -> str | None:
        """The LoRA adapter a request asks for: a `model` other than the base model's names
        (unknown names are the replica's 404 to give; their hashes match nothing)."""
        model = request.get("model")
        if not self.base_model_names or not isinstance(model, str) or model in self.base_model_names:
            return None
        return model

    def _prompt_token_ids(self, path: str, request: dict[str, Any]) -> list[int]:
        try:
            if path.endswith("/chat/completions"):
                return self._chat_token_ids(request)
            prompt = request.get("prompt")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # a batch: its first prompt
            if isinstance(prompt, list):
                return [int(t) for t in prompt]
            if isinstance(prompt, str) and self.tokenizer is not None:
                return list(self.tokenizer.encode(prompt))
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            logger.debug("no prompt to route by: %s", exc)
        return []

    def _chat_token_ids(self, request: dict[str, Any]) -> list[int]:
        if self.tokenizer is None:
            return []
        from shoal.frontend.chat import render_chat

        _, token_ids = render_chat(
            self.tokenizer,
            request["messages"],
            add_generation_prompt=request.get("add_generation_prompt", True),
            chat_template=request.get("chat_template") or self.chat_template,
            chat_template_kwargs=request.get("chat_template_kwargs"),
            tools=request.get("tools"),
            continue_final_message=request.get("continue_final_message", False),
        )
        return token_ids

    async def forward(self, method: str, path: str, query: bytes, body: bytes, headers: dict[str, str]) -> Any:
        """Send the request to the replica the policy picks, the next one if that one is
        unreachable; returns the replica's streamed answer (or a 503 when none answers)."""
        routed = path in ROUTED_PATHS and method == "POST"
        request = await self.routing_request(path, body, headers) if routed else None
        tried: set[str] = set()
        while True:
            candidates = [r for r in self.replicas if r.name not in tried]
            try:
                replica = self.policy.choose(candidates, request) if request else self._any_live(candidates)
            except ValueError:
                return _error(503, "no replica is available")
            tried.add(replica.name)
            try:
                return await self._send(replica, method, path, query, body, headers, counted=routed)
            except _UNREACHABLE as exc:
                self._mark_dead(replica, f"{type(exc).__name__}: {exc}")

    def _any_live(self, candidates: Sequence[ReplicaState]) -> ReplicaState:
        live = [r for r in candidates if r.alive]
        if not live:
            raise ValueError("no replica is alive")
        self._turn += 1
        return live[self._turn % len(live)]

    async def _send(
        self,
        replica: ReplicaState,
        method: str,
        path: str,
        query: bytes,
        body: bytes,
        headers: dict[str, str],
        counted: bool,
    ) -> Any:
        from starlette.background import BackgroundTask
        from starlette.responses import StreamingResponse

        url = f"{replica.url}{path}" + (f"?{query.decode()}" if query else "")
        sent = {k: v for k, v in headers.items() if k.lower() not in _DROPPED_HEADERS}
        outgoing = self._client.build_request(method, url, headers=sent, content=body)
        # A routed request counts towards its replica's load until its answer has ended.
        load = 1 if counted else 0
        replica.num_requests += load
        done = False

        async def release() -> None:
            """Once, whichever comes first: the stream's end, the response's background task."""
            nonlocal done
            if not done:
                done = True
                replica.num_requests -= load
                await answer.aclose()

        try:
            answer = await self._client.send(outgoing, stream=True)
        except BaseException:
            replica.num_requests -= load
            raise

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            finally:
                await release()

        kept = {k: v for k, v in answer.headers.items() if k.lower() not in _DROPPED_HEADERS}
        kept["x-shoal-replica"] = replica.name
        # The background task covers a response never iterated (its client gone before it started).
        return StreamingResponse(
            relay(), status_code=answer.status_code, headers=kept, background=BackgroundTask(release)
        )

    # ---- health ---------------------------------------------------------------------------------

    def _mark_dead(self, replica: ReplicaState, reason: str) -> None:
        if replica.alive:
            logger.warning("replica %s (%s) is unreachable (%s): routing around it", replica.name, replica.url, reason)
        replica.alive = False
        self.policy.index.clear(replica.name)

    async def _check_health_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await asyncio.gather(*(self.check_health(r) for r in self.replicas))

    async def check_health(self, replica: ReplicaState) -> bool:
        try:
            answer = await self._client.get(f"{replica.url}/health", timeout=5.0)
            healthy = answer.status_code == 200
        except httpx.HTTPError as exc:
            healthy, reason = False, f"{type(exc).__name__}"
        else:
            reason = f"/health answered {answer.status_code}"
        if healthy and not replica.alive:
            logger.info("replica %s is back", replica.name)
            replica.alive = True
        elif not healthy:
            self._mark_dead(replica, reason)
        return healthy

    async def metrics(self) -> bytes:
        """Every live replica's Prometheus text, each sample labelled with its replica."""
        parts: list[bytes] = []
        seen_comments: set[str] = set()
        for replica in self.replicas:
            with contextlib.suppress(httpx.HTTPError):
                answer = await self._client.get(f"{replica.url}/metrics", timeout=5.0)
                if answer.status_code == 200:
                    parts.append(label_samples(answer.content, replica.name, seen_comments))
        return b"".join(parts)

    def view(self) -> list[dict[str, Any]]:
        index = self.policy.index
        return [
            {
                "name": r.name,
                "url": r.url,
                "pid": e.pid,
                "alive": r.alive,
                "num_requests": r.num_requests,
                "num_cached_blocks": index.num_blocks(r.name),
            }
            for r, e in zip(self.replicas, self._endpoints, strict=True)
        ]


def label_samples(exposition: bytes, replica: str, seen_comments: set[str]) -> bytes:
    """Prometheus text with `replica="..."` on every sample; each HELP / TYPE line once."""
    lines = []
    for line in exposition.decode().splitlines():
        if line.startswith("#"):
            if line in seen_comments:
                continue
            seen_comments.add(line)
        elif line:
            metric, brace, rest = line.partition("{")
            if brace:
                line = f'{metric}{{replica="{replica}",{rest}'
            else:
                metric, _, sample = line.partition(" ")
                line = f'{metric}{{replica="{replica}"}} {sample}'
        lines.append(line)
    return ("\n".join(lines) + "\n").encode()


def _error(status: int, message: str) -> Any:
    from starlette.responses import JSONResponse

    body = {"error": {"message": message, "type": "ServiceUnavailable", "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


def build_app(router: Router) -> Any:
    """The router's ASGI app: `/health`, `/metrics`, `/router/replicas`, every other path
    forwarded."""
    from fastapi import FastAPI
    from starlette.responses import JSONResponse, Response

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router.start()
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(title="shoal router", lifespan=lifespan)

    @app.get("/health")
    async def health() -> Any:
        alive = any(r.alive for r in router.replicas)
        return Response(status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics() -> Any:
        return Response(await router.metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/router/replicas")
    async def replicas() -> Any:
        return JSONResponse(router.view())

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def forward(path: str, request: Request) -> Any:
        body = await request.body()
        headers = dict(request.headers)
        return await router.forward(request.method, "/" + path, request.url.query.encode(), body, headers)

    return app
