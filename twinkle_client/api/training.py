"""TrainingService: training models and the ops of a training loop, as `Call`s and
`OpCall`s (see `calls`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import struct_pb2

import twinkle_wire as wire
from twinkle_client.api.calls import (
    Call,
    ForwardCall,
    InSession,
    OpCall,
    UnaryOp,
    loss_fn,
    metrics,
    no_reply,
)
from twinkle_client.api.values import LoraSpec, Loss, ModelInfo
from twinkle_client.connection import Connection
from twinkle_wire._proto.twinkle.v1 import common_pb2, training_pb2
from twinkle_wire.values import AdamParams

# ----------------------------------------------------------------------------- models


class _NewModel(InSession[ModelInfo]):
    """CreateModel: the new model's ops are numbered from where the server expects them."""

    def send(self, conn: Connection) -> ModelInfo:
        info = super().send(conn)
        conn.register_model(info.model_id, info.next_seq_id)
        return info


def create_model(*, base_model: str = "", lora: LoraSpec | None = None,
                 user_metadata: Mapping[str, str] | None = None,
                 gradient_accumulation_steps: int = 0, from_checkpoint: str = "",
                 load_optimizer: bool = False) -> Call[ModelInfo]:
    """A new training model under the connection's session (from a checkpoint when
    `from_checkpoint` is set); once sent, its ops are numbered from where the server
    expects them."""
    request = training_pb2.CreateModelRequest(
        base_model=base_model, user_metadata=user_metadata or {},
        gradient_accumulation_steps=gradient_accumulation_steps,
        from_checkpoint=from_checkpoint, load_optimizer=load_optimizer)
    if lora is not None:
        request.lora.CopyFrom(_lora(lora))
    return _NewModel("training", "CreateModel", request, _model_info, retry=False)


def _model_info(info: training_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(info.model_id, info.base_model, info.arch, info.tokenizer_id,
                     info.is_lora, info.lora.rank, info.next_seq_id,
                     tuple(info.target_modules), info.trainable_params, info.state_bytes)


def _lora(spec: LoraSpec) -> common_pb2.LoraConfig:
    out = common_pb2.LoraConfig(
        rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout,
        target_modules=list(spec.target_modules), all_linear=spec.all_linear,
        use_rslora=spec.use_rslora, train_mlp=spec.train_mlp, train_attn=spec.train_attn,
        train_unembed=spec.train_unembed)
    if spec.seed is not None:
        out.seed = spec.seed
    return out


def unload_model(model_id: str) -> Call[None]:
    """Free the model's adapter slot now; its run and checkpoints stay."""
    return Call("training", "UnloadModel", training_pb2.UnloadModelRequest(model_id=model_id),
                no_reply, retry=False)

# ----------------------------------------------------------------------------- ordered ops


def forward(datums: Sequence[wire.Datum], loss: Loss | None = None, backward: bool = True,
            first: int = 0, provenance: Sequence[wire.Provenance | None] | None = None
            ) -> ForwardCall:
    """A Forward(Backward) op on `datums`, every chunk packed now (a datum that cannot be
    sent raises `wire.WireError` naming it by its index, counted from `first`).
    `provenance`, one entry per datum (None: none), names the recorded sampled sequences
    behind each datum's tokens, which the stable_reinforce loss needs."""
    if not isinstance(datums, Sequence) or not all(isinstance(d, wire.Datum) for d in datums):
        raise TypeError("datums: expected a list of wire.Datum (wire.encode_datum, "
                        "features.encode_feature or a client's conversion makes them)")
    chunks = wire.pack_request(datums, first=first)
    if provenance is not None:
        if len(provenance) != len(datums):
            raise ValueError(f"provenance: {len(provenance)} entries for {len(datums)} datums")
        wire.attach_provenance(chunks, provenance)
    return ForwardCall(chunks, loss, backward)


def set_loss(loss: Loss) -> OpCall[None]:
    """The loss later forward passes with no loss of their own use."""
    return UnaryOp("training", "SetLoss", training_pb2.SetLossRequest(loss=loss_fn(loss)),
                   no_reply)


def set_optimizer(name: str, kwargs: Mapping[str, Any]) -> OpCall[None]:
    """The optimizer by allow-listed name and its kwargs (numbers, strings, booleans or
    lists; anything else raises ValueError naming `optimizer.<key>`)."""
    return UnaryOp("training", "SetOptimizer", training_pb2.ConfigureRequest(
        name=name, kwargs=_struct(kwargs, "optimizer")), no_reply)


def set_lr_scheduler(name: str, kwargs: Mapping[str, Any]) -> OpCall[None]:
    """The learning-rate scheduler by allow-listed name and its kwargs (as set_optimizer)."""
    return UnaryOp("training", "SetLrScheduler", training_pb2.ConfigureRequest(
        name=name, kwargs=_struct(kwargs, "lr_scheduler")), no_reply)


def _struct(kwargs: Mapping[str, Any], what: str) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    for key, value in kwargs.items():
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, (bool, int, float, str, list, type(None))):
            raise ValueError(f"{what}.{key}: {type(value).__name__} values cannot be sent; "
                             "use numbers, strings, booleans or lists")
        out[key] = value
    return out


