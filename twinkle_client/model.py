"""`MultiLoraTransformersModel`: a remote mirror of a local LoRA training loop.

Every call the user writes in their loop (`forward_backward`, `clip_grad_norm`, `step`,
`zero_grad`, `lr_step`, `save`, ...) is one ordered op on the server. The server runs a
model's ops in the order of their `seq_id`s, which this class takes from the connection
in the caller's thread at call time, so call order is execution order even when calls
are not awaited.

Blocking and non-blocking: every op returns its value by default; with `blocking=False`
it returns a `twinkle_client.futures.Future` at once (`.result()`, or `await fut` in a
notebook), so a loop can queue several ops before waiting:

    fut = model.forward_backward(batch, blocking=False)
    model.clip_grad_and_step(blocking=False)
    print(fut.result().loss)

Adapters: each `add_adapter_to_model(name, ...)` creates one server model (one training
run) with its own LoRA weights, optimizer, scheduler, loss and counters. Ops take
`adapter_name=`; it may be left out while the object holds one adapter (the usual case).

Client-side validation (inputs, names, LoRA fields) happens before a seq_id is taken, so
a rejected call never leaves a gap that would stall the model's later ops. Creating,
finding and removing adapters, and sending an op to one, is `model_adapters`' half.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from twinkle_client import api, sampling
from twinkle_client.client import TwinkleClient
from twinkle_client.connection import Connection
from twinkle_client.errors import require_int
from twinkle_client.features import align_per_token, encode_feature
from twinkle_client.futures import Future
from twinkle_client.model_adapters import AdapterRecord, ModelAdapters, connection_of, served_base
from twinkle_client.outputs import AdapterInfo, ForwardOutput, SampledSequence, SampleOutput
from twinkle_client.processor import InputProcessor, make_processor
from twinkle_wire import paths

if TYPE_CHECKING:
    from twinkle_client.template import Template

__all__ = ["AdapterInfo", "ForwardOutput", "MultiLoraTransformersModel", "SampleOutput",
           "SampledSequence"]

T = TypeVar("T")


# ----------------------------------------------------------------------------- helpers


def _loss_config(kwargs: Mapping[str, Any]) -> dict[str, float]:
    config = {}
    for key, value in kwargs.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise ValueError(f"loss.{key}: must be a finite number, got {value!r}")
        config[key] = float(value)
    return config


def _class_name(value: str | type, what: str) -> str:
    name = value if isinstance(value, str) else getattr(value, "__name__", None)
    if not name:
        raise ValueError(f"{what}: expected a name such as 'AdamW' or a class, got {value!r}")
    return name


def _check_bool(value: Any, field: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{field}: must be True or False, got {value!r}")


def _forward_output(result: api.ForwardResult) -> ForwardOutput:
    return ForwardOutput(result.loss, result.metrics, [out["logprobs"] for out in result.outputs])


# ----------------------------------------------------------------------------- the model


class MultiLoraTransformersModel(ModelAdapters):
    """LoRA adapters on a served base model, trained by the calls of your own loop.

    Args:
        model_id: the base model, as the server serves it (`ms://`/`hf://` prefixes are
            dropped); a name the server does not serve raises InvalidArgumentError.
        client: a `TwinkleClient` or `Connection`; default the one `init_twinkle_client`
            made.

    Example:
        model = MultiLoraTransformersModel(model_id='ms://Qwen/Qwen3-0.6B')
        model.add_adapter_to_model('default', LoraConfig(r=8, target_modules='all-linear'))
        model.set_loss('CrossEntropyLoss'); model.set_optimizer('AdamW', lr=1e-4)
        for batch in dataloader:
            model.forward_backward(inputs=batch)
            model.clip_grad_and_step(1.0)
        path = model.save('final')
    """

    def __init__(self, model_id: str, client: TwinkleClient | Connection | None = None) -> None:
        self.connection = connection_of(client)
        self.model_id = model_id
        self.base_model = served_base(self.connection, model_id)
        self.processor: Callable[[Any], list[dict[str, Any]]] = InputProcessor()
        self.template: Template | None = None
        self._adapters: dict[str, AdapterRecord] = {}

    # ------------------------------------------------------------------ client-side setup

    def set_template(self, template: str | type | Template = "Template", **kwargs: Any) -> None:
        """The chat template that encodes rows given as `messages` and sample prompts, and
        decodes samples. A name or class gets `model_id` (this model's) and the
        connection unless `kwargs` set them."""
        from twinkle_client.template import build_template

        if isinstance(template, (str, type)):
            kwargs = {"model_id": self.model_id, "connection": self.connection, **kwargs}
        self.template = build_template(template, **kwargs)

    def set_processor(self, processor: str | type | Callable[[Any], list[dict[str, Any]]] =
                      "InputProcessor", **kwargs: Any) -> None:
        """How `inputs` become per-sequence features: a registered name
        ('InputProcessor'), a class (built with `kwargs`) or a callable."""
        self.processor = make_processor(processor, **kwargs)

    # ------------------------------------------------------------------ configuration ops

    def set_loss(self, loss_cls: str | type, *, adapter_name: str | None = None,
                 blocking: bool = True, **kwargs: Any) -> None | Future[None]:
        """The loss forward_backward uses, from the server's list ('CrossEntropyLoss' =
        token mean, 'GRPOLoss' with epsilon/epsilon_high, or a Tinker loss); `kwargs` are
        its numeric config."""
        name, config = _class_name(loss_cls, "loss"), _loss_config(kwargs)
        adapter = self._adapter(adapter_name)
        return self._ordered(adapter, api.set_loss(api.Loss(name, config)), blocking)

    def set_optimizer(self, optimizer_cls: str | type, *, adapter_name: str | None = None,
                      blocking: bool = True, **kwargs: Any) -> None | Future[None]:
        """The optimizer by name or class ('AdamW', 'Adam', 'SGD') and its kwargs
        (lr=..., weight_decay=...); the server checks both against its allow-list."""
        call = api.set_optimizer(_class_name(optimizer_cls, "optimizer"), kwargs)
        return self._ordered(self._adapter(adapter_name), call, blocking)

    def set_lr_scheduler(self, scheduler_cls: str | type, *, adapter_name: str | None = None,
                         blocking: bool = True, **kwargs: Any) -> None | Future[None]:
        """The learning-rate scheduler by name or class ('LinearLR', 'CosineAnnealingLR',
        'CosineWarmupScheduler', ...) and its kwargs; call after set_optimizer."""
        call = api.set_lr_scheduler(_class_name(scheduler_cls, "lr_scheduler"), kwargs)
        return self._ordered(self._adapter(adapter_name), call, blocking)

    # ------------------------------------------------------------------ forward

    def _features(self, inputs: Any, old_logps: Sequence[Any] | None,
                  advantages: Sequence[Any] | None) -> list[dict[str, Any]]:
        """Inputs -> per-sequence features (rows of `messages` through the template),
        with RL values attached one per sequence."""
        if isinstance(inputs, Sequence) and inputs and all(
                isinstance(x, Mapping) and "input_ids" not in x and "messages" in x
                for x in inputs):
            if self.template is None:
                raise ValueError("inputs: rows hold 'messages', not 'input_ids'; call "
                                 "set_template(...) first or encode the dataset")
            inputs = self.template.encode_batch(list(inputs))
        features = [dict(f) for f in self.processor(inputs)]
        for key, values in (("old_logps", old_logps), ("advantages", advantages)):
            if values is None:
                continue
            if len(values) != len(features):
                raise ValueError(f"{key}: has {len(values)} entries but inputs hold "
                                 f"{len(features)} sequences; give one per sequence")
            for index, (feature, value) in enumerate(zip(features, values, strict=True)):
                if key == "advantages" and np.ndim(value) == 0:
                    feature[key] = float(value)
                else:
                    feature[key] = align_per_token(value, feature, f"{key}[{index}]")
        return features

    def _forward(self, inputs: Any, backward: bool, adapter_name: str | None,
                 blocking: bool, old_logps: Sequence[Any] | None = None,
                 advantages: Sequence[Any] | None = None) -> ForwardOutput | Future[ForwardOutput]:
        adapter = self._adapter(adapter_name)
        features = self._features(inputs, old_logps, advantages)
        # Packed before the seq_id is taken: a datum that cannot be sent fails here.
        call = api.forward([encode_feature(f, i) for i, f in enumerate(features)],
                           backward=backward)
        future = api.submit(self.connection, adapter.run_id, call).then(_forward_output)
        adapter.last_forward = future
        return self._finish(adapter, future, blocking)

    def forward_backward(self, inputs: Any, *, old_logps: Sequence[Any] | None = None,
                         advantages: Sequence[Any] | None = None,
                         micro_batch_size: int | None = None,
                         adapter_name: str | None = None,
                         blocking: bool = True) -> ForwardOutput | Future[ForwardOutput]:
        """Forward and backward on a batch with the loss set by `set_loss`; gradients
        add up until `zero_grad`.

        Args:
            inputs: a list of features (`input_ids` + shifted `labels`), one feature, a
                padded batch dict with `attention_mask`, or rows of `messages` (with a
                template set); see `twinkle_client.processor`.
            old_logps: RL: per sequence, the sampler's logprobs, one per position or one
                per label token (a `SampledSequence.logprobs`).
            advantages: RL: per sequence, one value (broadcast over its tokens) or one per
                position.
            micro_batch_size: accepted for upstream compatibility and checked (>= 1); the
                server computes the whole batch's exact gradient in one op, so it does not
                change the result.
            adapter_name: which adapter (may be left out when there is one).
            blocking: False returns a Future at once.

        Returns:
            ForwardOutput with the loss, the metrics and per-sequence logprobs.
        """
        if micro_batch_size is not None:
            require_int(micro_batch_size, "micro_batch_size")
        return self._forward(inputs, True, adapter_name, blocking, old_logps, advantages)

    def forward_only(self, inputs: Any, *, adapter_name: str | None = None,
                     blocking: bool = True) -> ForwardOutput | Future[ForwardOutput]:
        """Forward without gradients (evaluation): the loss, metrics and logprobs; the
        loss counts toward `calculate_metric(is_training=False)`."""
        return self._forward(inputs, False, adapter_name, blocking)

    def calculate_loss(self, *, adapter_name: str | None = None,
                       blocking: bool = True) -> float | Future[float]:
        """The loss of the adapter's latest forward_backward or forward_only (the server
        computes it in that pass; this makes no extra call)."""
        adapter = self._adapter(adapter_name)
        if adapter.last_forward is None:
            raise ValueError("calculate_loss: no forward_backward or forward_only has run "
                             f"on adapter {adapter.name!r} yet")
        future = adapter.last_forward.then(lambda out: out.loss)
        return future.result() if blocking else future

    def calculate_metric(self, is_training: bool = True, *, adapter_name: str | None = None,
                         blocking: bool = True) -> dict[str, float] | Future[dict[str, float]]:
        """Averages since the previous call (loss, token_accuracy) of training
        (forward_backward) or evaluation (forward_only) passes, with grad_norm, lr,
        tokens_seen and steps; the averages then restart."""
        _check_bool(is_training, "is_training")
        adapter = self._adapter(adapter_name)
        return self._ordered(adapter, api.calculate_metric(is_training), blocking)

    # ------------------------------------------------------------------ optimizer ops

    def clip_grad_norm(self, max_norm: float = 1.0, *, adapter_name: str | None = None,
                       blocking: bool = True) -> float | Future[float]:
        """Clip the gradients to total L2 norm `max_norm` at the end of an accumulation
        window (inside one, it only measures; `max_norm` 0 always only measures, below 0
        is refused); returns the norm before clipping."""
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) \
                or not math.isfinite(max_norm):
            raise ValueError(f"max_norm: must be a finite number, got {max_norm!r}")
        adapter = self._adapter(adapter_name)
        return self._ordered(adapter, api.clip_grad_norm(float(max_norm)), blocking,
                             lambda metrics: metrics["grad_norm"])

    def step(self, *, adapter_name: str | None = None, blocking: bool = True
             ) -> dict[str, float] | Future[dict[str, float]]:
        """Count a micro-step; every gradient_accumulation_steps-th one applies the
        optimizer. Returns {'applied', 'step', 'micro_step'}."""
        return self._ordered(self._adapter(adapter_name), api.step(), blocking)

    def zero_grad(self, *, adapter_name: str | None = None, blocking: bool = True
                  ) -> None | Future[None]:
        """Drop the gradients, at an accumulation boundary (inside a window they keep
        adding up)."""
        return self._ordered(self._adapter(adapter_name), api.zero_grad(), blocking)

    def lr_step(self, *, adapter_name: str | None = None, blocking: bool = True
                ) -> None | Future[None]:
        """Advance the learning-rate scheduler, once per applied optimizer step."""
        return self._ordered(self._adapter(adapter_name), api.lr_step(), blocking)

    def clip_grad_and_step(self, max_norm: float = 1.0, *, adapter_name: str | None = None,
                           blocking: bool = True
                           ) -> dict[str, float] | Future[dict[str, float]]:
        """clip_grad_norm, step, zero_grad and lr_step, queued in that order. Returns
        {'grad_norm', 'applied', 'step', 'micro_step'}."""
        norm = self.clip_grad_norm(max_norm, adapter_name=adapter_name, blocking=False)
        stepped = self.step(adapter_name=adapter_name, blocking=False)
        self.zero_grad(adapter_name=adapter_name, blocking=False)
        last = self.lr_step(adapter_name=adapter_name, blocking=False)
        future = last.then(lambda _: {"grad_norm": norm.result(), **stepped.result()})
        return self._finish(self._adapter(adapter_name), future, blocking)

    def get_train_configs(self, *, adapter_name: str | None = None, blocking: bool = True
                          ) -> dict[str, Any] | Future[dict[str, Any]]:
        """The adapter's LoRA spec, optimizer, scheduler, loss, accumulation and counters."""
        return self._ordered(self._adapter(adapter_name), api.get_train_configs(), blocking)

    # ------------------------------------------------------------------ checkpoints

    def save(self, name: str, save_optimizer: bool = False, *, overwrite: bool = False,
             adapter_name: str | None = None, blocking: bool = True) -> str | Future[str]:
        """Save the adapter (PEFT format) and, with `save_optimizer`, the optimizer,
        scheduler and counters to resume exactly. Returns its twinkle:// path. A name
        this run has saved before is refused unless `overwrite` (replaced whole, never
        half-written)."""
        paths.check_name(name)
        _check_bool(save_optimizer, "save_optimizer")
        _check_bool(overwrite, "overwrite")
        adapter = self._adapter(adapter_name)
        return self._ordered(adapter, api.save_state(name, include_optimizer=save_optimizer,
                                                     overwrite=overwrite), blocking)

    def load(self, path: str, load_optimizer: bool = False, *,
             adapter_name: str | None = None, blocking: bool = True) -> None | Future[None]:
        """Load a checkpoint's weights (and, with `load_optimizer`, its optimizer,
        scheduler and counters) into the adapter; without `load_optimizer`, the adapter's
        optimizer and scheduler keep their settings but start again (moments, schedule
        position and step counters reset). `path` is a twinkle:// (or tinker://) path, or
        the bare name of a checkpoint of this adapter's own run."""
        _check_bool(load_optimizer, "load_optimizer")
        adapter = self._adapter(adapter_name)
        if "://" not in path:
            path = f"twinkle://{adapter.run_id}/weights/{paths.check_name(path)}"
        paths.parse(path)
        return self._ordered(adapter, api.load_state(path, include_optimizer=load_optimizer),
                             blocking)

    # ------------------------------------------------------------------ sampling

    def _template(self) -> Template:
        """The template set with `set_template`, else the default one for this model."""
        if self.template is None:
            self.set_template("Template")
        return self.template  # type: ignore[return-value]

    def sample(self, inputs: Any, *, max_tokens: int = 64, temperature: float = 1.0,
               top_p: float = 1.0, top_k: int = -1, stop: Sequence[str | int] | None = None,
               seed: int | None = None, num_samples: int = 1,
               adapter_name: str | None = None, blocking: bool = True
               ) -> SampleOutput | Future[SampleOutput]:
        """Sample completions from the adapter as it is now: each prompt is an op queued
        after the adapter's earlier training ops, so a rollout sees every update before it.

        Args:
            inputs: one prompt or a list (token ids, a feature, a string user message, or
                chat messages; strings and messages go through the template).
            max_tokens, temperature, top_p, top_k (-1 = no limit), stop (strings or token
                ids), seed (same seed, same tokens), num_samples per prompt.

        Returns:
            SampleOutput with every completion, prompt by prompt.
        """
        require_int(max_tokens, "max_tokens")
        require_int(num_samples, "num_samples")
        adapter = self._adapter(adapter_name)
        prompts = sampling.prompts(inputs, self._template)
        params = sampling.params(max_tokens, temperature, top_p, top_k, stop, seed)
        calls = [api.sample_op(prompt.astype(np.int64), num_samples, params, f"inputs[{i}]")
                 for i, prompt in enumerate(prompts)]
        replies = [api.submit(self.connection, adapter.run_id, call) for call in calls]

        def collect() -> SampleOutput:
            decode = self._template().decode
            return sampling.completions(prompts, [reply.result() for reply in replies], decode)

        return self._finish(adapter, self.connection.submit(collect), blocking)

    def __repr__(self) -> str:
        return (f"MultiLoraTransformersModel({self.model_id!r}, "
                f"adapters={ {n: a.run_id for n, a in self._adapters.items()} })")
