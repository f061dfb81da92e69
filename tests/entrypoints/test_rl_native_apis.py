"""SGLang's and vLLM's native RL APIs on `shoal serve --enable-rl-endpoints`, driven as the RL
frameworks drive them, against one real server of a tiny checkpoint:

- every SGLang-shaped answer checked against the fields SGLang's source gives it (the sets
  below, each naming its file and commit in sgl-project/sglang);
- AReaL 1.0.4's SGLang backend (areal/engine/sglang_remote.py) and its trainer's process group
  (areal/engine/core/distributed.py): AReaL pins torch<2.11 and transformers<=5.3, which cannot
  sit beside shoal's, so its request builders are ported here faithfully (tests/entrypoints/
  framework_clients.py);
- TRL's async GRPO client (trl/experimental/async_grpo/vllm_client.py), imported from TRL
  itself when it is installed;
- slime (not on PyPI): its calls as THUDM/slime makes them (framework_clients.py names the
  files and commits).
Bad requests are 400s that leave the engine serving."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import logging
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
import torch.distributed as dist

from tests.entrypoints import framework_clients as clients
from tests.entrypoints.server_utils import ServerProcess
from tests.ray_nodes import free_ports
from tests.rl.rl_utils import Trainer

PROMPT = "The quick brown fox"

# GenerateReqInput's answer, python/sglang/srt/managers/tokenizer_manager.py@c60799d0
# (`_handle_batch_output`): every /generate answer, and the meta_info fields of every answer.
SGLANG_ANSWER = {"text", "output_ids", "meta_info"}
SGLANG_META_INFO = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version"}
# With return_logprob (logprob_start_len >= 0 adds the prompt's, top_logprobs_num > 0 the top ones).
SGLANG_LOGPROBS = {"output_token_logprobs"}
SGLANG_PROMPT_LOGPROBS = {"input_token_logprobs"}
SGLANG_TOP_LOGPROBS = {"output_top_logprobs", "input_top_logprobs"}
# FINISH_MATCHED_TOKEN / FINISH_MATCHED_STR, FINISH_LENGTH, FINISH_ABORT .to_json(), same file.
SGLANG_FINISH = {"stop": {"type", "matched"}, "length": {"type", "length"}, "abort": {"type", "message"}}
# python/sglang/srt/entrypoints/http_server.py@0025436e: the control routes' answers.
SGLANG_PAUSE = {"message", "status"}
SGLANG_GROUP = {"success", "message"}  # /init_weights_update_group, /destroy_weights_update_group
SGLANG_VERSION = {"weight_version"}  # /get_weight_version
SGLANG_NEW_VERSION = {"success", "message", "new_version"}  # /update_weight_version
SGLANG_MODEL_INFO = {"model_path", "tokenizer_path", "is_generation", "preferred_sampling_params", "weight_version"}
# python/sglang/srt/entrypoints/v1_loads.py (`get_loads`).
SGLANG_LOADS = {"timestamp", "version", "dp_rank_count", "loads", "aggregate"}
SGLANG_LOAD = {"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs"}


@pytest.fixture(scope="module")
def native_server(tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """No API key: AReaL's, TRL's and slime's clients send none."""
    log_path = tmp_path_factory.mktemp("rl-native") / "server.log"
    process = ServerProcess([tiny_model_path, "--max-model-len", "256", "--enable-rl-endpoints"], log_path)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def http(native_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=native_server.url, timeout=60) as client:
        yield client


def generate(http: httpx.Client, **body: object) -> object:
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def check_answer(answer: dict, logprobs: bool = False, prompt_logprobs: bool = False, top: bool = False) -> None:
    assert set(answer) >= SGLANG_ANSWER
    meta = answer["meta_info"]
    expected = SGLANG_META_INFO | (SGLANG_LOGPROBS if logprobs else set())
    expected |= SGLANG_PROMPT_LOGPROBS if prompt_logprobs else set()
    expected |= ({"output_top_logprobs"} | ({"input_top_logprobs"} if prompt_logprobs else set())) if top else set()
    assert expected <= set(meta), sorted(expected - set(meta))
    finish = meta["finish_reason"]
    assert set(finish) == SGLANG_FINISH[finish["type"]]
    assert meta["completion_tokens"] == len(answer["output_ids"])
    if logprobs:
        entries = meta["output_token_logprobs"]
        assert [entry[1] for entry in entries] == answer["output_ids"]
        assert all(len(entry) == 3 and entry[0] <= 0 for entry in entries)


