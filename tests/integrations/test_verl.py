"""shoal as a veRL rollout engine (shoal/integrations/verl.py, verl_server.py).

The server (no veRL needed): token-in/token-out `generate` with veRL's sampling dict and the
fields of veRL's `TokenOutput`, the same tokens as shoal's OpenAI server on the same engine
(`server_address`), abort and resume, sleep and wake-up, weight updates and `global_steps`.

With veRL 0.9.1 itself (installed without its pins into a folder of its own, see the Makefile): `rollout.name=shoal`
resolves through veRL's own registries; a `ShoalReplica` launches its server actor in a Ray
placement group of the session's cluster and generates through `server_handle`, answering veRL's
`TokenOutput`; the `ShoalServerAdapter` releases, resumes and updates the weights in buckets.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from shoal.integrations.verl_server import COLOCATED, ShoalRolloutServer
from tests.rl.rl_utils import Trainer

CONFIG = {
    "prompt_length": 32,
    "response_length": 8,
    "max_num_seqs": 8,
    "dtype": "float32",
    "enable_prefix_caching": True,
    "free_cache_engine": True,
    "logprobs_mode": "raw_logprobs",
}
PROMPT = [5, 17, 42, 8, 99]
GREEDY = {"temperature": 0.0, "logprobs": True}


def test_rollout_server_answers_as_verl_servers_do(tiny_checkpoints) -> None:
    path = str(tiny_checkpoints["llama"])

    async def run() -> None:
        server = ShoalRolloutServer(CONFIG, path, rollout_mode=COLOCATED)
        await server.launch_server()
        try:
            out = await server.generate(PROMPT, dict(GREEDY), "r1")
            assert len(out["token_ids"]) == 8 and out["stop_reason"] == "completed"
            assert len(out["log_probs"]) == 8 and all(lp <= 0 for lp in out["log_probs"])
            assert out["extra_fields"] == {"global_steps": None, "num_cached_tokens": 0}
            host, port = server.get_server_address()
            async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as http:
                body = {"token_ids": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": 8}}
                answer = (await http.post("/inference/v1/generate", json=body)).json()
            assert answer["choices"][0]["token_ids"] == out["token_ids"]

            # abort: a request in the engine ends "aborted"; new ones wait for the resume (the
            # engine held first, so that the request is surely still there when the abort comes)
            await server.engine.pause_generation(mode="keep")
            long = asyncio.create_task(server.generate(PROMPT, {"max_tokens": 8, "ignore_eos": True}, "r2"))
            await asyncio.sleep(0.2)
            await server.abort_all_requests()
            assert (await long)["stop_reason"] == "aborted"
            held = asyncio.create_task(server.generate(PROMPT, dict(GREEDY), "r3"))
            await asyncio.sleep(0.2)
            assert not held.done()
            await server.resume_generation()
            assert (await held)["token_ids"] == out["token_ids"]

            await server.sleep()
            assert await server.is_sleeping()
            await server.wake_up()
            assert not await server.is_sleeping()

            trainer = Trainer(path)
            trainer.train_step(seed=3)
            await server.update_weights(list(trainer.weights.items()), weight_version="step-1")
            server.set_global_steps(1)
            changed = await server.generate(PROMPT, dict(GREEDY), "r4")
            assert changed["token_ids"] != out["token_ids"] and changed["extra_fields"]["global_steps"] == 1
        finally:
            await server.shutdown()

    asyncio.run(run())


def _verl_on_path() -> str | None:
    """veRL's folder (the Makefile's `$(VENV)/verl-site`, or VERL_SITE), appended to sys.path."""
    site = os.environ.get("VERL_SITE") or str(Path(sys.prefix) / "verl-site")
    if not Path(site, "verl").is_dir():
        return None
    if site not in sys.path:
        sys.path.append(site)
    return site


class _ActorShim:
    """An in-process object called as a Ray actor handle is (`handle.method.remote(...)`)."""

    def __init__(self, target: object) -> None:
        self.target = target

    def __getattr__(self, name: str) -> SimpleNamespace:
        method = getattr(self.target, name)

        async def remote(*args, **kwargs):
            result = method(*args, **kwargs)
            return await result if asyncio.iscoroutine(result) else result

        return SimpleNamespace(remote=remote)


def test_verl_classes_drive_a_shoal_server(tiny_checkpoints) -> None:
    """veRL's registries resolve "shoal"; the server answers veRL's own `TokenOutput`; the
    `ShoalServerAdapter` (veRL's `BaseRollout`) releases, resumes and sends weights in buckets of
    `update_weights_bucket_megabytes` to the replica's server (here in-process, called as the
    Ray actor handle it is in a deployment); a replica finds its bundles in veRL's pool."""
    _verl_on_path()
    replica_module = pytest.importorskip("verl.workers.rollout.replica")
    from verl.workers.rollout.base import get_rollout_class

    import shoal.integrations.verl as shoal_verl

    shoal_verl.register()
    assert replica_module.RolloutReplicaRegistry.get("shoal") is shoal_verl.ShoalReplica
    assert get_rollout_class("shoal", "async") is shoal_verl.ShoalServerAdapter
    path = str(tiny_checkpoints["llama"])
    config = SimpleNamespace(
        **CONFIG,
        tensor_model_parallel_size=2,
        data_parallel_size=1,
        pipeline_model_parallel_size=1,
        checkpoint_engine=SimpleNamespace(update_weights_bucket_megabytes=1),
    )
    model = SimpleNamespace(path=path, local_path=None)

    replica = shoal_verl.ShoalReplica(1, config, model, gpus_per_node=2)
    replica.rollout_mode = replica_module.RolloutMode.COLOCATED
    replica.resource_pool = SimpleNamespace(pgs=[SimpleNamespace(bundle_count=2), SimpleNamespace(bundle_count=2)])
    assert replica.placement() == (replica.resource_pool.pgs[1], [0, 1])

    async def run() -> None:
        server = shoal_verl.ShoalHttpServer(
            SimpleNamespace(**{**vars(config), "tensor_model_parallel_size": 1}),
            model,
            replica_module.RolloutMode.HYBRID,
            0,
        )
        await server.launch_server(serve_http=False)
        adapter = shoal_verl.ShoalServerAdapter(config, model, None, replica_rank=0)
        adapter._server = _ActorShim(server)
        try:
            out = await server.generate(PROMPT, dict(GREEDY), "v1")
            assert isinstance(out, replica_module.TokenOutput)
            assert len(out.token_ids) == 8 and len(out.log_probs) == 8 and out.stop_reason == "completed"
            await adapter.release()  # HYBRID: weights and KV cache dropped, new weights expected
            assert await server.is_sleeping()
            await adapter.resume(["weights"])
            trainer = Trainer(path)
            trainer.train_step(seed=3)
            await adapter.update_weights(iter(trainer.weights.items()), global_steps=7)
            await adapter.resume(["kv_cache"])
            assert not await server.is_sleeping()
            changed = await server.generate(PROMPT, dict(GREEDY), "v2")
            assert changed.token_ids != out.token_ids and changed.extra_fields["global_steps"] == 7
        finally:
            await server.shutdown()

    asyncio.run(run())
