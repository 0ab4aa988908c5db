"""Datasets: every file format and directory layout, data_slice, built-in sets, map/encode."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest

from twinkle_client.dataset import Dataset, DatasetError, DatasetMeta, builtin_ids
from twinkle_client.features import IGNORE_INDEX
from twinkle_client.preprocessor import GSM8KProcessor, SelfCognitionProcessor
from twinkle_client.template import TemplateError

ROWS = [{"query": f"q{i}", "response": f"r{i}"} for i in range(6)]


@pytest.fixture(scope="session")
def model_dir(tiny_cache):
    from twinkle_server.engine.tiny_model import build_tiny_model

    return str(build_tiny_model(tiny_cache))


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# ----------------------------------------------------------------------------- files


def test_jsonl_file_reads_one_row_per_line_skipping_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n", encoding="utf-8")
    assert Dataset(DatasetMeta(str(path))).rows == ROWS[:2]


def test_json_file_reads_a_list_of_objects(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(ROWS), encoding="utf-8")
    assert Dataset(DatasetMeta(path)).rows == ROWS


def test_csv_file_reads_rows_by_header_as_strings(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("query,response,n\nq0,r0,1\n\"a, b\",r1,2\n", encoding="utf-8")
    assert Dataset(DatasetMeta(str(path))).rows == [
        {"query": "q0", "response": "r0", "n": "1"}, {"query": "a, b", "response": "r1", "n": "2"}]


def test_parquet_file_reads_its_rows(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", ROWS)
    assert Dataset(DatasetMeta(str(path))).rows == ROWS


def test_parquet_without_pyarrow_says_how_to_install_it(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "d.parquet", ROWS)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DatasetError, match=r"d\.parquet: reading \.parquet files needs pyarrow"):
        Dataset(DatasetMeta(str(path)))


def test_directory_reads_every_file_in_sorted_order_when_no_split_is_named(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", ROWS[2:4])
    write_jsonl(tmp_path / "a.jsonl", ROWS[:2])
    write_parquet(tmp_path / "sub" / "c.parquet", ROWS[4:])
    (tmp_path / ".hidden.jsonl").write_text(json.dumps({"x": 1}) + "\n")
    assert Dataset(DatasetMeta(str(tmp_path))).rows == ROWS


def test_directory_with_split_files_reads_only_the_requested_split(tmp_path):
    write_parquet(tmp_path / "main" / "train-00000-of-00002.parquet", ROWS[:2])
    write_parquet(tmp_path / "main" / "train-00001-of-00002.parquet", ROWS[2:4])
    write_jsonl(tmp_path / "main" / "test.jsonl", ROWS[4:])
    write_jsonl(tmp_path / "socratic" / "train.jsonl", [{"other": 1}])
    assert Dataset(DatasetMeta(str(tmp_path), subset_name="main")).rows == ROWS[:4]
    assert Dataset(DatasetMeta(str(tmp_path), subset_name="main", split="test")).rows == ROWS[4:]


def test_directory_without_the_split_names_the_splits_it_has(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    with pytest.raises(DatasetError, match=r"no files for split 'validation'; found splits: \['train'\]"):
        Dataset(DatasetMeta(str(tmp_path), split="validation"))


def test_missing_subset_directory_lists_the_subsets(tmp_path):
    write_jsonl(tmp_path / "main" / "train.jsonl", ROWS)
    with pytest.raises(DatasetError, match=r"subset_name: .* no sub-directory 'x' \(found: \['main'\]\)"):
        Dataset(DatasetMeta(str(tmp_path), subset_name="x"))


@pytest.mark.parametrize("name, content, message", [
    ("bad.jsonl", '{"a": 1}\n{oops\n', r"bad\.jsonl:2: not valid JSON"),
    ("list.jsonl", "[1, 2]\n", r"list\.jsonl:1: each line must be a JSON object"),
    ("obj.json", '{"a": 1}', r"obj\.json: a \.json dataset must be a list of objects"),
    ("d.txt", "hello", r"unsupported suffix '\.txt'"),
])
def test_malformed_files_are_errors_naming_the_file(tmp_path, name, content, message):
    (tmp_path / name).write_text(content, encoding="utf-8")
    with pytest.raises(DatasetError, match=message):
        Dataset(DatasetMeta(str(tmp_path / name)))


def test_empty_directory_is_an_error(tmp_path):
    with pytest.raises(DatasetError, match="holds no data file"):
        Dataset(DatasetMeta(str(tmp_path)))


def test_unknown_id_names_it_and_lists_the_built_in_ids():
    with pytest.raises(DatasetError) as info:
        Dataset(DatasetMeta("ms://someone/unknown-set"))
    message = str(info.value)
    assert "'ms://someone/unknown-set'" in message and "never downloaded" in message
    for dataset_id in builtin_ids():
        assert dataset_id in message


def test_rows_from_a_python_list_are_copied():
    rows = [dict(row) for row in ROWS]
    dataset = Dataset.from_rows(rows)
    rows[0]["query"] = "changed"
    assert dataset.rows == ROWS and Dataset(ROWS).rows == ROWS
    with pytest.raises(DatasetError, match=r"id_or_path\[1\]: expected a dict, got int"):
        Dataset([{"a": 1}, 2])


# ----------------------------------------------------------------------------- data_slice


@pytest.mark.parametrize("data_slice, expected", [
    (range(500), list(range(6))),
    (range(2, 5), [2, 3, 4]),
    (range(1, 100, 2), [1, 3, 5]),
    (range(100, 2, -2), [4]),
    (range(8, -1, -3), [5, 2]),
    (slice(None, None, 2), [0, 2, 4]),
    (slice(-2, None), [4, 5]),
    ([5, 0, -1], [5, 0, 5]),
    (np.array([1, 2]), [1, 2]),
])
def test_data_slice_selects_rows_and_a_range_is_capped_at_the_length(data_slice, expected):
    dataset = Dataset.from_rows(ROWS, data_slice=data_slice)
    assert [row["query"] for row in dataset] == [f"q{i}" for i in expected]


@pytest.mark.parametrize("data_slice, message", [
    ([0, 6], r"data_slice\[1\]: index 6 is out of range for a dataset of 6 rows"),
    ([True], r"data_slice\[0\]: expected an int, got bool"),
    (["1"], r"data_slice\[0\]: expected an int, got str"),
    (range(-2, 3), "holds negative indices"),
    (range(10, 20), "selects no row of a dataset of 6 rows"),
    ("0:3", "data_slice: expected a range, slice or list of ints, got str"),
])
def test_bad_data_slice_is_an_error_naming_the_index_and_length(data_slice, message):
    with pytest.raises(DatasetError, match=message):
        Dataset.from_rows(ROWS, data_slice=data_slice)


# ----------------------------------------------------------------------------- built-ins


@pytest.mark.parametrize("dataset_id", ["ms://swift/self-cognition", "swift/self-cognition"])
def test_self_cognition_is_built_in_with_placeholders_in_english_and_chinese(dataset_id):
    rows = Dataset(DatasetMeta(dataset_id, data_slice=range(500))).rows
    assert 90 <= len(rows) <= 110
    assert all("{{NAME}}" in row["response"] or "{{AUTHOR}}" in row["response"] for row in rows)
    assert {row["tag"] for row in rows} == {"en", "zh"}
    assert len({row["query"] for row in rows}) == len(rows)


def test_self_cognition_processor_fills_every_placeholder():
    dataset = Dataset(DatasetMeta("ms://swift/self-cognition"))
    dataset.map("SelfCognitionProcessor", init_args={"model_name": "twinkle模型",
                                                     "model_author": "ModelScope社区"})
    for row in dataset:
        roles = [m["role"] for m in row["messages"]]
        text = "".join(m["content"] for m in row["messages"])
        assert roles == ["user", "assistant"] and "{{" not in text and "}}" not in text
    assert any("twinkle模型" in row["messages"][1]["content"] for row in dataset)
    assert any("ModelScope社区" in row["messages"][1]["content"] for row in dataset)


def test_self_cognition_processor_adds_an_optional_system_message():
    row = SelfCognitionProcessor("T", "A", system="Be brief.")(
        {"query": "Who is {{NAME}}?", "response": "{{NAME}} by {{AUTHOR}}"})
    assert row["messages"] == [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Who is T?"},
                               {"role": "assistant", "content": "T by A"}]


@pytest.mark.parametrize("dataset_id", ["ms://modelscope/gsm8k", "openai/gsm8k", "gsm8k"])
def test_gsm8k_is_built_in_with_train_and_test_splits_that_do_not_overlap(dataset_id):
    train = Dataset(DatasetMeta(dataset_id, subset_name="main", split="train")).rows
    test = Dataset(DatasetMeta(dataset_id, split="test")).rows
    assert (len(train), len(test)) == (200, 50)
    assert not {row["question"] for row in train} & {row["question"] for row in test}
    assert train == Dataset(DatasetMeta(dataset_id)).rows  # deterministic


def test_gsm8k_answers_are_correct_arithmetic_ending_in_the_result():
    rows = Dataset(DatasetMeta("gsm8k")).rows + Dataset(DatasetMeta("gsm8k", split="test")).rows
    for row in rows:
        *steps, final = row["answer"].split("\n")
        equations = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", " ".join(steps))
        assert 1 <= len(equations) <= 2, row
        for a, op, b, c in equations:
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b),
                    "/": int(a) / int(b)}[op] == int(c), row
        assert final == f"#### {equations[-1][3]}"


def test_gsm8k_processor_keeps_the_ground_truth_and_asks_for_the_format():
    row = GSM8KProcessor()({"question": "What is 2 + 3?",
                            "answer": "2 + 3 = <<2+3=5>>5 apples.\n#### 1,005"})
    assert row["ground_truth"] == "1005"
    user, assistant = row["messages"]
    assert user["content"].startswith("What is 2 + 3?\n") and "#### <number>" in user["content"]
    assert assistant == {"role": "assistant", "content": "2 + 3 = 5 apples.\n#### 1,005"}


@pytest.mark.parametrize("dataset_meta, message", [
    (DatasetMeta("gsm8k", subset_name="socratic"), r"subset_name: ms://modelscope/gsm8k has no subset 'socratic'"),
    (DatasetMeta("gsm8k", split="validation"), r"split: .* no split 'validation'; use one of \['train', 'test'\]"),
])
def test_bad_subset_or_split_of_a_built_in_lists_the_valid_ones(dataset_meta, message):
    with pytest.raises(DatasetError, match=message):
        Dataset(dataset_meta)


# ----------------------------------------------------------------------------- map / filter


class AddPrefix:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def __call__(self, row):
        return {**row, "query": self.prefix + row["query"]}


def test_map_takes_a_function_a_class_with_init_args_or_a_registered_name():
    dataset = Dataset.from_rows(ROWS[:2])
    dataset.map(lambda row: {**row, "n": 1})
    dataset.map(AddPrefix, init_args={"prefix": ">"})
    dataset.map(AddPrefix(">"))
    dataset.map("SelfCognitionProcessor", init_args={"model_name": "m", "model_author": "a"})
    assert dataset[0]["n"] == 1 and dataset[0]["query"] == ">>q0"
    assert dataset[-1]["messages"][0] == {"role": "user", "content": ">>q1"}


@pytest.mark.parametrize("fn, init_args, message", [
    (lambda row: [row], None, r"map: <lambda> returned list for row 0; it must return a dict"),
    (lambda row: row["missing"], None, r"map: <lambda> failed on row 0: 'missing'"),
    (lambda row: row, {"a": 1}, r"init_args: only used with a preprocessor class or name"),
    ("NoSuchProcessor", None, r"unknown name 'NoSuchProcessor'; registered: \['GSM8KProcessor'"),
    (AddPrefix, {"wrong": 1}, r"init_args: cannot build AddPrefix"),
    ("GSM8KProcessor", None, r"failed on row 0: GSM8KProcessor: row field 'question' must be a string"),
])
def test_map_errors_name_the_row_or_the_argument(fn, init_args, message):
    with pytest.raises(ValueError, match=message):
        Dataset.from_rows(ROWS).map(fn, init_args=init_args)


def test_filter_getitem_len_and_iteration():
    dataset = Dataset.from_rows(ROWS)
    dataset.filter(lambda row: row["query"] in {"q1", "q4"})
    assert len(dataset) == 2 and [r["query"] for r in dataset] == ["q1", "q4"]
    assert dataset[np.int64(1)] == dataset[-1] == ROWS[4]
    with pytest.raises(IndexError, match="index: 2 is out of range for a dataset of 2 rows"):
        dataset[2]


# ----------------------------------------------------------------------------- encode


def test_the_issue_example_encodes_self_cognition_into_shifted_features(model_dir):
    dataset = Dataset(dataset_meta=DatasetMeta("ms://swift/self-cognition", data_slice=range(500)))
    dataset.set_template("Template", model_id=model_dir, max_length=512)
    dataset.map("SelfCognitionProcessor", init_args={"model_name": "twinkle",
                                                     "model_author": "ModelScope"})
    dataset.encode(batched=True)
    assert dataset.is_encoded and len(dataset) == 100
    for row in dataset:
        assert row["input_ids"].shape == row["labels"].shape
        learned = dataset.template.decode(row["labels"][row["labels"] != IGNORE_INDEX])
        assert learned == row["messages"][-1]["content"] + "<|im_end|>\n"


def test_batched_and_row_by_row_encoding_give_the_same_features(model_dir):
    rows = Dataset(DatasetMeta("gsm8k", data_slice=range(7))).rows
    features = []
    for batched in (True, False):
        dataset = Dataset.from_rows(rows)
        dataset.set_template("Template", model_id=model_dir)
        dataset.map(GSM8KProcessor())
        dataset.encode(batched=batched, batch_size=3, progress=False)
        features.append(dataset.rows)
    for a, b in zip(*features, strict=True):
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
        np.testing.assert_array_equal(a["labels"], b["labels"])


def test_generation_prompt_encoding_keeps_ground_truth_for_rewards(model_dir):
    dataset = Dataset(DatasetMeta("ms://modelscope/gsm8k", subset_name="main", data_slice=[0, 1]))
    dataset.set_template("Template", model_id=model_dir, max_length=2048)
    dataset.map(GSM8KProcessor())
    dataset.encode(add_generation_prompt=True, progress=False)
    row = dataset[0]
    assert "labels" not in row and row["ground_truth"] == row["answer"].rsplit("#### ", 1)[1]
    assert dataset.template.decode(row["input_ids"]).endswith("<|im_start|>assistant\n")


def test_encode_errors_name_the_dataset_row(model_dir):
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}] * 4
    rows.append({"messages": [{"role": "user", "content": "long " * 50},
                              {"role": "assistant", "content": "b"}]})
    dataset = Dataset.from_rows(rows)
    with pytest.raises(DatasetError, match="call set_template"):
        dataset.encode()
    dataset.set_template("Template", model_id=model_dir, max_length=32,
                         truncation_strategy="raise")
    with pytest.raises(DatasetError, match="batch_size: must be an int >= 1, got 0"):
        dataset.encode(batch_size=0)
    with pytest.raises(TemplateError, match=r"row 4: \d+ tokens .* max_length 32"):
        dataset.encode(batch_size=3, progress=False)
