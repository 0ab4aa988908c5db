"""What each served base model is: `--models FILE` (TOML, one `[[models]]` table each), or
the one-model shorthand `--model NAME`.

A table names the model clients send (`name`, `aliases`), where its weights are
(`path`), what it may do (`role`), where it runs (`device`, `memory_gib`, `ranks`,
`sampler_ranks`) and its limits; every key but `name` defaults to the server's flag of the same meaning. A
file that cannot work is refused before anything loads, naming the table and the key.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import tomllib

from twinkle_server.config.placement import GIB
from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.tiny_model import RECIPES, TINY_MODEL_NAME
from twinkle_server.engine.types import AUTO_PASS_TOKENS, EngineLimits

TRAIN, SAMPLE = "train", "sample"
ROLES = (TRAIN, SAMPLE)
"""`train`: LoRA training and sampling; `sample`: sampling and logprobs only (of the base
and of sampler checkpoints trained on it), no training clients."""


@dataclass(frozen=True)
class ModelConfig:
    """One served base model: its names, weights, role, placement and limits."""

    name: str
    path: str
    aliases: tuple[str, ...] = ()
    role: str = TRAIN
    device: str = "auto"
    dtype: str = "auto"
    memory_gib: float = 0.0
    """Memory this model may hold on its device (weights, adapters, KV, passes), so
    several models can share one device; 0: no budget, it may use what is free."""
    ranks: tuple[int, ...] = ()
    """Under torchrun, the ranks it is sharded over; empty: every rank."""
    sampler_ranks: int = 0
    """Under torchrun, how many of its ranks (the last ones) sample apart from the others,
    which train; trained weights reach them in memory (`twinkle_server.ranks.split`). 0: every
    rank trains and samples (colocated)."""
    max_adapters: int = 32
    max_rank: int = 128
    max_seq_len: int = 0
    max_batch_tokens: int = 262_144
    max_pass_tokens: int = 0
    kv_pool_tokens: int = 0

    @property
    def names(self) -> tuple[str, ...]:
        """Every name clients may send for it, its own first."""
        return (self.name, *self.aliases)

    @property
    def trains(self) -> bool:
        return self.role == TRAIN

    @property
    def builtin(self) -> bool:
        """Built offline by the server (`tiny`, `tiny-large`)."""
        return self.path in RECIPES

    def limits(self) -> EngineLimits:
        return EngineLimits(max_adapters=self.max_adapters, max_rank=self.max_rank,
                            max_seq_len=self.max_seq_len, max_batch_tokens=self.max_batch_tokens,
                            max_pass_tokens=self.max_pass_tokens or AUTO_PASS_TOKENS,
                            kv_pool_tokens=self.kv_pool_tokens,
                            memory_bytes=self.memory_bytes)

    @property
    def memory_bytes(self) -> int:
        """`memory_gib` in bytes (0: no budget)."""
        return int(self.memory_gib * GIB)

    def tokenizer_id(self, model_dir: Path) -> str:
        """What a client passes to `AutoTokenizer.from_pretrained`: the first of the
        model's names that is a hub id (`org/name`, not a local path: a client anywhere
        can load it), else its files' directory `model_dir` (a client that shares this
        machine's files can). A built-in, or a local model served as `student`, gives
        the directory: the hub has no such tokenizer."""
        if not self.builtin:
            hub = next((n for n in self.names if _is_hub_id(n)), None)
            if hub is not None:
                return hub
        return str(model_dir)


def _is_hub_id(name: str) -> bool:
    """Whether `name` reads as a Hugging Face hub id (`org/name`, one slash, neither part
    empty or a dot) and names no local path."""
    parts = name.split("/")
    return (len(parts) == 2 and all(p and p not in (".", "..") for p in parts)
            and not name.startswith("~") and not Path(name).exists())


KEYS = tuple(f.name for f in fields(ModelConfig))
"""Every key a `[[models]]` table may have."""
_INTS = ("max_adapters", "max_rank", "max_seq_len", "max_batch_tokens", "max_pass_tokens",
         "kv_pool_tokens", "sampler_ranks")


def shorthand(defaults: dict[str, Any], model: str, aliases: tuple[str, ...]) -> ModelConfig:
    """`--model NAME [--model-alias A ...]`: one trainable model, the flags its limits."""
    name = model or TINY_MODEL_NAME
    return ModelConfig(name=name, path=name, aliases=aliases, **defaults)


def read_models_file(path: Path, defaults: dict[str, Any],
                     least: dict[str, int] | None = None) -> list[ModelConfig]:
    """The models of a `--models` file, each key absent taken from `defaults` (the flags),
    each integer key at least its flag's `least` (else 0). Raises `InvalidArgument`
    naming the file, the table and the key of the first problem."""
    where = f"--models {path}"
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InvalidArgument(f"{where}: cannot read it: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{where}: not TOML: {exc}") from None
    extra = sorted(set(data) - {"models"})
    if extra:
        raise InvalidArgument(f"{where}: unknown top-level key {extra[0]!r}; the file holds "
                              "only [[models]] tables")
    tables = data.get("models")
    if not isinstance(tables, list) or not tables:
        raise InvalidArgument(f"{where}: no [[models]] table; give one per served model")
    models = [_model(table, f"{where}: [[models]] #{i + 1}", defaults, least or {})
              for i, table in enumerate(tables)]
    check_names(models, where)
    return models


def _model(table: Any, where: str, defaults: dict[str, Any],
           least: dict[str, int]) -> ModelConfig:
    if not isinstance(table, dict):
        raise InvalidArgument(f"{where}: not a table")
    name = table.get("name")
    if not isinstance(name, str) or not name.strip():
        raise InvalidArgument(f"{where}: key 'name' is missing or empty; it is the name "
                              "clients send as base_model")
    where = f"{where} ({name!r})"
    unknown = sorted(set(table) - set(KEYS))
    if unknown:
        raise InvalidArgument(f"{where}: unknown key {unknown[0]!r}; the keys are "
                              f"{sorted(KEYS)}")
    values = {**defaults, "path": name}
    for key, value in table.items():
        values[key] = _value(key, value, where, least.get(key, 0))
    if values.get("role", TRAIN) not in ROLES:
        raise InvalidArgument(f"{where}: key 'role' is {values['role']!r}; give one of "
                              f"{list(ROLES)}")
    return ModelConfig(**values)


def _value(key: str, value: Any, where: str, least: int) -> Any:
    """A table's `key`, checked for its type and range (an integer at least `least`)."""
    def bad(wanted: str) -> InvalidArgument:
        return InvalidArgument(f"{where}: key {key!r} is {value!r}; give {wanted}")

    if key in ("aliases", "ranks"):
        item = str if key == "aliases" else int
        if not isinstance(value, list) or not all(
                type(v) is item and (item is str and v.strip() or item is int and v >= 0)
                for v in value):
            raise bad("a list of non-empty strings" if item is str
                      else "a list of rank numbers (integers >= 0)")
        if len(set(value)) != len(value):
            raise bad("a list without repeats")
        return tuple(value)
    if key in _INTS:
        if type(value) is not int or value < least:
            raise bad(f"an integer >= {least}")
        return value
    if key == "memory_gib":
        if type(value) not in (int, float) or not 0 <= value < float("inf"):
            raise bad("a number of GiB >= 0 (0: no budget)")
        return float(value)
    if not isinstance(value, str) or not value.strip():
        raise bad("a non-empty string")
    return value


def check_names(models: list[ModelConfig], where: str) -> None:
    """Each name or alias answers for one model only."""
    owner: dict[str, str] = {}
    for model in models:
        for name in model.names:
            if name in owner and owner[name] != model.name:
                raise InvalidArgument(f"{where}: name {name!r} is given to both "
                                      f"{owner[name]!r} and {model.name!r}")
            if name in owner:
                raise InvalidArgument(f"{where}: model {model.name!r} is listed twice, or "
                                      f"names {name!r} twice")
            owner[name] = model.name
