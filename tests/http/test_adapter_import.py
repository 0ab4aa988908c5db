"""Adapter import over the Tinker 0.39 routes (`external_weights_upload_start`, signed PUTs,
`external_weights_upload_finish`): an adapter trained with plain `peft` becomes a
checkpoint of the caller's that samples with `peft`'s own logprobs, trains on, downloads
again equal, and answers on the OpenAI route; hostile uploads are refused by name and
leave nothing behind.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from safetensors.torch import load_file, save_file
from tinker import types

from twinkle_server.engine.tiny_model import TINY_LARGE_NAME, build_tiny_model

from ..numerics import LOGPROB_ATOL
from .conftest import keyed_server, sft_data

pytestmark = pytest.mark.integration

TOKENS = [5, 17, 29, 3, 88, 41, 7, 12, 60]
LORA = {"rank": 4, "train_mlp": False, "train_attn": True, "train_unembed": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_cache):
    proc = keyed_server(tmp_path_factory.mktemp("import-server"), "--max-rank", "16")
    yield proc
    proc.stop()


def _peft_adapter(out: Path, base: str = "tiny", seed: int = 0) -> tuple[Path, np.ndarray]:
    """A LoRA trained one step with plain peft on a built-in base (q and v projections),
    saved by peft; and its logprobs of TOKENS[1:], in-process."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(name=base),
                                                 dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8,
                                            target_modules=["q_proj", "v_proj"]))
    ids = torch.tensor([TOKENS])
    optimizer = torch.optim.SGD([p for p in peft.parameters() if p.requires_grad], lr=0.5)
    peft(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    peft.eval()
    with torch.no_grad():
        logits = peft(input_ids=ids).logits[0].float()
    want = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0].numpy()
    peft.save_pretrained(out)
    return out, want


def _headers(server, tenant: str = "alice") -> dict[str, str]:
    return {"authorization": f"Bearer {server.keys[tenant]}"}


def _upload(server, directory: Path, lora: dict | None = None, base: str = "tiny",
            tenant: str = "alice") -> httpx.Response:
    """start, PUT every file, finish: the finish reply (or the first refusal), with the
    upload's id as `upload_id` (None when refused at the start)."""
    url = f"http://{server.http_address}/api/v1"
    started = httpx.post(f"{url}/external_weights_upload_start", headers=_headers(server, tenant),
                         json={"base_model": base, "lora_config": lora or LORA}, timeout=30)
    started.upload_id = None
    if started.status_code != 200:
        return started
    body = started.json()
    for name, signed in body["urls"].items():
        put = httpx.put(signed, content=(directory / name).read_bytes(), timeout=60)
        if put.status_code != 200:
            put.upload_id = body["upload_id"]
            return put
    finish = httpx.post(f"{url}/external_weights_upload_finish",
                        headers=_headers(server, tenant),
                        json={"upload_id": body["upload_id"]}, timeout=60)
    finish.upload_id = body["upload_id"]
    return finish


def _checkpoints(server, tenant: str = "alice") -> list[str]:
    rest = tinker.RestClient(base_url=f"http://{server.http_address}", api_key=server.keys[tenant])
    return [c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints]


def _uploads_left(server) -> list[str]:
    root = server.data_dir / "uploads"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


@pytest.fixture(scope="module")
def imported(server, tmp_path_factory) -> tuple[str, Path, np.ndarray]:
    directory, want = _peft_adapter(tmp_path_factory.mktemp("peft") / "adapter")
    reply = _upload(server, directory)
    assert reply.status_code == 200, reply.text
    return reply.json()["tinker_path"], directory, want


def test_a_peft_adapter_samples_with_pefts_own_logprobs(server, imported):
    path, _, want = imported
    assert path.startswith("tinker://") and "/external_weights/" in path
    assert path in _checkpoints(server)
    service = tinker.ServiceClient(base_url=f"http://{server.http_address}",
                                   api_key=server.keys["alice"])
    sampler = service.create_sampling_client(model_path=path).result()
    got = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()[1:]
    np.testing.assert_allclose(got, want, atol=LOGPROB_ATOL, rtol=0)


