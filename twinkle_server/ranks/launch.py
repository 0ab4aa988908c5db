"""Serving from several ranks: launching them, and what each rank does.

`twinkle-server serve --nproc-per-node N` hands itself to torch's elastic launcher
(`torch.distributed.run`, what `torchrun` runs), which starts N copies of the same
command with `RANK`, `WORLD_SIZE` and `LOCAL_RANK` set; `torchrun ... -m
twinkle_server.cli serve` does the same by hand, on one node or many. Each copy joins the
process group (`engine.parallel`); rank 0 serves (fronts, store, scheduler) and the
others follow it (`replication.follow`). No restarts are configured: a lost rank ends the
job with a non-zero exit, for the operator's supervisor to restart on the same data dir.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoConfig

from twinkle_server.config.flags import ServerConfig
from twinkle_server.config.model_table import ModelConfig
from twinkle_server.config.placement import Demand, Place, job_ranks, place
from twinkle_server.engine.base_model import model_dir, resolve_device, resolve_dtype
from twinkle_server.engine.engine import Engine
from twinkle_server.engine.errors import EngineError, InvalidArgument
from twinkle_server.engine.memory import (
    available_memory_bytes,
    checkpoint_weight_bytes,
    kv_bytes_per_token,
)
from twinkle_server.engine.parallel import Parallel, placement_from_env
from twinkle_server.engine.residency import Spill
from twinkle_server.engine.sampling.pool import refusal as pool_refusal
from twinkle_server.ranks.channel import Channel
from twinkle_server.ranks.replication import follow
from twinkle_server.ranks.sampler_rank import Link, SamplerRank

log = logging.getLogger(__name__)
SHUTDOWN_TIMEOUT_S = 90
"""How long the launcher waits for the ranks after passing on SIGINT/SIGTERM before it
kills them: rank 0's drain takes up to 60 s for in-flight ops (`server.serve`) and 5 s
for the fronts, then stops the others."""

PAGE_DIR = "adapter-pages"
"""Where adapters paged out past `--adapter-host-memory-gib` go, per model and rank."""


def under_launcher() -> bool:
    """Whether this process is one rank of a torchrun job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def wants_launch(config: ServerConfig) -> bool:
    return config.nproc_per_node > 1 or config.nnodes != "1" or bool(config.rdzv_endpoint)


