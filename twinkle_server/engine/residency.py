"""Adapter residency: `--max-adapters` is how many adapters are attached to the base at
once (resident), not how many may live. Past it the least recently used resident adapter
pages out: it is detached from every layer, and its weights, gradients and optimizer
state move to host memory (`HOST`; on a CPU device they stay where they are and only the
slot frees). Past a host budget (`Spill`: `--adapter-host-memory-gib`) the adapters
paged out longest go on to disk, one file each in the data dir, and their tensors are
freed. Its next use (any verb that names it, through `Training._adapter`) pages it back
in before it runs, paging out another. Nothing but where tensors live changes, so a run
paged out and in between its steps computes exactly what it would have resident.

Which pages out is fair between tenants: the least recently used adapter of the tenant
that would hold the most slots (counting the adapter coming in), so one tenant cycling
through many runs pages out its own, not everyone else's; with one tenant (or none
named) that is plain LRU. A tenant keeps its share (the slots over the tenants resident)
while it is idle: residency is not taken from a run for being quiet.

The scheduler plans merged passes around the slots (`scheduling.planning.Slots`, read
from `paging_stats`): a pass holds at most `--max-adapters` adapters, and ops of resident
adapters join it before those that would page in. Checking a request reads no adapter
tensor, so it pages nothing in.

Never paged out: an adapter the current pass needs (`_hold`), and one the decode
pool is sampling from. When every resident adapter is so held, the op that needs another
is refused (`ResourceExhausted`, naming `--max-adapters`) rather than waiting: the
scheduler never runs two ops of one pass apart. Paging is memory management of this
process: it is not a checkpoint, and a crash loses a paged adapter as it loses a
resident one (the store keeps what was saved); the next start clears the page files.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from twinkle_server.engine.adapter import Adapter
from twinkle_server.engine.checkpoint import replace_file
from twinkle_server.engine.errors import ResourceExhausted
from twinkle_server.engine.protocol import rank_zero_only

HOST = torch.device("cpu")


@dataclass(frozen=True)
class PagingStats:
    resident_ids: frozenset[str]
    paged: int                 # in host memory
    on_disk: int
    page_ins: int
    page_outs: int
    page_in_seconds: float     # summed over the page-ins

    @property
    def resident(self) -> int:
        return len(self.resident_ids)


@dataclass(frozen=True)
class Spill:
    """Past `host_bytes` of paged-out adapters' state in host memory, those paged out
    longest go to files in `directory` (`--adapter-host-memory-gib`)."""

    directory: Path
    host_bytes: int


class Residency:
    """Which adapters are attached, least recently used first, and the paging between.
    Mixed into `Engine`, over its `adapters`, `limits`, layers and decode pool."""

    def _init_residency(self, spill: Spill | None) -> None:
        self.resident: OrderedDict[str, None] = OrderedDict()
        self._on_host: OrderedDict[str, None] = OrderedDict()   # paged out, oldest first
        self._on_disk: dict[str, Path] = {}
        self._owners: dict[str, str] = {}    # adapter id -> its tenant (fair share)
        self._spill_to = spill
        if spill is not None:    # no page file outlives the process that wrote it
            shutil.rmtree(spill.directory, ignore_errors=True)
            spill.directory.mkdir(parents=True)
        self._held: set[str] = set()
        self._page_ins = self._page_outs = 0
        self._page_in_seconds = 0.0

    @rank_zero_only
    def paging_stats(self) -> PagingStats:
        """Adapters resident and paged out now, and pages in and out since the start."""
        return PagingStats(frozenset(self.resident), len(self._on_host), len(self._on_disk),
                           self._page_ins, self._page_outs, self._page_in_seconds)

    @contextlib.contextmanager
    def _hold(self, adapter_ids: Iterable[str]) -> Iterator[None]:
        """Within the block, `adapter_ids` are resident and none of them pages out.

        Raises:
            ResourceExhausted: they are more than `--max-adapters`, or room for them
                would page out adapters that are held or sampling.
        """
        ids = [a for a in dict.fromkeys(adapter_ids) if a in self.adapters]  # type: ignore[attr-defined]
        limit = self.limits.max_adapters   # type: ignore[attr-defined]
        if len(ids) > limit:
            raise ResourceExhausted(
                f"adapters: one pass needs {len(ids)} adapters resident, more than the "
                f"{limit} of --max-adapters")
        before = set(self._held)
        self._held.update(ids)
        try:
            for adapter_id in ids:
                self._make_resident(adapter_id)
            yield
        finally:
            self._held = before

    def _make_resident(self, adapter_id: str) -> None:
        """Page `adapter_id` in if it is out (paging out the least recently used
        adapter not held) and mark it the most recently used."""
        if adapter_id in self.resident:
            self.resident.move_to_end(adapter_id)
            return
        start = time.perf_counter()
        held = adapter_id in self._held
        self._held.add(adapter_id)        # room is made by paging out (and spilling) others
        try:
            self._make_room({adapter_id}, self._owners.get(adapter_id, ""))
        finally:
            if not held:
                self._held.discard(adapter_id)
        adapter = self.adapters[adapter_id]   # type: ignore[attr-defined]
        if adapter_id in self._on_disk:
            _read(adapter, self._on_disk.pop(adapter_id))
        self._on_host.pop(adapter_id, None)
        _move(adapter, self.base.device)   # type: ignore[attr-defined]
        self._attach(adapter)   # type: ignore[attr-defined]
        self.resident[adapter_id] = None
        self._page_ins += 1
        self._page_in_seconds += time.perf_counter() - start

    def _make_room(self, keep: set[str], owner: str) -> None:
        """Page out adapters until one more of `owner`'s fits (`_victim`), never one in
        `keep`, held, or sampling in the decode pool."""
        limit = self.limits.max_adapters   # type: ignore[attr-defined]
        while len(self.resident) >= limit:
            pinned = keep | self._held | self.sampling._pinned()   # type: ignore[attr-defined]
            victim = self._victim([a for a in self.resident if a not in pinned], owner)
            if victim is None:
                raise ResourceExhausted(
                    f"adapters: all {limit} resident adapter slots (--max-adapters) hold "
                    "adapters this pass needs or the sampler is decoding from; retry once "
                    "they finish, or serve with a higher --max-adapters")
            self._page_out(victim)

    def _victim(self, candidates: list[str], owner: str) -> str | None:
        """Of `candidates` (least recently used first), the first whose tenant would hold
        the most slots once `owner`'s adapter is in."""
        if not candidates:
            return None
        slots = Counter(self._owners.get(a, "") for a in self.resident)
        slots[owner] += 1
        most = max(slots[self._owners.get(a, "")] for a in candidates)
        return next(a for a in candidates if slots[self._owners.get(a, "")] == most)

    def _page_out(self, adapter_id: str) -> None:
        adapter = self.adapters[adapter_id]   # type: ignore[attr-defined]
        self._detach(adapter_id, adapter.weights)   # type: ignore[attr-defined]
        _move(adapter, HOST)
        del self.resident[adapter_id]
        self._on_host[adapter_id] = None
        self._page_outs += 1
        self._spill()

    def _spill(self) -> None:
        """Write the adapters paged out longest to disk while the host holds more than
        its budget of paged-out state."""
        spill = self._spill_to
        if spill is None:
            return
        held = {a: _state_bytes(self.adapters[a])   # type: ignore[attr-defined]
                for a in self._on_host if a not in self._held}
        while held and sum(held.values()) > spill.host_bytes:
            oldest = next(iter(held))
            path = spill.directory / f"{self._page_outs}-{oldest}.pt"
            _write(self.adapters[oldest], path)   # type: ignore[attr-defined]
            del self._on_host[oldest], held[oldest]
            self._on_disk[oldest] = path

    def _forget_residency(self, adapter_id: str) -> None:
        """`adapter_id` is gone (removed): it holds no slot, and no page of it is kept."""
        self.resident.pop(adapter_id, None)
        self._owners.pop(adapter_id, None)
        self._on_host.pop(adapter_id, None)
        path = self._on_disk.pop(adapter_id, None)
        if path is not None:
            path.unlink(missing_ok=True)