def test_it_trains_on_downloads_equal_and_answers_openai(server, imported, tmp_path):
    path, directory, _ = imported
    base_url = f"http://{server.http_address}"
    service = tinker.ServiceClient(base_url=base_url, api_key=server.keys["alice"])
    training = service.create_training_client_from_state(path).result()
    out = training.forward_backward(sft_data(n=2), "cross_entropy").result()
    assert np.isfinite(out.metrics["loss:sum"])
    rest = tinker.RestClient(base_url=base_url, api_key=server.keys["alice"])
    # Made with module names, not Tinker's switches: none is claimed.
    info = rest.get_weights_info_by_tinker_path(path).result()
    assert (info.lora_rank, info.train_attn, info.train_mlp, info.train_unembed) == (
        4, None, None, None)
    urls = rest.get_external_weights_urls(path).result().urls
    (tmp_path / "back").mkdir()
    for name, url in urls.items():
        (tmp_path / "back" / name).write_bytes(httpx.get(url, timeout=30).content)
    sent = load_file(str(directory / "adapter_model.safetensors"))
    back = load_file(str(tmp_path / "back" / "adapter_model.safetensors"))
    assert sorted(sent) == sorted(back)
    assert all(torch.equal(sent[k], back[k]) for k in sent)
    reply = httpx.post(f"{base_url}/oai/api/v1/completions", headers=_headers(server),
                       json={"model": path, "prompt": TOKENS, "max_tokens": 3}, timeout=30)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1


def test_an_export_imported_back_equals_the_original(server, tmp_path):
    base_url = f"http://{server.http_address}"
    service = tinker.ServiceClient(base_url=base_url, api_key=server.keys["alice"])
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    training.forward_backward(sft_data(n=2), "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    export = training.save_weights_external("out").result().path
    rest = tinker.RestClient(base_url=base_url, api_key=server.keys["alice"])
    for name, url in rest.get_external_weights_urls(export).result().urls.items():
        (tmp_path / name).write_bytes(httpx.get(url, timeout=30).content)
    lora = {"rank": 4, "train_mlp": True, "train_attn": True, "train_unembed": True}
    reply = _upload(server, tmp_path, lora)
    assert reply.status_code == 200, reply.text
    prompt = types.ModelInput.from_ints(TOKENS)
    original = training.save_weights_and_get_sampling_client().result()
    back = service.create_sampling_client(model_path=reply.json()["tinker_path"]).result()
    np.testing.assert_array_equal(back.compute_logprobs(prompt).result()[1:],
                                  original.compute_logprobs(prompt).result()[1:])


def test_another_tenant_cannot_finish_or_read_an_import(server, imported):
    path, directory, _ = imported
    bob = tinker.ServiceClient(base_url=f"http://{server.http_address}", api_key=server.keys["bob"])
    with pytest.raises(tinker.NotFoundError):
        bob.create_sampling_client(model_path=path).result()
    url = f"http://{server.http_address}/api/v1"
    started = httpx.post(f"{url}/external_weights_upload_start", headers=_headers(server),
                         json={"base_model": "tiny", "lora_config": LORA}, timeout=30).json()
    finish = httpx.post(f"{url}/external_weights_upload_finish",
                        headers=_headers(server, "bob"),
                        json={"upload_id": started["upload_id"]}, timeout=30)
    assert finish.status_code == 404


def _tamper(directory: Path, out: Path, how: str) -> Path:
    """A copy of the adapter in `directory`, made hostile one way."""
    out.mkdir()
    config = json.loads((directory / "adapter_config.json").read_text())
    tensors = load_file(str(directory / "adapter_model.safetensors"))
    key = next(k for k in sorted(tensors) if k.endswith("lora_A.weight"))
    if how == "pickle":
        buffer = io.BytesIO()
        pickle.dump({"x": 1}, buffer)
        (out / "adapter_model.safetensors").write_bytes(buffer.getvalue())
    elif how == "non_finite":
        tensors[key][0, 0] = float("nan")
    elif how == "shape":
        tensors[key] = tensors[key][:, :-1].contiguous()
    elif how == "dtype":
        tensors[key] = tensors[key].to(torch.int32)
    elif how == "module":
        tensors["base_model.model.model.embed_tokens.lora_A.weight"] = torch.zeros(4, 4096)
    elif how == "dora":
        config["use_dora"] = True
    elif how == "rank":
        config["r"] = 64
    elif how == "alpha":
        config["lora_alpha"] = 1e300
    elif how == "pissa":
        config["init_lora_weights"] = "pissa"
    elif how == "replication":
        config["layer_replication"] = [[0, 1], [0, 1]]
    elif how == "targets":
        config["target_modules"] = ["k_proj"]       # the tensors adapt q and v
    elif how == "eva":
        config["init_lora_weights"] = "eva"         # A's first values from activations
    elif how == "converted":                        # peft's PiSSA/CorDA conversion saves
        config.update(init_lora_weights=True, corda_config={"corda_method": "ipm"})
    elif how == "unmatched":                        # a generic list: peft skips qkv_proj
        config["target_modules"] = ["q_proj", "v_proj", "qkv_proj"]
    if not (out / "adapter_model.safetensors").exists():
        save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        "[" * 100_000 + "]" * 100_000 if how == "nested" else json.dumps(config))
    return out