def launch(config: ServerConfig, argv: list[str]) -> int:
    """Run `twinkle-server <argv>` as `config.nproc_per_node` ranks on this node through
    torch's elastic launcher; returns its exit status (non-zero when a rank failed)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    check_world(config)
    parser = get_args_parser()
    launcher = ["--nproc-per-node", str(config.nproc_per_node), "--nnodes", config.nnodes,
                "--node-rank", str(config.node_rank), "--max-restarts", "0"]
    if "--shutdown-timeout" in parser._option_string_actions:
        launcher += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    else:
        log.warning("this torch's launcher (%s) has no --shutdown-timeout: after SIGTERM it "
                    "gives the ranks its fixed 30 s, so ops still running then are cut off "
                    "(torch >= 2.12 waits %d s)", torch.__version__, SHUTDOWN_TIMEOUT_S)
    if config.rdzv_endpoint:
        launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", config.rdzv_endpoint,
                     "--rdzv-id", "twinkle"]
    else:
        launcher += ["--standalone"]
    args = parser.parse_args([*launcher, "-m", "twinkle_server.cli", *argv])
    try:
        run(args)
    except ChildFailedError as exc:
        log.error("a rank failed: %s", exc.format_msg())
        return 1
    except SignalException as exc:
        # SIGINT/SIGTERM: the launcher has passed it on and the ranks have stopped (rank
        # 0 drains first, then stops the others), as one server would.
        log.info("stopped by signal %s", exc.sigval)
    return 0


def check_world(config: ServerConfig) -> None:
    """Refuse, before any rank starts, a layout that cannot work."""
    if config.nproc_per_node < 1:
        raise InvalidArgument(f"--nproc-per-node: {config.nproc_per_node} is not >= 1")
    if config.nnodes != "1" and not config.rdzv_endpoint:
        raise InvalidArgument(f"--nnodes {config.nnodes}: several nodes need "
                              "--rdzv-endpoint HOST:PORT, where they meet")
    nodes = config.nnodes.split(":")[-1]
    world = config.nproc_per_node * int(nodes) if nodes.isdigit() else None
    size = config.shard_group_size
    if size < 0 or (world is not None and size and world % size):
        raise InvalidArgument(f"--shard-group-size: {size} does not divide the {world} ranks")


def join(config: ServerConfig) -> tuple[Parallel, Channel]:
    """Join the job's process group and open rank 0's call channel (every rank)."""
    parallel = Parallel.init(placement_from_env(config.device), config.collective_timeout,
                             config.shard_group_size)
    return parallel, Channel.open(config.collective_timeout)


def load_engine(config: ServerConfig, model: ModelConfig, parallel: Parallel | None = None,
                device: str | None = None) -> Engine:
    """The engine of served model `model` (on `device`, default its own), sharded over
    `parallel`'s ranks when given (each rank then logs the share of the base it holds); on
    a split model's trainer ranks it trains only (its sampler ranks' copies sample). A
    model the decode pool cannot hold is refused here under `--sampler continuous`, from
    its config before its weights load, naming the cause and `--sampler static`."""
    if config.sampler == "continuous":
        hf_config = AutoConfig.from_pretrained(model_dir(model.path), local_files_only=True)
        if (refused := pool_refusal(hf_config)) is not None:
            raise refused
    samples = parallel is None or not model.sampler_ranks
    spill = None
    if config.adapter_host_memory_gib > 0:
        rank = 0 if parallel is None else parallel.rank
        spill = Spill(config.data_dir / PAGE_DIR / model.name / f"rank{rank}",
                      int(config.adapter_host_memory_gib * 2**30))
    engine = Engine.load(model.path, device=device or model.device, dtype=model.dtype,
                         cache_dir=None, limits=model.limits(),
                         packing=config.packing == "on",
                         activation_checkpointing={"on": True, "off": False, "auto": None}[
                             config.activation_checkpointing],
                         parallel=parallel, samples=samples,
                         batch_invariant=config.batch_invariant == "on", spill=spill)
    if parallel is not None:
        log.info("loaded: %s", parallel.describe_share())
    return engine


def several_ranks_problem(config: ServerConfig, world: int) -> str | None:
    """Why `config`'s models cannot run on `world` ranks, or None. On several ranks each
    model is sharded over the ranks its table names (all by default), which must include
    rank 0 (it serves, and drives every model), and every rank of the job must be some
    model's (a rank of none would hold nothing); each rank runs its shards on its own
    device, so a table names ranks, and a device only of the job's kind, never an index
    (`_rank_device_kind`). One model's table is held to the same
    rules as several models': its ranks and device are served or refused, never ignored."""
    models = config.model_configs()
    for model in models:
        if (problem := _split_problem(config, model, world)) is not None:
            return problem
        try:
            job_ranks(model.name, model.ranks, world)
        except EngineError as exc:
            return str(exc)
    if world == 1:
        return None
    try:
        kind = _rank_device_kind(config.device)
    except InvalidArgument as exc:
        return f"--device {config.device}: {exc}"
    for model in models:
        if model.ranks and 0 not in model.ranks:
            return (f"models: {model.name!r} has ranks {list(model.ranks)}; every model's "
                    "ranks include rank 0, which serves and drives them")
        try:
            asked = _rank_device_kind(model.device)
        except InvalidArgument as exc:
            return f"models: {model.name!r} asks for device {model.device!r}; {exc}"
        if asked != kind:
            return (f"models: {model.name!r} asks for device {model.device!r}, but the job's "
                    f"ranks run on {kind} (--device {config.device}); a table names its "
                    "ranks, and a device only of the job's kind")
    used = {rank for model in models for part in split_ranks(model, world) for rank in part}
    if idle := [str(rank) for rank in range(world) if rank not in used]:
        which = (f"rank {idle[0]} is" if len(idle) == 1
                 else f"ranks {', '.join(idle)} are")
        return (f"models: {which} in no model's ranks and would hold nothing; name every "
                "rank in some model's ranks, or launch fewer ranks")
    if len(models) == 1:
        return None
    if config.shard_group_size:
        return (f"--shard-group-size {config.shard_group_size}: hybrid sharding serves one "
                f"model; --models names {len(models)}")
    # Rank 0 holds a shard of every model: about 1/len(trainer ranks) of its weights.
    device = placement_from_env(config.device).device
    try:
        place([_demand(m, str(device), len(split_ranks(m, world)[0])) for m in models],
              {str(device): available_memory_bytes(device)}, world)
    except EngineError as exc:
        return f"rank 0: {exc}"
    return None


