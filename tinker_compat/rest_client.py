"""Tinker's `RestClient`: the calling tenant's training runs and checkpoints.

Each method returns an `APIFuture` at once. A tenant sees only its own runs and
checkpoints; another tenant's look like none (NotFoundError). Moving checkpoint files in
and out (downloads, uploads, copies) is `rest_weights`' part of the class; the SDK's calls
this client does not serve, each refused by name, are `rest_unserved`'s.
"""

from __future__ import annotations

from datetime import date, datetime, timezone

from tinker import types

from tinker_compat import convert
from tinker_compat.errors import error_factory
from tinker_compat.futures import APIFuture, deprecated
from tinker_compat.rest_unserved import AccessScope, UnservedCalls
from tinker_compat.rest_weights import WeightsTransfer, deprecated_async
from twinkle_client import api
from twinkle_client.connection import Connection, env_endpoint, parse_base_url
from twinkle_wire import paths


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


class RestClient(WeightsTransfer, UnservedCalls):
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

    @deprecated(deprecated_async("get_training_run"))
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

    @deprecated(deprecated_async("get_training_run_by_tinker_path"))
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

    @deprecated(deprecated_async("list_training_runs"))
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

    @deprecated(deprecated_async("list_checkpoints"))
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

    @deprecated(deprecated_async("list_user_checkpoints"))
    async def list_user_checkpoints_async(self, limit: int = 100, offset: int = 0
                                          ) -> types.CheckpointsListResponse:
        """Deprecated: use `await rest_client.list_user_checkpoints(...)`."""
        return await self.list_user_checkpoints(limit, offset)

    def get_weights_info_by_tinker_path(self, tinker_path: str
                                        ) -> APIFuture[types.WeightsInfoResponse]:
        """What is needed to load a checkpoint: base model, LoRA rank, and the
        `train_attn` / `train_mlp` / `train_unembed` switches its run was made with (None
        for a run made with module names: the native client's, an import).

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
            return types.WeightsInfoResponse(
                base_model=ckpt.base_model, is_lora=True, lora_rank=ckpt.lora_rank or None,
                train_attn=ckpt.train_attn, train_mlp=ckpt.train_mlp,
                train_unembed=ckpt.train_unembed)

        return self._conn.submit(run, future_class=APIFuture)

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> APIFuture[None]:
        """Delete checkpoint `checkpoint_id` ("weights/<name>" or "sampler_weights/<name>").

        Example:
        ```python
        rest_client.delete_checkpoint("run-id", "weights/step-100").result()
        ```
        """
        return self.delete_checkpoint_from_tinker_path(
            paths.tinker_path(training_run_id, checkpoint_id))

    @deprecated(deprecated_async("delete_checkpoint"))
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

    @deprecated(deprecated_async("delete_checkpoint_from_tinker_path"))
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

    @deprecated(deprecated_async("get_audit_log"))
    async def get_audit_log_async(self, event_type: str = "all", day: date | None = None
                                  ) -> types.AuditLogResponse:
        """Deprecated: use `await rest_client.get_audit_log(...)`."""
        return await self.get_audit_log(event_type, day)

    @deprecated(deprecated_async("publish_checkpoint_from_tinker_path"))
    async def publish_checkpoint_from_tinker_path_async(self, tinker_path: str) -> None:
        """Deprecated: use `await rest_client.publish_checkpoint_from_tinker_path(...)`."""
        return await self.publish_checkpoint_from_tinker_path(tinker_path)

    @deprecated(deprecated_async("unpublish_checkpoint_from_tinker_path"))
    async def unpublish_checkpoint_from_tinker_path_async(self, tinker_path: str) -> None:
        """Deprecated: use `await rest_client.unpublish_checkpoint_from_tinker_path(...)`."""
        return await self.unpublish_checkpoint_from_tinker_path(tinker_path)

    @deprecated(deprecated_async("set_checkpoint_ttl_from_tinker_path"))
    async def set_checkpoint_ttl_from_tinker_path_async(self, tinker_path: str,
                                                        ttl_seconds: int | None) -> None:
        """Deprecated: use `await rest_client.set_checkpoint_ttl_from_tinker_path(...)`."""
        return await self.set_checkpoint_ttl_from_tinker_path(tinker_path, ttl_seconds)

    def get_telemetry(self) -> None:
        """None, the SDK's answer when it has no telemetry: Twinkle's clients report none."""
        return None
