"""Adapter checkpoints on disk: standard PEFT weights, plus training state when asked.

A checkpoint is a directory:
- `adapter_config.json`, `adapter_model.safetensors`: what `peft` writes, so
  `peft.PeftModel.from_pretrained(base, dir)` loads it and gives the engine's logits;
- `training_state.pt` (training checkpoints with optimizer): optimizer and scheduler
  state with their names and kwargs, counters, native loss. It holds only tensors and
  plain Python values and is read with `torch.load(weights_only=True)`, which executes
  no code from the file. No RNG state: torch's global generator is shared by every
  tenant of the process, so one adapter's load must not rewind it.

Writes go to a temp directory beside the target and are renamed into place, so a crash
never leaves a half checkpoint under a real name.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors

from twinkle_server.engine import optim
from twinkle_server.engine.adapter import Adapter
from twinkle_server.engine.declared import DeclaredNames, declared_names
from twinkle_server.engine.errors import FailedPrecondition, InvalidArgument, NotFound
from twinkle_server.engine.types import AdamParams, LoraSpec, LossSpec, tinker_switches

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
STATE_FILE = "training_state.pt"


PEFT_KEY_PREFIX = "base_model.model."


def peft_key(module: str, which: str) -> str:
    """PEFT's saved key for one LoRA matrix (`which` is `lora_A` or `lora_B`)."""
    return f"{PEFT_KEY_PREFIX}{module}.{which}.weight"


def rename_keys(tensors: Mapping[str, torch.Tensor], rename: Callable[[str], str]
                ) -> dict[str, torch.Tensor]:
    """`tensors` with each PEFT key's module path renamed (`declared.DeclaredNames`)."""
    return {PEFT_KEY_PREFIX + rename(k[len(PEFT_KEY_PREFIX):])
            if k.startswith(PEFT_KEY_PREFIX) else k: v for k, v in tensors.items()}