@pytest.mark.parametrize(("how", "status", "says"), [
    ("pickle", 400, "not a safetensors file"),
    ("non_finite", 400, "not finite"),
    ("shape", 400, "has shape"),
    ("dtype", 400, "torch.int32"),
    ("module", 400, "not a linear layer of this base"),
    ("dora", 400, "use_dora"),
    ("rank", 400, "r is 64; give an integer in [1, 16]"),
    # Each of these once answered 500, or imported an adapter that meant something else
    # (or could never sample).
    ("nested", 400, "not JSON"),
    ("alpha", 400, "lora_alpha: 1e+300 makes the scaling"),
    ("pissa", 400, "init_lora_weights is 'pissa'"),
    ("replication", 400, "layer_replication"),
    ("targets", 400, "does not select 'model.layers.0.self_attn.q_proj'"),
])
def test_a_hostile_upload_is_refused_and_leaves_nothing(server, imported, tmp_path, how,
                                                        status, says):
    _, directory, _ = imported
    before = _checkpoints(server)
    reply = _upload(server, _tamper(directory, tmp_path / how, how))
    assert reply.status_code == status, reply.text
    assert says in reply.json()["detail"], reply.text
    assert _checkpoints(server) == before
    assert reply.upload_id not in _uploads_left(server)


@pytest.mark.parametrize("how", ["eva", "converted", "unmatched"])
def test_peft_configs_that_leave_the_base_as_it_is_import(server, imported, tmp_path, how):
    """An init that only chooses the matrices' first values, peft's conversion of a
    base-rewriting adapter to plain LoRA, and a target list one of whose patterns this
    base lacks: peft loads each as plain LoRA, and so does the import."""
    _, directory, _ = imported
    reply = _upload(server, _tamper(directory, tmp_path / how, how))
    assert reply.status_code == 200, reply.text


def test_an_adapter_of_another_base_is_refused(server, tmp_path):
    directory, _ = _peft_adapter(tmp_path / "large", base=TINY_LARGE_NAME)
    reply = _upload(server, directory)
    assert reply.status_code == 400 and "of this base" in reply.json()["detail"], reply.text


def test_an_upload_must_be_the_adapter_its_start_announced(server, imported):
    _, directory, _ = imported
    reply = _upload(server, directory, {**LORA, "rank": 8})
    assert reply.status_code == 400
    assert "r is 4, the upload was started with lora_config.rank 8" in reply.json()["detail"]
    reply = _upload(server, directory, {**LORA, "train_attn": False})
    assert reply.status_code == 400 and "lora_config.train_attn false" in reply.json()["detail"]


def test_the_start_refuses_what_it_cannot_take(server):
    url = f"http://{server.http_address}/api/v1/external_weights_upload_start"
    for body, says in [
        ({"base_model": "tiny", "lora_config": {**LORA, "rank": 64}}, "lora_config.rank"),
        ({"base_model": "nope", "lora_config": LORA}, "base_model: 'nope' is not served"),
        ({"base_model": "tiny", "lora_config": {**LORA, "seed": 3}}, "lora_config.seed"),
        ({"base_model": "tiny", "lora_config": LORA, "destination_project_id": "p"},
         "destination_project_id"),
    ]:
        reply = httpx.post(url, headers=_headers(server), json=body, timeout=30)
        assert reply.status_code == 400 and says in reply.json()["detail"], reply.text


