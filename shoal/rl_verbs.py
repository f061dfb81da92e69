# mypy: disable-error-code="empty-body"
"""The RL verbs, each declared once: the calls an RL framework makes on its rollout engine
(sleep / wake_up, pause / resume, weight updates, the weight version; docs/rl.md).

A verb is a stub below, its signature and docstring what `LLM` and `AsyncLLM` users see, under
`@verb(...)`, which says where it lives. Every layer reads this table:

- the frontend: `LLM` and `AsyncLLM` get a method of the verb's name (async on `AsyncLLM`), and
  one per alias, with the stub's signature and docstring (shoal/frontend/verb_methods.py); it
  sends the engine core the utility call of the verb's name with the call's arguments, or the
  calls that the verb's `frontend` plan makes. `public=False`: no method (the frontend calls it
  itself);
- the HTTP server: each of the verb's `routes` (shoal/entrypoints/openai/rl_routes.py, with
  `shoal serve --enable-rl-endpoints`) takes the verb's parameters as its fields;
- the engine core (shoal/engine_core/utilities.py): the frontend may call every verb. With
  `layer="engine_core"` `EngineCore` implements it (engine_core/generation_control.py,
  engine_core/weight_updates.py), calling the workers itself where it needs them; with
  `layer="workers"` the engine core hands the call to every worker (`collective_rpc`) and
  returns their answers in rank order;
- the worker: a call of the verb's name runs `worker`, a path from the `Worker`
  ("weight_updates.from_disk"), or the worker's own method of that name (an extension's too).

A stub's signature is the caller's; the engine core and the workers get what the layer above
sends them (the same arguments, unless a `frontend` plan or the engine core's method makes
others). So a new verb is one declaration here plus its implementation (docs/rl.md, "Adding a
verb").
Each process has the verbs this module declares. It imports no torch: the engine core reads it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

# A weight bucket's size (shoal/rl/buckets.py) where the caller gives none: here, without torch,
# for the engine core and the trainer's side alike.
DEFAULT_BUCKET_BYTES = 512 << 20

Layer = Literal["engine_core", "workers"]


class _Result:
    def __repr__(self) -> str:
        return "RESULT"


# In a route's answer: the verb's result.
RESULT: Any = _Result()


@dataclass(frozen=True)
class Query:
    """In a route's answer: what the verb `verb` (no arguments) answers after the call."""

    verb: str


@dataclass(frozen=True)
class Route:
    """An HTTP route of a verb. Its fields are the verb's parameters, from a JSON object body or
    the query string (a list parameter repeated or comma-separated there); `aliases` names other
    spellings of a field (`{"model_path": "path"}`), `defaults` the route's own defaults of
    parameters the signature requires. `answer` is the JSON answer: constants, `RESULT`,
    `Query(...)`. `rewrite` ("module:function", run in the server) turns another framework's
    fields into the verb's before they are read (SGLang's `flush_cache` into
    `reset_prefix_cache`, say), raising ValueError for a value shoal cannot honour; a route's
    `abort_all_requests` field (SGLang's) aborts every request before the call."""

    method: Literal["GET", "POST"]
    path: str
    answer: Mapping[str, Any]
    aliases: Mapping[str, str] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    rewrite: str | None = None


@dataclass(frozen=True)
class Verb:
    name: str
    signature: inspect.Signature  # the caller's, without `self`
    doc: str
    layer: Layer = "engine_core"
    worker: str | None = None  # the worker's implementation: an attribute path from the `Worker`
    routes: tuple[Route, ...] = ()
    public: bool = True  # a method of `LLM` and `AsyncLLM`
    aliases: tuple[str, ...] = ()  # more names of the same method on `LLM` and `AsyncLLM`
    settles: bool = False  # the reply waits until a "wait" pause has settled (`settle_pause`)
    # "module:function", a generator of the engine-core calls that make up the verb (each call's
    # result is sent back in; it returns the verb's result); None: one call of the verb's name.
    frontend: str | None = None


_VERBS: dict[str, Verb] = {}
_listeners: list[Callable[[Verb, bool], None]] = []


def verb(
    *,
    layer: Layer = "engine_core",
    worker: str | None = None,
    routes: tuple[Route, ...] = (),
    public: bool = True,
    aliases: tuple[str, ...] = (),
    settles: bool = False,
    frontend: str | None = None,
) -> Callable[[Callable[..., Any]], Verb]:
    """Declare the verb whose name, signature and docstring the decorated stub gives."""

    def declare_stub(stub: Callable[..., Any]) -> Verb:
        signature = inspect.signature(stub, eval_str=True)
        doc = inspect.getdoc(stub) or ""
        return declare(Verb(stub.__name__, signature, doc, layer, worker, routes, public, aliases, settles, frontend))

    return declare_stub


