"""The SDK's bodies <-> the runtime's plain values, at the edge only.

The stock `tinker` SDK (0.38) sends `forward_backward` as its own protobuf
(`tinker.proto.tinker_public_pb2.ForwardBackwardRequest`) and reads `ForwardBackwardOutput`
and `SampleResponse` only as protobuf; everything else is JSON shaped like
`tinker.types`. Datums go straight into the runtime's `Datum` through the wire codec's
own checks (`encode_datum`, `narrow_datum`), so both fronts check and narrow them
identically (token ids int32, other loss inputs float32) and give the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as tpb

import twinkle_wire as wire
from twinkle_server.engine.errors import EngineError
from twinkle_server.engine.types import AdamParams, Datum, ForwardOutput, LossSpec, SamplingParams
from twinkle_server.http.errors import BadBody
from twinkle_server.runtime.runs import RunView
from twinkle_server.store import CheckpointRow, RunRow
from twinkle_wire import paths
from twinkle_wire.stop import parse_stop

PROTOBUF = "application/x-protobuf"
MAX_SPARSE_ELEMENTS = 1 << 24
"""A sparse loss input is densified; its dense size is capped (64 MiB of float32) so a
small body cannot ask for a huge allocation."""
_DTYPES = {tpb.DTYPE_FLOAT32: np.float32, tpb.DTYPE_INT64: np.int64,
           tpb.DTYPE_INT32: np.int32}
_STOP = {"stop": tpb.STOP_REASON_STOP, "length": tpb.STOP_REASON_LENGTH}
INT64_END = 2**63
"""Integers a body may give are int64, [-2^63, 2^63): SQLite rows, numpy arrays and torch
generators hold no more (a larger one was an OverflowError, a 500)."""


# ----------------------------------------------------------------------------- requests


def _field(body: Mapping[str, Any], name: str, kind: type | tuple, default: Any = None,
           required: bool = False, field: str = "") -> Any:
    field = field or name
    value = body.get(name, default)
    if value is None:
        if required:
            raise BadBody(f"{field}: required", field)
        return default
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise BadBody(f"{field}: expected a number, got {value!r}", field)
    if not isinstance(value, kind):
        raise BadBody(f"{field}: expected {getattr(kind, '__name__', 'a number')}, got "
                      f"{type(value).__name__}", field)
    return value


def text(body: Mapping[str, Any], name: str, required: bool = False) -> str:
    """Field `name`, a string; "" when left out (or null), unless `required`."""
    value = _field(body, name, str, None, required)
    return "" if value is None else value


def integer(body: Mapping[str, Any], name: str, default: int | None = None,
            low: int = -INT64_END, high: int = INT64_END - 1, field: str = "") -> int | None:
    """Field `name` (`field` in messages), an integer in [`low`, `high`] (int64 unless
    narrowed); `default` when left out or null."""
    field = field or name
    value = _field(body, name, int, None, field=field)
    if value is None:
        return default
    if value < low:
        raise BadBody(f"{field}: must be >= {low}, got {value}", field)
    if value > high:
        raise BadBody(f"{field}: must be <= {high}, got {value}", field)
    return value


def seed(body: Mapping[str, Any], name: str, field: str = "") -> int | None:
    """Field `name` (`field` in messages), a seed: an integer in [0, 2^63), on every route
    (OpenAI documents that range; torch's `manual_seed` refuses more than 64 bits);
    None when left out or null."""
    field = field or name
    value = body.get(name)
    if value is not None and (type(value) is not int or not 0 <= value < INT64_END):
        raise BadBody(f"{field}: {value!r}; give an integer in [0, 2^63)", field)
    return value


def flag(body: Mapping[str, Any], name: str, default: bool = False, field: str = "") -> bool:
    """Field `name` (`field` in messages), true or false; `default` when left out or
    null. Any other value (a string, a number) is refused, never read as true or false."""
    field = field or name
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadBody(f"{field}: must be true or false, got {value!r}", field)
    return value


def strings(body: Mapping[str, Any], name: str, field: str = "") -> list[str] | None:
    """Field `name` (`field` in messages), a list of strings; None when left out or
    null. Anything else (a string, a number, false, an object) is refused by name."""
    field = field or name
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise BadBody(f"{field}: give a list of strings, got {value!r}", field)
    return value


def query_integer(query: Mapping[str, str], name: str) -> int:
    """Query parameter `name`, a count or offset in [0, 2^63); 0 when left out or empty."""
    raw = query.get(name) or "0"
    try:
        value = int(raw)
    except ValueError:
        raise BadBody(f"{name}: {raw!r} is not an integer", name) from None
    if not 0 <= value < INT64_END:
        raise BadBody(f"{name}: {value} is out of range; give an integer in [0, 2^63)",
                      name)
    return value


def number(body: Mapping[str, Any], name: str, default: float) -> float:
    return float(_field(body, name, (int, float), default))


def mapping(body: Mapping[str, Any], name: str) -> dict[str, str]:
    value = _field(body, name, dict, {})
    return {str(k): str(v) for k, v in value.items()}


def _tensor(msg: tpb.Tensor, field: str) -> np.ndarray:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise BadBody(f"{field}: dtype {msg.dtype} is not float32 or int64")
    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape):
        raise BadBody(f"{field}: negative dimension in shape {shape}")
    if msg.HasField("sparse_csr"):
        if len(shape) != 2 or math.prod(shape) > MAX_SPARSE_ELEMENTS:
            raise BadBody(f"{field}: a sparse tensor must be 2-D with at most "
                          f"{MAX_SPARSE_ELEMENTS} elements, got shape {shape}")
        values = np.frombuffer(msg.sparse_csr.values, dtype)
        crow = np.frombuffer(msg.sparse_csr.crow_indices, np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, np.int64)
        if (len(crow) != shape[0] + 1 or len(col) != len(values) or crow[0] != 0
                or crow[-1] != len(values) or np.any(np.diff(crow) < 0)
                or np.any((col < 0) | (col >= shape[1]))):
            raise BadBody(f"{field}: inconsistent sparse CSR indices for shape {shape}")
        dense = np.zeros(shape, dtype)
        dense[np.repeat(np.arange(shape[0]), np.diff(crow)), col] = values
        return dense
    itemsize = np.dtype(dtype).itemsize
    if len(msg.dense) % itemsize:
        raise BadBody(f"{field}: {len(msg.dense)} bytes is not a whole number of "
                      f"{np.dtype(dtype).name} values")
    flat = np.frombuffer(msg.dense, dtype)
    if not shape:
        shape = [flat.size]
    if math.prod(shape) != flat.size:
        raise BadBody(f"{field}: shape {shape} needs {math.prod(shape)} values, the body "
                      f"holds {flat.size}")
    return flat.reshape(shape)


def forward_request(body: bytes, check_tokens: Callable[[str, int], None]
                    ) -> tuple[tpb.ForwardBackwardRequest, list[Datum] | Exception, LossSpec]:
    """The SDK's protobuf `forward_backward` body: (message, datums or the reason they are
    refused, loss). `check_tokens(model_id, total)` (`Training.check_tokens`) refuses a
    running token count over the model's limit as the datums are read. A body that does not parse at all raises
    `BadBody`."""
    msg = tpb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError
        raise BadBody(f"body: not a tinker ForwardBackwardRequest protobuf ({exc})") from None
    try:
        return msg, _datums(msg, lambda total: check_tokens(msg.model_id, total)), _loss(msg)
    except (wire.WireError, BadBody, EngineError) as exc:
        return msg, exc, LossSpec(msg.loss_fn)


def provenance(msg: tpb.ForwardBackwardRequest) -> list[wire.Provenance | None]:
    """Each datum's provenance spans (`Datum.with_provenance`: `model_input_spans`,
    `loss_fn_input_spans`) as the codec's `Provenance`, None where a datum has none; a
    malformed span raises `WireError` naming datum and span."""
    out: list[wire.Provenance | None] = []
    for index, datum in enumerate(msg.data):
        fields = []
        for name in ("model_input_spans", "loss_fn_input_spans"):
            spans = getattr(datum, name)
            if len(spans) > wire.provenance.MAX_SPANS:
                raise wire.WireError(f"datum[{index}].{name}: {len(spans)} spans, over the "
                                     f"{wire.provenance.MAX_SPANS} one field may have")
            fields.append([_span(span, f"datum[{index}].{name}[{j}]")
                           for j, span in enumerate(spans)] or None)
        out.append(wire.make_provenance(*fields, index))
    return out


def _span(msg: tpb.ProvenanceSpan, where: str) -> wire.Span:
    arm = msg.WhichOneof("span")
    if arm is None:
        raise wire.WireError(f"{where}: neither prompt_tokens nor sampled_tokens is set")
    run = getattr(msg, arm)
    return wire.make_span(run.sequence_id, run.offset, run.length, arm == "sampled_tokens",
                          where)


def _loss(msg: tpb.ForwardBackwardRequest) -> LossSpec:
    config: dict[str, float] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise BadBody(f"loss_fn_config[{key!r}]: must be a number, got {value.text!r}")
        config[key] = value.number
    return LossSpec(msg.loss_fn, config)


def _datums(msg: tpb.ForwardBackwardRequest, check_tokens: Callable[[int], None]
            ) -> list[Datum]:
    datums, tokens = [], 0
    for index, datum in enumerate(msg.data):
        parts = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise BadBody(f"datum[{index}].model_input: only text (EncodedTextChunk) "
                              "inputs are supported")
            parts.append(np.frombuffer(chunk.encoded_text.tokens, np.int32))
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        tokens += ids.size
        check_tokens(tokens)
        inputs = {key: _tensor(value, f"datum[{index}].loss_fn_inputs[{key!r}]")
                  for key, value in datum.loss_fn_inputs.items()}
        narrowed = wire.narrow_datum(wire.encode_datum(ids, inputs, index), index)
        datums.append(Datum(narrowed.input_ids, narrowed.loss_inputs))
    return datums


def adam(body: Mapping[str, Any]) -> AdamParams:
    params = _field(body, "optim_params", dict, {}) or _field(body, "adam_params", dict, {})
    kind = params.get("type", "adam")
    if kind not in ("adam", "adamw"):
        raise BadBody(f"optim_params.type: {kind!r}; this server runs AdamW only")
    return AdamParams(learning_rate=number(params, "learning_rate", 1e-4),
                      beta1=number(params, "beta1", 0.9), beta2=number(params, "beta2", 0.95),
                      eps=number(params, "eps", 1e-12),
                      weight_decay=number(params, "weight_decay", 0.0),
                      grad_clip_norm=number(params, "grad_clip_norm", 0.0))


def prompt_tokens(body: Mapping[str, Any]) -> np.ndarray:
    prompt = _field(body, "prompt", dict, required=True)
    ids: list[int] = []
    for index, chunk in enumerate(_field(prompt, "chunks", list, [])):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise BadBody(f"prompt.chunks[{index}]: only text (encoded_text) chunks are "
                          "supported")
        ids.extend(_field(chunk, "tokens", list, []))
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadBody("prompt: token ids must be integers")
    too_big = next((t for t in ids if not -INT64_END <= t < INT64_END), None)
    if too_big is not None:
        raise BadBody(f"prompt: token id {too_big} is outside int64")
    return wire.token_array(np.asarray(ids, np.int64), "prompt").astype(np.int64)


def sampling_params(body: Mapping[str, Any]) -> SamplingParams:
    """The SDK's `sampling_params`; `stop` as Tinker reads it (`twinkle_wire.stop`)."""
    p = _field(body, "sampling_params", dict, {})
    stop = parse_stop(p.get("stop"))
    # max_tokens left out (or null) is 0, which the runtime reads as "to the context
    # limit"; given, it is at least 1 like every other count.
    return SamplingParams(max_tokens=integer(p, "max_tokens", 0, low=1,
                                             field="sampling_params.max_tokens"),
                          temperature=number(p, "temperature", 1.0),
                          top_p=number(p, "top_p", 1.0), top_k=integer(p, "top_k", -1),
                          stop_token_ids=stop.token_ids, stop_strings=stop.strings,
                          seed=seed(p, "seed", "sampling_params.seed"),
                          ignore_eos=not stop.on_eos)