def _split_problem(config: ServerConfig, model: ModelConfig, world: int) -> str | None:
    """Why `model`'s `sampler_ranks` cannot work on `world` ranks, or None."""
    count = model.sampler_ranks
    where = f"sampler_ranks: {model.name!r} asks for {count}"
    if count < 0:
        return f"{where}; give 0 (every rank trains and samples) or more"
    if not count:
        return None
    if world == 1:
        return (f"{where}, but the server runs as one process; launch more ranks than that "
                f"(--nproc-per-node {count + 1} or more)")
    if not model.trains:
        return (f"{where}, but its role is 'sample': with no training it has no trainer "
                "ranks; name the ranks it samples on with 'ranks'")
    if model.ranks and 0 not in model.ranks:
        return (f"{where}, on ranks {list(model.ranks)}; rank 0 serves and trains, so a "
                "split model's ranks include it")
    ranks = model.ranks or range(world)
    if count >= len(ranks):
        return (f"{where} of its {len(ranks)} ranks, which leaves none to train; give at "
                f"most {len(ranks) - 1}")
    if config.sampler != "continuous":
        return (f"{where}; sampler ranks decode with the continuous sampler, and "
                "--sampler static samples on the trainer ranks: drop one of them")
    if config.shard_group_size:
        return (f"{where}; --shard-group-size {config.shard_group_size} (hybrid sharding) "
                "serves colocated ranks only: drop one of them")
    return None


@dataclass(frozen=True)
class Member:
    """A served model this rank holds a shard of: its table, the `Parallel` of its
    (trainer) ranks, the channel rank 0 sends its engine calls over, and on rank 0 of a
    split model the links to its sampler ranks."""

    model: ModelConfig
    parallel: Parallel
    channel: Channel
    links: tuple[Link, ...] = ()


@dataclass(frozen=True)
class Seat:
    """A served model this rank samples as one of its sampler ranks, and its link to rank 0."""

    model: ModelConfig
    link: Link