# ---- SGLang's /generate -------------------------------------------------------------------------


def test_generate_answers_in_sglang_shapes(http: httpx.Client) -> None:
    params = {"max_new_tokens": 6, "temperature": 0}
    by_text = generate(http, text=PROMPT, sampling_params=params, return_logprob=True)
    check_answer(by_text, logprobs=True)
    assert by_text["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert by_text["meta_info"]["weight_version"] == "0"
    # The same prompt as token ids, with the prompt's logprobs and the top 2 at each position.
    tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_ids = generate(
        http, input_ids=tokens, sampling_params=params, return_logprob=True, logprob_start_len=0, top_logprobs_num=2
    )
    check_answer(by_ids, logprobs=True, prompt_logprobs=True, top=True)
    assert by_ids["output_ids"] == by_text["output_ids"] and by_ids["text"] == by_text["text"]
    assert by_ids["meta_info"]["input_token_logprobs"][0] == [None, tokens[0], None]
    assert [e[1] for e in by_ids["meta_info"]["input_token_logprobs"]] == tokens
    assert all(len(top) == 2 for top in by_ids["meta_info"]["output_top_logprobs"])
    # A batch of two prompts with n=2 each: four answers, prompt by prompt.
    batch = generate(
        http, input_ids=[tokens, tokens[:2]], sampling_params={**params, "n": 2}, rid=["a", "b"], return_logprob=True
    )
    assert [answer["meta_info"]["id"] for answer in batch] == ["a_0", "a_1", "b_0", "b_1"]
    assert batch[0]["output_ids"] == batch[1]["output_ids"] == by_text["output_ids"]  # greedy
    for answer in batch:
        check_answer(answer, logprobs=True)
    # A stop token id: finish_reason names it.
    stopped = generate(http, input_ids=tokens, sampling_params={**params, "stop_token_ids": [by_text["output_ids"][2]]})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": by_text["output_ids"][2]}
    assert stopped["output_ids"] == by_text["output_ids"][:3]


def test_generate_streams_as_sglang_does(http: httpx.Client) -> None:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 0}, "stream": True}
    final = generate(http, **{**body, "stream": False})
    with http.stream("POST", "/generate", json={**body, "return_logprob": True}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    for event in events:  # each the whole output so far
        assert set(event) >= SGLANG_ANSWER and final["output_ids"][: len(event["output_ids"])] == event["output_ids"]
    assert events[-1]["output_ids"] == final["output_ids"] and events[-1]["text"] == final["text"]
    check_answer(events[-1], logprobs=True)
    assert all(event["meta_info"]["finish_reason"] is None for event in events[:-1])


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("/generate", {"text": PROMPT, "return_routed_experts": True}, "mixture-of-experts model"),
        ("/generate", {"text": PROMPT, "input_ids": [1, 2]}, "exactly one of text and input_ids"),
        ("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "beam": 2}}, "'beam'"),
        ("/generate", {"text": PROMPT, "sampling_params": {"temperature": -1}}, "temperature"),
        ("/generate", {"input_ids": [10**9]}, "vocabulary"),
        ("/generate", {"text": PROMPT, "image_data": "cat.png"}, "text only"),
        ("/generate", {"text": PROMPT, "lookahead": 3}, "unknown field"),
        ("/generate", {"text": [PROMPT, PROMPT], "return_logprob": [True]}, "2 prompts"),
        ("/pause_generation", {"mode": "sideways"}, "mode"),
        ("/release_memory_occupation", {"tags": ["activations"]}, "unknown memory tags"),
        ("/update_weights_from_disk", {"model_path": "/no/such/folder"}, "no/such/folder"),
        ("/update_weights_from_disk", {"model_path": "/no/such/folder", "load_format": "gguf"}, "load_format"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["eA=="]}, "cannot be read"),
        (
            "/update_weights_from_tensor",
            {"serialized_named_tensors": ["eA=="], "load_format": "x"},
            "unknown load_format",
        ),
        ("/update_weights_from_distributed", {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]]}, "group"),
        ("/abort_request", {}, "rid or abort_all"),
        ("/inference/v1/generate", {"token_ids": [], "sampling_params": {}}, "token_ids"),
        ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"top_q": 1}}, "top_q"),
        ("/update_weights", {"update_info": {}}, "/start_weight_update"),
        ("/start_weight_update", {"is_checkpoint_format": True}, "/init_weight_transfer_engine"),
        ("/collective_rpc", {"method": "_private"}, "public worker method"),
    ],
)
def test_bad_requests_are_400s_and_the_engine_keeps_serving(
    http: httpx.Client, path: str, body: dict, says: str
) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert says in response.json()["error"]["message"]
    assert http.get("/is_paused").json() == {"is_paused": False}
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    check_answer(generate(http, text=PROMPT, sampling_params={"max_new_tokens": 2}))


