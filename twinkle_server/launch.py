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
import signal

import torch

from twinkle_server.config import ServerConfig
from twinkle_server.engine.engine import Engine
from twinkle_server.engine.errors import EngineError, InvalidArgument
from twinkle_server.engine.parallel import Parallel, placement_from_env
from twinkle_server.replication import Channel, follow

log = logging.getLogger(__name__)
SHUTDOWN_TIMEOUT_S = 90
"""How long the launcher waits for the ranks after passing on SIGINT/SIGTERM before it
kills them: rank 0's drain takes up to 60 s for in-flight ops (`server.serve`) and 5 s
for the fronts, then stops the others."""


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


def load_engine(config: ServerConfig, parallel: Parallel | None = None) -> Engine:
    """The engine `config` asks for, sharded over `parallel`'s ranks when given (each
    rank then logs the share of the base it holds). A model the decode pool cannot hold
    is refused here under `--sampler continuous`, naming the cause and `--sampler static`."""
    engine = Engine.load(config.model, device=config.device, dtype=config.dtype,
                         cache_dir=None, limits=config.limits(),
                         packing=config.packing == "on",
                         activation_checkpointing={"on": True, "off": False, "auto": None}[
                             config.activation_checkpointing],
                         parallel=parallel)
    if config.sampler == "continuous" and engine.sampling.pool_refusal is not None:
        raise engine.sampling.pool_refusal
    if parallel is not None:
        log.info("loaded: %s", parallel.describe_share())
    return engine


def run_follower(config: ServerConfig, parallel: Parallel, channel: Channel) -> int:
    """A rank other than 0: load the shard, follow rank 0 until it stops; 0 on a clean
    stop, 2 when the engine cannot load (every rank fails alike), 1 when the group was
    lost. SIGINT and SIGTERM are left to rank 0, whose drain ends with telling this rank
    to stop."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        engine = load_engine(config, parallel)
    except EngineError as exc:
        log.error("rank %d: %s", parallel.rank, exc)
        return 2
    try:
        follow(engine, channel)
        log.info("stopping: %s", parallel.describe_share())
    except Exception as exc:
        log.error("rank %d: lost the group: %s: %s", parallel.rank, type(exc).__name__, exc)
        return 1
    return 0
