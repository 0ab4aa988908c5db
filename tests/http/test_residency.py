"""More runs than resident slots, through the stock SDK: training clients on a server with
few `--max-adapters` each train 3 steps in turn, none refused, and every loss, and the
logprobs their final weights give, equal the same runs on a server that pages nothing.
The same ops through the same passes, paging moving no number: equal exactly
(engine/test_residency.py). 8 runs on 2 slots run in `make test`; 64 runs on 4 slots, in
host memory and on disk, are `long` (one to two minutes together, left to
`make test-long`, which CI runs)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from twinkle_server.process import start_server

from .conftest import keyed_server, sft_data

pytestmark = pytest.mark.integration

STEPS = 3
Trained = tuple[list[list[float]], list[np.ndarray]]
"""Each run's losses, step by step, and its final weights' logprobs of its data."""


def _train_in_turn(service: tinker.ServiceClient, runs: int) -> Trained:
    clients = [service.create_lora_training_client(base_model="tiny", rank=4, seed=i).result()
               for i in range(runs)]
    losses: list[list[float]] = [[] for _ in clients]
    for _ in range(STEPS):
        for run, client in enumerate(clients):
            out = client.forward_backward(sft_data(n=2, seed=run), "cross_entropy").result()
            losses[run].append(out.metrics["loss:sum"])
            client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    final = [np.concatenate([o["logprobs"].to_numpy() for o in client.forward(
        sft_data(n=2, seed=run), "cross_entropy").result().loss_fn_outputs])
        for run, client in enumerate(clients)]
    return losses, final


def _paged(data_dir, runs: int, *flags: str) -> tuple[Trained, dict[str, float]]:
    """`runs` runs trained in turn on a server started with `flags`, and its adapter
    gauges and counters from /metrics while the runs are still live."""
    proc = keyed_server(data_dir, "--max-adapters-per-tenant", str(runs), *flags)
    try:
        service = tinker.ServiceClient(base_url=f"http://{proc.http_address}",
                                       api_key=proc.keys["alice"])
        trained = _train_in_turn(service, runs)
        metrics = httpx.get(f"http://{proc.http_address}/metrics").text
        service.close("success").result()
    finally:
        proc.stop()
    return trained, {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                     for line in metrics.splitlines() if line.startswith("twinkle_adapter")}


def _assert_equal(paged: Trained, resident: Trained) -> None:
    assert paged[0] == resident[0]
    for ours, theirs in zip(paged[1], resident[1], strict=True):
        np.testing.assert_array_equal(ours, theirs)
    assert all(min(run[1:]) < run[0] for run in paged[0])    # each run trains


def test_eight_runs_on_two_resident_slots_train_as_on_sixty_four(tmp_path, tiny_cache,
                                                                 server, base_url):
    runs = 8
    paged, counted = _paged(tmp_path / "two-slots", runs, "--max-adapters", "2")
    assert counted["twinkle_adapter_page_ins_total"] >= runs * STEPS - 2   # a run a step
    assert counted["twinkle_adapter_page_outs_total"] >= counted[
        "twinkle_adapter_page_ins_total"]
    service = tinker.ServiceClient(base_url=base_url, api_key=server.keys["alice"])
    _assert_equal(paged, _train_in_turn(service, runs))
    service.close("success").result()


MANY = 64


@pytest.fixture(scope="module")
def all_resident(tmp_path_factory, tiny_cache) -> Trained:
    """`MANY` runs on a server with a slot for each: nothing pages."""
    trained, counted = _paged(tmp_path_factory.mktemp("all-resident"), MANY,
                              "--max-adapters", str(MANY))
    assert counted["twinkle_adapter_page_outs_total"] == 0
    return trained


@pytest.mark.long
@pytest.mark.parametrize("pages_to", ["host memory", "disk"])
def test_sixty_four_runs_on_four_resident_slots_train_as_with_all_resident(
        tmp_path, all_resident, pages_to):
    """Every run pages out and in at each of its ops (LRU of 4 slots, 64 runs in turn),
    in host memory or, past a host budget of a few bytes, to disk."""
    flags = ["--max-adapters", "4"]
    if pages_to == "disk":
        flags += ["--adapter-host-memory-gib", "0.000001"]
    paged, counted = _paged(tmp_path / "four-slots", MANY, *flags)
    assert counted["twinkle_adapter_page_ins_total"] >= MANY * (STEPS + 1)
    on_disk = counted["twinkle_adapters_on_disk"]
    assert on_disk == (MANY - 4 if pages_to == "disk" else 0), counted
    _assert_equal(paged, all_resident)


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
