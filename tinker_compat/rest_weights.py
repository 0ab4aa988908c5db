"""The weights half of Tinker's `RestClient`: checkpoint files in and out.

`WeightsTransfer` is the part of `RestClient` (`tinker_compat.rest_client`) that moves
weights: signed download URLs of external weights, the upload of an adapter trained
elsewhere, copies between runs, and downloads of a checkpoint's files. Listing,
inspecting, deleting and publishing runs and checkpoints stay in `rest_client`.
"""

from __future__ import annotations

import os
import uuid
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel
from tinker import types

from tinker_compat import convert
from tinker_compat.futures import APIFuture, deprecated
from twinkle_client import api
from twinkle_client.connection import Connection
from twinkle_wire import paths


class ExternalWeightsUploadStartResult(BaseModel):
    """Tinker 0.39's `types.ExternalWeightsUploadStartResult` (the installed SDK may
    predate it): the upload's id, a signed PUT URL per file, and when they expire."""

    upload_id: str
    urls: dict[str, str]
    expires: datetime


class ExternalWeightsUploadFinishResult(BaseModel):
    """Tinker 0.39's `types.ExternalWeightsUploadFinishResult`: the new checkpoint."""

    tinker_path: str


def deprecated_async(method: str) -> str:
    """The deprecation message of `RestClient.<method>_async`, pointing at `method`."""
    return (f"DEPRECATED: RestClient.{method}_async() is deprecated. Use `await "
            f"RestClient.{method}(...)` instead; it returns an APIFuture that can be awaited.")


