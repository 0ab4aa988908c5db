"""Conversions between `tinker.types` and the Twinkle client's plain values, at the edge only.

Requests and replies are built and read by `twinkle_client.api`; this module rearranges
fields between its values and Tinker's: Tinker `Datum`s -> wire datums (through
`wire.encode_datum`, the one codec), ModelInfo -> GetInfoResponse, Checkpoint -> tinker
Checkpoint with a `tinker://` path, SamplingParams -> the server's (including Tinker's
`stop` semantics), and the Twinkle input feature <-> Tinker Datum helpers.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np
from tinker import types
from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results
from tinker.types.topk_logprobs import TopkLogprobs

import twinkle_wire as wire
from twinkle_client import api
from twinkle_client.features import feature_to_loss_inputs, loss_inputs_to_feature
from twinkle_wire import paths
from twinkle_wire.stop import parse_stop

LOSS_FN_OUTPUT_TYPE = "ArrayRecord"
"""`ForwardBackwardOutput.loss_fn_output_type`: per-datum dicts of arrays."""


# ----------------------------------------------------------------------------- training


def encode_datums(data: Sequence[types.Datum]) -> list[wire.Datum]:
    """Encode Tinker datums for the wire; a bad datum raises `wire.WireError` naming it."""
    if isinstance(data, types.Datum) or not isinstance(data, Sequence):
        raise ValueError(f"data: expected a list of tinker.types.Datum, got {type(data).__name__}")
    encoded = []
    for index, datum in enumerate(data):
        if not isinstance(datum, types.Datum):
            raise wire.WireError(f"datum[{index}]: expected tinker.types.Datum, got "
                                 f"{type(datum).__name__}")
        encoded.append(encode_tinker_datum(datum, index))
    return encoded


def encode_tinker_datum(datum: Any, index: int = 0) -> wire.Datum:
    """Encode a `tinker.types.Datum` (text chunks only; sparse inputs are sent dense)."""
    try:
        tokens = datum.model_input.to_ints()
    except Exception as exc:
        raise wire.WireError(
            f"datum[{index}].model_input: only text (EncodedTextChunk) inputs are supported: {exc}"
        ) from None
    return wire.encode_datum(np.asarray(tokens, dtype=np.int64), datum.loss_fn_inputs, index)


def datum_provenance(data: Sequence[types.Datum]) -> list[wire.Provenance | None]:
    """Each datum's provenance (`Datum.with_provenance`: `model_input_spans` and
    `loss_fn_input_spans`) for the wire, None where a datum has none."""
    out: list[wire.Provenance | None] = []
    for index, datum in enumerate(data):
        fields = []
        for name in ("model_input_spans", "loss_fn_input_spans"):
            spans = getattr(datum, name, None)
            fields.append(None if spans is None else [
                wire.make_span(span.sequence_id, span.offset, span.length,
                               isinstance(span, types.SampledProvenanceSpan),
                               f"datum[{index}].{name}[{j}]")
                for j, span in enumerate(spans)])
        out.append(wire.make_provenance(*fields, index))
    return out


def tensor_data(array: np.ndarray) -> types.TensorData:
    """An array as a dense `TensorData` in the dtypes Tinker uses: int64 or float32."""
    if array.dtype.kind in "iu":
        return types.TensorData.from_numpy(array.astype(np.int64, copy=False))
    return types.TensorData.from_numpy(array.astype(np.float32, copy=False))


def loss_spec(loss_fn: str, config: Mapping[str, float | str] | None) -> api.Loss:
    """A loss by name with its numeric config (`clip_low_threshold`, `beta`, ...)."""
    if not isinstance(loss_fn, str) or not loss_fn:
        raise ValueError(f"loss_fn: expected a loss name such as 'cross_entropy', got {loss_fn!r}")
    numbers = {}
    for key, value in (config or {}).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"loss_fn_config[{key!r}]: must be a number, got {value!r}")
        numbers[key] = float(value)
    return api.Loss(loss_fn, numbers)


def forward_output(result: api.ForwardResult) -> types.ForwardBackwardOutput:
    """A decoded forward(_backward) result as Tinker's output: per-datum `logprobs`."""
    outputs = [{key: types.TensorData.from_numpy(np.asarray(value))
                for key, value in out.items()} for out in result.outputs]
    return types.ForwardBackwardOutput(loss_fn_output_type=LOSS_FN_OUTPUT_TYPE,
                                       loss_fn_outputs=outputs, metrics=dict(result.metrics))


