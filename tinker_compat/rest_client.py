"""Tinker's `RestClient`: the calling tenant's training runs and checkpoints.

Each method returns an `APIFuture` at once. A tenant sees only its own runs and
checkpoints; another tenant's look like none (NotFoundError).
"""

from __future__ import annotations

import os
import uuid
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel
from tinker import types

from tinker_compat import convert
from tinker_compat.errors import error_factory
from tinker_compat.futures import APIFuture, deprecated
from twinkle_client import api
from twinkle_client.connection import Connection, env_endpoint, parse_base_url
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

AccessScope = Literal["owned", "accessible"]


def _audit_entry(entry: api.AuditEntry) -> types.AuditLogEntry:
    """Tinker's entry; its deprecated top-level fields set on checkpoint events only."""
    details = entry.details
    checkpoint = entry.event.startswith("checkpoint_")
    return types.AuditLogEntry(
        timestamp=datetime.fromtimestamp(entry.timestamp, timezone.utc), event=entry.event,
        event_details=details, model_id=details.get("model_id") if checkpoint else None,
        tinker_path=details.get("tinker_path") if checkpoint else None,
        purpose=details.get("purpose") if entry.event == "checkpoint_read" else None)


def resolve_endpoint(base_url: str | None = None, api_key: str | None = None
                     ) -> tuple[str, str | None]:
    """The server URL and API key a client uses.

    base_url: the argument, else `TWINKLE_BASE_URL`, else `TINKER_BASE_URL`;
    api_key: the argument, else `TWINKLE_API_KEY`, else `TINKER_API_KEY` (None: an open
    server). Unset or empty variables are skipped.

    Raises:
        ValueError: no base URL anywhere.
    """
    url, key = env_endpoint(base_url, api_key)
    if not url:
        raise ValueError("base_url: not given, and neither TWINKLE_BASE_URL nor TINKER_BASE_URL "
                         "is set; pass e.g. base_url='http://127.0.0.1:8000'")
    return url, key


def open_connection(base_url: str | None, api_key: str | None, client_name: str, *,
                    open_session: bool, tags: dict[str, str] | None = None) -> Connection:
    """A connection whose failures raise Tinker's exceptions (see `tinker_compat.errors`)."""
    url, key = resolve_endpoint(base_url, api_key)
    target, _ = parse_base_url(url)
    return Connection(url, key, client_name=client_name, error_factory=error_factory(target),
                      open_session=open_session, tags=tags)


def _single(method: str) -> str:
    return (f"DEPRECATED: RestClient.{method}_async() is deprecated. Use `await "
            f"RestClient.{method}(...)` instead; it returns an APIFuture that can be awaited.")


