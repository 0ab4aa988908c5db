"""`DatasetMeta` (what to load) and `Dataset` (rows in memory, mapped and encoded in place).

A dataset is a list of row dicts held on the client: loaded from a local file or
directory, a built-in set (`twinkle_client.dataset.builtin`) or a Python list; then
`map` turns rows into `messages` and `encode` turns those into token features with the
template set by `set_template`. Nothing is ever downloaded.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle_client.dataset.builtin import builtin_ids, find_builtin, load_builtin
from twinkle_client.dataset.loading import DatasetError, Row, check_rows, read_path, select_rows
from twinkle_client.errors import require_int
from twinkle_client.template import Template, build_template

DEFAULT_ENCODE_BATCH_SIZE = 1000


@dataclass(frozen=True)
class DatasetMeta:
    """Where a dataset comes from and which rows of it to take.

    Args:
        id_or_path: a local `.jsonl`/`.json`/`.csv`/`.parquet` file or a directory of them,
            a built-in id (`ms://swift/self-cognition`, `ms://modelscope/gsm8k`), or a list
            of row dicts.
        subset_name: a built-in's subset, or a sub-directory of a local directory.
        split: the split to read (a built-in's split, or files named after it in a
            directory); not used for a single file or a list.
        data_slice: rows to keep: a `range` (indices past the end are dropped, so
            `range(500)` caps the dataset at 500 rows as in the upstream API), a `slice`,
            or a list of indices (each must exist).
    """

    id_or_path: str | os.PathLike | Sequence[Mapping[str, Any]]
    subset_name: str | None = None
    split: str = "train"
    data_slice: range | slice | Sequence[int] | None = None

    def load(self) -> list[Row]:
        """The selected rows, freshly read."""
        source = self.id_or_path
        if isinstance(source, (str, os.PathLike)):
            rows = _load_source(os.fspath(source), self.subset_name, self.split)
        else:
            rows = check_rows(source, "id_or_path")
        return select_rows(rows, self.data_slice)


def _load_source(source: str, subset_name: str | None, split: str) -> list[Row]:
    path = Path(source).expanduser()
    if path.exists():
        return read_path(path, subset_name, split)
    builtin = find_builtin(source)
    if builtin is not None:
        return load_builtin(builtin, subset_name, split)
    raise DatasetError(
        f"id_or_path: {source!r} is neither a local file or directory nor a built-in dataset "
        f"(datasets are never downloaded); built-in ids: {', '.join(builtin_ids())}")


class Dataset:
    """Rows in memory; `map`, `filter` and `encode` change them in place.

    Args:
        dataset_meta: a `DatasetMeta`, a path or id (read as `DatasetMeta(it)`), or a list
            of row dicts.

    Example:
        >>> dataset = Dataset(dataset_meta=DatasetMeta('ms://swift/self-cognition'))
        >>> dataset.set_template('Template', model_id='/models/tiny', max_length=512)
        >>> dataset.map('SelfCognitionProcessor',
        ...             init_args={'model_name': 'twinkle', 'model_author': 'ModelScope'})
        >>> dataset.encode(batched=True)
        >>> sorted(dataset[0])[:2]
        ['input_ids', 'labels']
    """

    def __init__(self, dataset_meta: DatasetMeta | str | os.PathLike | Sequence[Mapping[str, Any]]
                 ) -> None:
        if not isinstance(dataset_meta, DatasetMeta):
            dataset_meta = DatasetMeta(dataset_meta)
        self.dataset_meta = dataset_meta
        self.rows: list[Row] = dataset_meta.load()
        self.template: Template | None = None

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]],
                  data_slice: range | slice | Sequence[int] | None = None) -> Dataset:
        """A dataset of in-memory rows (each a dict), optionally sliced."""
        return cls(DatasetMeta(rows, data_slice=data_slice))

    def set_template(self, template: str | type[Template] | Template, **kwargs: Any) -> None:
        """Choose the template `encode` uses: a registered name (`'Template'`), a Template
        class, or an instance; `kwargs` (model_id, max_length, truncation_strategy, ...) go
        to the class. The tokenizer is loaded now, so a bad model id fails here."""
        self.template = build_template(template, **kwargs)

    def map(self, fn: str | type | Callable[[Row], Mapping[str, Any]],
            init_args: Mapping[str, Any] | None = None,
            load_from_cache_file: bool = False) -> None:
        """Replace every row by `fn(row)`.

        Args:
            fn: a callable on a row dict returning a dict, a preprocessor class (built with
                `init_args`), or the name of a registered preprocessor
                (`'SelfCognitionProcessor'`, `'GSM8KProcessor'`).
            init_args: keyword arguments for a class or name; not allowed with a callable.
            load_from_cache_file: accepted for code written against datasets-backed
                Datasets (the seed article passes False); rows live in memory and are
                always computed, so there is no cache file to load either way.

        Raises:
            DatasetError: `fn` fails on a row or returns something other than a dict; the
                message names the row.
        """
        function = _resolve_function(fn, init_args)
        name = getattr(function, "__name__", type(function).__name__)
        mapped: list[Row] = []
        for index, row in enumerate(self.rows):
            try:
                out = function(row)
            except Exception as exc:
                raise DatasetError(f"map: {name} failed on row {index}: {exc}") from exc
            if not isinstance(out, Mapping):
                raise DatasetError(f"map: {name} returned {type(out).__name__} for row {index}; "
                                   "it must return a dict")
            mapped.append(dict(out))
        self.rows = mapped

    def filter(self, fn: Callable[[Row], bool]) -> None:
        """Keep the rows for which `fn(row)` is true."""
        if not callable(fn):
            raise DatasetError(f"filter: fn must be callable, got {type(fn).__name__}")
        self.rows = [row for row in self.rows if fn(row)]

    def encode(self, batched: bool = True, add_generation_prompt: bool = False,
               batch_size: int = DEFAULT_ENCODE_BATCH_SIZE, progress: bool = True,
               load_from_cache_file: bool = False) -> None:
        """Tokenize every row's `messages` with the template, in place.

        Each row keeps its fields and gains `input_ids` and shifted `labels` (numpy int64;
        see `twinkle_client.template`), or only `input_ids` with `add_generation_prompt`.

        Args:
            batched: tokenize `batch_size` rows per tokenizer call (faster); False encodes
                row by row. The result is the same.
            add_generation_prompt: encode prompts for sampling instead of training rows.
            batch_size: rows per tokenizer call when batched.
            progress: show a tqdm progress bar.
            load_from_cache_file: as in `map`: accepted, and there is no cache to load.

        Raises:
            DatasetError: no template was set, or a bad `batch_size`.
            TemplateError: a row cannot be encoded; the message names the row.
        """
        from tqdm.auto import tqdm

        if self.template is None:
            raise DatasetError("encode: no template; call set_template('Template', "
                               "model_id=...) first")
        require_int(batch_size, "batch_size", error=DatasetError)
        step = batch_size if batched else 1
        encoded: list[Row] = []
        with tqdm(total=len(self.rows), desc="Encoding", unit="row", disable=not progress) as bar:
            for start in range(0, len(self.rows), step):
                chunk = self.rows[start:start + step]
                features = self.template.encode_batch(chunk, add_generation_prompt, start)
                encoded.extend({**row, **feature} for row, feature in zip(chunk, features, strict=True))
                bar.update(len(chunk))
        self.rows = encoded

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Row:
        if isinstance(index, bool):
            raise TypeError("index: expected an int, got bool")
        index = operator.index(index)
        if not -len(self.rows) <= index < len(self.rows):
            raise IndexError(f"index: {index} is out of range for a dataset of "
                             f"{len(self.rows)} rows")
        return self.rows[index]

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)

    def __repr__(self) -> str:
        source = self.dataset_meta.id_or_path
        name = source if isinstance(source, (str, os.PathLike)) else "<rows>"
        return f"Dataset({name!s}, rows={len(self.rows)}, encoded={self.is_encoded})"

    @property
    def is_encoded(self) -> bool:
        """Whether every row has `input_ids` (after `encode`)."""
        return bool(self.rows) and all("input_ids" in row for row in self.rows)


def _resolve_function(fn: Any, init_args: Mapping[str, Any] | None
                      ) -> Callable[[Row], Mapping[str, Any]]:
    if isinstance(fn, str):
        from twinkle_client.preprocessor import get_preprocessor

        fn = get_preprocessor(fn)
    if isinstance(fn, type):
        try:
            return fn(**dict(init_args or {}))
        except TypeError as exc:
            raise DatasetError(f"init_args: cannot build {fn.__name__}: {exc}") from None
    if init_args is not None:
        raise DatasetError("init_args: only used with a preprocessor class or name, "
                           f"not with {type(fn).__name__}")
    if not callable(fn):
        raise DatasetError(f"map: expected a callable, class or registered name, "
                           f"got {type(fn).__name__}")
    return fn
