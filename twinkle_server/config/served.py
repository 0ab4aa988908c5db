"""What a data dir's server serves: `served.json` beside the store, written when the server
has loaded its models and its fronts listen, so that the tools run beside it check against
the served models and limits without the server's flags repeated (`twinkle-server adapters
import`) and reach its HTTP front (`twinkle-server sessions trace`).

It records each model's table (`ModelConfig`, as its flags and `--models` file made it),
the directory its files were loaded from, and where the HTTP front listens. A server that
never ran leaves none; the file is replaced whole (written beside, then renamed), so a
reader never sees half of one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from twinkle_server.config.model_table import ModelConfig
from twinkle_server.engine import replace_file
from twinkle_server.engine.errors import InvalidArgument

SERVED_FILE = "served.json"
T = TypeVar("T")


@dataclass(frozen=True)
class Front:
    """Where the HTTP front listens and whether it speaks TLS: what signed URLs point at
    (`runtime.external`), and what the tools beside the server reach."""

    host: str
    port: int
    https: bool = False

    @property
    def url(self) -> str:
        """Its base URL from this machine (a wildcard bind is reached on loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host,
                                                                          self.host)
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if self.https else 'http'}://{host}:{self.port}"


def write_served(data_dir: Path, models: Sequence[tuple[ModelConfig, Path]],
                 http: Front | None = None) -> None:
    """Record `models` (each with its files' directory) as what `data_dir`'s server
    serves, and its HTTP front (None: it has none)."""
    rows = [{**asdict(model), "model_dir": str(directory)} for model, directory in models]
    replace_file(Path(data_dir) / SERVED_FILE, json.dumps(
        {"models": rows, "http": None if http is None else asdict(http)}, indent=2).encode())


def served_front(data_dir: Path) -> Front | None:
    """The HTTP front `data_dir`'s server last recorded, or None (none ran, or it had no
    HTTP front).

    Raises:
        InvalidArgument: the file is not one `write_served` wrote.
    """
    return _read(data_dir, lambda record: None if record.get("http") is None
                 else Front(**record["http"]))


def read_served(data_dir: Path) -> list[tuple[ModelConfig, Path]] | None:
    """What `data_dir`'s server last recorded serving, or None where none ran there.

    Raises:
        InvalidArgument: the file is not one `write_served` wrote.
    """
    known = {f.name for f in fields(ModelConfig)}
    return _read(data_dir, lambda record: [
        (ModelConfig(**{k: tuple(v) if isinstance(v, list) else v
                        for k, v in row.items() if k in known}), Path(row["model_dir"]))
        for row in record["models"]])


def _read(data_dir: Path, build: Callable[[dict[str, Any]], T]) -> T | None:
    """`build` of `data_dir`'s record (None where there is none)."""
    path = Path(data_dir) / SERVED_FILE
    if not path.is_file():
        return None
    try:
        return build(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidArgument(f"{path}: not a record of served models ({exc}); start the "
                              "server again, or give --model or --models") from None


def pick(models: Sequence[tuple[ModelConfig, Path]], wanted: str, named: str
         ) -> tuple[ModelConfig, Path]:
    """The served model an adapter belongs to: `wanted` (`--base-model`) by any of its
    names; else the one the adapter names (`named`: its `base_model_name_or_path`) by a
    name, its path or its directory; else the only one served.

    Raises:
        InvalidArgument: `wanted` is not served, or several are and the adapter names
            none of them.
    """
    choices = [n for model, _ in models for n in model.names]
    if wanted:
        found = [(m, d) for m, d in models if wanted in m.names]
        if not found:
            raise InvalidArgument(f"--base-model: {wanted!r} is not one of the served "
                                  f"models {choices}")
        return found[0]
    for model, directory in models:
        if named and named in (*model.names, model.path, str(directory)):
            return model, directory
    if len(models) == 1:
        return models[0]
    raise InvalidArgument(f"--base-model: the adapter was trained on {named or 'no named base'}"
                          f", which is none of the served models {choices}; name one")
