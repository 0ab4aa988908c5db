"""How a Tinker forward request becomes ops on a Twinkle training model.

The server refuses a request over its `--max-batch-tokens`, so a bigger batch is split
into consecutive groups (`split`), each one op whose gradients accumulate exactly as one
op's would; every group is packed before any seq_id is taken (`pack`). `run_ops` sends
the groups in order under their reserved seq_ids and, if one fails, releases the rest so
the model's later ops do not wait; the server names a datum by its index in its op, which
`run_ops` turns back into its index in the caller's batch. A custom loss (`run_custom`) is tinker's two passes: a
forward for the logprobs, the user's torch loss on them here, then a cross_entropy
forward_backward whose weights carry exactly that loss's gradient.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from tinker import types

import twinkle_wire as wire
from tinker_compat import convert
from twinkle_client import api
from twinkle_client.connection import Connection, Op
from twinkle_client.errors import TwinkleError, category_of

if TYPE_CHECKING:
    import torch

CustomLossFn = Callable[[list[types.Datum], list["torch.Tensor"]],
                        tuple["torch.Tensor", dict[str, float]]]
"""(data, per-datum logprob tensors) -> (scalar loss, metrics), as tinker's CustomLossFnV1."""

SURROGATE = api.Loss("cross_entropy")
"""The loss both passes of a custom loss run on the server."""

_DATUM_INDEX = re.compile(r"\bdatum\[(\d+)\]")
"""How the server's messages name a datum: `datum[<index in its op>]`."""


@dataclass(frozen=True)
class Ops:
    """A request split into ops: each op's datum range in the request and its call, packed."""

    bounds: list[tuple[int, int]]
    calls: list[api.OpCall[api.ForwardResult]]


def split(datums: Sequence[wire.Datum], max_batch_tokens: int) -> list[tuple[int, int]]:
    """Where consecutive groups of datums start and end, each group within the
    server's per-request token limit (0: no limit): one op per group."""
    budget = max_batch_tokens
    bounds, start, tokens = [], 0, 0
    for index, datum in enumerate(datums):
        length = datum.num_tokens
        if index > start and budget and tokens + length > budget:
            bounds.append((start, index))
            start, tokens = index, 0
        tokens += length
    bounds.append((start, len(datums)))
    return bounds


def pack(datums: list[wire.Datum], bounds: list[tuple[int, int]], loss: api.Loss,
         backward: bool, provenance: Sequence[wire.Provenance | None] | None = None) -> Ops:
    """Each group's datums packed as one op (errors name datums by their index in the
    whole request), with their provenance when any datum has some."""
    if provenance is not None and not any(p is not None for p in provenance):
        provenance = None
    return Ops(bounds, [api.forward(datums[a:b], loss, backward, first=a,
                                    provenance=None if provenance is None else provenance[a:b])
                        for a, b in bounds])


def run_ops(conn: Connection, reserved: list[Op], ops: Ops) -> types.ForwardBackwardOutput:
    """Send each group as its op, in order; if one fails, the rest are released and its
    error names datums by their index in the whole request."""
    parts = []
    for index, (op, call) in enumerate(zip(reserved, ops.calls, strict=True)):
        try:
            parts.append(convert.forward_output(call.send(conn, op)))
        except BaseException as exc:
            for later in reserved[index + 1:]:
                api.release(conn, later)
            first = ops.bounds[index][0]
            if first and isinstance(exc, TwinkleError) and _DATUM_INDEX.search(exc.message):
                raise _counted_from(conn, exc, first) from None
            raise
    return convert.combine_outputs(parts)


def _counted_from(conn: Connection, error: TwinkleError, first: int) -> Exception:
    """`error` of an op whose datums start at `first` in the request, its datums named by
    their index in the request."""
    message = _DATUM_INDEX.sub(lambda m: f"datum[{int(m[1]) + first}]", error.message)
    return conn.error_factory(category_of(error.code), message, error.method)


def surrogate_data(data: Sequence[types.Datum]) -> list[types.Datum]:
    """The custom loss's forward pass datums: each datum's tokens and targets, with its
    weights (zero if it has none); `target_tokens` is required."""
    forward_data = []
    for index, datum in enumerate(data):
        targets = datum.loss_fn_inputs.get("target_tokens")
        if targets is None:
            raise ValueError(f"datum[{index}].loss_fn_inputs: 'target_tokens' is required "
                             "by forward_backward_custom")
        weights = datum.loss_fn_inputs.get("weights")
        if weights is None:
            weights = types.TensorData.from_numpy(np.zeros(targets.to_numpy().shape,
                                                           np.float32))
        forward_data.append(types.Datum(model_input=datum.model_input, loss_fn_inputs={
            "target_tokens": targets, "weights": weights}))
    return forward_data


def run_custom(conn: Connection, data: list[types.Datum], loss_fn: CustomLossFn, ops: Ops,
               forward_ops: list[Op], backward_ops: list[Op]) -> types.ForwardBackwardOutput:
    """Both passes of a custom loss under their reserved seq_ids; if the forward pass or
    the user's loss fails, the backward pass's seq_ids are released."""
    try:
        forward = run_ops(conn, forward_ops, ops)
        linear_data, metrics, loss_sum = _custom_loss(data, loss_fn, forward)
        backward = pack(convert.encode_datums(linear_data), ops.bounds, SURROGATE,
                        backward=True)
    except BaseException:
        for op in backward_ops:
            api.release(conn, op)
        raise
    result = run_ops(conn, backward_ops, backward)
    result.metrics["surrogate_loss:sum"] = result.metrics.pop("loss:sum")
    result.metrics.update(metrics)
    result.metrics["loss:sum"] = loss_sum
    return result


def _custom_loss(data: list[types.Datum], loss_fn: CustomLossFn,
                 forward: types.ForwardBackwardOutput
                 ) -> tuple[list[types.Datum], dict[str, float], float]:
    """Run the user's loss on the forward logprobs; returns the cross_entropy datums whose
    gradient equals the loss's (`weights = -dLoss/dlogprobs`), its metrics and its value."""
    import torch

    logprobs = [torch.tensor(out["logprobs"].to_numpy(), requires_grad=True)
                for out in forward.loss_fn_outputs]
    loss, metrics = loss_fn(data, logprobs)
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        raise ValueError("loss_fn: must return (loss, metrics) with loss a tensor computed "
                         "from the logprobs it was given")
    loss_sum = float(loss.detach().sum().item())
    loss.backward()
    linear = []
    for index, (datum, lp) in enumerate(zip(data, logprobs, strict=True)):
        if lp.grad is None:
            raise ValueError(f"loss_fn: no gradient reached datum[{index}]'s logprobs; compute "
                             "the loss from the logprobs tensors it is given")
        linear.append(types.Datum(model_input=datum.model_input, loss_fn_inputs={
            "target_tokens": datum.loss_fn_inputs["target_tokens"],
            # Server CE is L = -sum(logprobs * weights), so weights = -dC/dlogprobs.
            "weights": types.TensorData.from_torch(-lp.grad.detach().float())}))
    return linear, {k: float(v) for k, v in metrics.items()}, loss_sum