def test_signed_urls_are_single_use_unforgeable_and_bounded(server, imported):
    _, directory, _ = imported
    url = f"http://{server.http_address}/api/v1"
    started = httpx.post(f"{url}/external_weights_upload_start", headers=_headers(server),
                         json={"base_model": "tiny", "lora_config": LORA}, timeout=30).json()
    config_url = started["urls"]["adapter_config.json"]
    data = (directory / "adapter_config.json").read_bytes()
    assert httpx.put(config_url, content=data, timeout=30).status_code == 200
    again = httpx.put(config_url, content=data, timeout=30)
    assert again.status_code == 412 and "one PUT" in again.json()["detail"]
    other = config_url.replace("adapter_config.json", "..%2Fupload.json")
    assert httpx.put(other, content=b"{}", timeout=30).status_code in (403, 404)
    forged = config_url.replace("signature=", "signature=0")
    assert httpx.put(forged, content=data, timeout=30).status_code == 403
    oversized = httpx.put(started["urls"]["adapter_model.safetensors"],
                          content=b"x" * 10, timeout=30)
    assert oversized.status_code == 200   # bytes taken; the finish checks what they are
    fresh = httpx.post(f"{url}/external_weights_upload_start", headers=_headers(server),
                       json={"base_model": "tiny", "lora_config": LORA}, timeout=30).json()
    too_big = httpx.put(fresh["urls"]["adapter_config.json"], content=b" " * ((1 << 20) + 1),
                        timeout=30)
    assert too_big.status_code == 400 and "1048576-byte limit" in too_big.json()["detail"]
    left = server.data_dir / "uploads" / fresh["upload_id"] / "files"
    assert sorted(p.name for p in left.iterdir()) == []   # nothing half-written stays
    unfinished = httpx.post(f"{url}/external_weights_upload_finish", headers=_headers(server),
                            json={"upload_id": fresh["upload_id"]}, timeout=30)
    assert unfinished.status_code == 412 and "not uploaded" in unfinished.json()["detail"]
    big = httpx.put(started["urls"]["adapter_model.safetensors"].replace(
        "adapter_model.safetensors", "adapter_config.json"), content=b"x", timeout=30)
    assert big.status_code == 403   # a URL signs one file
    finish = httpx.post(f"{url}/external_weights_upload_finish", headers=_headers(server),
                        json={"upload_id": started["upload_id"]}, timeout=30)
    assert finish.status_code == 400 and "not a safetensors file" in finish.json()["detail"]
    assert started["upload_id"] not in _uploads_left(server)


def test_a_missing_required_field_is_refused_by_name(server):
    url = f"http://{server.http_address}/api/v1"
    for route, body, says in [
        ("external_weights_upload_start", {"lora_config": LORA}, "base_model: required"),
        ("external_weights_upload_finish", {}, "upload_id: required")]:
        reply = httpx.post(f"{url}/{route}", headers=_headers(server), json=body, timeout=30)
        assert reply.status_code == 400 and says in reply.json()["detail"], reply.text


