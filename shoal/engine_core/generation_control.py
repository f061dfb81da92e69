"""Pause/resume and sleep/wake_up of an engine core: the control calls of the RL rollout
contract (see docs/rl.md).

`EngineCore` inherits these; the frontend calls them as utility methods (the RL verbs of
shoal/rl_verbs.py). A pause or a sleep takes effect between steps: the steps still in
flight (pipeline parallelism and async scheduling keep some) land first, and what they sampled
goes to the frontend, through `side_outputs`, before the call returns. So do the final outputs
of the requests an "abort" pause ends.

What the scheduler may do while paused or asleep is its own state (`Scheduler.admission`);
this class adds the workers' side of sleep (their weights and KV cache) and the wait of a
"wait" pause (`settle_pause`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from shoal.engine_core.admission import PAUSE_MODES
from shoal.engine_core.scheduler import Scheduler
from shoal.executors.abstract import Executor
from shoal.protocol import EngineCoreOutputs

logger = logging.getLogger(__name__)

# What a worker drops when it sleeps and restores when it wakes up (`wake_up(tags=...)`).
SLEEP_TAGS = ("weights", "kv_cache")
SLEEP_LEVELS = (1, 2)
# SGLang's memory tags; "cuda_graph" names nothing shoal keeps asleep (graphs are captured again).
SGLANG_MEMORY_TAGS = (*SLEEP_TAGS, "cuda_graph")


class GenerationControl:
    scheduler: Scheduler
    executor: Executor
    batch_queue: deque[tuple[Any, Any, float, float]] | None

    def _send_owed_grammar(self) -> None: ...

    def _init_generation_control(self) -> None:
        # Outputs made outside `step` (landed steps, aborted requests), for the client to send
        # before the call's reply.
        self.side_outputs: deque[EngineCoreOutputs] = deque()
        self.sleeping_tags: set[str] = set()
        self._clear_cache_when_drained = False

    def has_work(self) -> bool:
        """Whether a step may run something now (not while paused or asleep, but a "wait"
        pause's requests go on)."""
        return self.scheduler.has_work()

    # ---- pause and resume -------------------------------------------------------------------

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Hold generation until `resume_generation`; requests that arrive meanwhile wait.

        "abort": every request (running and waiting) ends now with finish_reason "abort" and
        the tokens it has. "wait": the running requests go on to their end and no new one
        starts (the caller waits for `settle_pause`). "keep": the running requests freeze with
        their KV cache and continue after the resume. `clear_cache` resets the prefix cache
        (for "wait" once the running requests are done) and, with "keep", drops the kept
        requests' KV cache too: it is recomputed after the resume with the weights in place
        then, so that no token after the resume attends to KV of the old weights."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        if mode != "wait":
            self._land_steps_in_flight()
        aborted = self.scheduler.pause(mode, clear_cache=clear_cache and mode != "wait")
        self._clear_cache_when_drained = clear_cache and mode == "wait"
        if aborted:
            stats = self.scheduler.make_stats()
            self.side_outputs.append(EngineCoreOutputs(outputs=aborted, scheduler_stats=stats, timestamp=time.time()))
        logger.info("generation paused (%s): %d request(s) aborted", mode, len(aborted))

    def settle_pause(self) -> bool:
        """True once a pause has taken effect: at once for "abort" and "keep", for "wait" once
        no request runs any more; True too when generation is not paused. The first call that
        finds a "wait" pause settled resets the prefix cache if the pause asked for it."""
        if self.scheduler.pause_mode is None:
            return True
        if self.scheduler.pause_mode == "wait" and self.scheduler.has_started_requests():
            return False  # (also while asleep: they finish after the wake-up)
        self._land_steps_in_flight()  # only steps of requests aborted meanwhile can remain
        if self._clear_cache_when_drained:
            self._clear_cache_when_drained = False
            self.scheduler.reset_prefix_cache()
        return True

    def resume_generation(self) -> None:
        """Schedule again: kept requests continue, waiting ones start (unless asleep)."""
        self.scheduler.resume()
        logger.info("generation resumed")

    def is_paused(self) -> bool:
        return self.scheduler.pause_mode is not None

    # ---- sleep and wake up ------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Free the workers' device memory. Level 1 moves the weights to (pinned) host memory
        and drops the KV cache; level 2 drops both, and generation waits for new weights (an
        update advances the weight version) besides the wake-up. Running requests give up
        their KV cache and are recomputed after the wake-up; nothing is scheduled until then."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level!r}")
        start = time.perf_counter()
        self._land_steps_in_flight()
        self.scheduler.sleep(discard_weights=level == 2)
        freed = self.executor.collective_rpc("sleep", (level,))
        self.sleeping_tags.update(SLEEP_TAGS)
        logger.info(
            "asleep (level %d) in %.2f s: %.2f GiB freed on the first worker",
            level,
            time.perf_counter() - start,
            freed[0] / 2**30,
        )

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what `sleep` freed: all of it, or only the parts `tags` names ("weights",
        "kv_cache"; waking the weights first leaves room for an update before the KV cache
        returns). Generation resumes once every part is back."""
        tags = list(SLEEP_TAGS) if tags is None else list(tags)
        unknown = sorted(set(tags) - set(SLEEP_TAGS))
        if unknown:
            raise ValueError(f"unknown wake_up tags {unknown}; the tags are {list(SLEEP_TAGS)}")
        start = time.perf_counter()
        self.executor.collective_rpc("wake_up", (tags,))
        self.sleeping_tags.difference_update(tags)
        if not self.sleeping_tags:
            self.scheduler.wake_up()
        logger.info("woke up %s in %.2f s", "+".join(tags), time.perf_counter() - start)

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """SGLang's spelling of `sleep`: release the parts `tags` names (all by default). shoal
        sleeps whole, so this is `sleep(level=1)` (the weights keep a host copy, where SGLang's
        release may discard them), then a `wake_up` of the parts not named."""
        named = list(SGLANG_MEMORY_TAGS) if tags is None else list(tags)
        unknown = sorted(set(named) - set(SGLANG_MEMORY_TAGS))
        if unknown:
            raise ValueError(f"unknown memory tags {unknown}; the tags are {list(SGLANG_MEMORY_TAGS)}")
        released = [tag for tag in SLEEP_TAGS if tag in named]
        if not released:
            return
        self.sleep(1)
        kept = [tag for tag in SLEEP_TAGS if tag not in released]
        if kept:
            self.wake_up(kept)

    def is_sleeping(self) -> bool:
        """True while any part the engine dropped in `sleep` is still asleep."""
        return bool(self.sleeping_tags)

    def generation_hold(self) -> str | None:
        """Why new requests would wait now (asleep, weights discarded, paused), or None."""
        if self.sleeping_tags:
            return f"the engine is asleep ({', '.join(sorted(self.sleeping_tags))}): call wake_up() first"
        if self.scheduler.weights_missing:
            return "the engine's weights were discarded by sleep(level=2) or are half updated: load new weights first"
        if self.scheduler.pause_mode is not None:
            return "generation is paused: call resume_generation() first"
        return None

    def _land_steps_in_flight(self) -> None:
        """Wait for every step still executing and apply its output (kept for the frontend)."""
        while self.batch_queue:
            scheduler_output, future, _, _ = self.batch_queue.popleft()
            outputs = self.scheduler.update_from_output(scheduler_output, future.result())
            self._send_owed_grammar()  # the next step in the queue may wait for its bitmask
            if outputs.outputs:
                self.side_outputs.append(outputs)
