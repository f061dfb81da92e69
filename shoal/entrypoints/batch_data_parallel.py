"""`shoal batch --data-parallel-size N`: N engine replicas over one batch file, on Ray Data.

The pending requests become a dataset; `map_batches` runs them through an actor pool of N
`BatchReplica`s, each holding one engine (its TP x PP workers in a placement group of its own,
`shoal-<hex>`, so that replicas never share a bundle). Sharding, retries of a failed actor and
back-pressure are Ray Data's. The driver writes each result line as its batch comes back, so
the output is in completion order, as with one engine: match lines by `custom_id`. Greedy
requests give the same answers as one replica's.

Ray is imported only here (and in `serve_ray`, `executors/`, `cluster/`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.entrypoints.batch import IN_FLIGHT_PER_SEQ, BatchRunner, answer_all
from shoal.entrypoints.batch_format import BadLine, BatchLine, ResultWriter, bad_line_result
from shoal.entrypoints.openai.serving_chat import ChatOptions

if TYPE_CHECKING:
    from shoal.config import EngineArgs

logger = logging.getLogger(__name__)

# Requests per Ray Data batch: a replica answers a batch at once, and its lines are written
# when the whole batch is done, so this is also about what a killed job loses per replica.
DEFAULT_REQUESTS_PER_BATCH = 32


class BatchReplica:
    """One engine in a Ray Data actor; answers a batch of requests (columns of `_to_rows`)."""

    def __init__(self, engine_args: EngineArgs, chat_options: ChatOptions | None) -> None:
        from shoal.frontend.async_llm import AsyncLLM

        self.max_in_flight = IN_FLIGHT_PER_SEQ * engine_args.max_num_seqs
        self.loop = asyncio.new_event_loop()
        # The core runs in this actor; its workers are Ray actors in a placement group of their own.
        engine_args = dataclasses.replace(engine_args, distributed_executor_backend="ray")
        self.engine = AsyncLLM(engine_args, multiprocess=False)
        self.runner = BatchRunner(self.engine, chat_options)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[str]]:
        items = [
            BatchLine(int(n), str(c), str(u), json.loads(b))
            for n, c, u, b in zip(batch["line_number"], batch["custom_id"], batch["url"], batch["body"])
        ]
        lines: list[dict[str, Any]] = []
        self.loop.run_until_complete(answer_all(self.runner, items, self.max_in_flight, lines.append))
        return {"result": [json.dumps(line, separators=(",", ":")) for line in lines]}

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            self.loop.run_until_complete(asyncio.sleep(0))  # let the cancelled output handler end


def _to_rows(items: list[BatchLine]) -> list[dict[str, Any]]:
    return [
        {"line_number": item.line_number, "custom_id": item.custom_id, "url": item.url, "body": json.dumps(item.body)}
        for item in items
    ]


def run_data_parallel(
    engine_args: EngineArgs,
    pending: list[BatchLine | BadLine],
    output_path: str | Path,
    data_parallel_size: int,
    chat_options: ChatOptions | None = None,
    use_tqdm: bool = True,
    requests_per_batch: int = DEFAULT_REQUESTS_PER_BATCH,
) -> int:
    """Answer `pending` with `data_parallel_size` replicas, appending each line to `output_path`."""
    import ray.data
    from tqdm import tqdm

    from shoal.executors.ray_utils import connect_to_ray

    connect_to_ray(engine_args.ray_address, None)
    requests = [item for item in pending if isinstance(item, BatchLine)]
    writer = ResultWriter(output_path)
    progress = tqdm(total=len(pending), desc="requests", unit="req", disable=not use_tqdm)
    try:
        for bad in (item for item in pending if isinstance(item, BadLine)):
            writer.write(bad_line_result(bad))
            progress.update(1)
        if requests:
            ray.data.DataContext.get_current().enable_progress_bars = False  # ours counts requests
            dataset = ray.data.from_items(_to_rows(requests)).map_batches(
                BatchReplica,
                fn_constructor_kwargs={"engine_args": engine_args, "chat_options": chat_options},
                batch_size=requests_per_batch,
                compute=ray.data.ActorPoolStrategy(size=data_parallel_size),
                num_cpus=0,  # the replica waits on its workers, which hold the CPUs or GPUs
            )
            for row in dataset.iter_rows():
                writer.write(json.loads(row["result"]))
                progress.update(1)
    finally:
        progress.close()
        writer.close()
    return len(pending)