def test_racing_puts_and_finishes_take_one_each_and_answer_by_name(server, imported):
    """Two PUTs to one URL at once: one file, the other refused (the second once
    replaced the first). Three finishes at once: one of them takes the upload, the others
    find none (each once made its own). A PUT still sending when the upload is finished:
    not found (once 500).

    Which PUT wins is not fixed (they race), so the test accepts either and checks what
    each must leave: the winner's bytes, whole, under the file's name and nothing beside
    it; then a checkpoint when the adapter's own config won, or a refusal naming
    `adapter_config.json` and no checkpoint when `{"r": 4}` won; either way one finish
    answers that, the other two 404, and the upload is gone."""
    import asyncio

    _, directory, _ = imported
    url = f"http://{server.http_address}/api/v1"
    config = (directory / "adapter_config.json").read_bytes()
    weights = (directory / "adapter_model.safetensors").read_bytes()
    bodies = [config, b'{"r": 4}']   # the racing PUTs' bodies, in order

    async def slow(data: bytes, seconds: float = 0.5):
        for i in range(0, len(data), max(1, len(data) // 4)):
            yield data[i:i + max(1, len(data) // 4)]
            await asyncio.sleep(seconds / 4)

    async def held(data: bytes, release: asyncio.Event):
        """`data` in two halves, the second once `release` is set."""
        yield data[:len(data) // 2]
        await release.wait()
        yield data[len(data) // 2:]

    async def until(ready, seconds: float = 30.0):
        deadline = asyncio.get_running_loop().time() + seconds
        while not ready():
            assert asyncio.get_running_loop().time() < deadline, "never ready"
            await asyncio.sleep(0.02)

    async def start(client):
        reply = await client.post(f"{url}/external_weights_upload_start",
                                  headers=_headers(server),
                                  json={"base_model": "tiny", "lora_config": LORA})
        return reply.json()

    async def finish(client, upload_id):
        return await client.post(f"{url}/external_weights_upload_finish",
                                 headers=_headers(server), json={"upload_id": upload_id})

    async def race():
        async with httpx.AsyncClient(timeout=60) as client:
            started = await start(client)
            urls = started["urls"]
            puts = await asyncio.gather(*(client.put(urls["adapter_config.json"],
                                                     content=slow(body))
                                          for body in bodies))
            files = server.data_dir / "uploads" / started["upload_id"] / "files"
            landed = {p.name: p.read_bytes() for p in files.iterdir()}
            await client.put(urls["adapter_model.safetensors"], content=weights)
            before = len(_checkpoints(server))
            finishes = await asyncio.gather(*(finish(client, started["upload_id"])
                                              for _ in range(3)))
            made = len(_checkpoints(server)) - before
            late = await start(client)
            await client.put(late["urls"]["adapter_config.json"], content=config)
            finished = asyncio.Event()
            sending = asyncio.ensure_future(client.put(
                late["urls"]["adapter_model.safetensors"],
                content=held(weights, finished)))
            # Finish once the server is writing the PUT's partial file, and let the PUT
            # send its last bytes only after the finish answered: the PUT is still
            # sending when its upload is finished, however busy the machine (a sleep of
            # 0.4 s against a 1 s body once stood for this order).
            await until(lambda: any((server.data_dir / "uploads" / late["upload_id"]
                                      / "files").glob(".*.part")))
            gone = await finish(client, late["upload_id"])
            finished.set()
            return (started["upload_id"], puts, landed, finishes, made, gone,
                    await sending)

    upload_id, puts, landed, finishes, made, gone, sent = asyncio.run(race())
    # One PUT took the file, whole; the other was refused by name; no partial is left.
    assert sorted(p.status_code for p in puts) == [200, 412], [p.text for p in puts]
    [winner] = [body for body, put in zip(bodies, puts, strict=True) if put.status_code == 200]
    [loser] = [put for put in puts if put.status_code == 412]
    assert "adapter_config.json: already uploaded" in loser.json()["detail"]
    assert landed == {"adapter_config.json": winner}
    # One finish took the upload and answered for it; the others found none.
    [taken] = [f for f in finishes if f.status_code != 404]
    assert all(upload_id in f.json()["detail"] for f in finishes if f is not taken)
    if winner == config:
        assert taken.status_code == 200, taken.text
        assert made == 1
    else:     # '{"r": 4}' names no target modules: refused, and nothing made
        assert taken.status_code == 400 and "adapter_config.json" in taken.json()["detail"], \
            taken.text
        assert made == 0
    assert upload_id not in _uploads_left(server)
    assert f"{upload_id}.finishing" not in _uploads_left(server)
    assert gone.status_code == 412                      # its weights had not arrived
    assert sent.status_code == 404 and "was finished or expired" in sent.json()["detail"]


def test_every_door_imports_alike(server, imported, tmp_path):
    """tinker_compat's RestClient (gRPC + the signed PUTs), the native client, and the
    CLI beside the running server each make a checkpoint that samples peft's logprobs."""
    import subprocess
    import sys

    from tinker_compat import RestClient, ServiceClient
    from twinkle_client import init_twinkle_client

    _, directory, want = imported
    grpc_url = f"http://{server.address}"
    rest = RestClient(base_url=grpc_url, api_key=server.keys["alice"])
    started = rest.external_weights_upload_start(
        "tiny", types.LoraConfig(rank=4, train_mlp=False, train_unembed=False)).result()
    for name, url in started.urls.items():
        assert httpx.put(url, content=(directory / name).read_bytes(),
                         timeout=60).status_code == 200
    via_compat = rest.external_weights_upload_finish(started.upload_id).result().tinker_path
    info = rest.get_weights_info_by_tinker_path(via_compat).result()
    assert (info.lora_rank, info.train_attn, info.train_mlp, info.train_unembed) == (
        4, None, None, None)
    native = init_twinkle_client(base_url=grpc_url, api_key=server.keys["alice"])
    try:
        via_native = native.import_adapter(directory, base_model="tiny")
    finally:
        native.close()
    cli = subprocess.run([sys.executable, "-m", "twinkle_server.cli", "adapters", "import",
                          str(directory), "--tenant", "alice", "--data-dir",
                          str(server.data_dir)], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    via_cli = cli.stdout.strip()
    service = ServiceClient(base_url=grpc_url, api_key=server.keys["alice"])
    try:
        for path in (via_compat, via_native, via_cli):
            sampler = service.create_sampling_client(model_path=path).result()
            got = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()[1:]
            np.testing.assert_allclose(got, want, atol=LOGPROB_ATOL, rtol=0)
    finally:
        service.close()
    assert {via_compat, via_cli} <= set(_checkpoints(server))


def test_the_cli_refuses_a_hostile_directory_naming_why(server, imported, tmp_path):
    import subprocess
    import sys

    _, directory, _ = imported
    hostile = _tamper(directory, tmp_path / "bad", "non_finite")
    cli = subprocess.run([sys.executable, "-m", "twinkle_server.cli", "adapters", "import",
                          str(hostile), "--tenant", "alice", "--data-dir", str(server.data_dir)],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and "not finite" in cli.stderr
