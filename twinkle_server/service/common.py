"""What every servicer shares: the exception-to-status wrappers, auth metadata and proto
conversions."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import json_format

from twinkle_server.engine.types import LoraSpec
from twinkle_server.runtime import OpRef, Runtime, bearer_token
from twinkle_server.runtime.runs import RunView, run_switches
from twinkle_server.service.errors import status_for
from twinkle_server.store import CheckpointRow, RunRow
from twinkle_wire._proto.twinkle.v1 import common_pb2 as pb


def unary(fn: Callable) -> Callable:
    """Turn any exception of a unary handler into its gRPC status (and message)."""
    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            return await fn(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            code, message = status_for(exc)
            await context.abort(code, message)
    return wrapper


def streaming(fn: Callable) -> Callable:
    """The same for handlers that stream responses (async generators)."""
    @functools.wraps(fn)
    async def wrapper(self, request, context) -> AsyncIterator[Any]:
        try:
            async for item in fn(self, request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            code, message = status_for(exc)
            await context.abort(code, message)
    return wrapper


def tenant_of(rt: Runtime, context: grpc.aio.ServicerContext) -> str:
    """The calling tenant from `authorization: Bearer <key>` metadata (`bearer_token`)."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return rt.authenticate(bearer_token(value))
    return rt.authenticate(None)


def op_ref(header: pb.OpHeader) -> OpRef:
    return OpRef(header.model_id, header.seq_id, header.request_id)


def kwargs_of(struct) -> dict[str, Any]:
    return json_format.MessageToDict(struct) if struct is not None else {}


def spec_from_proto(lora: pb.LoraConfig) -> LoraSpec:
    """A LoRA spec from the wire: PEFT-style target list, 'all-linear', or Tinker switches
    (all three off is refused by `Training.create_model`)."""
    seed = lora.seed if lora.HasField("seed") else None
    if lora.all_linear or list(lora.target_modules):
        targets: tuple[str, ...] | str = ("all-linear" if lora.all_linear
                                          else tuple(sorted(lora.target_modules)))
        return LoraSpec(rank=lora.rank, alpha=lora.alpha or 32.0, dropout=lora.dropout,
                        target_modules=targets, use_rslora=lora.use_rslora, seed=seed)
    spec = LoraSpec.from_tinker(lora.rank, seed, lora.train_mlp, lora.train_attn,
                                lora.train_unembed)
    return LoraSpec(rank=spec.rank, alpha=lora.alpha or spec.alpha, dropout=lora.dropout,
                    target_modules=spec.target_modules, use_rslora=lora.use_rslora, seed=seed)


def spec_to_proto(spec: LoraSpec) -> pb.LoraConfig:
    out = pb.LoraConfig(rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout,
                        use_rslora=spec.use_rslora)
    if spec.target_modules == "all-linear":
        out.all_linear = True
    elif isinstance(spec.target_modules, str):
        out.target_modules.append(spec.target_modules)
    else:
        out.target_modules.extend(spec.target_modules)
    if spec.seed is not None:
        out.seed = spec.seed
    return out


def checkpoint_to_proto(row: CheckpointRow, run: RunRow | None) -> pb.Checkpoint:
    return pb.Checkpoint(
        checkpoint_id=row.checkpoint_id, checkpoint_type=row.kind,
        path=f"twinkle://{row.run_id}/{row.checkpoint_id}", run_id=row.run_id, name=row.name,
        created_at=row.created_at, size_bytes=row.size_bytes, has_optimizer=row.has_optimizer,
        base_model=run.base_model if run else "", lora_rank=int(run.lora["rank"]) if run else 0,
        user_metadata=row.user_metadata, public=row.public, expires_at=row.expires_at or 0.0,
        **run_switches(run))


def run_to_proto(view: RunView) -> pb.TrainingRun:
    run = view.run
    out = pb.TrainingRun(run_id=run.run_id, base_model=run.base_model, owner=run.tenant,
                         is_lora=True, lora_rank=int(run.lora["rank"]), created_at=run.created_at,
                         last_request_time=run.last_request_time,
                         user_metadata=run.user_metadata, loaded=view.loaded)
    if view.last_checkpoint is not None:
        out.last_checkpoint.CopyFrom(checkpoint_to_proto(view.last_checkpoint, run))
    if view.last_sampler_checkpoint is not None:
        out.last_sampler_checkpoint.CopyFrom(checkpoint_to_proto(view.last_sampler_checkpoint,
                                                                 run))
    return out
