"""When loaded models and sampling sessions end: an unload frees an adapter's slot, a
closed session takes its models and sampling sessions with it, and the periodic sweep
(`Core.expire`) ends idle sessions, expired checkpoints and superseded snapshots."""

from __future__ import annotations

import logging
import shutil
import time
from typing import TypeVar

from twinkle_server.engine.errors import FailedPrecondition
from twinkle_server.runtime.bases import Served
from twinkle_server.runtime.core import Core
from twinkle_wire import paths

log = logging.getLogger("twinkle_server")
E = TypeVar("E")


class Lifetimes:
    """Ends of models and sampling sessions, on `core`'s registry; its expiries join
    `core.sweeps`."""

    def __init__(self, core: Core) -> None:
        self.core = core
        core.sweeps += [self.expire_sessions, self.expire_checkpoints, self.expire_snapshots]

    def _forget(self, registry: dict[str, E], queue_id: str, why: str
                ) -> tuple[Served, E] | None:
        """Take `queue_id` out of `registry` and out of its model's scheduler, whose waiting
        ops fail naming `why`: its model and entry, or None if it was not there."""
        if queue_id not in registry:
            return None
        served = self.core.base_of(queue_id)
        entry = registry.pop(queue_id)
        served.scheduler.unregister(queue_id, FailedPrecondition(why))
        return served, entry

    async def unload(self, model_id: str, reason: str) -> None:
        """Free an adapter's slot; its run record and checkpoints stay."""
        core = self.core
        forgotten = self._forget(core.models, model_id,
                                 f"model_id: {model_id!r} was unloaded ({reason})")
        if forgotten is None:
            return
        served, entry = forgotten
        await core.admin("unload", lambda: served.engine.remove_adapter(model_id), served)
        log.info("unloaded model=%s tenant=%s (%s)", model_id, entry.tenant, reason)
        core.record(entry.tenant, "model_unload", model_id=model_id, reason=reason)
        for sampling_id in [s for s, e in core.samplers.items() if e.inflight_of == model_id]:
            await self.end_sampler(sampling_id, f"its model {model_id!r} was unloaded")

    async def expire_checkpoints(self, now: float | None = None) -> None:
        """Delete every tenant's checkpoints whose expiry (`Runs.set_checkpoint_ttl`) is
        at or before `now` (default: the current time)."""
        now = time.time() if now is None else now
        for row in self.core.store.expired_checkpoints(now):
            if await self.core.drop_checkpoint(row, expired_by=now):
                log.info("expired checkpoint %s tenant=%s",
                         paths.tinker_path(row.run_id, row.checkpoint_id), row.tenant)
                self.core.record(row.tenant, "checkpoint_delete", reason="expired",
                                 model_id=row.run_id,
                                 tinker_path=paths.tinker_path(row.run_id, row.checkpoint_id),
                                 checkpoint_type=row.kind, owner=row.tenant)

    async def expire_sessions(self) -> None:
        """Close every session idle past `--session-timeout` (no heartbeat, no op of its
        models or sampling sessions running or waiting its turn, and none ended within
        it: `Core.session_busy`, `Core.last_op`), with its models and sampling sessions."""
        core = self.core
        timeout, now = core.config.session_timeout, time.time()
        for session_id in core.store.expired_sessions(timeout):
            if (core.session_busy(session_id)
                    or now - core.last_op.get(session_id, 0.0) < timeout):
                continue
            tenant = core.store.session_tenant(session_id)
            await core.write(core.store.close_session, session_id)
            if tenant is not None:
                core.record(tenant, "session_close", session_id=session_id, reason="expired")
            await self.close_session_models(session_id, "session expired")

    async def expire_snapshots(self, now: float | None = None) -> None:
        """Drop the snapshots an RL loop has moved past; a snapshot otherwise lives as
        long as its client session (`close_session_models`).

        The server cannot know which sampling clients a program still holds, so it
        keeps, for each model and client session, the snapshots a held client may still
        need and drops only those superseded. A snapshot is dropped (at `now`, a
        `time.monotonic()`) when all hold:

        - no request of it is running or queued, and none ended for `--session-timeout`
          seconds;
        - it is not the newest snapshot of its model in its session (a loop samples its
          latest weights: a step longer than the timeout must not lose them);
        - it is not the first snapshot of its model in its session: that is where a
          reference is taken (tinker-cookbook's `preference/train_dpo.py` takes
          `training_client.save_weights_and_get_sampling_client()` right after creating
          the training client, then trains that same client, snapshotting it again for
          each sampling evaluation, and reads the reference every step, however long).

        So an RL loop that snapshots every step keeps on disk its first snapshot, its
        newest, and those used in the last `--session-timeout` seconds (an off-policy
        loop's few steps behind), whatever the number of steps. A snapshot of a model
        made outside any client session (gRPC `session_id` unset) has no session to
        live as long as: it goes when unused for the timeout, as any idle one."""
        now = time.monotonic() if now is None else now
        samplers, timeout = self.core.samplers, self.core.config.session_timeout
        kept: set[str] = set()
        lines: dict[tuple[str, str | None], list[str]] = {}
        for sampling_id, entry in samplers.items():   # in creation order
            if entry.snapshot and entry.session_id:
                lines.setdefault((entry.session_id, entry.snapshot_of), []).append(sampling_id)
        for line in lines.values():
            kept.update((line[0], line[-1]))
        idle = [s for s, e in samplers.items() if e.snapshot and s not in kept
                and not e.in_flight and now - e.last_used > timeout]
        for sampling_id in idle:
            await self.end_sampler(sampling_id, "a newer snapshot of its model replaced it "
                                                f"and it was unused for over {timeout:g} s "
                                                "(--session-timeout)")

    async def close_session_models(self, session_id: str, reason: str) -> None:
        """Unload a closed session's models and end its sampling sessions."""
        self.core.last_op.pop(session_id, None)
        for model_id in [m for m, e in self.core.models.items() if e.session_id == session_id]:
            await self.unload(model_id, reason)
        for sid in [s for s, e in self.core.samplers.items() if e.session_id == session_id]:
            await self.end_sampler(sid, reason)

    async def end_sampler(self, sampling_id: str, reason: str) -> None:
        """Forget a sampling session: its requests fail with `reason`, waiting or in the
        decode pool (whose next slice drops their rows; a static batch already running
        finishes), and the snapshot it owns is deleted, on the writer thread."""
        core = self.core
        forgotten = self._forget(core.samplers, sampling_id,
                                 f"sampling_session_id: {sampling_id!r} has ended ({reason})")
        if forgotten is None:
            return
        _, entry = forgotten
        core.record(entry.tenant, "sampler_end", sampling_session_id=sampling_id,
                    reason=reason)
        if entry.snapshot and entry.weights_path:
            await core.write(shutil.rmtree, entry.weights_path, True)
            log.info("dropped snapshot sampler=%s tenant=%s (%s)", sampling_id, entry.tenant,
                     reason)