def split_ranks(model: ModelConfig, world: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`model`'s trainer ranks and sampler ranks (its last `sampler_ranks`)."""
    ranks = tuple(sorted(model.ranks or range(world)))
    cut = len(ranks) - model.sampler_ranks
    return ranks[:cut], ranks[cut:]


def members(config: ServerConfig, parallel: Parallel, channel: Channel
            ) -> tuple[list[Member], list[Seat]]:
    """The models this rank trains (holds a shard of) and samples (holds a whole copy of,
    as a sampler rank). One colocated model spans the job (`parallel`, `channel`);
    otherwise each model's trainer ranks get process groups of their own, and each of its
    sampler ranks two gloo channels with rank 0 (calls, weights), all made by every rank
    of the job in the models' order, so each model's collectives run apart from the
    others'."""
    models = config.model_configs()
    if len(models) == 1 and not models[0].sampler_ranks:
        return [Member(models[0], parallel, channel)], []
    held, seats = [], []
    me = parallel.rank
    for model in models:
        trainers, samplers = split_ranks(model, parallel.world)
        shard = parallel.subgroup(trainers)
        calls = Channel.subgroup(trainers, config.collective_timeout)
        links = []
        for rank in samplers:
            pair = (Channel.subgroup((0, rank), config.collective_timeout),
                    Channel.subgroup((0, rank), config.collective_timeout))
            if pair[0] is not None and pair[1] is not None:
                links.append(Link(rank, *pair))
        if shard is not None and calls is not None:
            held.append(Member(model, shard, calls, tuple(links) if me == 0 else ()))
        seats += [Seat(model, link) for link in links if link.rank == me]
    return held, seats


def _rank_device_kind(device: str) -> str:
    """The kind of device a rank of a several-rank job runs `device` on ('auto': cuda
    where present); refuses a device index, which a rank never takes (it runs on its own,
    `cuda:LOCAL_RANK`)."""
    try:
        resolved = resolve_device(device)
    except RuntimeError:
        raise InvalidArgument("give cpu, cuda or auto") from None
    if resolved.index is not None:
        raise InvalidArgument(f"on several ranks each rank runs on its own "
                              f"{resolved.type}:LOCAL_RANK; give {resolved.type} or auto")
    return resolved.type


def place_models(models: list[ModelConfig]) -> dict[str, Place]:
    """Each model's device, checked to fit this host before anything loads
    (`placement.place`): a model's need is its weights in its dtype, plus its KV pool
    when the table fixes one."""
    capacity: dict[str, int | None] = {"cpu": available_memory_bytes(torch.device("cpu"))}
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            device = torch.device("cuda", index)
            capacity[str(device)] = available_memory_bytes(device)
    demands = [_demand(model, model.device) for model in models]
    return place(demands, capacity)


def _demand(model: ModelConfig, device: str, shards: int = 1) -> Demand:
    """What `model` asks for on `device` (its own, or a rank's) and needs there: its
    weights in its dtype, split over `shards` ranks, plus its KV pool when the table
    fixes one and the model samples there (a split model's pool is its sampler ranks',
    not on its trainer ranks)."""
    try:
        asked = resolve_device(device)
    except RuntimeError:
        raise InvalidArgument(f"models: {model.name!r} asks for device {device!r}; give cpu, "
                              "cuda, cuda:N or auto") from None
    try:
        dtype = resolve_dtype(model.dtype, asked)
    except InvalidArgument as exc:
        raise InvalidArgument(f"models: {model.name!r}: {exc}") from None
    where = model_dir(model.path)
    need = checkpoint_weight_bytes(where, dtype) // shards
    pool = model.kv_pool_tokens if not model.sampler_ranks else 0
    if pool:
        from transformers import AutoConfig
        need += pool * kv_bytes_per_token(
            AutoConfig.from_pretrained(where, local_files_only=True), dtype)
    log.info("model %s needs %.1f MiB on %s (weights in %s%s%s)", model.name, need / 2**20,
             device, str(dtype).removeprefix("torch."),
             f", a 1/{shards} shard" if shards > 1 else "",
             ", and its KV pool" if pool else "")
    return Demand(model.name, device, need, model.memory_bytes, model.ranks)


def load_engines(config: ServerConfig) -> list[tuple[ModelConfig, Engine]]:
    """Every served model's engine in one process, each on the device placement gives it,
    in the order of the models file."""
    models = config.model_configs()
    places = place_models(models)
    loaded = []
    for model in models:
        log.info("model %s (%s) on %s, role %s", model.name, model.path,
                 places[model.name].device, model.role)
        loaded.append((model, load_engine(config, model, device=places[model.name].device)))
    return loaded


def run_follower(config: ServerConfig, parallel: Parallel, channel: Channel) -> int:
    """A rank other than 0: load its shard of each model it trains and its copy of each
    it samples, then follow rank 0's calls of each until it stops; 0 on a clean stop, 2
    when an engine cannot load, 1 when the group was lost. SIGINT and SIGTERM are left to
    rank 0, whose drain ends with telling this rank to stop."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    held, seats = members(config, parallel, channel)
    device = str(parallel.placement.device)
    try:
        engines = [load_engine(config, m.model, m.parallel) for m in held]
        samplers = [SamplerRank(load_engine(config, seat.model, device=device), seat.link,
                                config.collective_timeout / 2) for seat in seats]
    except EngineError as exc:
        log.error("rank %d: %s", parallel.rank, exc)
        return 2
    for seat in seats:
        log.info("loaded: sampler rank %d holds a whole copy of %s on %s", parallel.rank,
                 seat.model.name, device)
    outcomes: queue.Queue[BaseException | None] = queue.Queue()

    def run(work: Callable[[], None], done: Callable[[], str]) -> None:
        try:
            work()
            log.info("stopping: %s", done())
            outcomes.put(None)
        except Exception as exc:
            outcomes.put(exc)

    jobs = [(lambda e=engine, m=member: follow(e, m.channel), member.parallel.describe_share,
             member.model.name) for engine, member in zip(engines, held, strict=True)]
    jobs += [(sampler.serve, lambda s=seat: f"sampler rank {s.link.rank} of {s.model.name}",
              f"{seat.model.name}-sampler") for sampler, seat in zip(samplers, seats,
                                                                     strict=True)]
    for work, done, name in jobs:
        threading.Thread(target=run, args=(work, done), daemon=True,
                         name=f"twinkle-follow-{name}").start()
    for _ in jobs:
        exc = outcomes.get()
        if exc is not None:
            log.error("rank %d: lost the group: %s: %s", parallel.rank, type(exc).__name__,
                      exc)
            return 1
    return 0
