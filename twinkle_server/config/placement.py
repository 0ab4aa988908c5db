"""Where each served model runs: a small pure decision, made once at start.

Given what each model asks for (a device or `auto`, an optional memory budget, ranks)
and what it needs (its weights in its dtype, and a KV pool given in positions), and the
memory each device of this host has, `place` picks every model's device and checks that
every model fits; what cannot work is refused with the numbers. On CPU the models share
the cores and the host's memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from twinkle_server.engine.errors import InvalidArgument

GIB = 1 << 30


@dataclass(frozen=True)
class Demand:
    """What one model asks for and needs."""

    name: str
    device: str                 # "auto", "cpu", "cuda" or "cuda:N"
    need_bytes: int             # weights in the model's dtype, plus a KV pool it fixed
    budget_bytes: int = 0       # its declared share of a device; 0: none
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Place:
    """Where one model runs: its device (`cpu`, `cuda:N`; per rank: each rank's own) and
    the ranks it is sharded over."""

    name: str
    device: str
    ranks: tuple[int, ...]


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def place(demands: Sequence[Demand], capacity: Mapping[str, int | None], world: int = 1
          ) -> dict[str, Place]:
    """Every model's place, by name, in the order given.

    `capacity` maps each device of this host (`cpu`, `cuda:0`, ...) to the bytes it has
    for models (None: unknown, not checked). A model on `auto` goes to the accelerators
    when there are any, else the CPU; on `cuda`, to the accelerator with the most room
    left after the models before it. A model charges its device its budget when it
    declares one (which must hold what it needs), else what it needs; the charges on a
    device must fit its capacity. `ranks` must be ranks of the `world`; empty is all."""
    accelerators = sorted((d for d in capacity if d != "cpu"), key=_index)
    charged: dict[str, list[tuple[str, int]]] = {}
    places: dict[str, Place] = {}
    for demand in demands:
        device = _device(demand, accelerators, capacity, charged)
        if demand.budget_bytes and demand.need_bytes > demand.budget_bytes:
            raise InvalidArgument(
                f"models: {demand.name!r} needs {_gib(demand.need_bytes)} (weights, and its "
                f"KV pool when given) but its memory_gib budget is "
                f"{_gib(demand.budget_bytes)}; raise memory_gib or give it a device of "
                "its own")
        charged.setdefault(device, []).append(
            (demand.name, demand.budget_bytes or demand.need_bytes))
        places[demand.name] = Place(demand.name, device, job_ranks(demand.name, demand.ranks, world))
    for device, charges in charged.items():
        have = capacity.get(device)
        total = sum(n for _, n in charges)
        if have is not None and total > have:
            each = ", ".join(f"{name!r} {_gib(n)}" for name, n in charges)
            raise InvalidArgument(
                f"models: {device} has {_gib(have)} for models, but the models placed on it "
                f"need {_gib(total)} ({each}); place some on another device, or give "
                "memory_gib budgets that add up to what it has")
    return places


def _index(device: str) -> tuple[str, int]:
    kind, _, index = device.partition(":")
    return kind, int(index or 0)


def _device(demand: Demand, accelerators: list[str], capacity: Mapping[str, int | None],
            charged: Mapping[str, list[tuple[str, int]]]) -> str:
    asked = demand.device
    if asked == "auto":
        asked = "cuda" if accelerators else "cpu"
    if asked == "cuda":
        if not accelerators:
            raise InvalidArgument(f"models: {demand.name!r} asks for device 'cuda', and "
                                  "this host has none; give 'cpu' or 'auto'")

        def room(device: str) -> float:
            have = capacity.get(device)
            used = sum(n for _, n in charged.get(device, []))
            return float("inf") if have is None else have - used
        return max(accelerators, key=lambda d: (room(d), -_index(d)[1]))
    if asked not in capacity:
        raise InvalidArgument(f"models: {demand.name!r} asks for device {asked!r}; this host "
                              f"has {sorted(capacity, key=_index)}")
    return asked


def job_ranks(name: str, ranks: tuple[int, ...], world: int) -> tuple[int, ...]:
    """The ranks model `name` runs on in a job of `world` ranks: `ranks`, or all when
    empty. Raises InvalidArgument naming the model when a rank is outside the job."""
    if [r for r in ranks if r >= world]:
        raise InvalidArgument(f"models: {name!r} asks for ranks {list(ranks)}, but the job "
                              f"has {world} (0..{world - 1})")
    return ranks or tuple(range(world))
