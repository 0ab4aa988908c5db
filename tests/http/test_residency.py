"""More runs than resident slots, through the stock SDK: 8 training clients on a server
with `--max-adapters 2` each train 3 steps in turn, none refused, and every loss equals
the same run on the package's server (64 slots, nothing paged). The same ops through the
same passes, paging moving no number: equal exactly (engine/test_residency.py)."""

from __future__ import annotations

import httpx
import pytest
import tinker
from tinker import types

from twinkle_server.process import start_server

from .conftest import keyed_server, sft_data

pytestmark = pytest.mark.integration

RUNS, STEPS = 8, 3


def _train_in_turn(url: str, key: str) -> list[list[float]]:
    service = tinker.ServiceClient(base_url=url, api_key=key)
    clients = [service.create_lora_training_client(base_model="tiny", rank=4, seed=i).result()
               for i in range(RUNS)]
    losses: list[list[float]] = [[] for _ in clients]
    for _ in range(STEPS):
        for run, client in enumerate(clients):
            out = client.forward_backward(sft_data(n=2, seed=run), "cross_entropy").result()
            losses[run].append(out.metrics["loss:sum"])
            client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    service.close("success").result()
    return losses


def test_eight_runs_on_two_resident_slots_train_as_on_sixty_four(tmp_path, tiny_cache,
                                                                 server, base_url):
    small = keyed_server(tmp_path / "two-slots", "--max-adapters", "2",
                         "--max-adapters-per-tenant", "16")
    try:
        paged = _train_in_turn(f"http://{small.http_address}", small.keys["alice"])
        metrics = httpx.get(f"http://{small.http_address}/metrics").text
    finally:
        small.stop()
    counted = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
               for line in metrics.splitlines() if line.startswith("twinkle_adapter")}
    assert counted["twinkle_adapter_page_ins_total"] >= RUNS * STEPS - 2   # a run a step
    assert counted["twinkle_adapter_page_outs_total"] >= counted[
        "twinkle_adapter_page_ins_total"]
    assert paged == _train_in_turn(base_url, server.keys["alice"])
    assert all(run[-1] < run[0] for run in paged)


def test_a_server_killed_with_adapters_on_disk_restarts_with_what_the_store_lists(
        tmp_path, tiny_cache):
    """Paging is not a checkpoint: killed (SIGKILL) while a run's adapter is paged to
    disk, the server restarts with no page file left, and the checkpoint the run saved
    before loads and trains on; the unsaved run is gone, as a resident one would be."""
    import signal

    data = tmp_path / "killed"
    flags = ("--max-adapters", "1", "--adapter-host-memory-gib", "0.000001")
    proc = keyed_server(data, *flags)
    service = tinker.ServiceClient(base_url=f"http://{proc.http_address}",
                                   api_key=proc.keys["alice"])
    saved = service.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    saved.forward_backward(sft_data(n=2), "cross_entropy").result()
    saved.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = saved.save_state("before-kill").result().path
    other = service.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    other.forward_backward(sft_data(n=2), "cross_entropy").result()   # pages `saved` out
    pages = list((data / "adapter-pages").rglob("*.pt"))
    assert pages, "the saved run's adapter was not on disk"
    proc.stop(signal.SIGKILL)
    key = proc.keys["alice"]
    proc = start_server(data, *flags, http=True)
    try:
        assert not list((data / "adapter-pages").rglob("*.pt"))
        service = tinker.ServiceClient(base_url=f"http://{proc.http_address}", api_key=key)
        resumed = service.create_training_client_from_state(path)
        out = resumed.forward_backward(sft_data(n=2), "cross_entropy").result()
        assert out.metrics["loss:sum"] > 0
        service.close("success").result()
    finally:
        proc.stop()
