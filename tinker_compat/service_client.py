"""Tinker's `ServiceClient`: the entry point that opens a session and creates clients.

One `ServiceClient` holds one `twinkle_client.connection.Connection` (channel, API key,
session heartbeat, call pool); every client it creates shares it. Closing it closes the
session, and the server unloads the session's adapters (saved checkpoints stay).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from tinker import types
from tinker.lib.public_interfaces.custom_loss import (
    LossHandle,
    PerDatumLossFn,
    check_loss_inputs,
    run_loss_handle,
    trace_loss,
)

from tinker_compat import convert
from tinker_compat.futures import APIFuture, ClientFuture, deprecated
from tinker_compat.rest_client import RestClient, open_connection
from tinker_compat.rest_unserved import unserved
from tinker_compat.sampling_client import SamplingClient, submit_sampling_client
from tinker_compat.training_client import TrainingClient, TrainingClientFuture
from twinkle_client import api
from twinkle_client.errors import require_int
from twinkle_wire import paths

if TYPE_CHECKING:
    import torch

CLIENT_NAME = "tinker_compat/0.1"


@dataclass(frozen=True)
class ClientSideLoss(LossHandle):
    """The SDK's `LossHandle` for a loss that runs in this client (the SDK's own choice
    when the server runs no custom losses, as Twinkle's does not): callable as
    `forward_backward_custom`'s `loss_fn`, it checks each datum's inputs against the
    declared ranks, runs the traced loss per datum and sums it."""

    def __call__(self, data: list[types.Datum], logprobs_list: list[torch.Tensor]
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        check_loss_inputs(self, data)
        return run_loss_handle(self, data, logprobs_list)


def _single(method: str) -> str:
    return (f"DEPRECATED: ServiceClient.{method}_async() is deprecated. Use `await "
            f"ServiceClient.{method}(...)` instead; it returns a future of the client that "
            "can be awaited.")


class ServiceClient:
    """The entry point: creates TrainingClients and SamplingClients on a Twinkle server.

    Args:
        base_url: `http://host:port` (plaintext gRPC), `https://host:port` (TLS) or
            `host:port`; default `TWINKLE_BASE_URL`, then `TINKER_BASE_URL`.
        api_key: default `TWINKLE_API_KEY`, then `TINKER_API_KEY`; none for an open server.
        user_metadata, project_id, display_name: stored as tags of the session.
        default_headers_overrides: None: this client speaks gRPC and sends no HTTP headers
            (headers given are refused: ValueError).
        **kwargs: other tinker options do not apply to Twinkle; ignored with a FutureWarning,
            as tinker ignores unknown ones.

    Example:
    ```python
    service_client = ServiceClient(base_url="http://127.0.0.1:8000")
    training_client = service_client.create_lora_training_client(base_model="tiny").result()
    sampling_client = service_client.create_sampling_client(base_model="tiny").result()
    ```
    """

    def __init__(self, user_metadata: dict[str, str] | None = None,
                 project_id: str | None = None, *, display_name: str | None = None,
                 base_url: str | None = None, api_key: str | None = None,
                 default_headers_overrides: Mapping[str, str] | None = None,
                 **kwargs: Any) -> None:
        # Positional order as tinker 0.38's (user_metadata, project_id); the rest by keyword.
        project_id = project_id or os.environ.get("TINKER_PROJECT_ID") or None
        if default_headers_overrides:
            raise ValueError("default_headers_overrides: this client speaks gRPC to the Twinkle "
                             "server and sends no HTTP headers; pass None (the key goes in "
                             "api_key)")
        if kwargs:
            warnings.warn(f"ServiceClient ignores unsupported arguments: "
                          f"{', '.join(sorted(kwargs))}.", FutureWarning, stacklevel=2)
        tags = dict(user_metadata or {})
        tags.update({k: v for k, v in (("project_id", project_id),
                                        ("display_name", display_name)) if v})
        self._project_id = project_id
        self._conn = open_connection(base_url, api_key, CLIENT_NAME, open_session=True,
                                     tags=tags)

    @property
    def session_id(self) -> str | None:
        """The server session that keeps this client's adapters loaded."""
        return self._conn.session_id

    def __repr__(self) -> str:
        return f"<ServiceClient {self._conn.base_url} session {self.session_id}>"

    def __enter__(self) -> ServiceClient:
        if self._conn.closed:
            raise RuntimeError("ServiceClient is closed")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close("success" if exc_type is None else "errored")

    def close(self, status: Literal["success", "errored", "interrupted"] = "success",
              detail: str | None = None) -> APIFuture[None]:
        """Finish the session: wait for submitted calls, then close it; the server unloads
        its adapters (saved checkpoints stay). `status`/`detail` are tinker's and unused.

        Returns:
        - An already finished future (closing waits for the calls in flight).

        Example:
        ```python
        service_client.close()
        ```
        """
        del status, detail
        self._conn.close()
        return APIFuture.completed(None)

    # ------------------------------------------------------------------ training clients

    def _submit_training(self, call: api.Call[api.ModelInfo]) -> ClientFuture:
        def create() -> TrainingClient:
            return TrainingClient(self._conn, call.send(self._conn))

        return self._conn.submit(create, future_class=TrainingClientFuture)

    def create_lora_training_client(self, base_model: str, rank: int = 32,
                                    seed: int | None = None, train_mlp: bool = True,
                                    train_attn: bool = True, train_unembed: bool = True,
                                    user_metadata: dict[str, str] | None = None,
                                    optimizer: types.AdamOptimizerConfig | None = None
                                    ) -> ClientFuture:
        """Create a LoRA adapter on `base_model` and a TrainingClient for it.

        Args:
        - `base_model`: a served model name (see `get_server_capabilities`)
        - `rank`: LoRA rank (default 32)
        - `seed`: initialisation seed; None = random
        - `train_mlp`, `train_attn`, `train_unembed`: which layers get LoRA
        - `user_metadata`: stored with the training run
        - `optimizer`: None or `AdamOptimizerConfig` (Twinkle trains with AdamW)

        Returns:
        - A future of the `TrainingClient`; await it or call `.result()`. Using the future
          directly as the client still works, with a FutureWarning, as in tinker 0.38.

        Example:
        ```python
        training_client = service_client.create_lora_training_client(
            base_model="tiny", rank=16).result()
        ```
        """
        if not (train_mlp or train_attn or train_unembed):
            raise ValueError("At least one of train_mlp, train_attn, or train_unembed must be "
                             "True")
        require_int(rank, "rank")
        self._check_optimizer(optimizer)
        lora = api.LoraSpec(rank=rank, train_mlp=train_mlp, train_attn=train_attn,
                            train_unembed=train_unembed, seed=seed)
        return self._submit_training(api.create_model(
            base_model=base_model, lora=lora, user_metadata=user_metadata))

    @deprecated(_single("create_lora_training_client"))
    async def create_lora_training_client_async(
            self, base_model: str, rank: int = 32, seed: int | None = None,
            train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True,
            user_metadata: dict[str, str] | None = None,
            optimizer: types.AdamOptimizerConfig | None = None) -> TrainingClient:
        """Deprecated: use `await service_client.create_lora_training_client(...)`."""
        return await self.create_lora_training_client(base_model, rank, seed, train_mlp,
                                                      train_attn, train_unembed, user_metadata,
                                                      optimizer)

    def _from_state(self, path: str, with_optimizer: bool, base_model: str | None,
                    user_metadata: dict[str, str] | None, weights_access_token: str | None
                    ) -> ClientFuture:
        paths.parse(path, "path")
        if weights_access_token is not None:
            raise ValueError("weights_access_token: Twinkle checkpoints are readable only by "
                             "their own tenant; pass None")
        return self._submit_training(api.create_model(
            base_model=base_model or "", from_checkpoint=path, load_optimizer=with_optimizer,
            user_metadata=user_metadata))

    def create_training_client_from_state(self, path: str, base_model: str | None = None,
                                          user_metadata: dict[str, str] | None = None,
                                          weights_access_token: str | None = None,
                                          optimizer: types.AdamOptimizerConfig | None = None
                                          ) -> ClientFuture:
        """A new TrainingClient starting from a checkpoint's weights (fresh optimizer).

        Args:
        - `path`: `tinker://<run>/weights/<name>` (or `twinkle://`)
        - `base_model`: optional; must be the checkpoint's
        - `user_metadata`: stored with the new run

        Example:
        ```python
        training_client = service_client.create_training_client_from_state(path).result()
        ```
        """
        self._check_optimizer(optimizer)
        return self._from_state(path, False, base_model, user_metadata, weights_access_token)

    @deprecated(_single("create_training_client_from_state"))
    async def create_training_client_from_state_async(
            self, path: str, base_model: str | None = None,
            user_metadata: dict[str, str] | None = None,
            weights_access_token: str | None = None,
            optimizer: types.AdamOptimizerConfig | None = None) -> TrainingClient:
        """Deprecated: use `await service_client.create_training_client_from_state(...)`."""
        return await self.create_training_client_from_state(
            path, base_model, user_metadata, weights_access_token, optimizer)

    def create_training_client_from_state_with_optimizer(
            self, path: str, base_model: str | None = None,
            user_metadata: dict[str, str] | None = None,
            weights_access_token: str | None = None) -> ClientFuture:
        """A new TrainingClient resuming a checkpoint exactly: weights and AdamW state.

        Example:
        ```python
        resumed = service_client.create_training_client_from_state_with_optimizer(
            "tinker://run-id/weights/step-100").result()
        ```
        """
        return self._from_state(path, True, base_model, user_metadata, weights_access_token)

    @deprecated(_single("create_training_client_from_state_with_optimizer"))
    async def create_training_client_from_state_with_optimizer_async(
            self, path: str, base_model: str | None = None,
            user_metadata: dict[str, str] | None = None,
            weights_access_token: str | None = None) -> TrainingClient:
        """Deprecated: use `await
        service_client.create_training_client_from_state_with_optimizer(...)`."""
        return await self.create_training_client_from_state_with_optimizer(
            path, base_model, user_metadata, weights_access_token)

    def copy_weights(self, path: str, *, ttl_seconds: int | None = None,
                     weights_access_token: str | None = None) -> APIFuture[str]:
        """Copy a checkpoint you may read into a new training run of yours, recorded under
        this client's `project_id` (or `TINKER_PROJECT_ID`; one is required, as by the
        SDK); `RestClient.copy_weights` with that project.

        Args:
        - `path`: tinker path of the checkpoint to copy (yours, or a published one)
        - `ttl_seconds`: the copy expires this long from now (3600 to 10 years); None: never
        - `weights_access_token`: another tenant's API key, to copy what that tenant may read

        Returns:
        - `APIFuture` of the copy's tinker path.

        Example:
        ```python
        archive = ServiceClient(project_id="archive", base_url="http://127.0.0.1:8000")
        copied = archive.copy_weights("tinker://run-id/weights/step-400").result()
        ```
        """
        return RestClient(self._conn).copy_weights(path, self._project_id,
                                                   ttl_seconds=ttl_seconds,
                                                   weights_access_token=weights_access_token)

    def create_custom_loss(self, fn: PerDatumLossFn,
                           input_ranks: Mapping[str, types.CustomLossInputRank]
                           ) -> APIFuture[LossHandle]:
        """A per-datum loss for `TrainingClient.forward_backward_custom`, traced and checked
        here as the SDK does (`torch.fx`, torch and math only; a function that breaks the
        rules raises ValueError now). It runs in this client, as the SDK runs it against a
        server without server-side losses: `fn(logprobs, *inputs) -> (loss, metrics)` on
        each datum, the losses summed, `:mean` metrics averaged.

        Args:
        - `fn`: the loss; its parameters after `logprobs` are `loss_fn_inputs` keys
        - `input_ranks`: each parameter's rank (0 scalar, 1 `[T]`, 2 `[T, K]`)

        Returns:
        - An already finished `APIFuture` of the handle to pass as `loss_fn`.

        Example:
        ```python
        def neg_ll(logprobs, weights):
            loss = -(logprobs * weights).sum()
            return loss, {"custom/neg_ll:sum": loss}

        handle = service_client.create_custom_loss(
            neg_ll, input_ranks={"logprobs": 1, "weights": 1}).result()
        result = training_client.forward_backward_custom(data, handle).result()
        ```
        """
        traced = trace_loss(fn, input_ranks, self._conn.session_id or "")
        return APIFuture.completed(ClientSideLoss(traced.name, traced.inputs,
                                                  traced.session_id, traced.graph))

    # ------------------------------------------------------------------ sampling

    def create_sampling_client(self, model_path: str | None = None,
                               base_model: str | None = None, retry_config: Any = None,
                               record_stability_info: bool = False) -> ClientFuture:
        """A future of a SamplingClient on saved sampler weights or the bare base model.

        Args:
        - `model_path`: `tinker://<run>/sampler_weights/<name>`; wins over `base_model`
        - `base_model`: a served model name

        Raises:
            ValueError: neither is given.

        Example:
        ```python
        sampling_client = service_client.create_sampling_client(base_model="tiny").result()
        ```
        """
        return submit_sampling_client(self._conn, model_path=model_path, base_model=base_model,
                                      retry_config=retry_config,
                                      record_stability_info=record_stability_info)

    @deprecated(_single("create_sampling_client"))
    async def create_sampling_client_async(self, model_path: str | None = None,
                                           base_model: str | None = None,
                                           retry_config: Any = None,
                                           record_stability_info: bool = False
                                           ) -> SamplingClient:
        """Deprecated: use `await service_client.create_sampling_client(...)`."""
        return await self.create_sampling_client(model_path, base_model, retry_config,
                                                 record_stability_info)

    # ------------------------------------------------------------------ server

    @deprecated("DEPRECATED: ServiceClient.get_server_capabilities() is deprecated. Use "
                "RestClient().get_server_capabilities() instead; it returns an APIFuture.")
    def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        """The models the server serves (blocking)."""
        return convert.capabilities_to_tinker(api.capabilities(self._conn, refresh=True))

    @deprecated("DEPRECATED: ServiceClient.get_server_capabilities_async() is deprecated. Use "
                "`await RestClient().get_server_capabilities()` instead.")
    async def get_server_capabilities_async(self) -> types.GetServerCapabilitiesResponse:
        """Deprecated: use `await RestClient().get_server_capabilities()`."""
        return await RestClient(self._conn).get_server_capabilities()

    @deprecated("DEPRECATED: ServiceClient.create_rest_client() is deprecated. Construct "
                "RestClient() directly instead; it takes the same base_url and api_key.")
    def create_rest_client(self) -> RestClient:
        """A RestClient sharing this client's connection."""
        return RestClient(self._conn)

    def get_console_url(self) -> str:
        """Not served (raises NotFoundError): the server has no web console."""
        raise unserved(self._conn, "get_console_url",
                       "it has no web console; RestClient lists its runs and checkpoints")

    def get_telemetry(self) -> None:
        """None, the SDK's answer when it has no telemetry: Twinkle's clients report none."""
        return None

    @staticmethod
    def _check_optimizer(optimizer: Mapping[str, Any] | types.AdamOptimizerConfig | None
                         ) -> None:
        if optimizer is not None and not isinstance(optimizer, types.AdamOptimizerConfig):
            raise ValueError(f"optimizer: Twinkle trains with AdamW; pass None or "
                             f"AdamOptimizerConfig(), got {optimizer!r}")
