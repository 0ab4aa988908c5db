"""One engine on several ranks: rank 0 replays every engine call on the others.

Rank 0 runs the whole server (fronts, runtime, scheduler, store) against a
`ReplicatedEngine`: each call that changes adapter state or runs the base is first sent
to every other rank, then run on rank 0, and the other ranks (`follow`) run the same call
on their own `Engine` in the same order, so the collectives inside it (`engine.parallel`)
meet and every rank keeps the same adapters. Reads (adapter info, limits, request checks)
and saves (rank 0 writes checkpoints; adapter state is the same everywhere) stay on
rank 0.

What could differ between ranks is settled on rank 0 before a call is sent: random seeds
(a new adapter's, an unseeded sample's) are drawn there, and checkpoint files are read
there and sent along, so the data dir need not be shared between nodes.

A call travels over a `channel.Channel` (a pickled header, its numpy arrays sent as one
byte tensor). Every collective is bounded by the group's timeout; when idle, rank 0 sends a no-op often enough that a waiting rank never
hits it. When a rank dies or hangs, the call on rank 0 fails: the engine refuses every
later call with UNAVAILABLE naming the lost ranks, and the server shuts down and exits
non-zero (`twinkle_server.server`), for the launcher or the operator to restart it.

Two limits. On CUDA the engine's collectives run on nccl, whose watchdog ends a process
whose collective timed out: the job then ends non-zero as well, but clients see their
connection drop rather than the UNAVAILABLE naming the rank (tested here on gloo only).
And every rank computes a pass's losses from the same gathered logprobs, so they drop a
non-finite loss alike; that holds for the same kernels on the same device type (every
rank of a job, as torchrun starts it), not across mixed accelerators.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from twinkle_server.engine.engine import Engine
from twinkle_server.engine.errors import EngineError, Unavailable
from twinkle_server.engine.protocol import marked
from twinkle_server.engine.sampling.book import PoolStats
from twinkle_server.engine.types import (
    AdamParams,
    ForwardOutput,
    ForwardRequest,
    Generation,
    LoraSpec,
    LossSpec,
    Progress,
    SampledSequence,
    SampleRequest,
)
from twinkle_server.ranks.channel import Channel
from twinkle_server.ranks.reads import RankZeroReads

log = logging.getLogger(__name__)

_NOOP, _STOP = "__noop__", "__stop__"
REPLICATED = marked(Engine, "replicated")
"""The `Engine` methods every rank runs (marked `@replicated` where they are defined,
`engine.protocol`): the only calls rank 0 sends, and the only ones the others run."""
_BEAT_KEY = "twinkle/heartbeat/{}"
BEAT_SECONDS = 1.0


@dataclass(frozen=True)
class ShippedDir:
    """A checkpoint directory on rank 0 (`source`), with its files (name -> contents), or
    None when the other ranks already hold them; `missing` when rank 0 has no such
    directory (every rank then fails the call alike)."""

    source: str
    files: dict[str, bytes] | None
    missing: bool = False


def _ship(path: str | os.PathLike | None, with_files: bool = True) -> ShippedDir | None:
    if path is None:
        return None
    root = Path(path)
    if not root.is_dir():
        return ShippedDir(os.path.realpath(root), None, missing=True)
    files = ({f.name: f.read_bytes() for f in sorted(root.iterdir()) if f.is_file()}
             if with_files else None)
    return ShippedDir(os.path.realpath(root), files)


def _fill_seed(request: SampleRequest) -> SampleRequest:
    if request.params.seed is not None:
        return request
    return replace(request, params=replace(request.params, seed=secrets.randbits(63)))


class ReplicatedEngine(RankZeroReads):
    """Rank 0's engine (an `engine.protocol.EngineAPI`): every `@replicated` call sent to
    all ranks first, then run on the local `Engine`; every `@rank_zero_only` call run on
    the local `Engine` alone. `on_lost` is called once, from the calling thread, when the
    group fails."""

    def __init__(self, engine: Engine, channel: Channel, timeout_s: float,
                 on_lost: Callable[[str], None] | None = None) -> None:
        super().__init__(engine)
        self.engine = engine
        self.channel = channel
        self.timeout_s = timeout_s
        self.on_lost = on_lost
        self.lost: str | None = None
        self._lock = threading.Lock()
        self._last_send = time.monotonic()
        self._closed = threading.Event()
        self._keepalive = threading.Thread(target=self._keep_alive, daemon=True,
                                           name="twinkle-keepalive")
        self._keepalive.start()

    # ------------------------------------------------------------------ rank 0 alone

    def save_weights(self, adapter_id: str, path: str | Path, overwrite: bool = False) -> int:
        return self.engine.save_weights(adapter_id, path, overwrite)

    def has_sampler(self, weights_path: str | os.PathLike) -> bool:
        return self.engine.has_sampler(weights_path)

    def sampler_dirs(self) -> set[str]:
        return self.engine.sampler_dirs()

    def decode_stats(self) -> PoolStats:
        return self.engine.decode_stats()

    # ------------------------------------------------------------------ every rank, as called

    def remove_adapter(self, adapter_id: str) -> None:
        self._all("remove_adapter", adapter_id)

    def forward_batch(self, requests: Sequence[ForwardRequest]
                      ) -> list[ForwardOutput | EngineError]:
        return self._all("forward_batch", requests)

    def optim_step(self, adapter_id: str, params: AdamParams) -> dict[str, float]:
        return self._all("optim_step", adapter_id, params)

    def set_loss(self, adapter_id: str, loss: LossSpec) -> None:
        self._all("set_loss", adapter_id, loss)

    def set_optimizer(self, adapter_id: str, name: str, kwargs: dict[str, Any]) -> None:
        self._all("set_optimizer", adapter_id, name, kwargs)

    def set_lr_scheduler(self, adapter_id: str, name: str, kwargs: dict[str, Any]) -> None:
        self._all("set_lr_scheduler", adapter_id, name, kwargs)

    def clip_grad_norm(self, adapter_id: str, max_norm: float) -> float:
        return self._all("clip_grad_norm", adapter_id, max_norm)

    def step(self, adapter_id: str) -> dict[str, float]:
        return self._all("step", adapter_id)

    def zero_grad(self, adapter_id: str) -> None:
        self._all("zero_grad", adapter_id)

    def lr_step(self, adapter_id: str) -> None:
        self._all("lr_step", adapter_id)

    def calculate_metric(self, adapter_id: str, is_training: bool = True) -> dict[str, float]:
        return self._all("calculate_metric", adapter_id, is_training)

    # ------------------------------------------------------------------ replicated calls

    def _all(self, name: str, *args: Any, shipped: tuple = ()) -> Any:
        """Send `name(*args)` to every rank, then run it here; `shipped` rides along for
        the other ranks to turn into local paths (see `follow`)."""
        if name not in REPLICATED:
            raise TypeError(f"{name}: not an @replicated Engine method; rank 0 runs it alone")
        with self._lock:
            if self.lost is not None:
                raise Unavailable(self.lost)
            try:
                self.channel.send((name, args, shipped))
                self._last_send = time.monotonic()
                return getattr(self.engine, name)(*args)
            except EngineError:
                raise
            except Exception as exc:
                # A collective failed, or rank 0 failed where the others did not (they
                # may now wait in a collective it will never join): the ranks are no
                # longer in step, and no later call could be trusted.
                self.lost = _lost_message(self.engine.parallel.ranks, exc, self.timeout_s)
                log.error("%s", self.lost)
        if self.on_lost is not None:
            self.on_lost(self.lost)
        raise Unavailable(self.lost)

    def add_adapter(self, adapter_id: str, spec: LoraSpec,
                    gradient_accumulation_steps: int = 1, owner: str = "") -> dict[str, Any]:
        if spec.seed is None:
            spec = replace(spec, seed=secrets.randbits(31))
        return self._all("add_adapter", adapter_id, spec, gradient_accumulation_steps,
                         owner)

    def load_state(self, adapter_id: str, path: str | os.PathLike, include_optimizer: bool,
                   adopt_accumulation: bool = False) -> None:
        """Every rank, this one too, loads the same bytes, read once here: a checkpoint
        deleted or saved over while the call is on its way cannot load on some ranks
        only, or differently."""
        shipped = (1, _ship(path))
        with tempfile.TemporaryDirectory(prefix="twinkle-rank0-") as scratch:
            local = _place([adapter_id, path], shipped, Path(scratch))[1]
            return self._all("load_state", adapter_id, local, include_optimizer,
                             adopt_accumulation, shipped=shipped)

    def sample_batch(self, requests: Sequence[SampleRequest]
                     ) -> list[list[SampledSequence] | EngineError]:
        requests = [_fill_seed(r) for r in requests]
        return self._all("sample_batch", requests,
                         shipped=tuple((i, self._ship_sampler(r.weights_path))
                                       for i, r in enumerate(requests)
                                       if r.weights_path is not None))

    def decode(self, requests: Sequence[SampleRequest], keys: Sequence[int], slice_s: float,
               cancelled: Sequence[int] = ()
               ) -> list[tuple[int, Generation | EngineError | Progress]]:
        """Every rank ends the `cancelled` keys it holds (each holds its own share)."""
        requests = [_fill_seed(r) for r in requests]
        return self._all("decode", requests, keys, slice_s, list(cancelled),
                         shipped=tuple((i, self._ship_sampler(r.weights_path))
                                       for i, r in enumerate(requests)
                                       if r.weights_path is not None))

    def publish_inflight(self, adapter_id: str) -> str:
        return self._all("publish_inflight", adapter_id)

    def prompt_logprobs(self, adapter_id: str | None, weights_path: str | None,
                        tokens: np.ndarray, topk: int = 0) -> Any:
        return self._all("prompt_logprobs", adapter_id, weights_path, tokens, topk,
                         shipped=(1, self._ship_sampler(weights_path)))

    def score_prompt(self, adapter_id: str | None, weights_path: str | None,
                     tokens: np.ndarray, scoring: Any) -> Any:
        return self._all("score_prompt", adapter_id, weights_path, tokens, scoring,
                         shipped=(1, self._ship_sampler(weights_path)))

    def _ship_sampler(self, path: str | None) -> ShippedDir | None:
        """Sampler weights go along only when this rank has them not loaded: every rank's
        sampler cache sees the same calls, so the others then have them loaded too."""
        return _ship(path, path is not None and not self.engine.has_sampler(path))

    def compute_logprobs(self, adapter_id: str | None, weights_path: str | None,
                         tokens: np.ndarray) -> np.ndarray:
        return self.prompt_logprobs(adapter_id, weights_path, tokens).logprobs

    # ------------------------------------------------------------------ lifetime

    def _keep_alive(self) -> None:
        """No-ops while idle, so a rank waiting for the next call never times out."""
        interval = max(0.05, self.timeout_s / 4)
        while not self._closed.wait(interval / 2):
            if time.monotonic() - self._last_send < interval or self.lost is not None:
                continue
            if not self._lock.acquire(blocking=False):
                continue
            if self.lost is not None:  # the worker lost the group while we waited
                self._lock.release()
                return
            try:
                self.channel.send((_NOOP, (), ()))
                self._last_send = time.monotonic()
            except Exception as exc:
                self.lost = _lost_message(self.engine.parallel.ranks, exc, self.timeout_s)
                log.error("%s", self.lost)
            finally:
                self._lock.release()
            if self.lost is not None and self.on_lost is not None:
                self.on_lost(self.lost)

    def close(self) -> None:
        """Tell the other ranks to exit (when the group is still whole)."""
        self._closed.set()
        self._keepalive.join()
        log.info("stopping: %s", self.engine.parallel.describe_share())
        with self._lock:
            if self.lost is None:
                try:
                    self.channel.send((_STOP, (), ()))
                except Exception as exc:
                    log.warning("could not stop the other ranks: %s", exc)


def _lost_message(ranks: Sequence[int], exc: BaseException, timeout_s: float) -> str:
    """Which of the job's `ranks` (an engine's) stopped beating (their heartbeat did not
    move for three beats)."""
    lost: list[int] = []
    others = [r for r in ranks if r != 0]
    try:
        store = dist.distributed_c10d._get_default_store()
        first = {r: store.get(_BEAT_KEY.format(r)) for r in others}
        time.sleep(3 * BEAT_SECONDS)
        lost = [r for r in others if store.get(_BEAT_KEY.format(r)) == first[r]]
    except Exception as store_exc:  # the store itself may be gone with the rank
        log.warning("could not read the ranks' heartbeats: %s", store_exc)
    who = (f"rank {', '.join(map(str, lost))} stopped" if lost
           else "the ranks are out of step")
    return (f"distributed group lost: {who} (collective timeout {timeout_s:g} s, "
            f"--collective-timeout): {type(exc).__name__}: {str(exc)[:300]}; the server is "
            "shutting down, restart it to resume from the saved checkpoints")


def _beat(rank: int, stop: threading.Event) -> None:
    store = dist.distributed_c10d._get_default_store()
    count = 0
    while not stop.wait(BEAT_SECONDS if count else 0):
        count += 1
        try:
            store.set(_BEAT_KEY.format(rank), str(count))
        except Exception:
            return


def follow(engine: Engine, channel: Channel) -> None:
    """A rank other than 0: run rank 0's engine calls until it says stop.

    Returns normally on stop; raises when the group fails (the process must then exit
    non-zero). Errors the engine raises on purpose are rank 0's to report."""
    rank = dist.get_rank()   # the job's: the heartbeat and scratch are the process's
    stop = threading.Event()
    threading.Thread(target=_beat, args=(rank, stop), daemon=True,
                     name="twinkle-heartbeat").start()
    scratch = Path(tempfile.mkdtemp(prefix=f"twinkle-rank{rank}-"))
    try:
        while True:
            name, args, shipped = channel.receive()
            if name == _STOP:
                return
            if name == _NOOP:
                continue
            if name not in REPLICATED:
                raise RuntimeError(f"rank 0 sent {name!r}, not an @replicated Engine method")
            args = _place(list(args), shipped, scratch)
            try:
                getattr(engine, name)(*args)
            except EngineError:
                pass
            # Shipped files are read by the call that brings them; keep only the loaded
            # sampler checkpoints' (their cache keys hash them), so scratch stays bounded.
            loaded = engine.sampler_dirs()
            for entry in scratch.iterdir():
                if os.path.realpath(entry) not in loaded:
                    shutil.rmtree(entry, ignore_errors=True)
    finally:
        stop.set()
        shutil.rmtree(scratch, ignore_errors=True)


def _place(args: list[Any], shipped: tuple, scratch: Path) -> list[Any]:
    """Write shipped checkpoint files under `scratch` and point the call at them:
    `(index, dir)` replaces argument `index`; `((i, dir), ...)` replaces
    `args[0][i].weights_path` (a batch of sample requests)."""
    def write(found: ShippedDir | None) -> str | None:
        if found is None:
            return None
        # One directory per rank-0 path, so the engine's sampler cache (by path and a
        # hash of the files) hits here exactly when it hits there: files are rewritten only
        # when rank 0 missed.
        # (Named after the checkpoint, so the engine's messages still name it.)
        digest = hashlib.sha256(found.source.encode()).hexdigest()[:16]
        target = scratch / f"{Path(found.source).name}.{digest}"
        if found.missing:
            shutil.rmtree(target, ignore_errors=True)
        elif found.files is not None:
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            for file_name, data in found.files.items():
                (target / file_name).write_bytes(data)
        return str(target)

    if not shipped:
        return args
    if isinstance(shipped[0], int):
        args[shipped[0]] = write(shipped[1])
        return args
    requests = list(args[0])
    for index, found in shipped:
        requests[index] = replace(requests[index], weights_path=write(found))
    args[0] = requests
    return args
