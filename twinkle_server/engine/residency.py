"""Adapter residency: `--max-adapters` is how many adapters are attached to the base at
once (resident), not how many may live. Past it the least recently used resident adapter
pages out: it is detached from every layer, and its weights, gradients and optimizer
state move to host memory (`HOST`; on a CPU device they stay where they are and only the
slot frees). Its next use (any verb that names it, through `Training._adapter`) pages it
back in before it runs, paging out another. Nothing but where tensors live changes, so a
run paged out and in between its steps computes exactly what it would have resident.

Never paged out: an adapter the current pass needs (`_hold`), and one the decode
pool is sampling from. When every resident adapter is so held, the op that needs another
is refused (`ResourceExhausted`, naming `--max-adapters`) rather than waiting: the
scheduler never runs two ops of one pass apart. Paging is memory management of this
process: it is not a checkpoint, and a crash loses a paged adapter as it loses a
resident one (the store keeps what was saved).
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from twinkle_server.engine.adapter import Adapter
from twinkle_server.engine.errors import ResourceExhausted
from twinkle_server.engine.protocol import rank_zero_only

HOST = torch.device("cpu")


@dataclass(frozen=True)
class PagingStats:
    resident: int
    paged: int
    page_ins: int
    page_outs: int
    page_in_seconds: float     # summed over the page-ins


class Residency:
    """Which adapters are attached, least recently used first, and the paging between.
    Mixed into `Engine`, over its `adapters`, `limits`, layers and decode pool."""

    def _init_residency(self) -> None:
        self.resident: OrderedDict[str, None] = OrderedDict()
        self._held: set[str] = set()
        self._page_ins = self._page_outs = 0
        self._page_in_seconds = 0.0

    @rank_zero_only
    def paging_stats(self) -> PagingStats:
        """Adapters resident and paged out now, and pages in and out since the start."""
        resident = len(self.resident)
        return PagingStats(resident, len(self.adapters) - resident,   # type: ignore[attr-defined]
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
        self._make_room({adapter_id})
        adapter = self.adapters[adapter_id]   # type: ignore[attr-defined]
        _move(adapter, self.base.device)   # type: ignore[attr-defined]
        self._attach(adapter)   # type: ignore[attr-defined]
        self.resident[adapter_id] = None
        self._page_ins += 1
        self._page_in_seconds += time.perf_counter() - start

    def _make_room(self, keep: set[str]) -> None:
        """Page out least recently used adapters until one more fits, never one in
        `keep`, held, or sampling in the decode pool."""
        limit = self.limits.max_adapters   # type: ignore[attr-defined]
        while len(self.resident) >= limit:
            pinned = keep | self._held | self.sampling._pinned()   # type: ignore[attr-defined]
            victim = next((a for a in self.resident if a not in pinned), None)
            if victim is None:
                raise ResourceExhausted(
                    f"adapters: all {limit} resident adapter slots (--max-adapters) hold "
                    "adapters this pass needs or the sampler is decoding from; retry once "
                    "they finish, or serve with a higher --max-adapters")
            self._page_out(victim)

    def _page_out(self, adapter_id: str) -> None:
        adapter = self.adapters[adapter_id]   # type: ignore[attr-defined]
        self._detach(adapter_id, adapter.weights)   # type: ignore[attr-defined]
        _move(adapter, HOST)
        del self.resident[adapter_id]
        self._page_outs += 1

    def _forget_residency(self, adapter_id: str) -> None:
        """`adapter_id` is gone (removed): it holds no slot."""
        self.resident.pop(adapter_id, None)


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