def _move(adapter: Adapter, device: torch.device) -> None:
    """Every tensor of `adapter` (weights, their gradients, optimizer state) to `device`,
    in place: the optimizer keeps its references to the same parameters. A no-op where
    they are there already."""
    for param in adapter.parameters():
        if param.device != device:
            grad = param.grad
            param.data = param.data.to(device)
            if grad is not None:
                param.grad = grad.to(device)
    if adapter.optimizer is not None:
        for state in adapter.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device != device \
                        and value.dim() > 0:
                    state[key] = value.to(device)


def _tensors(adapter: Adapter) -> list[tuple[torch.nn.Parameter, dict]]:
    """Each parameter with its optimizer state (empty without an optimizer yet)."""
    optimizer = adapter.optimizer
    return [(p, optimizer.state[p] if optimizer is not None else {})
            for p in adapter.parameters()]


def _state_bytes(adapter: Adapter) -> int:
    """Bytes of the adapter's tensors now: weights, gradients, optimizer state."""
    total = 0
    for param, state in _tensors(adapter):
        total += param.data.nbytes + (param.grad.nbytes if param.grad is not None else 0)
        total += sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))
    return total


def _write(adapter: Adapter, path: Path) -> None:
    """Every tensor of `adapter` to `path` (on the host), then freed in memory: each
    parameter keeps its object (the optimizer's key) with an empty tensor in place."""
    saved = [{"data": param.data, "grad": param.grad,
              "state": {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}}
             for param, state in _tensors(adapter)]
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    replace_file(path, buffer.getvalue())
    for param, state in _tensors(adapter):
        param.data = param.data.new_empty(0)
        param.grad = None
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor):
                state[key] = value.new_empty(0)


def _read(adapter: Adapter, path: Path) -> None:
    """The tensors `_write` put in `path`, back in place (on the host); the file goes."""
    saved = torch.load(path, weights_only=True)
    for (param, state), own in zip(_tensors(adapter), saved, strict=True):
        param.data = own["data"]
        param.grad = own["grad"]
        state.update(own["state"])
    path.unlink()