def test_abort_request_ends_a_request_with_what_it_has(http: httpx.Client) -> None:
    """A request held by a pause is aborted by its rid: its answer comes at once, finish_reason
    "abort" (SGLang's shape), and the engine serves on after the resume."""
    pause = http.post("/pause_generation", json={"mode": "in_place"})
    assert set(pause.json()) == SGLANG_PAUSE
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(generate, http, text=PROMPT, rid="held", sampling_params={"max_new_tokens": 50})
        time.sleep(0.5)
        assert not held.done()
        assert http.post("/abort_request", json={"rid": "held"}).status_code == 200
        answer = held.result(timeout=30)
    check_answer(answer)
    assert answer["meta_info"]["finish_reason"]["type"] == "abort" and answer["meta_info"]["id"] == "held"
    assert set(http.post("/continue_generation", json={}).json()) == SGLANG_PAUSE
    check_answer(generate(http, text=PROMPT, sampling_params={"max_new_tokens": 2}))


def test_info_routes(http: httpx.Client, native_server: ServerProcess) -> None:
    assert set(http.get("/get_model_info").json()) == SGLANG_MODEL_INFO
    loads = http.get("/v1/loads", params={"include": "core,disagg,queues"}).json()
    assert set(loads) >= SGLANG_LOADS and set(loads["loads"][0]) >= SGLANG_LOAD
    assert http.get("/health_generate").status_code == 200
    assert http.get("/flush_cache").status_code == 200
    assert set(http.get("/get_weight_version").json()) == SGLANG_VERSION
    # vLLM's names.
    assert http.get("/get_world_size").json() == {"world_size": 1}
    assert http.post("/reset_prefix_cache").json() == {"success": True}
    assert http.post("/collective_rpc", json={"method": "report_device"}).json() == {"results": ["cpu"]}
    tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    answer = http.post(
        "/inference/v1/generate",
        json={
            "request_id": "t1",
            "token_ids": tokens,
            "sampling_params": {"max_tokens": 4, "temperature": 0, "logprobs": 1},
        },
    ).json()
    sglang = generate(http, input_ids=tokens, sampling_params={"max_new_tokens": 4, "temperature": 0})
    (choice,) = answer["choices"]
    assert answer["request_id"] == "t1" and choice["token_ids"] == sglang["output_ids"]
    assert choice["weight_versions"] == [{"version": "0", "start": 0, "end": 4}]
    assert len(choice["logprobs"]["content"]) == 4


# ---- AReaL --------------------------------------------------------------------------------------