def combine_outputs(parts: Sequence[types.ForwardBackwardOutput]) -> types.ForwardBackwardOutput:
    """Outputs of one batch sent as several ops, in datum order, metrics reduced by their
    `:sum`/`:mean`/... suffix exactly as tinker combines its own chunked requests."""
    return parts[0] if len(parts) == 1 else combine_fwd_bwd_output_results(parts)


def adam_spec(params: Any) -> api.AdamParams:
    """Tinker `AdamParams` for OptimStep; other optimizer families are refused by name."""
    if not isinstance(params, types.AdamParams):
        raise ValueError(f"optim_params: Twinkle servers run AdamW; pass tinker.types.AdamParams, "
                         f"got {type(params).__name__}")
    return api.AdamParams(learning_rate=params.learning_rate, beta1=params.beta1,
                          beta2=params.beta2, eps=params.eps, weight_decay=params.weight_decay,
                          grad_clip_norm=params.grad_clip_norm)


def info_to_tinker(info: api.ModelInfo) -> types.GetInfoResponse:
    return types.GetInfoResponse(
        type="get_info", model_id=info.model_id, is_lora=info.is_lora,
        lora_rank=info.lora_rank, model_name=info.base_model,
        model_data=types.ModelData(arch=info.arch, model_name=info.base_model,
                                   tokenizer_id=info.tokenizer_id or info.base_model))


def capabilities_to_tinker(caps: api.Capabilities) -> types.GetServerCapabilitiesResponse:
    return types.GetServerCapabilitiesResponse(supported_models=[
        types.SupportedModel(model_name=m.name, max_context_length=m.max_context_length,
                             trainable=m.trainable, sampleable=m.sampleable)
        for m in caps.models])


# ----------------------------------------------------------------------------- runs


def tinker_path(path: str) -> str:
    """The `tinker://` form of a `twinkle://` or `tinker://` checkpoint path."""
    return paths.parse(path).tinker()


def _time(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=timezone.utc)


def checkpoint_to_tinker(ckpt: api.Checkpoint) -> types.Checkpoint:
    return types.Checkpoint(checkpoint_id=ckpt.checkpoint_id,
                            checkpoint_type=ckpt.checkpoint_type, time=_time(ckpt.created_at),
                            tinker_path=tinker_path(ckpt.path), size_bytes=ckpt.size_bytes,
                            user_metadata=dict(ckpt.user_metadata) or None,
                            public=ckpt.public,
                            expires_at=_time(ckpt.expires_at) if ckpt.expires_at else None)


def run_to_tinker(run: api.TrainingRun) -> types.TrainingRun:
    return types.TrainingRun(
        training_run_id=run.run_id, base_model=run.base_model, model_owner=run.owner,
        is_lora=run.is_lora, corrupted=run.corrupted, lora_rank=run.lora_rank,
        last_request_time=_time(run.last_request_time or run.created_at),
        last_checkpoint=(checkpoint_to_tinker(run.last_checkpoint)
                         if run.last_checkpoint is not None else None),
        last_sampler_checkpoint=(checkpoint_to_tinker(run.last_sampler_checkpoint)
                                 if run.last_sampler_checkpoint is not None else None),
        user_metadata=dict(run.user_metadata) or None)


def cursor(offset: int, limit: int, total: int) -> types.Cursor:
    return types.Cursor(offset=offset, limit=limit, total_count=total)


# ----------------------------------------------------------------------------- sampling


class Refused(ValueError):
    """A value the server refuses that the wire cannot carry to it: the caller answers
    it as the server's refusal (`BadRequestError`), as the stock SDK gets it."""


def prompt_tokens(prompt: types.ModelInput, field: str = "prompt") -> np.ndarray:
    """The prompt's token ids as an int32 array, checked; only text chunks are supported
    (an empty prompt is the server's to refuse)."""
    if not isinstance(prompt, types.ModelInput):
        raise ValueError(f"{field}: expected tinker.types.ModelInput, got {type(prompt).__name__}")
    try:
        tokens = prompt.to_ints()
    except Exception as exc:
        raise ValueError(f"{field}: only text (EncodedTextChunk) inputs are supported: {exc}"
                         ) from None
    return wire.token_array(np.asarray(tokens, dtype=np.int64), field).astype(np.int32)