class WeightsTransfer:
    """Checkpoint files in and out for one tenant; `RestClient` is the class to use (it
    sets `_conn`)."""

    _conn: Connection

    def get_external_weights_urls(self, tinker_path: str
                                  ) -> APIFuture[types.ExternalWeightsUrlsResponse]:
        """Signed download URLs, one per file, of an external weights checkpoint
        (`tinker://<run>/external_weights/<name>`, from `save_weights_external`). Each
        works with no API key until `expires`; the server's HTTP front serves them, so
        the server must run with `--http-port`.

        Example:
        ```python
        response = rest_client.get_external_weights_urls(path).result()
        for name, url in response.urls.items():
            urllib.request.urlretrieve(url, name)
        ```
        """
        parsed = paths.parse(tinker_path, "tinker_path")
        if parsed.kind != "external":
            raise ValueError("get_external_weights_urls only accepts external weights "
                             "checkpoints (tinker://<training_run_id>/external_weights/<name>), "
                             f"got {tinker_path!r}")

        def run() -> types.ExternalWeightsUrlsResponse:
            signed = api.external_weights_urls(self._conn, tinker_path)
            return types.ExternalWeightsUrlsResponse(
                urls=signed.urls, expires=datetime.fromtimestamp(signed.expires_at, timezone.utc))

        return self._conn.submit(run, future_class=APIFuture)

    @deprecated(deprecated_async("get_external_weights_urls"))
    async def get_external_weights_urls_async(self, tinker_path: str
                                              ) -> types.ExternalWeightsUrlsResponse:
        """Deprecated: use `await rest_client.get_external_weights_urls(...)`."""
        return await self.get_external_weights_urls(tinker_path)

    def external_weights_upload_start(self, base_model: str, lora_config: types.LoraConfig,
                                      destination_project_id: str | None = None
                                      ) -> APIFuture[ExternalWeightsUploadStartResult]:
        """Start importing a PEFT LoRA adapter trained elsewhere (Tinker 0.39): one signed
        URL per file (`adapter_config.json`, `adapter_model.safetensors`); PUT each file
        to its URL (no API key, once each) before `expires`, then call
        `external_weights_upload_finish(upload_id)`. `lora_config` says the adapter's rank
        and the layer groups it adapts; its `seed` must be None (an upload brings its own
        weights), and `destination_project_id` is refused (tenants, not projects).

        Example:
        ```python
        started = rest_client.external_weights_upload_start(
            "Qwen/Qwen3-8B", types.LoraConfig(rank=16)).result()
        for name, url in started.urls.items():
            httpx.put(url, content=open(f"adapter/{name}", "rb").read())
        path = rest_client.external_weights_upload_finish(started.upload_id).result()
        ```
        """
        if destination_project_id is not None:
            raise ValueError("destination_project_id: this server has tenants, not projects")
        if lora_config.seed is not None:
            raise ValueError("lora_config.seed: an upload brings its own weights; leave it None")

        def run() -> ExternalWeightsUploadStartResult:
            upload = api.start_upload(self._conn, base_model, lora_config.rank,
                                      lora_config.train_mlp, lora_config.train_attn,
                                      lora_config.train_unembed)
            return ExternalWeightsUploadStartResult(
                upload_id=upload.upload_id, urls=upload.urls,
                expires=datetime.fromtimestamp(upload.expires_at, timezone.utc))

        return self._conn.submit(run, future_class=APIFuture)

    def external_weights_upload_finish(self, upload_id: str
                                       ) -> APIFuture[ExternalWeightsUploadFinishResult]:
        """Finish an upload once every file is PUT: the adapter, checked against its base,
        becomes an external weights checkpoint of the caller's; its `tinker_path` samples,
        trains on (`create_training_client_from_state`) and downloads like any other."""
        def run() -> ExternalWeightsUploadFinishResult:
            path = api.finish_upload(self._conn, upload_id)
            return ExternalWeightsUploadFinishResult(tinker_path=convert.tinker_path(path))

        return self._conn.submit(run, future_class=APIFuture)

    def copy_weights(self, path: str, destination_project_id: str | None = None, *,
                     ttl_seconds: int | None = None, weights_access_token: str | None = None
                     ) -> APIFuture[str]:
        """Copy a checkpoint you may read into a new training run of yours.

        The copy keeps the source's kind and name, shares its files (no bytes duplicated),
        starts private, and outlives the source. Twinkle has tenants, not projects:
        `destination_project_id` (or `TINKER_PROJECT_ID`) is required, as by the SDK, and
        recorded only.

        Args:
        - `path`: tinker path of the checkpoint to copy (yours, or a published one)
        - `destination_project_id`: recorded with the copy
        - `ttl_seconds`: the copy expires this long from now (3600 to 10 years); None: never
        - `weights_access_token`: another tenant's API key, to copy what that tenant may read

        Returns:
        - `APIFuture` of the copy's tinker path.

        Example:
        ```python
        copied = rest_client.copy_weights("tinker://run-id/weights/step-400", "archive").result()
        ```
        """
        if destination_project_id is None:
            destination_project_id = os.environ.get("TINKER_PROJECT_ID") or None
        if destination_project_id is None:
            raise ValueError("Provide destination_project_id or set TINKER_PROJECT_ID")
        paths.parse(path, "path")
        # One key per call, reused by the connection's retries: a retry answers one copy.
        call = api.copy_checkpoint(path, destination_project_id=destination_project_id,
                                   ttl_seconds=ttl_seconds,
                                   weights_access_token=weights_access_token or "",
                                   idempotency_key=str(uuid.uuid4()))
        return self._conn.submit(call.send, self._conn, future_class=APIFuture)

    @deprecated(deprecated_async("copy_weights"))
    async def copy_weights_async(self, path: str, destination_project_id: str | None = None,
                                 *, ttl_seconds: int | None = None,
                                 weights_access_token: str | None = None) -> str:
        """Deprecated: use `await rest_client.copy_weights(...)`."""
        return await self.copy_weights(path, destination_project_id, ttl_seconds=ttl_seconds,
                                       weights_access_token=weights_access_token)

    def download_checkpoint(self, tinker_path: str, dest: str | os.PathLike
                            ) -> APIFuture[Path]:
        """Download every file of a checkpoint into directory `dest` (a Twinkle addition:
        a sampler checkpoint is a PEFT adapter directory, `PeftModel.from_pretrained` loads it).

        Args:
        - `tinker_path`: the checkpoint, `tinker://` or `twinkle://`
        - `dest`: the directory to fill (made if missing; never left half-written)

        Returns:
        - `APIFuture` of the directory's `Path`

        Example:
        ```python
        folder = rest_client.download_checkpoint(path, "./adapter").result()
        ```
        """
        paths.parse(tinker_path, "tinker_path")
        return self._conn.submit(api.download_checkpoint, self._conn, tinker_path, dest,
                                 future_class=APIFuture)
