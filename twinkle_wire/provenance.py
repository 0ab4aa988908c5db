"""Datum provenance: which recorded sampled sequence each position of a datum reproduces.

A datum's provenance is two lists of runs (`Span`s): one tiling its `input_ids`, one
tiling its loss inputs' token axis (`target_tokens`). A run claims that its positions are
positions `[offset, offset + length)` of a recorded sequence's sampled tokens
(`sampled`) or of the prompt of the request that sampled it; the sequence is named by
the `sequence_id` sampling returned (Tinker's `SampledProvenanceSpan` and
`PromptProvenanceSpan`). stable_reinforce needs it: the server resolves every position
into the sampler's own record. On the wire a `ForwardChunk` carries one
`DatumProvenance` per datum of its batch (`attach_provenance`, `read_provenance`), or
none when no datum of the chunk has any.

Only the form is checked here (ids present and bounded, offsets and lengths not
negative, the two lists given together); whether runs tile their field and match a
record is the server's business, since only it holds the records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from twinkle_wire._proto.twinkle.v1 import training_pb2
from twinkle_wire.tensors import WireError

MAX_SEQUENCE_ID_CHARS = 128
MAX_SPANS = 1 << 16
"""Runs per datum field. A run may be empty (length 0 is legal, as in Tinker), so the
count is not bounded by the datum's length and is capped on its own; 65,536 is far past
any real interleaving of turns."""


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
    """Positions `[offset, offset + length)` of a recorded sequence's sampled tokens
    (`sampled`) or of its request's prompt."""

    sequence_id: str
    offset: int
    length: int
    sampled: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Provenance:
    """Runs tiling a datum's input_ids (`model_input`) and its loss inputs
    (`loss_inputs`)."""

    model_input: tuple[Span, ...]
    loss_inputs: tuple[Span, ...]


def make_span(sequence_id: object, offset: object, length: object, sampled: bool,
              where: str) -> Span:
    """A checked `Span`; `where` names it in the `WireError` of a bad one."""
    if not isinstance(sequence_id, str) or not sequence_id:
        raise WireError(f"{where}.sequence_id: must be a non-empty string")
    if len(sequence_id) > MAX_SEQUENCE_ID_CHARS:
        raise WireError(f"{where}.sequence_id: {len(sequence_id)} characters, over the "
                        f"{MAX_SEQUENCE_ID_CHARS} a sequence id has")
    for name, value in (("offset", offset), ("length", length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise WireError(f"{where}.{name}: must be an integer >= 0, got {value!r}")
    return Span(sequence_id, int(offset), int(length), bool(sampled))  # type: ignore[arg-type]


def make_provenance(model_input: Sequence[Span] | None, loss_inputs: Sequence[Span] | None,
                    index: int) -> Provenance | None:
    """Datum `index`'s provenance from its two run lists (None for both: none); one list
    without the other raises `WireError`, as Tinker's `Datum` does."""
    if model_input is None and loss_inputs is None:
        return None
    if model_input is None or loss_inputs is None:
        raise WireError(f"datum[{index}]: model_input_spans and loss_fn_input_spans come "
                        "as a pair; give both or neither")
    for name, spans in (("model_input_spans", model_input),
                        ("loss_fn_input_spans", loss_inputs)):
        if len(spans) > MAX_SPANS:
            raise WireError(f"datum[{index}].{name}: {len(spans)} spans, over the "
                            f"{MAX_SPANS} one field may have")
    return Provenance(tuple(model_input), tuple(loss_inputs))


def _to_proto(spans: Iterable[Span], out) -> None:
    for span in spans:
        out.add(sequence_id=span.sequence_id, offset=span.offset, length=span.length,
                sampled=span.sampled)


def attach_provenance(chunks: Sequence[training_pb2.ForwardChunk],
                      provenance: Sequence[Provenance | None]) -> None:
    """Fill each chunk's `provenance` from the request's per-datum list (aligned with the
    datums `pack_request` packed into `chunks`); a chunk none of whose datums has any
    carries none."""
    if not any(p is not None for p in provenance):
        return
    start = 0
    for chunk in chunks:
        count = len(chunk.batch.lengths)
        own = provenance[start:start + count]
        start += count
        if not any(p is not None for p in own):
            continue
        for p in own:
            entry = chunk.provenance.add()
            if p is not None:
                _to_proto(p.model_input, entry.model_input_spans)
                _to_proto(p.loss_inputs, entry.loss_fn_input_spans)
    if start != len(provenance):
        raise WireError(f"provenance: {len(provenance)} entries for {start} datums")


def _from_proto(spans, where: str) -> list[Span]:
    return [make_span(s.sequence_id, s.offset, s.length, s.sampled, f"{where}[{i}]")
            for i, s in enumerate(spans)]


def read_provenance(chunk: training_pb2.ForwardChunk, first: int = 0
                    ) -> list[Provenance | None]:
    """The provenance of each datum of a chunk's batch (None: that datum has none);
    `first` numbers the chunk's first datum in errors."""
    count = len(chunk.batch.lengths)
    if not chunk.provenance:
        return [None] * count
    if len(chunk.provenance) != count:
        raise WireError(f"provenance: {len(chunk.provenance)} entries for the chunk's "
                        f"{count} datums; give one per datum or none")
    out: list[Provenance | None] = []
    for index, entry in enumerate(chunk.provenance, first):
        if not entry.model_input_spans and not entry.loss_fn_input_spans:
            out.append(None)
            continue
        for name in ("model_input_spans", "loss_fn_input_spans"):
            if len(getattr(entry, name)) > MAX_SPANS:
                raise WireError(f"datum[{index}].{name}: {len(getattr(entry, name))} spans, "
                                f"over the {MAX_SPANS} one field may have")
        out.append(make_provenance(
            _from_proto(entry.model_input_spans, f"datum[{index}].model_input_spans"),
            _from_proto(entry.loss_fn_input_spans, f"datum[{index}].loss_fn_input_spans"),
            index))
    return out