def write_atomically(path: str | Path, fill: Callable[[Path], None],
                     overwrite: bool = False) -> int:
    """Create directory `path` by filling a temp dir and renaming it; returns bytes written.

    With `overwrite`, an existing `path` is replaced only once the new one is complete
    (moved aside, the new one renamed in, the old one removed): a crash leaves either the
    old or the new checkpoint, except in the instant between the two renames.

    Every file is written with plain file I/O (`write_bytes`), so a full disk, a quota or a
    read-only data dir is one `OSError`, reported as `FailedPrecondition`: the adapter's
    state in memory is untouched and the same save can be tried again.
    """
    target = Path(path)
    if target.exists() and not overwrite:
        raise FailedPrecondition(f"checkpoint: {target.name!r} already exists; choose another "
                                 "name or overwrite it")
    scratch: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        fill(scratch)
        size = sum(f.stat().st_size for f in scratch.iterdir())
        for f in scratch.iterdir():
            with open(f, "rb") as handle:
                os.fsync(handle.fileno())
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old)
            os.rename(scratch, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(scratch, target)
    except OSError as exc:
        raise FailedPrecondition(
            f"checkpoint: could not write {target.name!r}: {exc.strerror or exc}; training "
            "state is unchanged and can be saved again") from exc
    finally:
        if scratch is not None and scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return size


def replace_file(path: Path, data: bytes) -> None:
    """Write file `path` whole: `data` into a hidden file beside it, then renamed over it,
    so a reader finds the old file or the new one, never part of one."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.part")
    partial.write_bytes(data)
    partial.replace(path)


def write_state(out: Path, state: dict) -> None:
    """`torch.save` of the training state into `out`, through memory so that a failed
    write is an `OSError` like every other checkpoint file's."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    (out / STATE_FILE).write_bytes(buffer.getvalue())


DROPOUT_METADATA = "twinkle.lora_dropout"
"""The weights file's metadata key for an adapter's dropout where its `adapter_config.json`
cannot hold it (see `write_peft`)."""
NAMES_METADATA = "twinkle.declared_names"
"""The weights file's metadata key for the module-name map its names were written with
(`declared.DeclaredNames`, JSON; absent where empty), which `read_spec` and
`read_weights` undo."""
ROLES_METADATA = "twinkle.target_roles"
"""The weights file's metadata key for the roles an adapter made with Tinker's switches
targets (`types.ROLE_TARGETS`, JSON; absent for module-name targets): `read_spec` gives
them back, so a run resumed from the checkpoint is made with the same switches."""


def write_peft(out: Path, spec: LoraSpec, tensors: dict[str, torch.Tensor],
               target_modules: list[str], base_model_path: str,
               target_parameters: list[str] | None = None) -> None:
    """Write `adapter_config.json` and `adapter_model.safetensors` into `out`; the linears
    `target_modules` names as peft must read them (`peft_targets`), and
    `target_parameters` the MoE expert projections (`engine.experts`): both kinds of
    parameter target in one list, as peft reads them.

    peft refuses to load dropout on parameter targets. Dropout changes no output outside
    training, so such a config records 0, and the adapter's own dropout goes into the
    weights file's metadata (`DROPOUT_METADATA`, which peft ignores) for `read_spec`:
    every checkpoint loads in peft, and training resumes with the adapter's dropout.

    Names (`target_modules`, `tensors`' keys, `target_parameters`) are the engine's and
    are written as the base checkpoint's declared architecture spells them
    (`declared.declared_names`: a multimodal checkpoint's text model is under
    `model.language_model.` there), the map kept in the metadata (`NAMES_METADATA`)."""
    from peft import LoraConfig

    names = declared_names(base_model_path)
    modules, parameters = peft_targets(target_modules, _model_type(base_model_path))
    parameters = sorted(names.declared(p) for p in [*parameters, *(target_parameters or ())])
    modules = sorted(names.declared(m) for m in modules)
    metadata = {"format": "pt"}
    if parameters and spec.dropout:
        metadata[DROPOUT_METADATA] = repr(float(spec.dropout))
    if names.prefixes:
        metadata[NAMES_METADATA] = names.to_json()
    if tinker_switches(spec.target_modules) is not None:
        metadata[ROLES_METADATA] = json.dumps(list(spec.target_modules))
    config = LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha,
        lora_dropout=0.0 if parameters else spec.dropout,
        target_modules=modules, target_parameters=parameters or None,
        use_rslora=spec.use_rslora, base_model_name_or_path=base_model_path,
        task_type="CAUSAL_LM",
    )
    config.save_pretrained(str(out))
    (out / WEIGHTS_FILE).write_bytes(_sorted_metadata(save_safetensors(
        {k: v.detach().contiguous().cpu()
         for k, v in rename_keys(tensors, names.declared).items()}, metadata=metadata)))


