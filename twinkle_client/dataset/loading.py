"""Reading rows from local files and selecting rows with `data_slice`.

Supported files: `.jsonl` (one JSON object a line), `.json` (a list of objects), `.csv`
(a header row; every value a string) and `.parquet` (needs pyarrow, imported only when a
parquet file is read). A directory is read as all supported files under it, in sorted
path order, restricted to one split when its files are named by split (see
`split_files`).
"""

from __future__ import annotations

import csv
import json
import operator
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
# File and folder names that mark a split in a dataset directory (as on HF / ModelScope:
# `train-00000-of-00001.parquet`, `test.jsonl`, `validation/part-0.json`).
KNOWN_SPLITS = ("train", "test", "validation", "valid", "dev", "eval")


class DatasetError(ValueError):
    """A dataset that cannot be read or a selection that cannot be made; names the field."""


def read_path(path: Path, subset_name: str | None = None, split: str = "train") -> list[Row]:
    """All rows of a local file, or of the files of `split` in a directory.

    For a directory, `subset_name` names a sub-directory (HF layout `<dir>/main/...`);
    for a single file both `subset_name` and `split` are not used.
    """
    if path.is_file():
        return read_file(path)
    if subset_name is not None:
        subset_dir = path / subset_name
        if not subset_dir.is_dir():
            found = sorted(p.name for p in path.iterdir() if p.is_dir())
            raise DatasetError(f"subset_name: {path} has no sub-directory {subset_name!r} "
                               f"(found: {found or 'none'})")
        path = subset_dir
    rows: list[Row] = []
    for file in split_files(path, split):
        rows.extend(read_file(file))
    return rows


def split_files(directory: Path, split: str) -> list[Path]:
    """The data files of `split` under `directory`, in sorted order.

    A file belongs to a split when its name is the split (`train.jsonl`), starts with the
    split and `-`, `_` or `.` (`train-00000-of-00001.parquet`), or lies in a folder named
    after it. If no file is named after any split in `KNOWN_SPLITS`, the whole directory
    is one split and every file is read.
    """
    files = sorted(p for p in directory.rglob("*")
                   if p.is_file() and p.suffix.lower() in SUPPORTED_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(directory).parts))
    if not files:
        raise DatasetError(f"id_or_path: directory {directory} holds no data file "
                           f"({', '.join(SUPPORTED_SUFFIXES)})")
    tagged = {name: [f for f in files if _in_split(f.relative_to(directory), name)]
              for name in {*KNOWN_SPLITS, split}}
    if tagged[split]:
        return tagged[split]
    found = sorted(name for name, members in tagged.items() if members)
    if not found:
        return files
    raise DatasetError(f"split: directory {directory} has no files for split {split!r}; "
                       f"found splits: {found}")


def _in_split(relative: Path, split: str) -> bool:
    stem = relative.name.split(".", 1)[0]
    return (stem == split or stem.startswith((f"{split}-", f"{split}_"))
            or split in relative.parts[:-1])


def read_file(path: Path) -> list[Row]:
    """The rows of one data file; a malformed file raises `DatasetError` naming it."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".json":
        return _read_json(path)
    if suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            return [dict(row) for row in csv.DictReader(f)]
    if suffix == ".parquet":
        return _read_parquet(path)
    raise DatasetError(f"id_or_path: {path} has an unsupported suffix {path.suffix!r}; "
                       f"use one of {', '.join(SUPPORTED_SUFFIXES)}")


def _read_jsonl(path: Path) -> list[Row]:
    rows: list[Row] = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{line_no}: not valid JSON: {exc.msg}") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{line_no}: each line must be a JSON object, "
                                   f"got {type(row).__name__}")
            rows.append(row)
    return rows


def _read_json(path: Path) -> list[Row]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: not valid JSON at line {exc.lineno}: {exc.msg}") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: a .json dataset must be a list of objects, "
                           f"got {type(data).__name__}")
    for index, row in enumerate(data):
        if not isinstance(row, dict):
            raise DatasetError(f"{path}: item {index} must be a JSON object, "
                               f"got {type(row).__name__}")
    return data


def _read_parquet(path: Path) -> list[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading .parquet files needs pyarrow; install it with "
                           "`pip install pyarrow` or convert the file to .jsonl") from None
    return pq.read_table(path).to_pylist()


def check_rows(rows: Any, field: str = "rows") -> list[Row]:
    """A list copy of in-memory rows; each must be a mapping (copied to a plain dict)."""
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Sequence):
        raise DatasetError(f"{field}: expected a list of dicts, got {type(rows).__name__}")
    out: list[Row] = []
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise DatasetError(f"{field}[{index}]: expected a dict, got {type(row).__name__}")
        out.append(dict(row))
    return out


def select_rows(rows: list[Row], data_slice: Any) -> list[Row]:
    """The rows picked by `data_slice`: None (all), a `range`, a `slice` or a list of ints.

    A `range` is read as in the upstream API, where `range(500)` means "at most the first
    500 rows": indices at or past the end are dropped, so `range(500)` on a 100-row set
    gives all 100 rows; a range that then selects nothing, or holds a negative index, is
    an error. A `slice` follows Python slicing. A list is an explicit choice: every index
    must lie in `[-len, len)`.
    """
    if data_slice is None:
        return rows
    count = len(rows)
    if isinstance(data_slice, range):
        return [rows[i] for i in _clip_range(data_slice, count)]
    if isinstance(data_slice, slice):
        return rows[data_slice]
    is_list = isinstance(data_slice, Sequence) or hasattr(data_slice, "__array__")
    if isinstance(data_slice, (str, bytes, Mapping)) or not is_list:
        raise DatasetError(f"data_slice: expected a range, slice or list of ints, "
                           f"got {type(data_slice).__name__}")
    picked: list[Row] = []
    for position, value in enumerate(list(data_slice)):
        if isinstance(value, bool):
            raise DatasetError(f"data_slice[{position}]: expected an int, got bool")
        try:
            index = operator.index(value)
        except TypeError:
            raise DatasetError(f"data_slice[{position}]: expected an int, "
                               f"got {type(value).__name__}") from None
        if not -count <= index < count:
            raise DatasetError(f"data_slice[{position}]: index {index} is out of range for a "
                               f"dataset of {count} rows (valid: {-count}..{count - 1})")
        picked.append(rows[index])
    return picked


def _clip_range(selection: range, count: int) -> range:
    """`selection` without the indices >= count; negative indices are an error."""
    if len(selection) and min(selection[0], selection[-1]) < 0:
        raise DatasetError(f"data_slice: {selection} holds negative indices; a range selects "
                           "rows by position from 0")
    if selection.step > 0:
        clipped = range(selection.start, min(selection.stop, count), selection.step)
    else:
        first = selection.start
        if first >= count:
            steps = -(-(first - (count - 1)) // -selection.step)
            first += steps * selection.step
        clipped = range(first, selection.stop, selection.step)
    if len(selection) and not len(clipped):
        raise DatasetError(f"data_slice: {selection} selects no row of a dataset of "
                           f"{count} rows")
    return clipped
