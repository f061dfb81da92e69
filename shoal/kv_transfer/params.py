"""`KVTransferParams`: what a request carries for prefill/decode disaggregation, and the errors
of a transfer.

The proxy (shoal/entrypoints/disaggregated/) sends a request twice: to a prefill engine with
`role="save"` and one token to generate, then to a decode engine with `role="load"`. Both carry
the same `transfer_id`, the name under which the prefill engine's workers leave the request's KV
and the decode engine's workers find it. The params ride in `SamplingParams.extra_args
["kv_transfer_params"]` (vLLM's place for them) as a plain dict. Plain Python: the engine core
imports this module.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

KV_TRANSFER_PARAMS = "kv_transfer_params"
# A decode engine gives up on a transfer that has not arrived after this long (seconds).
DEFAULT_TRANSFER_TIMEOUT_S = 10.0
# The stop reason of a request whose KV could not be loaded (the proxy retries it elsewhere).
KV_TRANSFER_FAILED = "kv transfer failed"


class KVTransferError(RuntimeError):
    """A transfer failed: its KV is missing, malformed or of another geometry."""


class KVTransferTimeout(KVTransferError):
    """A transfer did not complete within its timeout."""


class KVTransferParams(msgspec.Struct, frozen=True, kw_only=True):
    transfer_id: str
    role: Literal["save", "load"]
    # load: how many of the prompt's first tokens the transfer holds (the prompt less its last
    # token, which the decode engine computes for the first token's logits).
    num_tokens: int = 0
    timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S

    def as_extra_args(self, extra_args: dict[str, Any] | None = None) -> dict[str, Any]:
        return {**(extra_args or {}), KV_TRANSFER_PARAMS: msgspec.to_builtins(self)}


def transfer_params(extra_args: dict[str, Any] | None) -> KVTransferParams | None:
    """A request's transfer params, if it has any (a malformed dict is a `ValueError`)."""
    raw = extra_args.get(KV_TRANSFER_PARAMS) if extra_args else None
    if raw is None:
        return None
    try:
        return msgspec.convert(raw, KVTransferParams)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad kv_transfer_params: {exc}") from exc