def _sorted_metadata(data: bytes) -> bytes:
    """`data` (a safetensors file) with its header's metadata in key order. safetensors
    writes the metadata from a hash map, whose order changes from one call to the next:
    the same weights would be different bytes at each save. The header keeps its length
    (the same JSON, reordered; padded as safetensors pads), so no offset moves."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(text) > size:
        raise ValueError(f"safetensors header re-encoded to {len(text)} bytes, over its {size}")
    return data[:8] + text.ljust(size) + data[8 + size:]


def peft_targets(linears: list[str], model_type: str | None
                 ) -> tuple[list[str], list[str]]:
    """`(target_modules, target_parameters)` that make `peft` put LoRA on exactly the
    linear layers `linears` of a base of `model_type`.

    peft 0.21 on transformers 5 rewrites the config of MoE model types whose checkpoints
    transformers converts (glm4_moe, qwen3_moe, qwen3_next, deepseek_v3, ...; those
    mapped to qwen2_moe or mixtral): every `target_modules` entry ending in an expert
    projection's old name (`gate_proj`, `up_proj`, `down_proj`, `w1`..`w3`, `gate`) becomes
    a parameter target of the fused experts and leaves `target_modules`. A dense MLP's or
    a shared expert's LoRA under such a name would load as nothing, and routed experts
    would get zero LoRA in its place (glm4_moe: logprobs off by 0.33 after 4 steps). Those
    linears are written as parameter targets of their weight (`<module>.weight`), which
    peft applies as `W0 + s B A`: the same LoRA, under the same tensor keys."""
    renamed = peft_renamed_leaves(model_type) if model_type else frozenset()
    parameters = sorted(f"{n}.weight" for n in linears if n.rsplit(".", 1)[-1] in renamed)
    return sorted(n for n in linears if n.rsplit(".", 1)[-1] not in renamed), parameters


def peft_renamed_leaves(model_type: str) -> frozenset[str]:
    """The module-name leaves peft rewrites into expert parameter targets for
    `model_type` (`peft.utils.transformers_weight_conversion._convert_peft_config_moe`'s
    own tables and test; none where this peft has no such rewrite)."""
    try:
        from peft.utils.transformers_weight_conversion import (
            _MODEL_TO_CONVERSION_PATTERN,
            _MOE_FUSED_TARGETS,
            _MOE_TARGET_MODULE_MAPPING,
        )
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return frozenset()
    base = _MODEL_TO_CONVERSION_PATTERN.get(model_type)
    if (base is None or get_checkpoint_conversion_mapping(model_type) is None
            or not _MOE_FUSED_TARGETS.get(base)):
        return frozenset()
    return frozenset(_MOE_TARGET_MODULE_MAPPING.get(base, {}))


def _model_type(base_model_path: str) -> str | None:
    """The `model_type` in a base model directory's `config.json` (None without one)."""
    config = Path(base_model_path) / "config.json"
    try:
        return json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def read_spec(path: str | Path) -> tuple[LoraSpec, list[str]]:
    """The LoRA shape and target module names recorded in a checkpoint's config, in the
    engine's names (`NAMES_METADATA`; linears written as parameter targets of their
    `.weight` by `peft_targets` stay in `target_parameters`: `experts.split_parameters`
    reads them as linears)."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise NotFound(f"checkpoint: no {CONFIG_FILE} at {Path(path).name!r}")
    data = json.loads(config_path.read_text())
    metadata = _metadata(Path(path))
    names = _recorded_names(metadata)
    targets = data.get("target_modules") or []
    targets = [names.engine(t) for t in ([targets] if isinstance(targets, str) else targets)]
    dropout = float(metadata.get(DROPOUT_METADATA, 0.0))
    roles = metadata.get(ROLES_METADATA)
    spec = LoraSpec(rank=int(data["r"]), alpha=float(data["lora_alpha"]),
                    dropout=dropout or float(data.get("lora_dropout") or 0.0),
                    target_modules=tuple(sorted(targets)),
                    use_rslora=bool(data.get("use_rslora", False)),
                    target_parameters=tuple(sorted(
                        names.engine(p) for p in data.get("target_parameters") or ())))
    if roles is not None:   # the same layers on the same base, resolved from the roles
        spec = replace(spec, target_modules=tuple(json.loads(roles)), target_parameters=None)
    return spec, targets


def _metadata(path: Path) -> dict[str, str]:
    """The weights file's metadata (empty where it has none or cannot be read)."""
    try:
        with safe_open(str(path / WEIGHTS_FILE), "pt") as weights:
            return dict(weights.metadata() or {})
    except (OSError, ValueError, SafetensorError):
        return {}


def _recorded_names(metadata: Mapping[str, str]) -> DeclaredNames:
    """The name map `write_peft` kept in the metadata (empty where none: checkpoints
    written before it, or of a base whose declared architecture the engine loads)."""
    text = metadata.get(NAMES_METADATA)
    return DeclaredNames() if text is None else DeclaredNames.from_json(text)


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under the engine's PEFT keys (`NAMES_METADATA`)."""
    weights = Path(path) / WEIGHTS_FILE
    if not weights.is_file():
        raise NotFound(f"checkpoint: no {WEIGHTS_FILE} at {Path(path).name!r}")
    return rename_keys(load_file(str(weights)), _recorded_names(_metadata(Path(path))).engine)