def test_areal_sglang_backend(http: httpx.Client, tiny_model_path: str, tmp_path) -> None:
    """AReaL's SGLang backend: generate with logprobs, pause and continue, an update over a
    torch gloo group its trainer builds (one broadcast per tensor), a disk update; the weight
    version on the returned tokens moves with the updates."""
    backend = clients.ArealSGLangBackend()
    request = backend.build_generation_request(PROMPT_IDS(http), max_new_tokens=6, greedy=True)
    before = backend.parse_generation_response(clients.send(http, request))
    assert len(before.output_tokens) == len(before.output_logprobs) == 6 and before.stop_reason == "length"
    assert clients.send(http, backend.get_pause_request())["status"] == "ok"
    assert clients.send(http, backend.get_resume_request())["status"] == "ok"

    trainer = Trainer(tiny_model_path)
    trainer.train_step(seed=3)
    (port,) = free_ports(1)
    init = backend.build_init_weights_group_request("127.0.0.1", port, server_idx=0, gen_world_size=1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        group = pool.submit(
            clients.areal_init_custom_process_group, "gloo", f"tcp://127.0.0.1:{port}", 2, 0, "update_weight_group"
        )
        assert set(clients.send(http, init)) == SGLANG_GROUP
        process_group = group.result(timeout=60)
        names = list(trainer.weights)
        (update,) = backend.build_distributed_weight_update_requests(
            [(n, str(trainer.weights[n].dtype).removeprefix("torch."), list(trainer.weights[n].shape)) for n in names]
        )
        assert clients.send(http, backend.get_pause_request())["status"] == "ok"
        sent = pool.submit(http.post, update.endpoint, json=update.payload)
        for name in names:
            dist.broadcast(trainer.weights[name], src=0, group=process_group)
        assert sent.result(timeout=60).json()["success"] is True
        assert clients.send(http, backend.get_resume_request())["status"] == "ok"
    assert (
        set(http.post("/destroy_weights_update_group", json={"group_name": "update_weight_group"}).json())
        == SGLANG_GROUP
    )
    dist.destroy_process_group(process_group)
    after = clients.send(http, backend.build_generation_request(PROMPT_IDS(http), max_new_tokens=6, greedy=True))
    assert after["meta_info"]["weight_version"] == "1"
    assert after["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": 6}]
    changed = backend.parse_generation_response(after).output_tokens
    assert changed != before.output_tokens

    # The same weights from disk give the same tokens; the original folder the original ones.
    folder = trainer.save(str(tmp_path / "step-1"))
    try:
        (disk,) = backend.build_disk_weight_update_requests(tiny_model_path)
        assert clients.send(http, disk)["success"] is True
        again = backend.parse_generation_response(clients.send(http, request))
        assert again.output_tokens == before.output_tokens
        (disk,) = backend.build_disk_weight_update_requests(folder)
        assert clients.send(http, disk)["success"] is True
        assert backend.parse_generation_response(clients.send(http, request)).output_tokens == changed
        # Offload and onload in two stages, as AReaL's colocated mode does.
        assert clients.send(http, backend.get_offload_request())["success"] is True
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        clients.send(http, backend.get_onload_request(["weights"]))
        clients.send(http, backend.get_onload_request(["kv_cache"]))
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert backend.parse_generation_response(clients.send(http, request)).output_tokens == changed
    finally:
        http.post("/update_weights_from_disk", json={"model_path": tiny_model_path, "weight_version": "0"})


@pytest.fixture
def areal_on_path() -> Iterator[None]:
    """AReaL's folder (the Makefile's `$(VENV)/areal-site`, or AREAL_SITE), appended to sys.path.
    AReaL's `getLogger` replaces the logging module's root logger and manager (areal/utils/logging.py),
    which would orphan every logger made afterwards from the root that pytest's caplog listens on:
    they are put back after the test."""
    import os
    import sys
    from pathlib import Path

    site = os.environ.get("AREAL_SITE") or str(Path(sys.prefix) / "areal-site")
    if Path(site, "areal").is_dir() and site not in sys.path:
        sys.path.append(site)
    root, manager = logging.Logger.root, logging.Logger.manager
    yield
    logging.Logger.root, logging.Logger.manager = root, manager