def clip_grad_norm(max_norm: float) -> OpCall[dict[str, float]]:
    """Clip to total L2 norm `max_norm`; the metrics hold `grad_norm` before clipping."""
    return UnaryOp("training", "ClipGradNorm",
                   training_pb2.ClipGradNormRequest(max_norm=max_norm), metrics)


def step() -> OpCall[dict[str, float]]:
    """A native-loop optimizer micro-step: {'applied', 'step', 'micro_step'}."""
    return UnaryOp("training", "Step", training_pb2.OpRequest(), metrics)


def zero_grad() -> OpCall[None]:
    """Drop the gradients (at an accumulation boundary)."""
    return UnaryOp("training", "ZeroGrad", training_pb2.OpRequest(), no_reply)


def lr_step() -> OpCall[None]:
    """Advance the learning-rate scheduler."""
    return UnaryOp("training", "LrStep", training_pb2.OpRequest(), no_reply)


def calculate_metric(is_training: bool) -> OpCall[dict[str, float]]:
    """Averages of training (or evaluation) passes since the last call, and counters."""
    return UnaryOp("training", "CalculateMetric",
                   training_pb2.CalculateMetricRequest(is_training=is_training), metrics)


def get_train_configs() -> OpCall[dict[str, Any]]:
    """The adapter's LoRA spec, optimizer, scheduler, loss and counters, as a dict."""
    return UnaryOp("training", "GetTrainConfigs", training_pb2.OpRequest(),
                   lambda reply: json.loads(reply.json))


def optim_step(adam: AdamParams) -> OpCall[dict[str, float]]:
    """Tinker's optim_step: AdamW with `adam`'s hyper-parameters, then zero the gradients."""
    return UnaryOp("training", "OptimStep", training_pb2.OptimStepRequest(
        adam=training_pb2.AdamParams(
            learning_rate=adam.learning_rate, beta1=adam.beta1, beta2=adam.beta2,
            eps=adam.eps, weight_decay=adam.weight_decay,
            grad_clip_norm=adam.grad_clip_norm)), metrics)


def save_state(name: str, include_optimizer: bool = False,
               user_metadata: Mapping[str, str] | None = None,
               overwrite: bool = False) -> OpCall[str]:
    """Save the adapter (and optimizer state) as `weights/<name>`; returns its path."""
    return UnaryOp("training", "SaveState", training_pb2.SaveRequest(
        name=name, include_optimizer=include_optimizer, user_metadata=user_metadata or {},
        overwrite=overwrite), lambda reply: reply.path)


def save_weights_for_sampler(name: str, user_metadata: Mapping[str, str] | None = None
                             ) -> OpCall[str]:
    """Save the adapter weights as `sampler_weights/<name>`; returns its path."""
    return UnaryOp("training", "SaveWeightsForSampler", training_pb2.SaveRequest(
        name=name, user_metadata=user_metadata or {}), lambda reply: reply.path)


def save_ephemeral_sampler(inflight: bool = False) -> OpCall[str]:
    """Snapshot the adapter weights for a new sampling session of their own (Tinker's
    ephemeral sampler weights: no checkpoint, deleted with the session); returns the
    sampling session's id. `inflight`: publish them to the model's shared inflight target
    instead, which every inflight session of the model samples and later inflight saves
    update."""
    return UnaryOp("training", "SaveWeightsForSampler", training_pb2.SaveRequest(
        ephemeral=True, inflight=inflight), lambda reply: reply.sampling_session_id)


def load_state(path: str, include_optimizer: bool = False) -> OpCall[None]:
    """Load a checkpoint's weights (and optimizer state) into the adapter."""
    return UnaryOp("training", "LoadState", training_pb2.LoadStateRequest(
        path=path, include_optimizer=include_optimizer), no_reply)