def check_shapes(expected: dict[str, torch.Size], found: dict[str, torch.Tensor]) -> None:
    """Refuse a checkpoint whose tensors are not exactly the adapter's (names and shapes)."""
    missing = sorted(set(expected) - set(found))
    if missing:
        raise InvalidArgument(f"checkpoint: lacks {len(missing)} tensors, e.g. {missing[0]!r}; "
                              "it was saved for a different adapter shape (target modules)")
    extra = sorted(set(found) - set(expected))
    if extra:
        raise InvalidArgument(f"checkpoint: has {len(extra)} tensors the adapter does not, "
                              f"e.g. {extra[0]!r}; it was saved for different target modules")
    for key, shape in expected.items():
        if found[key].shape != shape:
            raise InvalidArgument(f"checkpoint: {key} has shape {list(found[key].shape)}, "
                                  f"the adapter needs {list(shape)} (a different rank?)")


# ----------------------------------------------------------------------------- adapters


def peft_tensors(adapter: Adapter) -> dict[str, torch.Tensor]:
    """The adapter's live LoRA matrices under their PEFT keys (the tensors themselves)."""
    return {peft_key(name, which): getattr(w, which)
            for name, w in adapter.weights.items() for which in ("lora_A", "lora_B")}


def check_weights(adapter: Adapter, found: dict[str, torch.Tensor]) -> None:
    """Refuse saved tensors that are not exactly the adapter's (names and shapes)."""
    check_shapes({k: v.shape for k, v in peft_tensors(adapter).items()}, found)


def copy_weights(adapter: Adapter, found: dict[str, torch.Tensor]) -> None:
    """Overwrite the adapter's weights in place with checked saved tensors."""
    with torch.no_grad():
        for key, tensor in peft_tensors(adapter).items():
            tensor.copy_(found[key].to(tensor.device, tensor.dtype))


def _fill_weights(adapter: Adapter, out: Path, base_model_path: str) -> None:
    # Expert weights are keyed by PEFT module path and name their base parameter.
    parameters = [w.parameter for w in adapter.weights.values() if hasattr(w, "parameter")]
    modules = [n for n, w in adapter.weights.items() if not hasattr(w, "parameter")]
    write_peft(out, adapter.spec, peft_tensors(adapter), sorted(modules), base_model_path,
               parameters)


def save_weights(adapter: Adapter, path: str | Path, base_model_path: str,
                 overwrite: bool = False) -> int:
    """PEFT weights only (a sampler checkpoint, an export); returns bytes written."""
    return write_atomically(
        path, lambda out: _fill_weights(adapter, out, base_model_path),
        overwrite)


def save_state(adapter: Adapter, path: str | Path, base_model_path: str,
               include_optimizer: bool = True, overwrite: bool = False) -> int:
    """PEFT weights plus, with `include_optimizer`, everything needed to resume exactly."""
    def fill(out: Path) -> None:
        _fill_weights(adapter, out, base_model_path)
        if include_optimizer:
            write_state(out, training_state(adapter))
    return write_atomically(path, fill, overwrite)


