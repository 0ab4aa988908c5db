"""The weights half of Tinker's `TrainingClient`: checkpoints saved and loaded, and
sampling clients on the adapter's weights.

`TrainingWeights` is the part of `TrainingClient` (`tinker_compat.training_client`) that
saves the adapter (`weights/`, `sampler_weights/`, `external_weights/`), loads a
checkpoint into it, and hands out `SamplingClient`s; the training passes and the
optimizer step stay in `training_client`. Every call takes its op's `seq_id` in the
calling thread, in call order, like the passes. A save's `ttl_seconds` is set right after
the save op, with the call `RestClient.set_checkpoint_ttl_from_tinker_path` makes (the
gRPC save carries no TTL).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from tinker import types

from tinker_compat import convert
from tinker_compat.futures import APIFuture, ClientFuture, deprecated
from tinker_compat.rest_unserved import unserved
from tinker_compat.sampling_client import (
    SamplingClient,
    SamplingClientFuture,
    check_sampling_options,
    submit_sampling_client,
)
from twinkle_client import api
from twinkle_client.connection import Connection
from twinkle_client.errors import TwinkleError, category_of
from twinkle_wire import paths

T = TypeVar("T")
U = TypeVar("U")

MIN_CHECKPOINT_TTL_SECONDS = 3600
MAX_CHECKPOINT_TTL_SECONDS = 10 * 365 * 24 * 3600
"""The TTLs the server accepts (1 hour to 10 years), checked before the save so that a TTL
it would refuse saves nothing."""


def moved_to_sync(method: str, advice: str) -> str:
    """The deprecation message of `TrainingClient.<method>_async`, pointing at `method`."""
    return (f"DEPRECATED: TrainingClient.{method}_async() is deprecated. Use "
            f"TrainingClient.{method}(...) instead: {advice}")


class TrainingWeights:
    """Checkpoints and sampling clients of one training model; `TrainingClient` is the
    class to use (it sets the attributes below)."""

    _conn: Connection
    model_id: str
    _base_model: str

    # ------------------------------------------------------------------ checkpoints

    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                   user_metadata: dict[str, str] | None = None
                   ) -> APIFuture[types.SaveWeightsResponse]:
        """Save the adapter weights and optimizer state as `tinker://<run>/weights/<name>`.

        Args:
        - `name`: 1-128 letters, digits, '.', '_', '-'
        - `ttl_seconds`: delete it this long after it is saved (3600 to 10 years); None:
          never. A TTL out of range fails the future (BadRequestError, as the SDK's) and
          saves nothing; if setting it fails after the save, the error names the saved path
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
        call = api.save_state(paths.check_name(name, "name"), include_optimizer=True,
                              user_metadata=user_metadata, overwrite=overwrite)
        return self._save(call, ttl_seconds, lambda path: types.SaveWeightsResponse(
            path=convert.tinker_path(path), type="save_weights"))

    @deprecated(moved_to_sync("save_state", "it returns an APIFuture that can be awaited."))
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

        Args:
        - `name`: 1-128 letters, digits, '.', '_', '-'
        - `ttl_seconds`: as `save_state`'s
        - `user_metadata`: stored with the checkpoint

        Example:
        ```python
        path = training_client.save_weights_for_sampler("s-1").result().path
        sampling_client = service_client.create_sampling_client(model_path=path).result()
        ```
        """
        call = api.save_weights_for_sampler(paths.check_name(name, "name"), user_metadata)
        return self._save(call, ttl_seconds,
                          lambda path: types.SaveWeightsForSamplerResponse(
                              path=convert.tinker_path(path), type="save_weights_for_sampler"))

    @deprecated(moved_to_sync("save_weights_for_sampler", "it returns an APIFuture that can be awaited."))
    async def save_weights_for_sampler_async(self, name: str, ttl_seconds: int | None = None,
                                             user_metadata: dict[str, str] | None = None
                                             ) -> APIFuture[types.SaveWeightsForSamplerResponse]:
        """Deprecated: use `training_client.save_weights_for_sampler(...)`."""
        return self.save_weights_for_sampler(name, ttl_seconds, user_metadata)

    def save_weights_external(self, name: str, ttl_seconds: int | None = None,
                              age_encryption_recipients: list[str] | None = None
                              ) -> APIFuture[types.SaveWeightsExternalResponse]:
        """Export the adapter in Hugging Face/PEFT format (`adapter_config.json`,
        `adapter_model.safetensors`) as `tinker://<run>/external_weights/<name>`: listed,
        TTL'd and deleted like any checkpoint; download its files with
        `RestClient.get_external_weights_urls` (or `tinker_cookbook.weights.download`).

        Args:
        - `name`: 1-128 letters, digits, '.', '_', '-'
        - `ttl_seconds`: delete it this long from now (3600 to 10 years); None: never
        - `age_encryption_recipients`: at most 10 `age1...` keys or SSH public keys; every
          file is encrypted to all of them and stored as `<file>.age` (`age -d` decrypts)

        Example:
        ```python
        path = training_client.save_weights_external("final").result().path
        urls = rest_client.get_external_weights_urls(path).result().urls
        ```
        """
        call = api.save_weights_external(paths.check_name(name, "name"), ttl_seconds,
                                         age_encryption_recipients)
        return self._submit(call, lambda path: types.SaveWeightsExternalResponse(
            path=convert.tinker_path(path), type="save_weights_external"))

    @deprecated(moved_to_sync("save_weights_external", "it returns an APIFuture that can be awaited."))
    async def save_weights_external_async(self, name: str, ttl_seconds: int | None = None,
                                          age_encryption_recipients: list[str] | None = None
                                          ) -> APIFuture[types.SaveWeightsExternalResponse]:
        """Deprecated: use `training_client.save_weights_external(...)`."""
        return self.save_weights_external(name, ttl_seconds, age_encryption_recipients)

    def _load(self, path: str, optimizer: bool, weights_access_token: str | None
              ) -> APIFuture[types.LoadWeightsResponse]:
        paths.parse(path, "path")
        if weights_access_token is not None:
            raise ValueError("weights_access_token: loading reads as this client's own key "
                             "only; copy the checkpoint first with RestClient.copy_weights(path, "
                             "..., weights_access_token=...) and load the copy, or pass None")
        return self._submit(api.load_state(path, include_optimizer=optimizer),
                            lambda _: types.LoadWeightsResponse(
                                path=convert.tinker_path(path), model_id=self.model_id,
                                type="load_weights"))

    @deprecated("DEPRECATED: TrainingClient.load_state() is deprecated in tinker; use "
                "ServiceClient.create_training_client_from_state() instead.")
    def load_state(self, path: str, weights_access_token: str | None = None
                   ) -> APIFuture[types.LoadWeightsResponse]:
        """Load adapter weights from a `weights/` checkpoint; the optimizer starts again
        (its moments and step count reset), as the SDK documents.

        Args:
        - `path`: `tinker://<run>/weights/<name>` (or `twinkle://`), own or published
        - `weights_access_token`: None; another tenant's key is refused (ValueError):
          copy its checkpoint with `RestClient.copy_weights` and load the copy

        Example:
        ```python
        training_client.load_state("tinker://run-id/weights/step-100").result()
        ```
        """
        return self._load(path, False, weights_access_token)

    @deprecated("DEPRECATED: TrainingClient.load_state_async() is deprecated in tinker; use "
                "ServiceClient.create_training_client_from_state() instead.")
    async def load_state_async(self, path: str, weights_access_token: str | None = None
                               ) -> APIFuture[types.LoadWeightsResponse]:
        """Deprecated: as `load_state`, awaited once for the future."""
        return self._load(path, False, weights_access_token)

    @deprecated("DEPRECATED: TrainingClient.load_state_with_optimizer() is deprecated in tinker; "
                "use ServiceClient.create_training_client_from_state_with_optimizer() instead.")
    def load_state_with_optimizer(self, path: str, weights_access_token: str | None = None
                                  ) -> APIFuture[types.LoadWeightsResponse]:
        """Load adapter weights and AdamW state from a `weights/` checkpoint
        (`weights_access_token` as `load_state`'s).

        Example:
        ```python
        training_client.load_state_with_optimizer("tinker://run-id/weights/step-100").result()
        ```
        """
        return self._load(path, True, weights_access_token)

    @deprecated("DEPRECATED: TrainingClient.load_state_with_optimizer_async() is deprecated in "
                "tinker; use ServiceClient.create_training_client_from_state_with_optimizer().")
    async def load_state_with_optimizer_async(self, path: str,
                                              weights_access_token: str | None = None
                                              ) -> APIFuture[types.LoadWeightsResponse]:
        """Deprecated: as `load_state_with_optimizer`, awaited once for the future."""
        return self._load(path, True, weights_access_token)

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
        """Save the current weights for sampling and return a future of a `SamplingClient`.

        `kind="snapshot"` (default): the weights after every op submitted before this
        call; ops submitted later do not change what it samples. As in Tinker it is
        ephemeral: no checkpoint (never listed, no path), deleted with its sampling
        session, when the session closes or expires, after the server's session timeout
        unused, or at a server restart.

        `kind="inflight"`: publishes the weights to this model's one mutable target,
        shared by all its inflight sampling clients; a later inflight save updates it for
        existing and new clients alike, rows mid-generation included (from their next
        token). Each client is its own prefix-cache namespace.

        Args:
        - `name`: deprecated in tinker and ignored
        - `kind`: "snapshot" or "inflight" (`tinker.types.SamplingClientKind`)

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
        if kind not in ("snapshot", "inflight"):
            raise ValueError(f"kind: must be 'snapshot' or 'inflight', got {kind!r}")
        check_sampling_options(retry_config=retry_config,
                               record_stability_info=record_stability_info)
        op = self._conn.reserve(self.model_id)
        call = api.save_ephemeral_sampler(inflight=kind == "inflight")

        def run() -> SamplingClient:
            return SamplingClient(self._conn, call.send(self._conn, op), self._base_model,
                                  record_stability_info=record_stability_info)

        return self._conn.submit(run, future_class=SamplingClientFuture,
                                 on_cancel=self._releaser([op]))

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

    # ------------------------------------------------------------------ console

    def get_console_url(self) -> str:
        """Not served (raises NotFoundError): the server has no web console."""
        raise unserved(self._conn, "get_console_url",
                       "it has no web console; RestClient.get_training_run(model_id) describes "
                       "the run")

    def get_telemetry(self) -> None:
        """None, the SDK's answer when it has no telemetry: Twinkle's clients report none."""
        return None

    # ------------------------------------------------------------------ internals

    def _save(self, call: api.OpCall[str], ttl_seconds: int | None,
              then: Callable[[str], U]) -> APIFuture[U]:
        """A save op, then (with `ttl_seconds`) its checkpoint's expiry, `ttl_seconds` after
        the save as the SDK's; the future fails if either fails, and a TTL the server would
        refuse fails it before any seq_id is taken."""
        if ttl_seconds is None:
            return self._submit(call, then)
        if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or not (
                MIN_CHECKPOINT_TTL_SECONDS <= ttl_seconds <= MAX_CHECKPOINT_TTL_SECONDS):
            return APIFuture.failed(self._conn.error_factory(
                "invalid_argument", f"ttl_seconds: {ttl_seconds!r} is out of range; give "
                f"{MIN_CHECKPOINT_TTL_SECONDS} (1 hour) to {MAX_CHECKPOINT_TTL_SECONDS} "
                "(10 years), or None for no expiry", call.method))
        op = self._conn.reserve(self.model_id)

        def run() -> U:
            path = call.send(self._conn, op)
            try:
                api.set_checkpoint_ttl(path, ttl_seconds).send(self._conn)
            except TwinkleError as exc:
                raise self._conn.error_factory(
                    category_of(exc.code), f"{convert.tinker_path(path)}: saved, but its "
                    f"ttl_seconds was not set: {exc}", exc.method) from exc
            return then(path)

        return self._conn.submit(run, future_class=APIFuture, on_cancel=self._releaser([op]))

    def _releaser(self, reserved: list[api.Op]) -> Callable[[], None]:
        """What a future cancelled before its ops are sent runs instead: their release."""
        def release() -> None:
            for op in reserved:
                api.release(self._conn, op)

        return release

    def _submit(self, call: api.OpCall[T], then: Callable[[T], U]) -> APIFuture[U]:
        """One op: its seq_id taken now, in call order; `then` makes its Tinker response."""
        return api.submit(self._conn, self.model_id, call, future_class=APIFuture).then(then)
