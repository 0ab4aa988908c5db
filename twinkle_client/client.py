"""`init_twinkle_client(...)` and `TwinkleClient`: the server, its runs and checkpoints.

`init_twinkle_client` opens one `Connection` (a session kept alive by a heartbeat) and
makes it the default one, so `MultiLoraTransformersModel(...)` and dataset templates
created afterwards use it without being handed a client. `TwinkleClient` answers the
questions a user asks between training loops: is the server up, what does it serve, which
runs and checkpoints do I have, and it deletes and downloads checkpoints.

Every record it returns is a pydantic model (`model_dump_json(indent=2)` prints it).
Listings are oldest first, so the last item a loop sees is the newest:

    client = init_twinkle_client(base_url='http://127.0.0.1:8000')
    for run in client.list_training_runs():
        for ckpt in client.list_checkpoints(run.training_run_id):
            resume_path = ckpt.twinkle_path        # ends as the newest checkpoint
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from twinkle_client import api
from twinkle_client.connection import (
    Connection,
    env_endpoint,
    get_default_connection,
    set_default_connection,
)
from twinkle_wire import paths
from twinkle_wire.values import ServerLimits

CLIENT_NAME = "twinkle_client/0.1"
HEALTH_TIMEOUT_S = 5.0
"""A health check answers at once on a live server; longer means it is not healthy."""
PAGE_SIZE = 1000
"""Rows asked for per listing call (the server's largest page)."""


class _Record(BaseModel):
    """A server record: frozen, and tolerant of fields a newer server may add."""

    model_config = ConfigDict(frozen=True, extra="ignore")


class Checkpoint(_Record):
    """A saved checkpoint. `twinkle_path` is what `model.load(...)` and
    `from_checkpoint` take; `tinker_path` is the same checkpoint for the Tinker shim."""

    checkpoint_id: str
    checkpoint_type: str
    twinkle_path: str
    training_run_id: str
    name: str
    created_at: datetime
    size_bytes: int
    has_optimizer: bool
    base_model: str
    lora_rank: int
    user_metadata: dict[str, str]

    @property
    def tinker_path(self) -> str:
        return paths.parse(self.twinkle_path).tinker()


class TrainingRun(_Record):
    """A training run: one adapter, its base model and its newest checkpoints."""

    training_run_id: str
    base_model: str
    owner: str
    is_lora: bool
    lora_rank: int
    created_at: datetime
    last_request_time: datetime
    last_checkpoint: Checkpoint | None
    last_sampler_checkpoint: Checkpoint | None
    user_metadata: dict[str, str]
    loaded: bool
    corrupted: bool


class ServedModel(_Record):
    name: str
    aliases: list[str]
    max_context_length: int
    vocab_size: int
    trainable: bool
    sampleable: bool
    arch: str


class ServerCapabilities(_Record):
    """What the server serves and allows: models, limits and the allow-lists of losses,
    optimizers and learning-rate schedulers that `set_loss`/`set_optimizer`/... accept."""

    models: list[ServedModel]
    limits: ServerLimits
    scheduling: str
    server_version: str
    loss_functions: list[str]
    optimizers: list[str]
    lr_schedulers: list[str]


class CapacityInfo(_Record):
    """Room for new adapters now: slots in use and free, and free memory for their state."""

    adapters_loaded: int
    adapters_free: int
    max_adapters: int
    max_adapters_per_tenant: int
    max_rank: int
    memory_available_bytes: int


def _time(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=timezone.utc)


def checkpoint_record(ckpt: api.Checkpoint) -> Checkpoint:
    return Checkpoint(
        checkpoint_id=ckpt.checkpoint_id, checkpoint_type=ckpt.checkpoint_type,
        twinkle_path=ckpt.path, training_run_id=ckpt.run_id, name=ckpt.name,
        created_at=_time(ckpt.created_at), size_bytes=ckpt.size_bytes,
        has_optimizer=ckpt.has_optimizer, base_model=ckpt.base_model,
        lora_rank=ckpt.lora_rank, user_metadata=dict(ckpt.user_metadata))


def run_record(run: api.TrainingRun) -> TrainingRun:
    return TrainingRun(
        training_run_id=run.run_id, base_model=run.base_model, owner=run.owner,
        is_lora=run.is_lora, lora_rank=run.lora_rank, created_at=_time(run.created_at),
        last_request_time=_time(run.last_request_time),
        last_checkpoint=(checkpoint_record(run.last_checkpoint)
                         if run.last_checkpoint is not None else None),
        last_sampler_checkpoint=(checkpoint_record(run.last_sampler_checkpoint)
                                 if run.last_sampler_checkpoint is not None else None),
        user_metadata=dict(run.user_metadata), loaded=run.loaded, corrupted=run.corrupted)


def capabilities_record(caps: api.Capabilities) -> ServerCapabilities:
    return ServerCapabilities(
        models=[ServedModel(**dataclasses.asdict(m)) for m in caps.models],
        limits=caps.limits,
        scheduling=caps.scheduling, server_version=caps.server_version,
        loss_functions=list(caps.loss_functions), optimizers=list(caps.optimizers),
        lr_schedulers=list(caps.lr_schedulers))


def _check_page(limit: int | None, offset: int) -> None:
    if limit is not None and limit < 0:
        raise ValueError(f"limit: must be >= 0 or None (all), got {limit}")
    if offset < 0:
        raise ValueError(f"offset: must be >= 0, got {offset}")


class TwinkleClient:
    """The server's runs, checkpoints and capabilities over one `Connection`.

    Args:
        connection: the connection to use (`init_twinkle_client` makes one).

    Example:
        with init_twinkle_client('http://127.0.0.1:8000') as client:
            print(client.get_server_capabilities().models[0].name)
    """

    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    @property
    def base_url(self) -> str:
        return self.connection.base_url

    # ------------------------------------------------------------------ server

    def health_check(self, timeout: float = HEALTH_TIMEOUT_S) -> bool:
        """True when the server's standard `grpc.health.v1` check answers SERVING; False
        when it answers otherwise or cannot be reached within `timeout` seconds."""
        return api.health_check(self.connection, timeout)

    def get_server_capabilities(self) -> ServerCapabilities:
        """Served models (names and aliases), limits and allow-lists, fetched now."""
        return capabilities_record(api.capabilities(self.connection, refresh=True))

    def get_capacity_info(self) -> CapacityInfo:
        """Adapter slots in use and free, and memory free for new adapter state, now."""
        caps = api.capabilities(self.connection, refresh=True)
        return CapacityInfo(
            adapters_loaded=caps.adapters_loaded, adapters_free=caps.adapters_free,
            max_adapters=caps.limits.max_adapters,
            max_adapters_per_tenant=caps.limits.max_adapters_per_tenant,
            max_rank=caps.limits.max_rank, memory_available_bytes=caps.memory_available_bytes)

    # ------------------------------------------------------------------ runs

    def list_training_runs(self, limit: int | None = None, offset: int = 0
                           ) -> list[TrainingRun]:
        """This tenant's training runs, oldest first.

        Args:
            limit: at most this many runs; None for all of them.
            offset: skip this many of the oldest runs first.
        """
        _check_page(limit, offset)
        runs: list[TrainingRun] = []
        page_offset = 0
        while True:
            page = api.list_runs(PAGE_SIZE, page_offset).send(self.connection)
            runs.extend(run_record(r) for r in page.items)
            if page.next_offset < 0 or not page.items:
                break
            page_offset = page.next_offset
        runs.sort(key=lambda r: (r.created_at, r.training_run_id))
        return runs[offset:] if limit is None else runs[offset:offset + limit]

    def get_training_run(self, training_run_id: str) -> TrainingRun:
        """One run by id; NotFoundError (with the server's message) if this tenant has none."""
        return run_record(api.get_run(training_run_id).send(self.connection))

    # ------------------------------------------------------------------ checkpoints

    def list_checkpoints(self, training_run_id: str | None = None) -> list[Checkpoint]:
        """Checkpoints of one run (or, with None, of every run of this tenant), oldest
        first; NotFoundError for an unknown run."""
        found: list[Checkpoint] = []
        page_offset = 0
        while True:
            page = api.list_checkpoints(training_run_id or "", PAGE_SIZE, page_offset
                                        ).send(self.connection)
            found.extend(checkpoint_record(c) for c in page.items)
            if page.next_offset < 0 or not page.items:
                break
            page_offset = page.next_offset
        found.sort(key=lambda c: (c.created_at, c.name))
        return found

    def get_latest_checkpoint_path(self, training_run_id: str) -> str | None:
        """The twinkle:// path of the run's newest training checkpoint (weights and,
        if saved with it, optimizer state), or None if the run has none."""
        last = self.get_training_run(training_run_id).last_checkpoint
        return last.twinkle_path if last is not None else None

    def get_checkpoint(self, path: str) -> Checkpoint:
        """One checkpoint by twinkle:// (or tinker://) path."""
        return checkpoint_record(api.get_checkpoint(path).send(self.connection))

    def delete_checkpoint(self, path: str) -> None:
        """Delete a checkpoint's record and files; NotFoundError if there is none."""
        api.delete_checkpoint(path).send(self.connection)

    def download_checkpoint(self, path: str, dest_dir: str | os.PathLike) -> Path:
        """Every file of checkpoint `path` (PEFT `adapter_model.safetensors` and
        `adapter_config.json`, plus optimizer state if saved) into `dest_dir`, which
        `peft.PeftModel.from_pretrained(base, dest_dir)` then loads. Returns `dest_dir`."""
        return api.download_checkpoint(self.connection, path, dest_dir)

    def import_adapter(self, directory: str | os.PathLike, base_model: str = "") -> str:
        """Import a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`
        in `directory`, as `peft`'s `save_pretrained` writes them) for served model
        `base_model` (default: the first served); returns the new checkpoint's path,
        which samples, loads to train on, and serves on the OpenAI route. The server
        checks it against the base and refuses, naming why, what does not fit."""
        config = json.loads((Path(directory) / "adapter_config.json").read_text())
        rank = config.get("r")
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise ValueError(f"adapter_config.json: r is {rank!r}, not an integer")
        base = base_model or api.capabilities(self.connection).models[0].name
        upload = api.start_upload(self.connection, base, rank)
        api.put_files(self.connection, upload, directory)
        return api.finish_upload(self.connection, upload.upload_id)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Close the session (the server unloads its adapters; checkpoints stay) and the
        channel; stop being the default connection."""
        if get_default_connection() is self.connection:
            set_default_connection(None)
        self.connection.close()

    def __enter__(self) -> TwinkleClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TwinkleClient({self.base_url!r}, session={self.connection.session_id!r})"


def init_twinkle_client(base_url: str | None = None, api_key: str | None = None
                        ) -> TwinkleClient:
    """Connect to a Twinkle server, open a session and make it the default connection.

    Args:
        base_url: `http://host:port`, `https://host:port` or `host:port`; default the
            environment variable TWINKLE_BASE_URL, then TINKER_BASE_URL.
        api_key: sent as `authorization: Bearer <key>`; default TWINKLE_API_KEY, then
            TINKER_API_KEY. An open (keyless) server ignores it, so placeholders such as
            'EMPTY_TOKEN' work there.

    Raises:
        ValueError: no base URL given or set in the environment, or a malformed one.
        TwinkleError subclasses: the server refused the session (e.g. a bad key).
    """
    url, key = env_endpoint(base_url, api_key)
    if not url:
        raise ValueError("base_url: not given and TWINKLE_BASE_URL is not set (nor "
                         "TINKER_BASE_URL); pass e.g. "
                         "init_twinkle_client(base_url='http://127.0.0.1:8000')")
    connection = Connection(url, key, client_name=CLIENT_NAME)
    set_default_connection(connection)
    return TwinkleClient(connection)