def declare(declaration: Verb) -> Verb:
    taken = {name for known in _VERBS.values() for name in (known.name, *known.aliases)}
    clashes = sorted(taken & {declaration.name, *declaration.aliases})
    if clashes:
        raise ValueError(f"RL verb names {clashes} are declared already")
    _VERBS[declaration.name] = declaration
    notified: list[Callable[[Verb, bool], None]] = []
    try:
        for listener in list(_listeners):
            listener(declaration, True)
            notified.append(listener)
    except Exception:  # e.g. a name `LLM` has already: the verb is not declared
        del _VERBS[declaration.name]
        for listener in notified:
            listener(declaration, False)
        raise
    return declaration


def withdraw(name: str) -> None:
    """Undeclare the verb `name` (a test's toy verb)."""
    declaration = _VERBS.pop(name)
    for listener in list(_listeners):
        listener(declaration, False)


def subscribe(listener: Callable[[Verb, bool], None]) -> None:
    """Call `listener(verb, True)` for every verb declared, now and later, and
    `listener(verb, False)` when one is withdrawn (how `LLM` and `AsyncLLM` get their methods)."""
    _listeners.append(listener)
    for declaration in list(_VERBS.values()):
        listener(declaration, True)


def find(name: str) -> Verb | None:
    return _VERBS.get(name)


def declared() -> list[Verb]:
    return list(_VERBS.values())


def settles(name: str) -> bool:
    declaration = _VERBS.get(name)
    return declaration is not None and declaration.settles


def worker_path(name: str) -> str | None:
    """Where a worker implements the verb `name`, if the table says (see `Verb.worker`)."""
    declaration = _VERBS.get(name)
    return None if declaration is None else declaration.worker


# ---- sleep and wake up (engine_core/generation_control.py, workers/sleep.py) --------------------


@verb(worker="sleeper.sleep", routes=(Route("POST", "/sleep", {"is_sleeping": True}),))
def sleep(level: int = 1) -> None:
    """Free the engine's device memory: level 1 moves the weights to pinned host memory and
    drops the KV cache, level 2 drops both (new weights come with an update). Requests running
    meanwhile give up their KV cache; they and new ones wait until `wake_up` and then run
    (recomputed). `LLM.generate` raises `GenerationHeldError` until then."""


# The answers of SGLang's spellings (shoal/entrypoints/openai/rl_spellings.py rewrites their fields).
_SGLANG = "shoal.entrypoints.openai.rl_spellings"
_DONE = {"success": True, "message": "Success."}


def _both_methods(path: str, answer: Mapping[str, Any], rewrite: str | None = None) -> tuple[Route, Route]:
    """SGLang serves some control routes on GET and POST alike."""
    return Route("POST", path, answer, rewrite=rewrite), Route("GET", path, answer, rewrite=rewrite)


@verb(
    worker="sleeper.wake_up",
    routes=(
        Route("POST", "/wake_up", {"is_sleeping": Query("is_sleeping")}),
        *_both_methods("/resume_memory_occupation", _DONE, rewrite=f"{_SGLANG}:resume_tags"),
    ),
)
def wake_up(tags: list[str] | None = None) -> None:
    """Restore what `sleep` freed: everything, or the parts in `tags` ("weights", "kv_cache"),
    e.g. the weights first to update them before the KV cache comes back."""


@verb(routes=(Route("GET", "/is_sleeping", {"is_sleeping": RESULT}),))
def is_sleeping() -> bool:
    """True while any part dropped by `sleep` is still asleep."""


@verb(routes=_both_methods("/release_memory_occupation", _DONE, rewrite=f"{_SGLANG}:memory_tags"))
def release_memory_occupation(tags: list[str] | None = None) -> None:
    """SGLang's spelling of `sleep`: release the parts in `tags` ("weights", "kv_cache"; SGLang's
    "cuda_graph" has nothing to release here, graphs are captured again), all of them by
    default. It is `sleep(level=1)` (the weights keep a host copy), then a `wake_up` of the
    parts not named."""


# ---- pause and resume (engine_core/generation_control.py) ---------------------------------------


@verb(
    settles=True,
    routes=(
        Route("POST", "/pause", {"is_paused": True}),
        Route(
            "POST",
            "/pause_generation",
            {"message": "Generation paused successfully.", "status": "ok"},
            rewrite=f"{_SGLANG}:pause_mode",
        ),
    ),
)
def pause_generation(mode: str = "abort", clear_cache: bool = True) -> None:
    """Hold generation until `resume_generation`; requests that arrive meanwhile wait.

    mode="abort": running and waiting requests end now with finish_reason "abort" and their
    tokens so far. mode="wait": returns once the running requests have finished; no new one
    starts. mode="keep": running requests freeze and continue after the resume. Steps in
    flight land first. `clear_cache` resets the prefix cache; with "keep" the frozen requests'
    KV cache is dropped too and recomputed after the resume (with the weights then in place);
    `clear_cache=False` keeps it. Every output's `weight_versions` says which weights sampled
    which tokens. (`LLM` runs nothing between `generate` calls, and `generate` raises while
    paused.)"""


