"""The SDK's sampling options beyond plain sampling, read from an `asample` body and
added to its protobuf `SampleResponse`.

- `topk_sample_logprobs` k: each sequence's `topk_sampled_logprobs` (`[n, k]`).
- `target_prompt_logprobs`: an int64 `TensorData` `[len(prompt) - 1, K]` in JSON, dense or
  sparse CSR (unlisted cells = -1: the SDK builds it with `from_torch_sparse(ids,
  pad_value=-1)`); answered as a float32 `Tensor` in the request's own layout, as the SDK
  documents ("the same shape and layout"), 0.0 where the request had -1.
- `prompt_alt_tokens_k` k: `prompt_alt_tokens`, two `[len(prompt) - 1, k]` tensors.
- `prompt_logprobs_last_n` N: prompt (and top-k) logprobs of the last N tokens only.

The limits are the engine's (`engine.checks`), checked once by `runtime.sampling` before
the request is queued, so a bad option is a 400 naming the field, not a failed future.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as tpb

from twinkle_server.engine import PromptScoring
from twinkle_server.http import convert
from twinkle_server.http.errors import BadBody

FIELD = "target_prompt_logprobs"


@dataclass(frozen=True)
class SampleOptions:
    """The options of one `asample` request; `csr` is the target table's
    `(crow_indices, col_indices)` when it came sparse (the answer's layout)."""

    topk_sample_logprobs: int
    prompt: PromptScoring
    csr: tuple[np.ndarray, np.ndarray] | None = None


def read(body: Mapping[str, Any]) -> SampleOptions:
    """The body's options as the runtime's values; their limits are checked by
    `runtime.sampling` with the rest of the request.

    Raises:
        BadBody: a field of the wrong form, named.
    """
    targets, csr = _targets(body.get(FIELD))
    prompt = PromptScoring(last_n=convert.integer(body, "prompt_logprobs_last_n"),
                           targets=targets,
                           alt_k=convert.integer(body, "prompt_alt_tokens_k", 0) or 0)
    return SampleOptions(convert.integer(body, "topk_sample_logprobs", 0) or 0, prompt, csr)


def _ints(values: Any, field: str) -> np.ndarray:
    if not isinstance(values, list):
        raise BadBody(f"{field}: expected a list of integers")
    array = np.asarray(values)
    if array.size and (array.dtype.kind != "i" or array.ndim != 1):
        raise BadBody(f"{field}: expected a flat list of integers")
    return array.astype(np.int64)


def _targets(raw: Any) -> tuple[np.ndarray | None, tuple[np.ndarray, np.ndarray] | None]:
    """The id table, dense int64 with -1 in unlisted cells, and its CSR indices if sparse."""
    if raw is None:
        return None, None
    if not isinstance(raw, dict):
        raise BadBody(f"{FIELD}: expected a TensorData object")
    if raw.get("dtype") != "int64":
        raise BadBody(f"{FIELD}: dtype must be int64 (token ids), got {raw.get('dtype')!r}")
    shape = raw.get("shape")
    if (not isinstance(shape, list) or len(shape) != 2
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                       for d in shape)):
        raise BadBody(f"{FIELD}: shape must be [len(prompt) - 1, K], got {shape!r}")
    if math.prod(shape) > convert.MAX_SPARSE_ELEMENTS:
        raise BadBody(f"{FIELD}: shape {shape} has more than {convert.MAX_SPARSE_ELEMENTS} "
                      "cells")
    values = _ints(raw.get("data"), f"{FIELD}.data")
    crow_raw, col_raw = raw.get("sparse_crow_indices"), raw.get("sparse_col_indices")
    if crow_raw is None and col_raw is None:
        if values.size != math.prod(shape):
            raise BadBody(f"{FIELD}: shape {shape} needs {math.prod(shape)} values, got "
                          f"{values.size}")
        return values.reshape(shape), None
    crow = _ints(crow_raw, f"{FIELD}.sparse_crow_indices")
    col = _ints(col_raw, f"{FIELD}.sparse_col_indices")
    rows, width = shape
    if (crow.size != rows + 1 or col.size != values.size or crow[0] != 0
            or crow[-1] != values.size or np.any(np.diff(crow) < 0)
            or np.any((col < 0) | (col >= width))):
        raise BadBody(f"{FIELD}: inconsistent sparse CSR indices for shape {shape}")
    dense = np.full(shape, -1, np.int64)
    dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return dense, (crow, col)


def _tensor(array: np.ndarray, dtype: int) -> tpb.Tensor:
    return tpb.Tensor(dense=np.ascontiguousarray(array).tobytes(), dtype=dtype,
                      shape=list(array.shape))


def sample_response(result: Any, include_prompt_logprobs: bool,
                    options: SampleOptions) -> bytes:
    """The `SampleResponse` bytes of `result`: the plain response (`convert`) with what
    `options` asked for added, serialized once."""
    out = convert.sample_response(result, include_prompt_logprobs)
    if options.topk_sample_logprobs:
        for msg, seq in zip(out.sequences, result.sequences, strict=True):
            ids = np.asarray(seq.topk_token_ids, np.int32)
            msg.topk_sampled_logprobs.CopyFrom(tpb.TopkLogprobs(
                token_ids=ids.tobytes(),
                logprobs=np.asarray(seq.topk_logprobs, np.float32).tobytes(),
                k=ids.shape[1], length=ids.shape[0]))
    scored = result.prompt_logprobs
    if scored is None:
        return out.SerializeToString()
    if scored.target_logprobs is not None:
        logprobs = np.asarray(scored.target_logprobs, np.float32)
        if options.csr is None:
            out.target_prompt_logprobs.CopyFrom(_tensor(logprobs, tpb.DTYPE_FLOAT32))
        else:
            crow, col = options.csr
            rows = np.repeat(np.arange(logprobs.shape[0]), np.diff(crow))
            out.target_prompt_logprobs.CopyFrom(tpb.Tensor(
                sparse_csr=tpb.SparseCsr(values=logprobs[rows, col].tobytes(),
                                         crow_indices=crow.tobytes(),
                                         col_indices=col.tobytes()),
                dtype=tpb.DTYPE_FLOAT32, shape=list(logprobs.shape)))
    if scored.alt_tokens is not None:
        out.prompt_alt_tokens.CopyFrom(tpb.PromptAltTokens(
            tokens=_tensor(np.asarray(scored.alt_tokens, np.int64), tpb.DTYPE_INT64),
            logprobs=_tensor(np.asarray(scored.alt_logprobs, np.float32),
                             tpb.DTYPE_FLOAT32)))
    return out.SerializeToString()