def test_areal_own_sglang_backend(http: httpx.Client, tiny_model_path: str, tmp_path, areal_on_path) -> None:
    """AReaL 1.0.4's own `SGLangBackend` (areal/engine/sglang_remote.py, installed without its
    pins): its generation request and parser (logprobs, finish reason), pause and continue, a
    disk update from its `WeightUpdateMeta`, offload and onload, as its remote engine sends them."""
    sglang_remote = pytest.importorskip("areal.engine.sglang_remote")
    from areal.api.cli_args import GenerationHyperparameters
    from areal.api.io_struct import ModelRequest, WeightUpdateMeta

    backend = sglang_remote.SGLangBackend()

    def call(request) -> dict:
        response = http.request(request.method, request.endpoint, json=request.payload)
        assert response.status_code == 200, response.text
        return response.json()

    gconfig = GenerationHyperparameters(max_new_tokens=6, greedy=True)
    request = backend.build_generation_request(
        ModelRequest(input_ids=PROMPT_IDS(http), gconfig=gconfig), with_lora=False, version=0
    )
    before = backend.parse_generation_response(call(request))
    assert len(before.output_tokens) == len(before.output_logprobs) == 6 and before.stop_reason == "length"
    assert call(backend.get_pause_request())["status"] == "ok"
    assert call(backend.get_resume_request())["status"] == "ok"
    trainer = Trainer(tiny_model_path)
    trainer.train_step(seed=17)
    try:
        (disk,) = backend.build_disk_weight_update_requests(
            WeightUpdateMeta(type="disk", path=trainer.save(str(tmp_path / "step")))
        ).requests
        assert call(disk)["success"] is True
        after = call(request)
        assert backend.parse_generation_response(after).output_tokens != before.output_tokens
        assert after["meta_info"]["weight_version"] != "0"
        assert call(backend.get_offload_request())["success"] is True
        call(backend.get_onload_request(["weights"]))
        call(backend.get_onload_request(["kv_cache"]))
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    finally:
        http.post("/update_weights_from_disk", json={"model_path": tiny_model_path, "weight_version": "0"})
    assert backend.parse_generation_response(call(request)).output_tokens == before.output_tokens


def PROMPT_IDS(http: httpx.Client) -> list[int]:
    return http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]


def test_sglang_update_weights_from_tensor(http: httpx.Client, tiny_model_path: str, tmp_path) -> None:
    """A trainer in another process on the same host sends SGLang's payloads: direct (name,
    tensor) pairs, then a flattened bucket, shared through torch's file_system strategy; the
    engine then answers as after a disk update of the same weights. Payloads it cannot or will not
    read are 400s that change nothing."""
    import os
    import pickle

    import torch.multiprocessing

    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    before = generate(http, **body)["output_ids"]
    trainer = Trainer(tiny_model_path)
    trainer.train_step(seed=7)
    named = list(trainer.weights.items())
    strategy = torch.multiprocessing.get_sharing_strategy()
    try:
        torch.multiprocessing.set_sharing_strategy("file_descriptor")
        refused = http.post(
            "/update_weights_from_tensor", json={"serialized_named_tensors": [clients.sglang_serialize(named)]}
        )
        assert refused.status_code == 400 and "file_system" in refused.text
        evil = base64.b64encode(pickle.dumps(os.system)).decode()
        refused = http.post("/update_weights_from_tensor", json={"serialized_named_tensors": [evil]})
        assert refused.status_code == 400 and "not a tensor" in refused.text
        assert generate(http, **body)["output_ids"] == before
        torch.multiprocessing.set_sharing_strategy("file_system")
        half = len(named) // 2
        direct = {"serialized_named_tensors": [clients.sglang_serialize(named[:half])] * 2, "flush_cache": False}
        assert http.post("/update_weights_from_tensor", json=direct).json()["success"] is True
        bucket = clients.sglang_serialize(clients.sglang_flattened_bucket(named[half:]))
        flattened = {"serialized_named_tensors": [bucket], "load_format": "flattened_bucket", "weight_version": "t-1"}
        assert http.post("/update_weights_from_tensor", json=flattened).json()["weight_version"] == "t-1"
        changed = generate(http, **body)
        assert changed["output_ids"] != before and changed["meta_info"]["weight_version"] == "t-1"
        http.post("/update_weights_from_disk", json={"model_path": trainer.save(str(tmp_path / "step"))})
        assert generate(http, **body)["output_ids"] == changed["output_ids"]
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
        http.post("/update_weights_from_disk", json={"model_path": tiny_model_path, "weight_version": "0"})
    assert generate(http, **body)["output_ids"] == before


