"""Tinker's sampling options beyond plain sampling, between `tinker.types` and the wire.

`SamplingClient.sample` accepts what the stock SDK's does: `topk_sample_logprobs`,
`target_prompt_logprobs` (an int64 `TensorData` `[len(prompt) - 1, K]`, dense or sparse
CSR, -1 = no id), `prompt_alt_tokens_k` and `prompt_logprobs_last_n`. The wire carries the
id table dense (-1 where a sparse table lists nothing); the answer comes back in the
request's own layout, as the SDK's does: a sparse request gets a sparse answer with the
same indices.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from tinker import types
from tinker.types.prompt_alt_tokens import PromptAltTokens
from tinker.types.topk_logprobs import TopkLogprobs

from twinkle_client import api
from twinkle_client.errors import require_int


def check(*, topk_sample_logprobs: int, prompt_alt_tokens_k: int,
          prompt_logprobs_last_n: int | None, include_prompt_logprobs: bool,
          target_prompt_logprobs: types.TensorData | None) -> None:
    """Refuse at once what the SDK refuses before sending (the server checks the limits
    that depend on the prompt and on its own caps)."""
    require_int(topk_sample_logprobs, "topk_sample_logprobs", minimum=0)
    require_int(prompt_alt_tokens_k, "prompt_alt_tokens_k", minimum=0)
    if prompt_logprobs_last_n is not None:
        require_int(prompt_logprobs_last_n, "prompt_logprobs_last_n", minimum=1)
        if not include_prompt_logprobs:
            raise ValueError("prompt_logprobs_last_n applies to prompt logprobs; set "
                             "include_prompt_logprobs")
    if target_prompt_logprobs is not None:
        if target_prompt_logprobs.dtype != "int64":
            raise ValueError("target_prompt_logprobs must be an int64 tensor of token ids, "
                             f"got {target_prompt_logprobs.dtype}")
        shape = target_prompt_logprobs.shape
        if shape is None or len(shape) != 2:
            raise ValueError("target_prompt_logprobs must be 2-D, [len(prompt) - 1, K], "
                             f"got shape {shape}")


def dense_targets(targets: types.TensorData) -> np.ndarray:
    """The id table as a dense int64 array, -1 wherever a sparse table lists nothing."""
    shape = [int(d) for d in targets.shape or []]
    values = np.asarray(targets.data, np.int64)
    if targets.sparse_crow_indices is None:
        return values.reshape(shape)
    crow = np.asarray(targets.sparse_crow_indices, np.int64)
    col = np.asarray(targets.sparse_col_indices, np.int64)
    dense = np.full(shape, -1, np.int64)
    dense[np.repeat(np.arange(shape[0]), np.diff(crow)), col] = values
    return dense


def in_layout(logprobs: np.ndarray, request: types.TensorData) -> types.TensorData:
    """`logprobs` (float32, the request's dense shape) in the request's layout."""
    logprobs = np.asarray(logprobs, np.float32)
    if request.sparse_crow_indices is None:
        return types.TensorData.from_numpy(logprobs)
    crow = np.asarray(request.sparse_crow_indices, np.int64)
    col = np.asarray(request.sparse_col_indices, np.int64)
    rows = np.repeat(np.arange(logprobs.shape[0]), np.diff(crow))
    return types.TensorData(data=logprobs[rows, col], dtype="float32",
                            shape=list(logprobs.shape),
                            sparse_crow_indices=list(request.sparse_crow_indices),
                            sparse_col_indices=list(request.sparse_col_indices))


def extend_response(response: types.SampleResponse, result: api.SampleResult,
                    target_request: types.TensorData | None) -> types.SampleResponse:
    """`response` with what the options asked for: each sequence's `topk_logprobs_np`,
    `target_prompt_logprobs` (in `target_request`'s layout) and `prompt_alt_tokens`."""
    sequences = [
        dataclasses.replace(seq, topk_logprobs_np=TopkLogprobs(
            token_ids=np.asarray(out.topk_token_ids, np.int32),
            logprobs=np.asarray(out.topk_logprobs, np.float32)))
        if out.topk_token_ids is not None else seq
        for seq, out in zip(response.sequences, result.sequences, strict=True)]
    extra: dict = {"sequences": sequences}
    if result.target_logprobs is not None and target_request is not None:
        extra["target_prompt_logprobs"] = in_layout(result.target_logprobs, target_request)
    if result.alt_tokens is not None:
        extra["prompt_alt_tokens"] = PromptAltTokens(
            tokens=types.TensorData.from_numpy(np.asarray(result.alt_tokens, np.int64)),
            logprobs=types.TensorData.from_numpy(np.asarray(result.alt_logprobs, np.float32)))
    return dataclasses.replace(response, **extra)