# ----------------------------------------------------------------------------- responses


def _batched(arrays: list[np.ndarray], dtype: int) -> tpb.BatchedTensor:
    offsets = np.zeros(len(arrays) + 1, np.int64)
    np.cumsum([a.nbytes for a in arrays], out=offsets[1:])
    return tpb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays),
                             offsets=offsets.tobytes(), dtype=dtype,
                             trailing_shape=list(arrays[0].shape[1:]) if arrays else [])


def forward_output(result: ForwardOutput) -> bytes:
    """`ForwardBackwardOutput` protobuf: per-datum `logprobs`, one ArrayRecord per run of
    datums sharing a trailing shape, and the metrics."""
    out = tpb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=result.metrics)
    arrays = [np.ascontiguousarray(lp, np.float32) for lp in result.logprobs]
    start = 0
    while start < len(arrays):
        end = start + 1
        while end < len(arrays) and arrays[end].shape[1:] == arrays[start].shape[1:]:
            end += 1
        record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=end - start)
        record.fields["logprobs"].CopyFrom(_batched(arrays[start:end], tpb.DTYPE_FLOAT32))
        start = end
    return out.SerializeToString()


def sample_response(result: Any, include_prompt_logprobs: bool) -> tpb.SampleResponse:
    """The plain `SampleResponse` of the runtime's `SampleResult` (sequences, prompt
    logprobs and their top-k); `sampling_options.sample_response` adds the rest."""
    out = tpb.SampleResponse(prompt_cache_hit_tokens=result.prompt_cache_hit_tokens)
    for seq in result.sequences:
        out.sequences.add(stop_reason=_STOP.get(seq.stop_reason or "length",
                                                tpb.STOP_REASON_LENGTH),
                          tokens=np.asarray(seq.tokens, np.int32).tobytes(),
                          logprobs=np.asarray(seq.logprobs, np.float32).tobytes())
    scored = result.prompt_logprobs
    if scored is not None and include_prompt_logprobs:
        out.prompt_logprobs = np.asarray(scored.logprobs, np.float32).tobytes()
    if scored is not None and getattr(scored, "topk_token_ids", None) is not None:
        ids = np.asarray(scored.topk_token_ids, np.int32)
        if ids.size:
            out.topk_prompt_logprobs.CopyFrom(tpb.TopkLogprobs(
                token_ids=ids.tobytes(),
                logprobs=np.asarray(scored.topk_logprobs, np.float32).tobytes(),
                k=ids.shape[1], length=ids.shape[0]))
    return out


