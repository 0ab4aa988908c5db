"""The served base models: each with its own engine, scheduler (queue and worker) and
decode pool, so one model's work never holds another's; and the one place a name a
client sends (a model's name or alias) is resolved, or refused naming what is served.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from twinkle_server.config.flags import ServerConfig
from twinkle_server.config.model_table import ModelConfig
from twinkle_server.engine.errors import FailedPrecondition, InvalidArgument
from twinkle_server.engine.protocol import EngineAPI
from twinkle_server.engine.types import AUTO_SEQ_LEN
from twinkle_server.scheduling.executor import SAMPLE, EngineExecutor, Turns
from twinkle_server.scheduling.planning import Slots, default_token_budget
from twinkle_server.scheduling.queues import QueueLimits
from twinkle_server.scheduling.scheduler import Scheduler

ADMIN_QUEUE = "__admin__"
"""Each model's queue for engine mutations (adding and removing adapters)."""
ONCE_QUEUE = "__once__"
"""Each model's queue for samples without a session (`Sampling.sample_from`): unordered,
so they decode together, and standing, so a request adds no queue of its own."""


@dataclass(frozen=True)
class Served:
    """One served model: its table (limits as the engine resolved them), its engine and
    its scheduler."""

    model: ModelConfig
    engine: EngineAPI
    scheduler: Scheduler

    @property
    def name(self) -> str:
        return self.model.name

    def check_trains(self, field: str = "base_model") -> None:
        """Refuse training on a model whose role is `sample`, naming the role."""
        if not self.model.trains:
            raise FailedPrecondition(
                f"{field}: {self.name!r} is served with role 'sample' (sampling and "
                "logprobs only); training clients need a model of role 'train'")

    @property
    def tokenizer_id(self) -> str:
        return self.model.tokenizer_id(self.engine.base.model_dir)


def serve_all(config: ServerConfig, engines: Sequence[tuple[ModelConfig, EngineAPI]]
              ) -> list[Served]:
    """Each model served by its engine under a scheduler of its own (not yet started);
    models whose engines share a device take turns on it (`executor.Turns`)."""
    turns = shared_turns([str(engine.base.device) for _, engine in engines])
    return [serve(config, model, engine, t)
            for (model, engine), t in zip(engines, turns, strict=True)]


def shared_turns(devices: Sequence[str]) -> list[Turns | None]:
    """Each model's turns, given each model's device: one `Turns` shared by the models of
    a device that holds more than one, None for a model alone on its device."""
    shared = {d: Turns() for d in set(devices) if devices.count(d) > 1}
    return [shared.get(d) for d in devices]


def serve(config: ServerConfig, model: ModelConfig, engine: EngineAPI,
          turns: Turns | None = None) -> Served:
    """`model` served by `engine`, under a scheduler of its own (not yet started), taking
    `turns` on a device it shares."""
    if model.max_seq_len == AUTO_SEQ_LEN:   # the engine chose it (`max_seq_len` 0)
        model = replace(model, max_seq_len=engine.limits.max_seq_len)
    budget = config.merge_token_budget or default_token_budget(engine.base.device.type)
    # A split model decodes on its sampler ranks: apart from its training, on no device
    # it shares.
    split = model.sampler_ranks > 0
    scheduler = Scheduler(
        EngineExecutor(engine, turns, decodes_here=not split), mode=config.scheduling,
        token_budget=budget, decode_group=SAMPLE if config.sampler == "continuous" else None,
        decode_slice_s=config.decode_slice_ms / 1000, decode_apart=split,
        limits=QueueLimits(config.max_queued_ops_per_tenant,
                           config.max_queued_bytes_per_tenant, config.max_queued_ops,
                           config.max_queued_bytes),
        slots=lambda: Slots(engine.limits.max_adapters, engine.paging_stats().resident_ids))
    for queue in (ADMIN_QUEUE, ONCE_QUEUE):
        scheduler.register_model(queue)
    return Served(model, engine, scheduler)


class Bases:
    """Every served model, in the order configured (the first is the default where a
    request names none), found by any of its names."""

    def __init__(self, served: Sequence[Served]) -> None:
        if not served:
            raise InvalidArgument("models: none to serve")
        self._all = tuple(served)
        self._by_name = {name: s for s in served for name in s.model.names}

    def __iter__(self) -> Iterator[Served]:
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._all)

    @property
    def default(self) -> Served:
        return self._all[0]

    @property
    def names(self) -> tuple[str, ...]:
        """Every name and alias served, each model's own first."""
        return tuple(name for s in self._all for name in s.model.names)

    def get(self, name: str, field: str = "base_model") -> Served:
        """The model `name` (a name or alias; empty: the default), or `InvalidArgument`
        naming `field` and every name served."""
        if not name:
            return self.default
        served = self._by_name.get(name)
        if served is None:
            raise InvalidArgument(f"{field}: {name!r} is not served here; served names are "
                                  f"{list(self.names)}")
        return served

    def of_record(self, base_model: str, what: str) -> Served:
        """The model a stored record (a run, a checkpoint) was trained on; one no longer
        served (the server restarted with other models) is refused naming it."""
        served = self._by_name.get(base_model)
        if served is None:
            raise FailedPrecondition(
                f"{what} was trained on base model {base_model!r}, which this server no "
                f"longer serves (it serves {list(self.names)})")
        return served
