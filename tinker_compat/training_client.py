"""Tinker's `TrainingClient` over a Twinkle training model (one LoRA adapter).

Every method reserves its op's `seq_id` in the calling thread, in call order, then sends
the op from the connection's call pool and returns a future at once. The server runs a
model's ops strictly in seq_id order, so `forward_backward(...)` then `optim_step(...)`
submitted before waiting on either is correct, and faster than waiting in between.

A reserved seq_id must always reach the server, or the model's later ops would wait for
it: when an op cannot be sent (an earlier part of its request failed, the user's custom
loss raised, its future was cancelled before it was sent), the seq_id is spent with no op
under it (`api.release`, the SkipSeq RPC). An op already sent cannot be cancelled: the
server applies it in order, so its future's cancel() is False.
Checkpoints and sampling clients are `training_weights`' half of the class.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from tinker import types

import twinkle_wire as wire
from tinker_compat import convert, forward_ops
from tinker_compat.forward_ops import CustomLossFn
from tinker_compat.futures import APIFuture, ClientFuture, client_future, deprecated
from tinker_compat.training_weights import TrainingWeights, moved_to_sync
from twinkle_client import api
from twinkle_client.connection import Connection
from twinkle_client.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_AT_ONCE = ("it returns an APIFuture at once; submit the requests that follow, then await "
            "the future or call .result() on it.")


class TrainingClient(TrainingWeights):
    """Trains one LoRA adapter: forward/backward passes, optimizer steps, checkpoints.

    You get one from `service_client.create_lora_training_client(...)`.

    Example:
        training_client = service_client.create_lora_training_client(base_model="tiny").result()
        fwdbwd_future = training_client.forward_backward(data, "cross_entropy")
        optim_future = training_client.optim_step(types.AdamParams(learning_rate=1e-4))
        fwdbwd_result = fwdbwd_future.result()  # wait for gradients
        optim_result = optim_future.result()    # wait for the update
    """

    def __init__(self, connection: Connection, info: api.ModelInfo) -> None:
        self._conn = connection
        self.model_id: str = info.model_id
        self._base_model = info.base_model
        self._info = convert.info_to_tinker(info)
        # The server refuses a request over this many tokens; bigger batches are sent as
        # several consecutive ops, whose gradients accumulate exactly as one would.
        self._max_batch_tokens = int(api.capabilities(connection).limits.max_batch_tokens)

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

    @deprecated(moved_to_sync("forward", _AT_ONCE))
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

    @deprecated(moved_to_sync("forward_backward", _AT_ONCE))
    async def forward_backward_async(self, data: list[types.Datum], loss_fn: types.LossFnType,
                                     loss_fn_config: Mapping[str, float | str] | None = None
                                     ) -> APIFuture[types.ForwardBackwardOutput]:
        """Deprecated: use `training_client.forward_backward(...)`; awaiting this gives the
        future, which is awaited again (`await (await tc.forward_backward_async(...))`)."""
        return self.forward_backward(data, loss_fn, loss_fn_config)

    def forward_backward_custom(self, data: list[types.Datum], loss_fn: CustomLossFn, *,
                                loss_type_input: Literal["logprobs"] | None = None
                                ) -> APIFuture[types.ForwardBackwardOutput]:
        """Forward/backward with a loss computed here, in torch, on the returned logprobs.

        As tinker does it: a forward pass returns each datum's logprobs; `loss_fn(data,
        logprobs_list)` runs locally on tensors that require grad; then a cross_entropy
        forward_backward with `weights = -dLoss/dlogprobs` puts exactly that gradient into
        the adapter. Both passes take their seq_ids now, so later ops queue behind them.

        Args:
        - `data`: datums with `target_tokens` (and any extra fields the loss reads)
        - `loss_fn`: `(data, logprobs_list) -> (loss, metrics)`
        - `loss_type_input`: deprecated, as in the SDK: the loss always receives logprobs;
          given, it warns, and any value but "logprobs" is refused

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
        _check_loss_type_input(loss_type_input, "forward_backward_custom")
        if not callable(loss_fn):
            raise ValueError(f"loss_fn: expected a callable (data, logprobs) -> (loss, metrics), "
                             f"got {type(loss_fn).__name__}")
        if not data:
            raise ValueError("No data provided")
        ops = self._pack(forward_ops.surrogate_data(data), forward_ops.SURROGATE,
                         backward=False)
        if isinstance(ops, APIFuture):
            return ops
        first_pass = [self._conn.reserve(self.model_id) for _ in ops.bounds]
        second_pass = [self._conn.reserve(self.model_id) for _ in ops.bounds]
        return self._conn.submit(forward_ops.run_custom, self._conn, list(data), loss_fn, ops,
                                 first_pass, second_pass, future_class=APIFuture,
                                 on_cancel=self._releaser(first_pass + second_pass))

    @deprecated(moved_to_sync("forward_backward_custom", _AT_ONCE))
    async def forward_backward_custom_async(
            self, data: list[types.Datum], loss_fn: CustomLossFn, *,
            loss_type_input: Literal["logprobs"] | None = None
            ) -> APIFuture[types.ForwardBackwardOutput]:
        """Deprecated: use `training_client.forward_backward_custom(...)`."""
        return self.forward_backward_custom(data, loss_fn, loss_type_input=loss_type_input)

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
        - `APIFuture` of the `OptimStepResponse`; its `metrics` hold the gradient norm
          (`grad_norm`) only: tinker-cookbook's loops merge them into their own log rows
          (`step`, `learning_rate`, ...), which a server's other counters would overwrite

        Example:
        ```python
        training_client.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        ```
        """
        if optim_params is not None and adam_params is not None:
            raise ValueError("Specify optim_params or legacy adam_params, not both")
        adam = convert.adam_spec(optim_params if optim_params is not None else adam_params)
        return self._submit(api.optim_step(adam),
                            lambda metrics: types.OptimStepResponse(
                                metrics={"grad_norm": metrics["grad_norm"]}))

    @deprecated(moved_to_sync("optim_step", _AT_ONCE))
    async def optim_step_async(self, optim_params: types.AdamParams | None = None, *,
                               adam_params: types.AdamParams | None = None
                               ) -> APIFuture[types.OptimStepResponse]:
        """Deprecated: use `training_client.optim_step(...)`."""
        return self.optim_step(optim_params, adam_params=adam_params)

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


    def _pack(self, data: Sequence[types.Datum], loss: api.Loss, backward: bool
              ) -> forward_ops.Ops | APIFuture[Any]:
        """Encode and pack before any seq_id is reserved: a bad datum fails its future (a
        BadRequestError naming the datum and field) and nothing reaches the server."""
        if not data:
            raise ValueError("No data provided")
        try:
            encoded = convert.encode_datums(data)
            bounds = forward_ops.split(encoded, self._max_batch_tokens)
            return forward_ops.pack(encoded, bounds, loss, backward,
                                    convert.datum_provenance(data))
        except wire.WireError as exc:
            return APIFuture.failed(self._conn.error_factory(
                "invalid_argument", str(exc), "ForwardBackward" if backward else "Forward"))

    def _forward(self, data: list[types.Datum], loss_fn: str,
                 loss_fn_config: Mapping[str, float | str] | None, backward: bool
                 ) -> APIFuture[types.ForwardBackwardOutput]:
        loss = convert.loss_spec(loss_fn, loss_fn_config)
        ops = self._pack(data, loss, backward)
        if isinstance(ops, APIFuture):
            return ops
        reserved = [self._conn.reserve(self.model_id) for _ in ops.bounds]
        return self._conn.submit(forward_ops.run_ops, self._conn, reserved, ops,
                                 future_class=APIFuture, on_cancel=self._releaser(reserved))


TrainingClientFuture: type[ClientFuture] = client_future(TrainingClient, "TrainingClient")


def _check_loss_type_input(loss_type_input: str | None, method: str) -> None:
    """The SDK's deprecated `loss_type_input`: given, a DeprecationWarning; only "logprobs"
    (what the loss always receives) is served."""
    if loss_type_input is None:
        return
    warnings.warn(f"The 'loss_type_input' parameter of {method}() is deprecated: the loss "
                  "always receives logprobs; remove it from your call.", DeprecationWarning,
                  stacklevel=3)
    if loss_type_input != "logprobs":
        raise ValueError(f"loss_type_input: {loss_type_input!r} is not served; the loss "
                         "receives 'logprobs'")

