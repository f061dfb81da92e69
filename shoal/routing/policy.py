"""Routing policies: which replica takes a request.

- `round_robin`: the next live replica in turn.
- `session`: a conversation's requests (one session id) go to the replica its first request
  went to (chosen in turn); requests without a session go in turn.
- `cache_aware`: the replica holding the longest prefix of the prompt in its prefix cache,
  unless that would overload it: when the busiest and the idlest replica differ by more than
  `balance_abs_threshold` requests and the busiest has more than `balance_rel_threshold` times
  the idlest's, the least loaded replica takes the request instead (the cache then follows the
  load). Ties go to the least loaded, then in turn. A session id pins as with `session`,
  the first request of a session being routed by cache.

Load is running + waiting requests: those the router sent that have not finished yet. A dead
replica is never chosen; a session pinned to one moves to the replica chosen now.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.routing.prefix_index import PrefixIndex

POLICIES = ("cache_aware", "round_robin", "session")
# A load imbalance that overrides the cache (see the module docstring): more requests than
# this between the busiest and the idlest replica, and more than this ratio between them.
BALANCE_ABS_THRESHOLD = 4
BALANCE_REL_THRESHOLD = 1.5
# Sessions remembered; the least recently used is forgotten beyond this.
MAX_SESSIONS = 100_000


@dataclass
class ReplicaState:
    name: str
    url: str
    num_requests: int = 0  # running + waiting: sent here and not finished
    alive: bool = True


@dataclass(frozen=True)
class RoutingRequest:
    """What a policy sees of a request: its prompt's block hashes and its session, if any."""

    block_hashes: Sequence[bytes] = ()
    session_id: str | None = None


class RoutingPolicy:
    def __init__(
        self,
        name: str,
        index: PrefixIndex | None = None,
        balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = BALANCE_REL_THRESHOLD,
    ) -> None:
        if name not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {name!r}")
        self.name = name
        self.index = index or PrefixIndex()
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._turn = itertools.count()
        self._sessions: OrderedDict[str, str] = OrderedDict()

    def choose(self, replicas: Sequence[ReplicaState], request: RoutingRequest) -> ReplicaState:
        """The replica that takes `request`; `ValueError` when none is alive."""
        live = [r for r in replicas if r.alive]
        if not live:
            raise ValueError("no replica is alive")
        pinned = self._pinned(live, request.session_id)
        if pinned is not None:
            return pinned
        if self.name == "cache_aware":
            chosen = self._by_cache(live, request.block_hashes)
        else:
            chosen = self._in_turn(live)
        if request.session_id is not None and self.name != "round_robin":
            self._sessions[request.session_id] = chosen.name
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return chosen

    def _pinned(self, live: Sequence[ReplicaState], session_id: str | None) -> ReplicaState | None:
        if session_id is None or self.name == "round_robin":
            return None
        name = self._sessions.get(session_id)
        replica = next((r for r in live if r.name == name), None)
        if replica is not None:
            self._sessions.move_to_end(session_id)
        return replica

    def _in_turn(self, live: Sequence[ReplicaState]) -> ReplicaState:
        return live[next(self._turn) % len(live)]

    def _by_cache(self, live: Sequence[ReplicaState], block_hashes: Sequence[bytes]) -> ReplicaState:
        loads = [r.num_requests for r in live]
        busiest, idlest = max(loads), min(loads)
        if busiest - idlest > self.balance_abs_threshold and busiest > self.balance_rel_threshold * idlest:
            candidates = [r for r in live if r.num_requests == idlest]
            return max(candidates, key=lambda r: self.index.matched_blocks(r.name, block_hashes))
        # Rotate the start so that ties (a miss everywhere, equal loads) spread in turn.
        start = next(self._turn) % len(live)
        rotated = [*live[start:], *live[:start]]
        return max(rotated, key=lambda r: (self.index.matched_blocks(r.name, block_hashes), -r.num_requests))
