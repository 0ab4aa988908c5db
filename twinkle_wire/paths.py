"""Checkpoint paths: `twinkle://<run_id>/weights/<name>`, `.../sampler_weights/<name>` and
`.../external_weights/<name>` (PEFT/HF exports, `save_weights_external`).

The Tinker shim shows the same path as `tinker://...`; both schemes are accepted
everywhere. Names are validated so a path can never leave its run's directory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SCHEMES = ("twinkle://", "tinker://")
SEGMENTS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
KIND_SEGMENTS = {kind: segment for segment, kind in SEGMENTS.items()}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_RUN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")


class PathError(ValueError):
    """A malformed checkpoint path or name; the message says what is allowed."""


def check_name(name: str, field: str = "name") -> str:
    """A checkpoint name: 1-128 of letters, digits, '.', '_', '-'; no '/', '..' or controls."""
    if not _NAME.fullmatch(name or "") or ".." in name:
        raise PathError(f"{field}: {name!r} is not a valid checkpoint name; use 1-128 letters, "
                        "digits, '.', '_' or '-', starting with a letter or digit, no '..'")
    return name


@dataclass(frozen=True)
class CheckpointPath:
    run_id: str
    kind: str  # "training", "sampler" or "external"
    name: str

    @property
    def segment(self) -> str:
        return KIND_SEGMENTS[self.kind]

    def twinkle(self) -> str:
        return f"twinkle://{self.run_id}/{self.segment}/{self.name}"

    def tinker(self) -> str:
        return tinker_path(self.run_id, f"{self.segment}/{self.name}")


def tinker_path(run_id: str, checkpoint_id: str) -> str:
    """The `tinker://` path of checkpoint `checkpoint_id` (`<segment>/<name>`, as the
    store keeps it) of run `run_id`: the one place the form is spelled. Checks nothing;
    `parse` checks a path."""
    return f"tinker://{run_id}/{checkpoint_id}"


def parse(path: str, field: str = "path") -> CheckpointPath:
    """Parse a `twinkle://` or `tinker://` checkpoint path."""
    scheme = next((s for s in SCHEMES if (path or "").startswith(s)), None)
    if scheme is None:
        raise PathError(f"{field}: {path!r} must start with twinkle:// or tinker://")
    parts = path[len(scheme):].split("/")
    if len(parts) != 3 or parts[1] not in SEGMENTS or not _RUN.fullmatch(parts[0]):
        raise PathError(f"{field}: {path!r} is not <scheme><run_id>/weights/<name>, "
                        "<scheme><run_id>/sampler_weights/<name> or "
                        "<scheme><run_id>/external_weights/<name>")
    return CheckpointPath(parts[0], SEGMENTS[parts[1]], check_name(parts[2], field))