# ---- TRL ----------------------------------------------------------------------------------------


def test_trl_async_grpo_client(native_server: ServerProcess, http: httpx.Client, tiny_model_path: str) -> None:
    """TRL's async GRPO client drives pause, the four-phase weight transfer and resume; the
    trainer's broadcast is shoal's `WeightSender` (in TRL's place, vLLM's NCCL trainer)."""
    vllm_client = pytest.importorskip("trl.experimental.async_grpo.vllm_client")
    from accelerate import PartialState

    PartialState()  # as TRL's trainer has: the client logs through accelerate
    client = vllm_client.VLLMClient(native_server.url, server_timeout=30)
    client.wait_for_server_ready(poll_interval_s=0.2)
    assert client.get_world_size() == 1
    assert client.get_max_model_len() == 256
    assert client.get_dtype().removeprefix("torch.") == "float32"
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    before = generate(http, **body)["output_ids"]

    trainer = Trainer(tiny_model_path)
    trainer.train_step(seed=5)
    (port,) = free_ports(1)
    init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    client.pause()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joined = pool.submit(trainer.start_sender, port, 2, 128 << 10)
        client.init_weight_transfer_engine(init_info)
        joined.result(timeout=60)
        client.start_weight_update()
        metadata = trainer.metadata()
        update_info = {
            "names": metadata["names"],
            "dtype_names": metadata["dtypes"],
            "shapes": metadata["shapes"],
            "packed": True,
            "bucket_bytes": metadata["bucket_bytes"],
        }
        sent = pool.submit(trainer.send)
        client.update_weights(update_info)
        assert sent.result(timeout=60) >= 2
        client.finish_weight_update()
    client.resume()
    trainer.close()
    http.post("/destroy_weight_update_group")
    try:
        changed = generate(http, **body)
        assert changed["output_ids"] != before
        assert changed["meta_info"]["weight_version"] != "0"
    finally:
        http.post("/update_weights_from_disk", json={"model_path": tiny_model_path, "weight_version": "0"})
    assert generate(http, **body)["output_ids"] == before


def test_trl_weight_transfer_of_shoal(
    native_server: ServerProcess, http: httpx.Client, tiny_model_path: str, tmp_path
) -> None:
    """`shoal.integrations.trl.ShoalWeightTransfer`, what AsyncGRPOTrainer takes as its
    `weight_transfer`, over TRL's own VLLMClient: TRL's iterator streamed in chunks, one
    /update_weights each; the engine then answers as after a disk update of the same weights."""
    vllm_client = pytest.importorskip("trl.experimental.async_grpo.vllm_client")
    from accelerate import PartialState

    from shoal.integrations.trl import ShoalWeightTransfer

    PartialState()
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    before = generate(http, **body)["output_ids"]
    trainer = Trainer(tiny_model_path)
    trainer.train_step(seed=13)
    transfer = ShoalWeightTransfer(vllm_client.VLLMClient(native_server.url), backend="gloo", bucket_bytes=256 << 10)
    try:
        transfer.init_weight_transfer()
        transfer.pause()
        transfer.send_weights(iter(trainer.weights.items()))
        transfer.resume()
        changed = generate(http, **body)["output_ids"]
        assert changed != before
        http.post("/update_weights_from_disk", json={"model_path": trainer.save(str(tmp_path / "step"))})
        assert generate(http, **body)["output_ids"] == changed
    finally:
        transfer.destroy()
        http.post("/destroy_weight_update_group")
        http.post("/update_weights_from_disk", json={"model_path": tiny_model_path, "weight_version": "0"})
    assert generate(http, **body)["output_ids"] == before


