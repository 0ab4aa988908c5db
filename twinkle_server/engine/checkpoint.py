"""Adapter checkpoints on disk: standard PEFT weights, plus training state when asked.

A checkpoint is a directory:
- `adapter_config.json`, `adapter_model.safetensors`: what `peft` writes, so
  `peft.PeftModel.from_pretrained(base, dir)` loads it and gives the engine's logits;
- `training_state.pt` (training checkpoints with optimizer): optimizer and scheduler
  state with their names and kwargs, counters, native loss, RNG state.

Writes go to a temp directory beside the target and are renamed into place, so a crash
never leaves a half checkpoint under a real name.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors

from twinkle_server.engine.errors import FailedPrecondition, InvalidArgument, NotFound
from twinkle_server.engine.types import LoraSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
STATE_FILE = "training_state.pt"


def peft_key(module: str, which: str) -> str:
    """PEFT's saved key for one LoRA matrix (`which` is `lora_A` or `lora_B`)."""
    return f"base_model.model.{module}.{which}.weight"


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


def write_state(out: Path, state: dict) -> None:
    """`torch.save` of the training state into `out`, through memory so that a failed
    write is an `OSError` like every other checkpoint file's."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    (out / STATE_FILE).write_bytes(buffer.getvalue())


def write_peft(out: Path, spec: LoraSpec, tensors: dict[str, torch.Tensor],
               target_modules: list[str], base_model_path: str) -> None:
    """Write `adapter_config.json` and `adapter_model.safetensors` into `out`."""
    from peft import LoraConfig

    config = LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
        target_modules=sorted(target_modules), use_rslora=spec.use_rslora,
        base_model_name_or_path=base_model_path, task_type="CAUSAL_LM",
    )
    config.save_pretrained(str(out))
    (out / WEIGHTS_FILE).write_bytes(save_safetensors(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
        metadata={"format": "pt"}))


def read_spec(path: str | Path) -> tuple[LoraSpec, list[str]]:
    """The LoRA shape and target module names recorded in a checkpoint's config."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise NotFound(f"checkpoint: no {CONFIG_FILE} at {Path(path).name!r}")
    data = json.loads(config_path.read_text())
    targets = data.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    spec = LoraSpec(rank=int(data["r"]), alpha=float(data["lora_alpha"]),
                    dropout=float(data.get("lora_dropout") or 0.0),
                    target_modules=tuple(sorted(targets)),
                    use_rslora=bool(data.get("use_rslora", False)))
    return spec, targets


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    weights = Path(path) / WEIGHTS_FILE
    if not weights.is_file():
        raise NotFound(f"checkpoint: no {WEIGHTS_FILE} at {Path(path).name!r}")
    return load_file(str(weights))


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
