"""`placement.place`: each model's device, and the start-time check that every model fits
where it is placed, refused with the numbers otherwise."""

from __future__ import annotations

import pytest

from twinkle_server.config.placement import GIB, Demand, place
from twinkle_server.engine.errors import InvalidArgument

GPUS = {"cpu": 64 * GIB, "cuda:0": 80 * GIB, "cuda:1": 80 * GIB}


def test_auto_goes_to_the_accelerator_with_the_most_room():
    places = place([Demand("student", "auto", 30 * GIB), Demand("teacher", "cuda", 60 * GIB),
                    Demand("grader", "auto", 10 * GIB)], GPUS)
    assert [places[n].device for n in ("student", "teacher", "grader")] == [
        "cuda:0", "cuda:1", "cuda:0"]


def test_auto_is_the_cpu_on_a_host_without_accelerators():
    places = place([Demand("a", "auto", GIB), Demand("b", "auto", GIB)], {"cpu": 8 * GIB})
    assert {p.device for p in places.values()} == {"cpu"}


def test_models_sharing_a_device_within_their_budgets_fit():
    places = place([Demand("a", "cuda:0", 20 * GIB, budget_bytes=40 * GIB),
                    Demand("b", "cuda:0", 30 * GIB, budget_bytes=40 * GIB)], GPUS)
    assert places["a"].device == places["b"].device == "cuda:0"


def test_models_over_a_device_are_refused_with_the_numbers():
    with pytest.raises(InvalidArgument) as refused:
        place([Demand("a", "cuda:1", 50 * GIB), Demand("b", "cuda:1", 40 * GIB)], GPUS)
    message = str(refused.value)
    assert "cuda:1 has 80.00 GiB" in message and "need 90.00 GiB" in message
    assert "'a' 50.00 GiB, 'b' 40.00 GiB" in message


def test_a_budget_below_the_weights_is_refused_with_both():
    with pytest.raises(InvalidArgument, match=r"'a' needs 16.00 GiB .* budget is 10.00 GiB"):
        place([Demand("a", "cuda:0", 16 * GIB, budget_bytes=10 * GIB)], GPUS)


def test_a_device_the_host_lacks_is_refused_naming_those_it_has():
    with pytest.raises(InvalidArgument, match=r"'cuda:2'; this host has \['cpu', 'cuda:0', "
                                              r"'cuda:1'\]"):
        place([Demand("a", "cuda:2", GIB)], GPUS)
    with pytest.raises(InvalidArgument, match="asks for device 'cuda', and this host has none"):
        place([Demand("a", "cuda", GIB)], {"cpu": GIB})


def test_unknown_capacity_is_not_checked():
    places = place([Demand("a", "cpu", 10**15)], {"cpu": None})
    assert places["a"].device == "cpu"


def test_ranks_default_to_all_and_must_be_ranks_of_the_job():
    assert place([Demand("a", "cpu", 1)], {"cpu": None}, world=4)["a"].ranks == (0, 1, 2, 3)
    assert place([Demand("a", "cpu", 1, ranks=(2, 3))], {"cpu": None},
                 world=4)["a"].ranks == (2, 3)
    with pytest.raises(InvalidArgument, match=r"ranks \[3, 4\], but the job has 4"):
        place([Demand("a", "cpu", 1, ranks=(3, 4))], {"cpu": None}, world=4)