@verb(
    routes=(
        Route("POST", "/resume", {"is_paused": False}),
        Route("POST", "/continue_generation", {"message": "Generation continued successfully.", "status": "ok"}),
    )
)
def resume_generation() -> None:
    """Generate again: kept requests continue, waiting ones start (unless asleep)."""


@verb(routes=(Route("GET", "/is_paused", {"is_paused": RESULT}),))
def is_paused() -> bool:
    """True while generation is paused."""


@verb(public=False)
def generation_hold() -> str | None:
    """Why new requests would wait now (asleep, weights discarded, paused), or None: what
    `LLM.generate` raises rather than wait for a call its thread could never make."""


# ---- weight updates (engine_core/weight_updates.py, workers/weight_updates.py) ------------------
# Each returns the new weight version (`weight_version`, else "1", "2", ...); a refused update
# (an unknown name, a wrong shape or dtype, weights asleep) raises ValueError and changes nothing.

_UPDATED = {"success": True, "weight_version": RESULT}


@verb(
    worker="weight_updates.from_disk",
    routes=(
        Route(
            "POST",
            "/update_weights_from_disk",
            _UPDATED,
            aliases={"model_path": "path"},
            rewrite=f"{_SGLANG}:weight_update",
        ),
    ),
)
def update_weights_from_disk(path: str, weight_version: str | None = None, reset_prefix_cache: bool = True) -> str:
    """Load new weights from a safetensors folder (Hugging Face names, any float dtype) and
    return the new weight version. `reset_prefix_cache=False` keeps the prefix cache, whose
    blocks hold keys and values of the old weights."""


@verb(worker="weight_updates.from_tensors", frontend="shoal.frontend.weight_updates:tensor_update_calls")
def update_weights_from_tensors(
    named_tensors: Any,
    weight_version: str | None = None,
    reset_prefix_cache: bool = True,
    bucket_bytes: int | None = None,
) -> str:
    """Load (name, tensor) pairs (a dict, a list of pairs or a module's parameters) from
    this process, whole Hugging Face tensors in the engine's dtype, and return the new weight
    version. CPU tensors travel as bytes; CUDA tensors through CUDA IPC, one bucket of
    `bucket_bytes` at a time."""


@verb(public=False, worker="weight_updates.check_encoded")
def check_weights(metas: list[list[Any]]) -> None:
    """Raise ValueError if an update of these [name, dtype, shape] would be refused."""


@verb(
    worker="weight_updates.init_group",
    routes=(
        Route("POST", "/init_weight_update_group", {"success": True}, defaults={"rank_offset": 1}),
        Route(
            "POST",
            "/init_weights_update_group",
            _DONE,
            defaults={"rank_offset": 1},
            rewrite=f"{_SGLANG}:weights_update_group",
        ),
    ),
)
def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    backend: str | None = None,
    group_name: str | None = None,
) -> None:
    """Join a trainer's weight-update group (rank 0: its `shoal.rl.WeightSender`, built at
    the same time); this engine's workers are ranks `rank_offset` on. `backend`: "gloo",
    "nccl", or None for gloo on a CPU and NCCL on a GPU. With `group_name`, the group is the
    torch process group of that name that SGLang's trainers build (`init_custom_process_group`
    in SGLang, AReaL, slime), and each tensor of an update comes in a broadcast of its own."""


@verb(
    worker="weight_updates.from_distributed",
    routes=(Route("POST", "/update_weights_from_distributed", _UPDATED, rewrite=f"{_SGLANG}:weight_update"),),
)
def update_weights_from_distributed(
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    weight_version: str | None = None,
    reset_prefix_cache: bool = True,
    bucket_bytes: int | None = None,
) -> str:
    """Receive the trainer's `WeightSender.send` of these tensors (run it concurrently:
    this call returns once every bucket has arrived and been loaded) and return the new
    weight version."""


@verb(
    worker="weight_updates.destroy_group",
    routes=(
        Route("POST", "/destroy_weight_update_group", {"success": True}),
        Route("POST", "/destroy_weights_update_group", _DONE),
    ),
)
def destroy_weight_update_group() -> None:
    """Leave the weight-update group."""


@verb(
    routes=(
        Route("GET", "/weight_version", {"weight_version": RESULT}),
        Route("GET", "/get_weight_version", {"weight_version": RESULT}),
    )
)
def get_weight_version() -> str:
    """The version of the weights the engine runs now ("0" until the first update)."""


@verb(
    routes=(
        Route(
            "POST",
            "/update_weight_version",
            {"success": True, "message": "Weight version updated.", "new_version": RESULT},
        ),
    )
)
def update_weight_version(new_version: str) -> str:
    """Rename the version of the weights the engine runs now, without changing them (SGLang's
    `/update_weight_version`): later tokens carry `new_version`."""