def sampling_spec(params: types.SamplingParams) -> api.SamplingParams:
    """Tinker's SamplingParams for the server.

    `stop` as Tinker reads it (`twinkle_wire.stop`; `[]`, no stop at all, is the
    server's `ignore_eos`). `top_k=-1` means no limit.
    """
    if not isinstance(params, types.SamplingParams):
        raise ValueError(f"sampling_params: expected tinker.types.SamplingParams, got "
                         f"{type(params).__name__}")
    if params.max_tokens is not None and params.max_tokens < 1:
        # The wire's 0 means "to the context limit": refused here, as the server would.
        raise Refused(f"sampling_params.max_tokens: must be >= 1, got {params.max_tokens}")
    stop = parse_stop(params.stop)
    return api.SamplingParams(max_tokens=params.max_tokens or 0,
                              temperature=params.temperature, top_p=params.top_p,
                              top_k=params.top_k, stop_strings=stop.strings,
                              stop_token_ids=stop.token_ids, seed=params.seed,
                              ignore_eos=not stop.on_eos)


def logprobs_list(values: np.ndarray) -> list[float | None]:
    """Per-token logprobs as Tinker lists them: None where none was computed (NaN)."""
    return [None if math.isnan(v) else v for v in np.asarray(values, np.float64).tolist()]


def sample_response_to_tinker(result: api.SampleResult, include_prompt_logprobs: bool
                              ) -> types.SampleResponse:
    sequences = [
        types.SampledSequence(
            stop_reason=seq.stop_reason or "length",
            sequence_id=seq.sequence_id or uuid.uuid4().hex,   # an older server sends none
            tokens_np=seq.tokens.astype(np.int32), logprobs_np=seq.logprobs.astype(np.float32))
        for seq in result.sequences]
    prompt_logprobs = None
    if include_prompt_logprobs and result.prompt_logprobs is not None:
        prompt_logprobs = result.prompt_logprobs.astype(np.float32)
    topk = None
    if result.topk_token_ids is not None:
        topk = TopkLogprobs(token_ids=result.topk_token_ids.astype(np.int32),
                            logprobs=result.topk_logprobs.astype(np.float32))
    return types.SampleResponse(sequences=sequences, prompt_logprobs_np=prompt_logprobs,
                                topk_prompt_logprobs_np=topk,
                                prompt_cache_hit_tokens=result.prompt_cache_hit_tokens)


# ----------------------------------------------------------------------------- features


def input_feature_to_datum(feature: Mapping[str, Any]) -> types.Datum:
    """A Twinkle input feature (`input_ids` + shifted `labels`, -100 = no loss) as a Tinker
    Datum (`target_tokens`, `weights`; RL extras `logprobs`, `advantages`).

    Args:
        feature: one sequence: `input_ids` [T] and `labels` [T] (lists, numpy or torch).

    Returns:
        The `tinker.types.Datum` to pass to `forward_backward`.

    Example:
        datum = input_feature_to_datum({"input_ids": [5, 6, 7], "labels": [-100, 7, 2]})
        datum.loss_fn_inputs["weights"].tolist()   # [0.0, 1.0, 1.0]
    """
    ids, inputs = feature_to_loss_inputs(feature)
    if ids.ndim != 1:
        raise ValueError(f"feature.input_ids: one sequence of shape [T] expected, got shape "
                         f"{list(ids.shape)}; convert a batch feature by feature")
    return types.Datum(model_input=types.ModelInput.from_ints(ids.astype(np.int64).tolist()),
                       loss_fn_inputs={key: types.TensorData.from_numpy(value)
                                       for key, value in inputs.items()})


def datum_to_input_feature(datum: types.Datum) -> dict[str, np.ndarray]:
    """A Tinker Datum as a Twinkle input feature: the inverse of `input_feature_to_datum`.

    Example:
        feature = datum_to_input_feature(datum)
        feature["labels"].tolist()   # [-100, 7, 2]
    """
    ids = np.asarray(datum.model_input.to_ints(), dtype=np.int64)
    inputs = {key: value.to_numpy() for key, value in datum.loss_fn_inputs.items()}
    return loss_inputs_to_feature(ids, inputs)
