"""Stability records: what sampling keeps for stable_reinforce, and how a training datum's
provenance is resolved into the loss's per-token inputs.

Sampling with `record_stability_info` records each sampled sequence (`store.stability.
StabilityRecord`: the request's prompt, the sampled tokens, the sampler's float32 logprob
of each) under the `sequence_id` the front returned for it, owned by the tenant and the
session that sampled. A record lives a day after its last use (`RECORD_TTL_SECONDS`;
each training use restarts the day) and survives restarts (the store). A tenant keeps at
most `--max-stability-records`: past it, a new record evicts the tenant's least recently
used one, so a long RL run never stops sampling because old rollouts were not trained on
(a datum naming an evicted record then fails NOT_FOUND, like an expired one).

A stable_reinforce datum names its sources by provenance (`twinkle_wire.
Provenance`): runs tiling its input_ids and runs tiling its targets. `resolve` checks every
run against its record (the named record exists for this tenant and session, the runs
tile their field, each run lies inside its record and reproduces its tokens (all of
input_ids, and the sampled runs of the targets: the cookbook's `rl_loop` puts 0, not the
prompt, under its prompt positions, which carry no loss), prompt positions carry no
advantage) and hands the engine ordinary loss inputs: `logprobs` the
sampler's recorded logprob at each sampled position (0 elsewhere) and `sampled_mask`
(1 at sampled positions). A client's own `logprobs` are replaced. Any failure names the
datum and the span and is raised before the op queues, so nothing is applied; the fronts
then let the refused op take its seq_id (`Training.refuse`).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Sequence

import numpy as np

from twinkle_server.engine.errors import InvalidArgument, NotFound
from twinkle_server.engine.types import Datum
from twinkle_server.runtime.core import Core
from twinkle_server.store.stability import StabilityRecord
from twinkle_wire import Provenance, Span

RECORD_TTL_SECONDS = 24 * 3600.0
"""A record can be trained on until a day after its last use (Tinker: "for one day after
sampling. Each training request that uses a sequence restarts that day")."""
LOSS = "stable_reinforce"
_FIELDS = (("model_input_spans", "input_ids"), ("loss_fn_input_spans", "target_tokens"))


class Stability:
    def __init__(self, core: Core) -> None:
        self.core = core

    # ------------------------------------------------------------------ sampling

    @staticmethod
    def new_ids(count: int) -> list[str]:
        """Sequence ids for one sample request's `count` sequences, fixed when it is
        submitted (the Tinker SDK reads them from the request's future)."""
        return ["seq-" + secrets.token_hex(12) for _ in range(count)]

    def session_of(self, queue: str) -> str:
        """The session a sample on `queue` belongs to: its sampling session's, or (a
        live model's queue) the model's."""
        sampler = self.core.samplers.get(queue)
        if sampler is not None:
            return sampler.session_id or ""
        model = self.core.models.get(queue)
        return (model.session_id or "") if model is not None else ""

    async def recorded(self, tenant: str, queue: str, prompt: np.ndarray, ids: Sequence[str],
                       sampled: Awaitable) -> object:
        """Await a sample (`Sampling.sample`) and record its sequences under `ids`, in
        order; returns the sample's result."""
        result = await sampled
        await self.record(tenant, queue, prompt, ids, result)
        return result

    async def record(self, tenant: str, queue: str, prompt: np.ndarray, ids: Sequence[str],
                     result: object) -> None:
        """Record a sample's sequences (`SampleResult.sequences`) under `ids`, in order."""
        sequences = result.sequences  # type: ignore[attr-defined]
        if len(sequences) != len(ids):
            raise InvalidArgument(f"num_samples: {len(sequences)} sequences for {len(ids)} "
                                  "sequence ids")
        now = time.time()
        session = self.session_of(queue)
        records = [StabilityRecord(sequence_id, tenant, session,
                                   np.asarray(prompt, np.int32), np.asarray(seq.tokens, np.int32),
                                   np.asarray(seq.logprobs, np.float32), now, now)
                   for sequence_id, seq in zip(ids, sequences, strict=True)]
        await self.core.write(self.core.store.add_stability_records, records,
                              self.core.config.max_stability_records, RECORD_TTL_SECONDS)

    # ------------------------------------------------------------------ training

    def resolve(self, tenant: str, model_id: str, datums: Sequence[Datum],
                provenance: Sequence[Provenance | None] | None
                ) -> tuple[list[Datum], list[str]]:
        """The datums with stable_reinforce's inputs from the records their provenance
        names, and the ids used (to `touch` once the request is accepted)."""
        session = self.core.model_of(tenant, model_id).session_id or ""
        provenance = list(provenance or [])
        if len(provenance) < len(datums):
            provenance += [None] * (len(datums) - len(provenance))
        for index, prov in enumerate(provenance[:len(datums)]):
            if prov is None:
                raise InvalidArgument(
                    f"datum[{index}]: {LOSS} needs provenance: model_input_spans and "
                    "loss_fn_input_spans naming the sampled sequences (Datum.with_provenance; "
                    "sample with record_stability_info=True)")
        ids = sorted({span.sequence_id for prov in provenance[:len(datums)]
                      for spans in (prov.model_input, prov.loss_inputs) for span in spans})
        found = self.core.store.stability_records(tenant, ids, RECORD_TTL_SECONDS)
        records = {k: r for k, r in found.items() if r.session_id == session}
        out = [self._resolve_one(index, datum, prov, records)
               for index, (datum, prov) in enumerate(zip(datums, provenance, strict=False))]
        return out, ids

    def touch(self, tenant: str, sequence_ids: list[str]) -> None:
        """A training request used these records: restart their day."""
        if sequence_ids:
            self.core.write_later(self.core.store.touch_stability_records, tenant,
                                  sequence_ids)

    def _resolve_one(self, index: int, datum: Datum, prov: Provenance,
                     records: dict[str, StabilityRecord]) -> Datum:
        inputs = dict(datum.loss_inputs)
        targets = inputs.get("target_tokens")
        if targets is None or targets.ndim != 1:
            raise InvalidArgument(f"datum[{index}].loss_fn_inputs['target_tokens']: {LOSS} "
                                  "needs one target per position ([T])")
        q = np.zeros(targets.shape[0], np.float32)
        sampled = np.zeros(targets.shape[0], np.float32)
        advantages = inputs.get("advantages")
        for (name, what), spans, tokens in zip(
                _FIELDS, (prov.model_input, prov.loss_inputs), (datum.input_ids, targets),
                strict=True):
            covered = sum(span.length for span in spans)
            if covered != tokens.shape[0]:
                raise InvalidArgument(
                    f"datum[{index}].{name}: the spans cover {covered} positions but "
                    f"{what} has {tokens.shape[0]}; the runs must tile it exactly")
            position = 0
            for j, span in enumerate(spans):
                where = f"datum[{index}].{name}[{j}]"
                source = self._source(where, span, records)
                end = span.offset + span.length
                if end > source.shape[0]:
                    raise InvalidArgument(
                        f"{where}: positions [{span.offset}, {end}) are outside sequence "
                        f"{span.sequence_id!r}'s {source.shape[0]} "
                        f"{'sampled' if span.sampled else 'prompt'} tokens")
                mine = tokens[position:position + span.length]
                recorded = source[span.offset:end]
                # A loss prompt run's targets are not compared: they carry no loss, and
                # Tinker's own rl_loop puts 0 there rather than the prompt's tokens.
                checked = span.sampled or name == "model_input_spans"
                if checked and not np.array_equal(mine, recorded):
                    at = int(np.flatnonzero(mine != recorded)[0])
                    raise InvalidArgument(
                        f"{where}: {what}[{position + at}] is {int(mine[at])} but sequence "
                        f"{span.sequence_id!r}'s {'sampled' if span.sampled else 'prompt'} "
                        f"token {span.offset + at} is {int(recorded[at])}")
                if name == "loss_fn_input_spans":
                    rows = slice(position, position + span.length)
                    if span.sampled:
                        logprobs = records[span.sequence_id].logprobs
                        q[rows] = logprobs[span.offset:end]
                        sampled[rows] = 1.0
                    elif advantages is not None and np.any(advantages[rows] != 0):
                        raise InvalidArgument(
                            f"{where}: a prompt span's positions carry non-zero advantages; "
                            f"{LOSS} trains only sampled tokens (give prompt positions "
                            "advantage 0)")
                position += span.length
        inputs["logprobs"] = q
        inputs["sampled_mask"] = sampled
        return Datum(datum.input_ids, inputs)

    @staticmethod
    def _source(where: str, span: Span, records: dict[str, StabilityRecord]) -> np.ndarray:
        record = records.get(span.sequence_id)
        if record is None:
            raise NotFound(
                f"{where}.sequence_id: no recorded sequence {span.sequence_id!r} in this "
                "session (sample with record_stability_info=True in the training client's "
                "session; a record expires a day after its last use)")
        return record.tokens if span.sampled else record.prompt