def test_vllm_ipc_weight_transfer(
    native_server: ServerProcess, http: httpx.Client, tiny_model_path: str, tmp_path
) -> None:
    """vLLM's "ipc" backend through TRL's client: the update_info a vLLM trainer builds
    (per-tensor `reduce_tensor` handles, pickled and base64-encoded; on a CPU the storages by
    value), then a packed one; the engine then answers as after a disk update of the same weights."""
    vllm_client = pytest.importorskip("trl.experimental.async_grpo.vllm_client")
    import pickle

    from accelerate import PartialState
    from torch.multiprocessing.reductions import reduce_tensor

    PartialState()
    client = vllm_client.VLLMClient(native_server.url, server_timeout=30)
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    before = generate(http, **body)["output_ids"]
    trainer = Trainer(tiny_model_path)
    trainer.train_step(seed=11)
    named = list(trainer.weights.items())
    half = len(named) // 2

    def update_info(pairs, packed: bool) -> dict:
        info = {
            "names": [n for n, _ in pairs],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in pairs],
            "shapes": [list(t.shape) for _, t in pairs],
        }
        if packed:
            flat = torch.cat([t.flatten() for _, t in pairs])
            info["sizes"] = [t.numel() for _, t in pairs]
            handles = {"cpu": reduce_tensor(flat)}
        else:
            handles = [{"cpu": reduce_tensor(t.contiguous())} for _, t in pairs]
        info["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(handles)).decode("utf-8")
        return info

    try:
        client.pause()
        client.init_weight_transfer_engine({})
        client.start_weight_update()
        client.update_weights(update_info(named[:half], packed=False))
        client.update_weights(update_info(named[half:], packed=True))
        client.finish_weight_update()
        client.resume()
        changed = generate(http, **body)["output_ids"]
        assert changed != before
        http.post("/update_weights_from_disk", json={"model_path": trainer.save(str(tmp_path / "step"))})
        assert generate(http, **body)["output_ids"] == changed
        client.start_weight_update()
        bad = update_info(named[:1], packed=False)
        bad["shapes"] = [[1]]
        response = http.post("/update_weights", json={"update_info": bad})
        assert response.status_code == 400 and "update_info says" in response.text
        client.finish_weight_update()
    finally:
        http.post("/update_weights_from_disk", json={"model_path": tiny_model_path, "weight_version": "0"})
    assert generate(http, **body)["output_ids"] == before


# ---- slime --------------------------------------------------------------------------------------


def test_slime_calls(http: httpx.Client, tiny_model_path: str) -> None:
    """slime's calls on an external SGLang engine, as its source makes them."""
    (info,) = clients.slime_discover_external_engines(http)
    assert info == {"worker_type": "regular", "num_gpus": 1, "tp_size": 1, "pp_size": 1}
    assert clients.slime_wait_until_launched(http)
    sample = clients.slime_generate(http, PROMPT_IDS(http), max_new_tokens=5)
    assert sample["status"] == "truncated" and len(sample["tokens"]) == len(sample["log_probs"]) == 5
    assert sample["weight_versions"] == ["0"]
    clients.slime_abort_until_idle(http)
    assert clients.slime_engine_call(http, "pause_generation").status_code == 200
    assert clients.slime_engine_call(http, "continue_generation").status_code == 200
    clients.slime_engine_call(http, "release_memory_occupation")
    clients.slime_engine_call(http, "resume_memory_occupation")
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    response = clients.slime_engine_call(http, "update_weights_from_disk", {"model_path": tiny_model_path})
    assert response.json()["success"] is True
    version = http.get("/get_weight_version").json()["weight_version"]
    renamed = http.post("/update_weight_version", json={"new_version": "0", "abort_all_requests": True}).json()
    assert set(renamed) == SGLANG_NEW_VERSION and renamed["new_version"] == "0" != version
    assert clients.slime_generate(http, PROMPT_IDS(http), max_new_tokens=5)["weight_versions"] == ["0"]