def _plain(value: Any) -> Any:
    """`value` with numpy scalars as Python numbers, which `weights_only` loading accepts
    (kwargs and loss configs given in-process may hold them; the wire gives floats)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def training_state(adapter: Adapter) -> dict[str, Any]:
    """What `training_state.pt` holds: tensors and plain Python values only."""
    return {
        "optimizer": adapter.optimizer.state_dict() if adapter.optimizer else None,
        "optimizer_name": adapter.optimizer_name,
        "optimizer_kwargs": _plain(adapter.optimizer_kwargs),
        "scheduler": adapter.scheduler.state_dict() if adapter.scheduler else None,
        "scheduler_name": adapter.scheduler_name,
        "scheduler_kwargs": _plain(adapter.scheduler_kwargs),
        "loss": _plain(asdict(adapter.loss)) if adapter.loss else None,
        "counters": {"step": adapter.step, "micro_step": adapter.micro_step,
                     "tokens_seen": adapter.tokens_seen, "grad_accum": adapter.grad_accum},
        "seed": _plain(adapter.spec.seed),
        # Saved mid accumulation window, the window's gradients so far: without them a
        # resumed run would apply its next step to only the micro-batches after the load.
        "pending_grads": None if adapter.at_boundary else [
            None if p.grad is None else p.grad.detach().cpu() for p in adapter.parameters()],
    }


def load_state(adapter: Adapter, path: str | Path, include_optimizer: bool,
               adopt_accumulation: bool = False) -> None:
    """Load weights (and optimizer, scheduler, loss, counters) into an existing adapter;
    without the optimizer, the adapter's optimizer starts again (`restart_optimizer`).

    Everything is read and rebuilt before the adapter changes, so a failure leaves it as
    it was. With the optimizer, the saved gradient accumulation count must equal the
    adapter's, or the load is refused; `adopt_accumulation` (an adapter created from the
    checkpoint with no count of its own) takes the saved count instead. A state saved mid
    accumulation window brings back the window's gradients so far, so the resumed run
    steps exactly as the uninterrupted one. Checkpoints
    written before the RNG state was dropped carry an `rng` key, which is ignored.
    """
    found = read_weights(path)
    check_weights(adapter, found)
    restored = None
    if include_optimizer:
        state_file = Path(path) / STATE_FILE
        if not state_file.is_file():
            raise FailedPrecondition("checkpoint: saved without optimizer state; "
                                     "load it without the optimizer")
        restored = _rebuild(adapter, torch.load(state_file, weights_only=True),
                            adopt_accumulation)
    pending = restored.pop("pending_grads") if restored is not None else None
    copy_weights(adapter, found)
    adapter.zero_grad()
    if restored is None:
        adapter.restart_optimizer()
    else:
        for field_name, value in restored.items():
            setattr(adapter, field_name, value)
    if pending is not None:
        for param, grad in zip(adapter.parameters(), pending, strict=True):
            if grad is not None:
                param.grad = grad.to(device=param.device, dtype=param.dtype)


def _rebuild(adapter: Adapter, state: dict[str, Any], adopt_accumulation: bool
             ) -> dict[str, Any]:
    """The adapter fields a saved training state sets, built without touching it."""
    counters = state["counters"]
    if counters["grad_accum"] != adapter.grad_accum and not adopt_accumulation:
        raise FailedPrecondition(
            f"checkpoint: saved with gradient_accumulation_steps={counters['grad_accum']} "
            f"but this adapter uses {adapter.grad_accum}; load it into an adapter with "
            f"{counters['grad_accum']}, or without the optimizer")
    optimizer = scheduler = None
    optimizer_name, optimizer_kwargs = "", {}
    scheduler_name, scheduler_kwargs = "", {}
    if state["optimizer"] is not None:
        optimizer_name = state["optimizer_name"]
        optimizer_kwargs = dict(state["optimizer_kwargs"])
        if optimizer_name == "AdamW" and not optimizer_kwargs:
            optimizer = optim.make_adamw(adapter.parameters(), AdamParams())
        else:
            optimizer = optim.build_optimizer(optimizer_name, adapter.parameters(),
                                              **optimizer_kwargs)
        optimizer.load_state_dict(state["optimizer"])
        if state["scheduler"] is not None:
            scheduler_name = state["scheduler_name"]
            scheduler_kwargs = dict(state["scheduler_kwargs"])
            scheduler = optim.build_scheduler(scheduler_name, optimizer, **scheduler_kwargs)
            # Building a scheduler takes its initial step, which rewrites every group's
            # lr (LinearLR: base lr / 3); the saved groups put the resumed lr back.
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
    pending = state.get("pending_grads")   # absent from checkpoints written before it
    params = list(adapter.parameters())
    if pending is not None and (len(pending) != len(params) or any(
            g is not None and g.shape != p.shape for g, p in zip(pending, params, strict=True))):
        raise FailedPrecondition("checkpoint: its pending gradients do not fit this "
                                 "adapter's parameters; load it without the optimizer")
    return {
        "pending_grads": pending,
        "optimizer": optimizer, "optimizer_name": optimizer_name,
        "optimizer_kwargs": optimizer_kwargs, "scheduler": scheduler,
        "scheduler_name": scheduler_name, "scheduler_kwargs": scheduler_kwargs,
        "loss": LossSpec(**state["loss"]) if state["loss"] else adapter.loss,
        "step": counters["step"], "micro_step": counters["micro_step"],
        "tokens_seen": counters["tokens_seen"], "grad_accum": counters["grad_accum"],
    }
