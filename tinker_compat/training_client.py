"""Tinker's `TrainingClient` over a Twinkle training model (one LoRA adapter).

Every method reserves its op's `seq_id` in the calling thread, in call order, then sends
the op from the connection's call pool and returns a future at once. The server runs a
model's ops strictly in seq_id order, so `forward_backward(...)` then `optim_step(...)`
submitted before waiting on either is correct, and faster than waiting in between.

A reserved seq_id must always reach the server, or the model's later ops would wait for
it: when an op cannot be sent (its batch failed to encode after reservation, the user's
custom loss raised), a cheap read-only op (`GetTrainConfigs`) is sent in its place.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from tinker import types

from tinker_compat import convert
from tinker_compat.futures import APIFuture, ClientFuture, client_future, deprecated
from tinker_compat.sampling_client import (
    SamplingClient,
    SamplingClientFuture,
    check_sampling_options,
    open_sampling_client,
    submit_sampling_client,
)
from twinkle_client import paths, wire
from twinkle_client._proto.twinkle.v1 import common_pb2 as pb
from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb
from twinkle_client.connection import Connection
from twinkle_client.tokenizer import load_tokenizer

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

CustomLossFn = Callable[[list[types.Datum], list["torch.Tensor"]],
                        tuple["torch.Tensor", dict[str, float]]]
"""(data, per-datum logprob tensors) -> (scalar loss, metrics), as tinker's CustomLossFnV1."""

_SURROGATE = pb.LossFn(name="cross_entropy")


def _moved(method: str, advice: str) -> str:
    return (f"DEPRECATED: TrainingClient.{method}_async() is deprecated. Use "
            f"TrainingClient.{method}(...) instead: {advice}")


_AT_ONCE = ("it returns an APIFuture at once; submit the requests that follow, then await "
            "the future or call .result() on it.")


@dataclass(frozen=True)
class Ops:
    """A request split into ops: each op's datum range in the request and its packed
    stream chunks."""

    bounds: list[tuple[int, int]]
    chunks: list[list[tpb.ForwardChunk]]


