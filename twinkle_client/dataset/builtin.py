"""Built-in datasets: small sets the project ships so examples run offline.

The clients never download data. A dataset id that is not a local path must name one of
these (the `ms://` / `hf://` prefix is optional):

- `swift/self-cognition`: 100 query/response rows (60 English, 40 Chinese) in the spirit of
  ModelScope's set, with `{{NAME}}` / `{{AUTHOR}}` placeholders that
  `SelfCognitionProcessor` fills. Split `train` only; shipped as `self_cognition.jsonl`.
- `modelscope/gsm8k` (also `openai/gsm8k`, `gsm8k`): grade-school arithmetic word problems
  in GSM8K's format (`question`, `answer` ending in `#### <number>`), one or two operations
  on small numbers so a tiny model can learn the format. Generated deterministically:
  200 `train` rows and 50 `test` rows, no question in both. Subset `main` (GSM8K's name)
  or none.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from twinkle_client.dataset.loading import DatasetError

Row = dict[str, object]

_SELF_COGNITION_FILE = Path(__file__).with_name("self_cognition.jsonl")
HUB_SCHEMES = ("ms://", "hf://")

GSM8K_TRAIN_ROWS = 200
GSM8K_TEST_ROWS = 50
_GSM8K_SEED = 20240607


@dataclass(frozen=True)
class BuiltinDataset:
    """One built-in dataset: its canonical id, aliases, subsets and a loader per split."""

    id: str
    aliases: tuple[str, ...]
    subsets: tuple[str, ...]
    splits: dict[str, Callable[[], list[Row]]]


def _self_cognition() -> list[Row]:
    with _SELF_COGNITION_FILE.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


_NAMES = ("Tom", "Lily", "Sam", "Mia", "Ben", "Ana", "Leo", "Zoe", "Max", "Ivy")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "stamps", "shells")


def _gsm8k_problem(rng: random.Random) -> tuple[str, str]:
    """One word problem: (question, worked answer ending in `#### <result>`)."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.randrange(7)
    if kind == 0:
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        n = a + b
        q = f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?"
        steps = f"{name} has {a} + {b} = {n} {item}."
    elif kind == 1:
        a = rng.randint(10, 50)
        b = rng.randint(1, a - 1)
        n = a - b
        q = f"{name} has {a} {item} and gives away {b} of them. How many {item} are left?"
        steps = f"{name} has {a} - {b} = {n} {item} left."
    elif kind == 2:
        a, b = rng.randint(2, 9), rng.randint(2, 12)
        n = a * b
        q = f"{name} buys {a} bags with {b} {item} in each bag. How many {item} does {name} buy?"
        steps = f"{name} buys {a} * {b} = {n} {item}."
    elif kind == 3:
        b, n = rng.randint(2, 9), rng.randint(2, 10)
        a = b * n
        q = f"{name} shares {a} {item} equally among {b} friends. How many {item} does each friend get?"
        steps = f"Each friend gets {a} / {b} = {n} {item}."
    elif kind == 4:
        a, b = rng.randint(5, 30), rng.randint(2, 20)
        c = rng.randint(1, a + b - 1)
        n = a + b - c
        q = (f"{name} has {a} {item}, finds {b} more and then loses {c}. "
             f"How many {item} does {name} have?")
        steps = (f"After finding more, {name} has {a} + {b} = {a + b} {item}.\n"
                 f"After losing some, {name} has {a + b} - {c} = {n} {item}.")
    elif kind == 5:
        a, b, c = rng.randint(2, 6), rng.randint(2, 10), rng.randint(1, 20)
        n = a * b + c
        q = (f"{name} has {a} boxes of {b} {item} and {c} loose {item}. "
             f"How many {item} does {name} have in total?")
        steps = (f"The boxes hold {a} * {b} = {a * b} {item}.\n"
                 f"In total {name} has {a * b} + {c} = {n} {item}.")
    else:
        price, count = rng.randint(2, 9), rng.randint(2, 8)
        paid = price * count + rng.randint(1, 20)
        n = paid - price * count
        q = (f"{name} buys {count} {item} at {price} dollars each and pays with {paid} dollars. "
             f"How much change does {name} get?")
        steps = (f"The {item} cost {count} * {price} = {price * count} dollars.\n"
                 f"The change is {paid} - {price * count} = {n} dollars.")
    return q, f"{steps}\n#### {n}"


def _gsm8k_rows() -> list[Row]:
    """All generated rows, unique questions, in a fixed order (train first, then test)."""
    rng = random.Random(_GSM8K_SEED)
    rows: list[Row] = []
    seen: set[str] = set()
    while len(rows) < GSM8K_TRAIN_ROWS + GSM8K_TEST_ROWS:
        question, answer = _gsm8k_problem(rng)
        if question not in seen:
            seen.add(question)
            rows.append({"question": question, "answer": answer})
    return rows


BUILTIN_DATASETS: tuple[BuiltinDataset, ...] = (
    BuiltinDataset(
        id="ms://swift/self-cognition",
        aliases=("swift/self-cognition",),
        subsets=("default",),
        splits={"train": _self_cognition},
    ),
    BuiltinDataset(
        id="ms://modelscope/gsm8k",
        aliases=("modelscope/gsm8k", "openai/gsm8k", "gsm8k"),
        subsets=("main",),
        splits={"train": lambda: _gsm8k_rows()[:GSM8K_TRAIN_ROWS],
                "test": lambda: _gsm8k_rows()[GSM8K_TRAIN_ROWS:]},
    ),
)


def builtin_ids() -> list[str]:
    """The canonical ids of the built-in datasets, for error messages and docs."""
    return [dataset.id for dataset in BUILTIN_DATASETS]


def find_builtin(dataset_id: str) -> BuiltinDataset | None:
    """The built-in dataset answering `dataset_id` (with or without a hub scheme), or None."""
    bare = dataset_id
    for scheme in HUB_SCHEMES:
        if bare.startswith(scheme):
            bare = bare[len(scheme):]
            break
    for dataset in BUILTIN_DATASETS:
        if bare == dataset.id.removeprefix("ms://") or bare in dataset.aliases:
            return dataset
    return None


def load_builtin(dataset: BuiltinDataset, subset_name: str | None, split: str) -> list[Row]:
    """The rows of one split of a built-in dataset; bad subset or split names are errors."""
    if subset_name is not None and subset_name not in dataset.subsets:
        raise DatasetError(
            f"subset_name: {dataset.id} has no subset {subset_name!r}; "
            f"use one of {list(dataset.subsets)} or None")
    if split not in dataset.splits:
        raise DatasetError(
            f"split: {dataset.id} has no split {split!r}; use one of {list(dataset.splits)}")
    return dataset.splits[split]()