class RestClient:
    """Lists, inspects, deletes and downloads the caller's training runs and checkpoints.

    Args:
    - `base_url`: the server; default `TWINKLE_BASE_URL`, then `TINKER_BASE_URL`
    - `api_key`: default `TWINKLE_API_KEY`, then `TINKER_API_KEY`

    Example:
    ```python
    rest_client = RestClient(base_url="http://127.0.0.1:8000")
    runs = rest_client.list_training_runs(limit=10).result()
    for checkpoint in rest_client.list_checkpoints(runs.training_runs[0].training_run_id
                                                   ).result().checkpoints:
        print(checkpoint.tinker_path)
    ```
    """

    def __init__(self, connection: Connection | None = None, *, base_url: str | None = None,
                 api_key: str | None = None) -> None:
        if connection is not None and (base_url or api_key):
            raise ValueError("base_url, api_key: not with a connection, which already has both")
        self._owns_connection = connection is None
        self._conn = connection or open_connection(base_url, api_key, "tinker_compat/rest",
                                                   open_session=False)

    def close(self) -> None:
        """Close the connection this client opened (not one a ServiceClient shares)."""
        if self._owns_connection:
            self._conn.close()

    def __enter__(self) -> RestClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ server

    def get_server_capabilities(self) -> APIFuture[types.GetServerCapabilitiesResponse]:
        """The models the server serves.

        Example:
        ```python
        caps = rest_client.get_server_capabilities().result()
        print([m.model_name for m in caps.supported_models])
        ```
        """
        return self._conn.submit(
            lambda: convert.capabilities_to_tinker(api.capabilities(self._conn, refresh=True)),
            future_class=APIFuture)

    # ------------------------------------------------------------------ runs

    def get_training_run(self, training_run_id: str, access_scope: AccessScope = "owned"
                         ) -> APIFuture[types.TrainingRun]:
        """One training run of the caller (`access_scope` is accepted for compatibility:
        a Twinkle tenant can access only its own runs).

        Example:
        ```python
        run = rest_client.get_training_run("run-id").result()
        print(run.base_model, run.lora_rank, run.last_checkpoint)
        ```
        """
        call = api.get_run(training_run_id)
        return self._conn.submit(lambda: convert.run_to_tinker(call.send(self._conn)),
                                 future_class=APIFuture)

    @deprecated(_single("get_training_run"))
    async def get_training_run_async(self, training_run_id: str,
                                     access_scope: AccessScope = "owned") -> types.TrainingRun:
        """Deprecated: use `await rest_client.get_training_run(...)`."""
        return await self.get_training_run(training_run_id, access_scope)

    def get_training_run_by_tinker_path(self, tinker_path: str,
                                        access_scope: AccessScope = "owned"
                                        ) -> APIFuture[types.TrainingRun]:
        """The training run a checkpoint path (`tinker://` or `twinkle://`) belongs to.

        Example:
        ```python
        run = rest_client.get_training_run_by_tinker_path("tinker://run-id/weights/a").result()
        ```
        """
        return self.get_training_run(paths.parse(tinker_path, "tinker_path").run_id,
                                     access_scope)

    @deprecated(_single("get_training_run_by_tinker_path"))
    async def get_training_run_by_tinker_path_async(self, tinker_path: str,
                                                    access_scope: AccessScope = "owned"
                                                    ) -> types.TrainingRun:
        """Deprecated: use `await rest_client.get_training_run_by_tinker_path(...)`."""
        return await self.get_training_run_by_tinker_path(tinker_path, access_scope)

    def list_training_runs(self, limit: int = 20, offset: int = 0,
                           access_scope: AccessScope = "owned", project_id: str | None = None
                           ) -> APIFuture[types.TrainingRunsResponse]:
        """The caller's training runs, a page at a time; `cursor.total_count` counts all.

        Args:
        - `limit`: runs per page (default 20, at most 1000)
        - `offset`: runs to skip
        - `access_scope`, `project_id`: accepted for compatibility (a tenant sees its own)

        Example:
        ```python
        page = rest_client.list_training_runs(limit=50).result()
        more = page.cursor.offset + page.cursor.limit < page.cursor.total_count
        ```
        """
        call = api.list_runs(limit, offset)

        def run() -> types.TrainingRunsResponse:
            page = call.send(self._conn)
            return types.TrainingRunsResponse(
                training_runs=[convert.run_to_tinker(r) for r in page.items],
                cursor=convert.cursor(offset, limit, page.total))

        return self._conn.submit(run, future_class=APIFuture)

    @deprecated(_single("list_training_runs"))
    async def list_training_runs_async(self, limit: int = 20, offset: int = 0,
                                       access_scope: AccessScope = "owned",
                                       project_id: str | None = None
                                       ) -> types.TrainingRunsResponse:
        """Deprecated: use `await rest_client.list_training_runs(...)`."""
        return await self.list_training_runs(limit, offset, access_scope, project_id)

    # ------------------------------------------------------------------ checkpoints

    def _list(self, run_id: str, limit: int, offset: int) -> types.CheckpointsListResponse:
        page = api.list_checkpoints(run_id, limit, offset).send(self._conn)
        return types.CheckpointsListResponse(
            checkpoints=[convert.checkpoint_to_tinker(c) for c in page.items],
            cursor=convert.cursor(offset, limit or len(page.items), page.total))

    def list_checkpoints(self, training_run_id: str) -> APIFuture[types.CheckpointsListResponse]:
        """Every checkpoint (training and sampler) of one run, newest first.

        Example:
        ```python
        for c in rest_client.list_checkpoints("run-id").result().checkpoints:
            print(c.checkpoint_type, c.checkpoint_id, c.tinker_path)
        ```
        """
        if not training_run_id:
            raise ValueError("training_run_id: empty")
        return self._conn.submit(self._list, training_run_id, 0, 0, future_class=APIFuture)

    @deprecated(_single("list_checkpoints"))
    async def list_checkpoints_async(self, training_run_id: str
                                     ) -> types.CheckpointsListResponse:
        """Deprecated: use `await rest_client.list_checkpoints(...)`."""
        return await self.list_checkpoints(training_run_id)

    def list_user_checkpoints(self, limit: int = 100, offset: int = 0
                              ) -> APIFuture[types.CheckpointsListResponse]:
        """Every checkpoint of every run of the caller, newest first, a page at a time.

        Example:
        ```python
        page = rest_client.list_user_checkpoints(limit=50).result()
        print(page.cursor.total_count, [c.tinker_path for c in page.checkpoints])
        ```
        """
        return self._conn.submit(self._list, "", limit, offset, future_class=APIFuture)

    @deprecated(_single("list_user_checkpoints"))
    async def list_user_checkpoints_async(self, limit: int = 100, offset: int = 0
                                          ) -> types.CheckpointsListResponse:
        """Deprecated: use `await rest_client.list_user_checkpoints(...)`."""
        return await self.list_user_checkpoints(limit, offset)

    def get_weights_info_by_tinker_path(self, tinker_path: str
                                        ) -> APIFuture[types.WeightsInfoResponse]:
        """What is needed to load a checkpoint: base model and LoRA rank.

        Example:
        ```python
        info = rest_client.get_weights_info_by_tinker_path("tinker://run-id/weights/a").result()
        print(info.base_model, info.lora_rank)
        ```
        """
        paths.parse(tinker_path, "tinker_path")
        call = api.get_checkpoint(tinker_path)

        def run() -> types.WeightsInfoResponse:
            ckpt = call.send(self._conn)
            return types.WeightsInfoResponse(base_model=ckpt.base_model, is_lora=True,
                                             lora_rank=ckpt.lora_rank or None)

        return self._conn.submit(run, future_class=APIFuture)

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> APIFuture[None]:
        """Delete checkpoint `checkpoint_id` ("weights/<name>" or "sampler_weights/<name>").

        Example:
        ```python
        rest_client.delete_checkpoint("run-id", "weights/step-100").result()
        ```
        """
        return self.delete_checkpoint_from_tinker_path(
            f"tinker://{training_run_id}/{checkpoint_id}")

    @deprecated(_single("delete_checkpoint"))
    async def delete_checkpoint_async(self, training_run_id: str, checkpoint_id: str) -> None:
        """Deprecated: use `await rest_client.delete_checkpoint(...)`."""
        return await self.delete_checkpoint(training_run_id, checkpoint_id)

    def delete_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        """Delete the checkpoint at a `tinker://` (or `twinkle://`) path.

        Example:
        ```python
        rest_client.delete_checkpoint_from_tinker_path("tinker://run-id/weights/a").result()
        ```
        """
        paths.parse(tinker_path, "tinker_path")
        return self._conn.submit(api.delete_checkpoint(tinker_path).send, self._conn,
                                 future_class=APIFuture)

    @deprecated(_single("delete_checkpoint_from_tinker_path"))
    async def delete_checkpoint_from_tinker_path_async(self, tinker_path: str) -> None:
        """Deprecated: use `await rest_client.delete_checkpoint_from_tinker_path(...)`."""
        return await self.delete_checkpoint_from_tinker_path(tinker_path)

    def publish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        """Make an own checkpoint readable by every tenant of the server (load, sample,
        download); only its owner may still change or delete it."""
        paths.parse(tinker_path, "tinker_path")
        return self._conn.submit(api.publish_checkpoint(tinker_path, True).send, self._conn,
                                 future_class=APIFuture)

    def unpublish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        """Make a published checkpoint private to its owner again."""
        paths.parse(tinker_path, "tinker_path")
        return self._conn.submit(api.publish_checkpoint(tinker_path, False).send, self._conn,
                                 future_class=APIFuture)

    def set_checkpoint_ttl_from_tinker_path(self, tinker_path: str, ttl_seconds: int | None
                                            ) -> APIFuture[None]:
        """Delete an own checkpoint `ttl_seconds` from now (3600 to 10 years), or never
        (None)."""
        paths.parse(tinker_path, "tinker_path")
        return self._conn.submit(api.set_checkpoint_ttl(tinker_path, ttl_seconds).send,
                                 self._conn, future_class=APIFuture)

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

    @deprecated(_single("get_external_weights_urls"))
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

    @deprecated(_single("copy_weights"))
    async def copy_weights_async(self, path: str, destination_project_id: str | None = None,
                                 *, ttl_seconds: int | None = None,
                                 weights_access_token: str | None = None) -> str:
        """Deprecated: use `await rest_client.copy_weights(...)`."""
        return await self.copy_weights(path, destination_project_id, ttl_seconds=ttl_seconds,
                                       weights_access_token=weights_access_token)

    def get_audit_log(self, event_type: str = "all", day: date | None = None
                      ) -> APIFuture[types.AuditLogResponse]:
        """Your audit log entries of one UTC day (default today), oldest first: who did
        what (sessions, models, checkpoint saves, reads, copies, deletes, publishing).

        Args:
        - `event_type`: "all", "checkpoints", "models" or "sessions" ("projects", "teams"
          and "organizations" have no events on this server)
        - `day`: the UTC day to read

        Example:
        ```python
        for entry in rest_client.get_audit_log(event_type="checkpoints").result().entries:
            print(entry.timestamp, entry.event, entry.tinker_path)
        ```
        """
        call = api.get_audit_log(event_type, day.isoformat() if day else "")

        def run() -> types.AuditLogResponse:
            return types.AuditLogResponse(entries=[
                _audit_entry(e)
                for e in call.send(self._conn)])

        return self._conn.submit(run, future_class=APIFuture)

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