class TrainingClient:
    """Trains one LoRA adapter: forward/backward passes, optimizer steps, checkpoints.

    You get one from `service_client.create_lora_training_client(...)`.

    Example:
        training_client = service_client.create_lora_training_client(base_model="tiny").result()
        fwdbwd_future = training_client.forward_backward(data, "cross_entropy")
        optim_future = training_client.optim_step(types.AdamParams(learning_rate=1e-4))
        fwdbwd_result = fwdbwd_future.result()  # wait for gradients
        optim_result = optim_future.result()    # wait for the update
    """

    def __init__(self, connection: Connection, info: tpb.ModelInfo) -> None:
        self._conn = connection
        self.model_id: str = info.model_id
        self._base_model = info.base_model
        self._info = convert.info_to_tinker(info)
        # The server refuses a request over this many tokens; bigger batches are sent as
        # several consecutive ops, whose gradients accumulate exactly as one would.
        self._max_batch_tokens = int(connection.capabilities().limits.max_batch_tokens)

    def __repr__(self) -> str:
        return f"<TrainingClient {self.model_id} on {self._base_model}>"

    # ------------------------------------------------------------------ forward passes

    def forward(self, data: list[types.Datum], loss_fn: types.LossFnType,
                loss_fn_config: Mapping[str, float | str] | None = None
                ) -> APIFuture[types.ForwardBackwardOutput]:
        """Compute the loss and per-token logprobs without gradients.

        Args:
        - `data`: list of training datums
        - `loss_fn`: loss name ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
        - `loss_fn_config`: optional numeric loss config (e.g. clip thresholds)

        Returns:
        - `APIFuture` of the `ForwardBackwardOutput`: `loss_fn_outputs[i]["logprobs"]` per
          datum and `metrics` such as `loss:sum`.

        Example:
        ```python
        result = training_client.forward(data, "cross_entropy").result()
        print(result.metrics["loss:sum"])
        ```
        """
        return self._forward(data, loss_fn, loss_fn_config, backward=False)

    @deprecated(_moved("forward", _AT_ONCE))
    async def forward_async(self, data: list[types.Datum], loss_fn: types.LossFnType,
                            loss_fn_config: Mapping[str, float | str] | None = None
                            ) -> APIFuture[types.ForwardBackwardOutput]:
        """Deprecated: use `training_client.forward(...)`."""
        return self.forward(data, loss_fn, loss_fn_config)

    def forward_backward(self, data: list[types.Datum], loss_fn: types.LossFnType,
                         loss_fn_config: Mapping[str, float | str] | None = None
                         ) -> APIFuture[types.ForwardBackwardOutput]:
        """Compute the loss and accumulate its gradients (until the next `optim_step`).

        Args:
        - `data`: list of training datums of any total size (streamed in chunks; split
          into several ops above the server's `--max-batch-tokens`)
        - `loss_fn`: "cross_entropy", "importance_sampling", "ppo", "cispo" or "dro"
        - `loss_fn_config`: optional numeric loss config, e.g.
          `{"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}` for ppo

        Returns:
        - `APIFuture` of the `ForwardBackwardOutput`, outputs in datum order.

        Example:
        ```python
        fwdbwd_future = training_client.forward_backward(data, "cross_entropy")
        optim_future = training_client.optim_step(types.AdamParams(learning_rate=1e-4))
        print(fwdbwd_future.result().metrics["loss:sum"])
        ```
        """
        return self._forward(data, loss_fn, loss_fn_config, backward=True)

    @deprecated(_moved("forward_backward", _AT_ONCE))
    async def forward_backward_async(self, data: list[types.Datum], loss_fn: types.LossFnType,
                                     loss_fn_config: Mapping[str, float | str] | None = None
                                     ) -> APIFuture[types.ForwardBackwardOutput]:
        """Deprecated: use `training_client.forward_backward(...)`; awaiting this gives the
        future, which is awaited again (`await (await tc.forward_backward_async(...))`)."""
        return self.forward_backward(data, loss_fn, loss_fn_config)

    def forward_backward_custom(self, data: list[types.Datum], loss_fn: CustomLossFn
                                ) -> APIFuture[types.ForwardBackwardOutput]:
        """Forward/backward with a loss computed here, in torch, on the returned logprobs.

        As tinker does it: a forward pass returns each datum's logprobs; `loss_fn(data,
        logprobs_list)` runs locally on tensors that require grad; then a cross_entropy
        forward_backward with `weights = -dLoss/dlogprobs` puts exactly that gradient into
        the adapter. Both passes take their seq_ids now, so later ops queue behind them.

        Args:
        - `data`: datums with `target_tokens` (and any extra fields the loss reads)
        - `loss_fn`: `(data, logprobs_list) -> (loss, metrics)`

        Returns:
        - `APIFuture` of the `ForwardBackwardOutput`; `metrics["loss:sum"]` is the custom
          loss, `metrics["surrogate_loss:sum"]` the cross_entropy surrogate's.

        Example:
        ```python
        def loss_fn(data, logprobs_list):
            loss = -sum(lp.sum() for lp in logprobs_list)
            return loss, {"custom:sum": loss.item()}
        result = training_client.forward_backward_custom(data, loss_fn).result()
        ```
        """
        if not callable(loss_fn):
            raise ValueError(f"loss_fn: expected a callable (data, logprobs) -> (loss, metrics), "
                             f"got {type(loss_fn).__name__}")
        if not data:
            raise ValueError("No data provided")
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
        ops = self._pack(forward_data, "Forward")
        if isinstance(ops, APIFuture):
            return ops
        forward_ops = [self._conn.op(self.model_id) for _ in ops.bounds]
        backward_ops = [self._conn.op(self.model_id) for _ in ops.bounds]
        return self._conn.submit(self._run_custom, list(data), loss_fn, ops, forward_ops,
                                 backward_ops, future_class=APIFuture)

    @deprecated(_moved("forward_backward_custom", _AT_ONCE))
    async def forward_backward_custom_async(self, data: list[types.Datum], loss_fn: CustomLossFn
                                            ) -> APIFuture[types.ForwardBackwardOutput]:
        """Deprecated: use `training_client.forward_backward_custom(...)`."""
        return self.forward_backward_custom(data, loss_fn)

    # ------------------------------------------------------------------ optimizer

    def optim_step(self, optim_params: types.AdamParams | None = None, *,
                   adam_params: types.AdamParams | None = None
                   ) -> APIFuture[types.OptimStepResponse]:
        """Apply the accumulated gradients with AdamW (exactly these hyper-parameters,
        decoupled weight decay, `grad_clip_norm` 0 = off), then zero them.

        Args:
        - `optim_params`: `types.AdamParams`
        - `adam_params`: legacy keyword alias; not together with `optim_params`

        Returns:
        - `APIFuture` of the `OptimStepResponse` with `metrics` (grad_norm, learning_rate, step)

        Example:
        ```python
        training_client.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        ```
        """
        if optim_params is not None and adam_params is not None:
            raise ValueError("Specify optim_params or legacy adam_params, not both")
        adam = convert.adam_to_proto(optim_params if optim_params is not None else adam_params)
        header = self._conn.op(self.model_id)

        def run() -> types.OptimStepResponse:
            reply = self._conn.call(self._conn.training.OptimStep,
                                    tpb.OptimStepRequest(op=header, adam=adam))
            return types.OptimStepResponse(metrics=dict(reply.metrics))

        return self._conn.submit(run, future_class=APIFuture)

    @deprecated(_moved("optim_step", _AT_ONCE))
    async def optim_step_async(self, optim_params: types.AdamParams | None = None, *,
                               adam_params: types.AdamParams | None = None
                               ) -> APIFuture[types.OptimStepResponse]:
        """Deprecated: use `training_client.optim_step(...)`."""
        return self.optim_step(optim_params, adam_params=adam_params)

    # ------------------------------------------------------------------ checkpoints

    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                   user_metadata: dict[str, str] | None = None
                   ) -> APIFuture[types.SaveWeightsResponse]:
        """Save the adapter weights and optimizer state as `tinker://<run>/weights/<name>`.

        Args:
        - `name`: 1-128 letters, digits, '.', '_', '-'
        - `ttl_seconds`: accepted for compatibility; Twinkle checkpoints do not expire
        - `overwrite`: replace a checkpoint of the same name (without it, saving a name
          again is a `ConflictError`); the new checkpoint is complete before the old goes
        - `user_metadata`: stored with the checkpoint

        Returns:
        - `APIFuture` of the `SaveWeightsResponse` with the checkpoint's `path`

        Example:
        ```python
        path = training_client.save_state("step-100").result().path
        ```
        """
        self._warn_ttl(ttl_seconds)
        request = tpb.SaveRequest(name=paths.check_name(name, "name"), include_optimizer=True,
                                  user_metadata=user_metadata or {}, overwrite=overwrite)
        request.op.CopyFrom(self._conn.op(self.model_id))

        def run() -> types.SaveWeightsResponse:
            reply = self._conn.call(self._conn.training.SaveState, request)
            return types.SaveWeightsResponse(path=convert.tinker_path(reply.path),
                                             type="save_weights")

        return self._conn.submit(run, future_class=APIFuture)

    @deprecated(_moved("save_state", "it returns an APIFuture that can be awaited."))
    async def save_state_async(self, name: str, ttl_seconds: int | None = None,
                               overwrite: bool = False,
                               user_metadata: dict[str, str] | None = None
                               ) -> APIFuture[types.SaveWeightsResponse]:
        """Deprecated: use `training_client.save_state(...)`."""
        return self.save_state(name, ttl_seconds, overwrite, user_metadata)

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None,
                                 user_metadata: dict[str, str] | None = None
                                 ) -> APIFuture[types.SaveWeightsForSamplerResponse]:
        """Save the adapter weights (PEFT format, no optimizer) for sampling, as
        `tinker://<run>/sampler_weights/<name>`.

        Example:
        ```python
        path = training_client.save_weights_for_sampler("s-1").result().path
        sampling_client = service_client.create_sampling_client(model_path=path).result()
        ```
        """
        self._warn_ttl(ttl_seconds)
        request = tpb.SaveRequest(name=paths.check_name(name, "name"),
                                  user_metadata=user_metadata or {})
        request.op.CopyFrom(self._conn.op(self.model_id))

        def run() -> types.SaveWeightsForSamplerResponse:
            reply = self._conn.call(self._conn.training.SaveWeightsForSampler, request)
            return types.SaveWeightsForSamplerResponse(path=convert.tinker_path(reply.path),
                                                       type="save_weights_for_sampler")

        return self._conn.submit(run, future_class=APIFuture)

    @deprecated(_moved("save_weights_for_sampler", "it returns an APIFuture that can be awaited."))
    async def save_weights_for_sampler_async(self, name: str, ttl_seconds: int | None = None,
                                             user_metadata: dict[str, str] | None = None
                                             ) -> APIFuture[types.SaveWeightsForSamplerResponse]:
        """Deprecated: use `training_client.save_weights_for_sampler(...)`."""
        return self.save_weights_for_sampler(name, ttl_seconds, user_metadata)

    def _load(self, path: str, optimizer: bool) -> APIFuture[types.LoadWeightsResponse]:
        paths.parse(path, "path")
        request = tpb.LoadStateRequest(op=self._conn.op(self.model_id), path=path,
                                       include_optimizer=optimizer)

        def run() -> types.LoadWeightsResponse:
            self._conn.call(self._conn.training.LoadState, request)
            return types.LoadWeightsResponse(path=convert.tinker_path(path),
                                             model_id=self.model_id, type="load_weights")

        return self._conn.submit(run, future_class=APIFuture)

    @deprecated("DEPRECATED: TrainingClient.load_state() is deprecated in tinker; use "
                "ServiceClient.create_training_client_from_state() instead.")
    def load_state(self, path: str) -> APIFuture[types.LoadWeightsResponse]:
        """Load adapter weights (not the optimizer state) from a `weights/` checkpoint.

        Example:
        ```python
        training_client.load_state("tinker://run-id/weights/step-100").result()
        ```
        """
        return self._load(path, optimizer=False)

    @deprecated("DEPRECATED: TrainingClient.load_state_async() is deprecated in tinker; use "
                "ServiceClient.create_training_client_from_state() instead.")
    async def load_state_async(self, path: str) -> APIFuture[types.LoadWeightsResponse]:
        """Deprecated: as `load_state`, awaited once for the future."""
        return self._load(path, optimizer=False)

    @deprecated("DEPRECATED: TrainingClient.load_state_with_optimizer() is deprecated in tinker; "
                "use ServiceClient.create_training_client_from_state_with_optimizer() instead.")
    def load_state_with_optimizer(self, path: str) -> APIFuture[types.LoadWeightsResponse]:
        """Load adapter weights and AdamW state from a `weights/` checkpoint.

        Example:
        ```python
        training_client.load_state_with_optimizer("tinker://run-id/weights/step-100").result()
        ```
        """
        return self._load(path, optimizer=True)

    @deprecated("DEPRECATED: TrainingClient.load_state_with_optimizer_async() is deprecated in "
                "tinker; use ServiceClient.create_training_client_from_state_with_optimizer().")
    async def load_state_with_optimizer_async(self, path: str
                                              ) -> APIFuture[types.LoadWeightsResponse]:
        """Deprecated: as `load_state_with_optimizer`, awaited once for the future."""
        return self._load(path, optimizer=True)

    # ------------------------------------------------------------------ sampling

    def create_sampling_client(self, model_path: str, retry_config: Any = None,
                               record_stability_info: bool = False) -> ClientFuture:
        """A future of a `SamplingClient` on saved sampler weights.

        Example:
        ```python
        sampling_client = training_client.create_sampling_client(path).result()
        ```
        """
        return submit_sampling_client(self._conn, model_path=model_path,
                                      retry_config=retry_config,
                                      record_stability_info=record_stability_info)

    @deprecated("DEPRECATED: TrainingClient.create_sampling_client_async() is deprecated. Use "
                "`await TrainingClient.create_sampling_client(...)` instead.")
    async def create_sampling_client_async(self, model_path: str, retry_config: Any = None,
                                           record_stability_info: bool = False
                                           ) -> SamplingClient:
        """Deprecated: use `await training_client.create_sampling_client(...)`."""
        return await self.create_sampling_client(model_path, retry_config, record_stability_info)

    def save_weights_and_get_sampling_client(self, name: str | None = None,
                                             retry_config: Any = None,
                                             record_stability_info: bool = False,
                                             kind: str = "snapshot") -> ClientFuture:
        """Snapshot the current weights and return a future of a `SamplingClient` on them.

        The snapshot is the weights after every op submitted before this call; ops
        submitted later do not change what it samples. It is saved as a sampler checkpoint
        named `ephemeral-<seq>` (Twinkle has no unlisted checkpoints).

        Args:
        - `name`: deprecated in tinker and ignored
        - `kind`: "snapshot" (the only kind Twinkle serves)

        Example:
        ```python
        sampling_client = training_client.save_weights_and_get_sampling_client().result()
        result = sampling_client.sample(prompt, 1, types.SamplingParams(max_tokens=20)).result()
        ```
        """
        if name is not None:
            warnings.warn("The 'name' parameter of save_weights_and_get_sampling_client() is "
                          "deprecated and has no effect; use save_weights_for_sampler(name=...) "
                          "+ create_sampling_client(model_path=...) for a named checkpoint.",
                          DeprecationWarning, stacklevel=2)
        if kind != "snapshot":
            raise ValueError(f"kind: Twinkle serves only 'snapshot' sampling clients, got {kind!r}")
        check_sampling_options(retry_config=retry_config,
                               record_stability_info=record_stability_info)
        header = self._conn.op(self.model_id)
        request = tpb.SaveRequest(op=header, name=f"ephemeral-{header.seq_id}")

        def run() -> SamplingClient:
            reply = self._conn.call(self._conn.training.SaveWeightsForSampler, request)
            return open_sampling_client(self._conn, model_path=reply.path)

        return self._conn.submit(run, future_class=SamplingClientFuture)

    @deprecated("DEPRECATED: TrainingClient.save_weights_and_get_sampling_client_async() is "
                "deprecated. Use `await TrainingClient.save_weights_and_get_sampling_client()`.")
    async def save_weights_and_get_sampling_client_async(self, name: str | None = None,
                                                         retry_config: Any = None,
                                                         record_stability_info: bool = False,
                                                         kind: str = "snapshot"
                                                         ) -> SamplingClient:
        """Deprecated: use `await training_client.save_weights_and_get_sampling_client()`."""
        return await self.save_weights_and_get_sampling_client(
            name, retry_config, record_stability_info, kind)

    # ------------------------------------------------------------------ info

    def get_info(self) -> types.GetInfoResponse:
        """The model's id, base model and LoRA rank; known since creation, never waits.

        Example:
        ```python
        info = training_client.get_info()
        print(info.model_id, info.model_data.model_name, info.lora_rank)
        ```
        """
        return self._info

    @deprecated("DEPRECATED: TrainingClient.get_info_async() is deprecated. Use "
                "TrainingClient.get_info() instead; it answers without a request.")
    async def get_info_async(self) -> types.GetInfoResponse:
        """Deprecated: use `training_client.get_info()`."""
        return self._info

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The base model's tokenizer, fetched from the server once per process (no hub).

        Example:
        ```python
        tokens = training_client.get_tokenizer().encode("Hello world")
        ```
        """
        return load_tokenizer(self._base_model, self._conn)

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _warn_ttl(ttl_seconds: int | None) -> None:
        if ttl_seconds is not None:
            warnings.warn("ttl_seconds: Twinkle checkpoints do not expire; the value is ignored",
                          UserWarning, stacklevel=3)

    def _pack(self, data: Sequence[types.Datum], method: str) -> Ops | APIFuture[Any]:
        """Encode and pack before any seq_id is reserved: a bad datum fails its future (a
        BadRequestError naming the datum and field) and nothing reaches the server."""
        if not data:
            raise ValueError("No data provided")
        try:
            encoded = convert.encode_datums(data)
            return self._ops(encoded, self._bounds(encoded))
        except wire.WireError as exc:
            return APIFuture.failed(self._conn.error_factory("invalid_argument", str(exc),
                                                             method))

    def _bounds(self, datums: list[wire.Datum]) -> list[tuple[int, int]]:
        """Where consecutive groups of datums start and end, each group within the
        server's per-request token limit: one op per group."""
        budget = self._max_batch_tokens
        bounds, start, tokens = [], 0, 0
        for index, datum in enumerate(datums):
            length = datum.num_tokens
            if index > start and budget and tokens + length > budget:
                bounds.append((start, index))
                start, tokens = index, 0
            tokens += length
        bounds.append((start, len(datums)))
        return bounds

    @staticmethod
    def _ops(datums: list[wire.Datum], bounds: list[tuple[int, int]]) -> Ops:
        """Each group's datums packed as one op's chunks (errors name datums by their
        index in the whole request)."""
        return Ops(bounds, [wire.pack_request(datums[a:b], first=a) for a, b in bounds])

    def _forward(self, data: list[types.Datum], loss_fn: str,
                 loss_fn_config: Mapping[str, float | str] | None, backward: bool
                 ) -> APIFuture[types.ForwardBackwardOutput]:
        loss = convert.loss_fn_to_proto(loss_fn, loss_fn_config)
        ops = self._pack(data, "ForwardBackward" if backward else "Forward")
        if isinstance(ops, APIFuture):
            return ops
        headers = [self._conn.op(self.model_id) for _ in ops.bounds]
        return self._conn.submit(self._run_ops, headers, ops, loss, backward,
                                 future_class=APIFuture)

    def _run_ops(self, headers: list[pb.OpHeader], ops: Ops, loss: pb.LossFn, backward: bool
                 ) -> types.ForwardBackwardOutput:
        """Send each group as its op, in order; if one fails, the rest are stood in for."""
        parts = []
        for index, (header, chunks) in enumerate(zip(headers, ops.chunks, strict=True)):
            try:
                parts.append(convert.forward_output(
                    self._conn.forward(header, chunks, loss, backward)))
            except BaseException:
                for header in headers[index + 1:]:
                    self._conn.release(header)
                raise
        return convert.combine_outputs(parts)

    def _run_custom(self, data: list[types.Datum], loss_fn: CustomLossFn, ops: Ops,
                    forward_ops: list[pb.OpHeader], backward_ops: list[pb.OpHeader]
                    ) -> types.ForwardBackwardOutput:
        try:
            forward = self._run_ops(forward_ops, ops, _SURROGATE, backward=False)
            linear_data, metrics, loss_sum = _custom_loss(data, loss_fn, forward)
            backward = self._ops(convert.encode_datums(linear_data), ops.bounds)
        except BaseException:
            for header in backward_ops:
                self._conn.release(header)
            raise
        result = self._run_ops(backward_ops, backward, _SURROGATE, backward=True)
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


TrainingClientFuture: type[ClientFuture] = client_future(TrainingClient, "TrainingClient")