def _time(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat()


def tinker_path(row: CheckpointRow) -> str:
    return paths.tinker_path(row.run_id, row.checkpoint_id)


def checkpoint(row: CheckpointRow, run: RunRow | None) -> dict[str, Any]:
    """A checkpoint as the SDK's `Checkpoint`, with the base it was trained on (Tinker
    0.39's `Checkpoint.base_model`; older SDKs ignore the field)."""
    return {"checkpoint_id": row.checkpoint_id, "checkpoint_type": row.kind,
            "time": _time(row.created_at), "tinker_path": tinker_path(row),
            "size_bytes": row.size_bytes, "public": row.public,
            "user_metadata": dict(row.user_metadata) or None,
            "expires_at": None if row.expires_at is None else _time(row.expires_at),
            "base_model": run.base_model if run is not None else None}


def run(view: RunView) -> dict[str, Any]:
    r: RunRow = view.run
    return {"training_run_id": r.run_id, "base_model": r.base_model, "model_owner": r.tenant,
            "is_lora": True, "corrupted": False, "lora_rank": int(r.lora["rank"]),
            "last_request_time": _time(r.last_request_time or r.created_at),
            "last_checkpoint": (checkpoint(view.last_checkpoint, r)
                                if view.last_checkpoint else None),
            "last_sampler_checkpoint": (checkpoint(view.last_sampler_checkpoint, r)
                                        if view.last_sampler_checkpoint else None),
            "user_metadata": dict(r.user_metadata) or None}
