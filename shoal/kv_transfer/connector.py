"""`KVConnector`: the scheduler's view of KV that may arrive from elsewhere (KV transfer).

A request's KV may come from outside this engine's KV cache: from a prefill engine that has
computed the prompt (prefill/decode disaggregation), or from a host-memory tier that kept
blocks this engine evicted. The scheduler asks the connector right after its own prefix cache
how many more of the request's tokens can be loaded rather than computed (`tokens_to_load`).
It allocates their slots with the rest, counts them as computed, and tells the connector which
blocks they go to (`load_into`), so that their KV is in place before the step that reads it.

A connector may load in the background (`loads_in_background`: a transfer from another engine,
which may be slow or never come). Such a request is parked instead (engine_core/remote_kv.py):
its blocks allocated but not in the prefix cache, no step computing it, until the connector
reports its load ended (`Scheduler.end_kv_load`); a request given up meanwhile (aborted,
preempted) has its load cancelled (`cancel_load`) before its blocks are freed.

`Scheduler(kv_connector=None)` (the default) asks nothing. The connectors: `HostKVTier`
(host_tier.py, `--kv-offload-bytes`) and `PDConnector` (pd_connector.py, `kv_transfer_role`:
prefill/decode disaggregation, in front of the host tier when both are on); the engine core
installs them. Plain Python: the engine core imports this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from shoal.engine_core.request import Request


class KVConnector(Protocol):
    def num_loadable_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """How many of the request's tokens after its first `num_computed_tokens` (those the
        prefix cache holds) can be loaded from elsewhere."""
        ...

    def load_into(self, request: Request, block_ids: list[int], num_computed_tokens: int, num_tokens: int) -> None:
        """The request's tokens [num_computed_tokens, num_computed_tokens + num_tokens) are to
        be loaded into its blocks `block_ids` (all of them, in order; token t is in block
        t // block_size) before its first step runs, or, loading in the background, before
        the request is reported loaded."""
        ...

    def loads_in_background(self, request: Request) -> bool:
        """Whether the request's load runs while steps go on (the request is parked until it
        ends) rather than with its first step."""
        ...

    def cancel_load(self, request: Request, workers_alive: bool = True) -> None:
        """Give up the request's background load: once this returns, nothing more is written
        into its blocks (`workers_alive=False`: the workers lost their state, nothing to ask)."""
        ...


def tokens_to_load(connector: KVConnector, request: Request, num_computed_tokens: int) -> int:
    """What the connector can load for a request starting after `num_computed_tokens`, less
    the last token: the model always runs on it, for the logits of the next token."""
    num_loadable = connector.num_loadable_tokens(request, num_computed_tokens)
    return max(0, min(num_loadable, request.num_tokens - 1 - num_computed_tokens))
