"""The adapters of a `MultiLoraTransformersModel`, and how an op reaches one.

`ModelAdapters` is the part of `MultiLoraTransformersModel` (`twinkle_client.model`)
that creates, names, finds and removes its adapters (one server training run each), and
sends an ordered op to one of them; the ops of a training loop stay in `model`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from twinkle_client import api, errors
from twinkle_client.client import TwinkleClient
from twinkle_client.connection import Connection, get_default_connection
from twinkle_client.futures import Future
from twinkle_client.lora import lora_spec
from twinkle_client.outputs import AdapterInfo, ForwardOutput
from twinkle_client.tokenizer import served_name

if TYPE_CHECKING:
    from peft import LoraConfig

T = TypeVar("T")


@dataclass
class AdapterRecord:
    """One adapter of the model: its name, server run, and its latest ops."""

    name: str
    run_id: str
    info: AdapterInfo
    last_forward: Future[ForwardOutput] | None = None
    last_op: Future[Any] | None = None


def connection_of(client: TwinkleClient | Connection | None) -> Connection:
    """The connection of `client`, or the default one `init_twinkle_client` made."""
    if isinstance(client, TwinkleClient):
        return client.connection
    if isinstance(client, Connection):
        return client
    if client is not None:
        raise ValueError(f"client: expected a TwinkleClient or Connection, got "
                         f"{type(client).__name__}")
    connection = get_default_connection()
    if connection is None:
        raise ValueError("client: none given and no default; call "
                         "init_twinkle_client(base_url=...) first")
    return connection


def served_base(connection: Connection, model_id: str) -> str:
    """The served name `model_id` stands for; an unserved name is an error, never a
    silent fallback to whatever the server holds."""
    name = served_name(model_id)
    caps = api.capabilities(connection)
    for model in caps.models:
        if name == model.name or name in model.aliases:
            return model.name
    served = [n for m in caps.models for n in (m.name, *m.aliases)]
    raise errors.InvalidArgumentError(
        f"model_id: {model_id!r} is not served by {connection.base_url}; it serves {served} "
        "(start the server with --model <it> or --model-alias <it>, or name it in a "
        "--models file)")


class ModelAdapters:
    """The adapters of one model on one connection; `MultiLoraTransformersModel` is the
    class to use (it sets the attributes below)."""

    connection: Connection
    base_model: str
    _adapters: dict[str, AdapterRecord]

    # ------------------------------------------------------------------ adapters

    def add_adapter_to_model(self, adapter_name: str, config: LoraConfig | Mapping[str, Any],
                             gradient_accumulation_steps: int = 1, *, seed: int | None = None,
                             user_metadata: Mapping[str, str] | None = None) -> AdapterInfo:
        """Create a LoRA adapter (one server training run) under `adapter_name`.

        Args:
            adapter_name: the name later ops pass as `adapter_name=`; unique in this object.
            config: a peft `LoraConfig` or a dict of its fields (see `lora.lora_spec`).
            gradient_accumulation_steps: `step()` applies the optimizer (and `zero_grad`,
                `lr_step` act) only every k-th call; native losses divide by k, so k
                micro-batches of equal token count equal one k-times larger batch.
            seed: the LoRA initialisation seed (random when None).
            user_metadata: stored with the run.

        Raises:
            ValueError: a duplicate name, a bad step count or an unsupported LoRA field.
            TwinkleError subclasses: the server refused (rank over its limit, no free slot,
                not enough memory; the message says which and by how much).
        """
        if not adapter_name or not isinstance(adapter_name, str):
            raise ValueError(f"adapter_name: must be a non-empty string, got {adapter_name!r}")
        if adapter_name in self._adapters:
            raise ValueError(f"adapter_name: {adapter_name!r} already exists in this model; "
                             f"it holds {sorted(self._adapters)}")
        if isinstance(gradient_accumulation_steps, bool) \
                or not isinstance(gradient_accumulation_steps, int) \
                or gradient_accumulation_steps < 1:
            raise ValueError("gradient_accumulation_steps: must be an integer >= 1, got "
                             f"{gradient_accumulation_steps!r}")
        lora = lora_spec(config, seed)
        info = api.create_model(
            base_model=self.base_model, lora=lora,
            gradient_accumulation_steps=gradient_accumulation_steps,
            user_metadata={"adapter_name": adapter_name, **(user_metadata or {})}
        ).send(self.connection)
        record = AdapterInfo(adapter_name=adapter_name, training_run_id=info.model_id,
                             base_model=info.base_model, target_modules=list(info.target_modules),
                             trainable_params=info.trainable_params, state_bytes=info.state_bytes,
                             gradient_accumulation_steps=gradient_accumulation_steps)
        self._adapters[adapter_name] = AdapterRecord(adapter_name, info.model_id, record)
        return record

    @property
    def adapter_names(self) -> list[str]:
        return list(self._adapters)

    def get_adapter_info(self, adapter_name: str | None = None) -> AdapterInfo:
        """The adapter's server run id, targets and sizes."""
        return self._adapter(adapter_name).info

    @property
    def training_run_id(self) -> str:
        """The run id of the only adapter (see `get_adapter_info` for several)."""
        return self._adapter(None).run_id

    def remove_adapter(self, adapter_name: str | None = None) -> None:
        """Wait for the adapter's queued ops, then unload it on the server (its slot is
        freed; its run and checkpoints stay)."""
        adapter = self._adapter(adapter_name)
        if adapter.last_op is not None:
            adapter.last_op.exception()
        api.unload_model(adapter.run_id).send(self.connection)
        del self._adapters[adapter.name]

    def _adapter(self, adapter_name: str | None) -> AdapterRecord:
        if adapter_name is None:
            if len(self._adapters) == 1:
                return next(iter(self._adapters.values()))
            if not self._adapters:
                raise ValueError("adapter_name: the model has no adapter; call "
                                 "add_adapter_to_model(name, LoraConfig(...)) first")
            raise ValueError(f"adapter_name: the model holds {sorted(self._adapters)}; "
                             "pass adapter_name= to choose one")
        if adapter_name not in self._adapters:
            raise ValueError(f"adapter_name: no adapter {adapter_name!r}; the model holds "
                             f"{sorted(self._adapters)}")
        return self._adapters[adapter_name]

    # ------------------------------------------------------------------ op plumbing

    def _finish(self, adapter: AdapterRecord, future: Future[T], blocking: bool) -> T | Future[T]:
        adapter.last_op = future
        return future.result() if blocking else future

    def _ordered(self, adapter: AdapterRecord, call: api.OpCall[Any], blocking: bool,
                 then: Callable[[Any], T] | None = None) -> T | Future[T]:
        """One ordered op, already built (and its arguments checked) by the caller: its
        seq_id is taken now, in the caller's thread, so a bad argument fails before and
        leaves no gap in the model's seq chain."""
        future = api.submit(self.connection, adapter.run_id, call)
        return self._finish(adapter, future if then is None else future.then(then), blocking)
