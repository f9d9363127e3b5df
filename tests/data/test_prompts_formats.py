"""Prompt datasets: real Parquet files and `datasets` folders, the rows' other fields, and the errors."""

from __future__ import annotations

import datetime
import json
import pickle
from types import SimpleNamespace

import numpy as np
import pytest

from omnirl_async.data.prompts import (
    MAX_LISTED_ROWS,
    PromptSet,
    load_train_prompts,
    load_val_prompts,
    read_prompt_rows,
    read_prompt_set,
    read_prompts,
)
from omnirl_async.preflight import InputError

KEY = "data.train_files"


def _parquet(path, columns: dict) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), str(path))
    return str(path)


def test_parquet_prompts_keep_their_rows_other_fields(tmp_path):
    path = _parquet(tmp_path / "p.parquet", {
        "prompt": ["two red circles", "a blue square"],
        "ground_truth": [{"count": 2, "color": "red"}, {"count": 1, "color": "blue"}],
        "data_source": ["geneval", "geneval"],
        "score": np.array([0.5, 1.5], np.float32),
        "made": [datetime.date(2026, 1, 2), datetime.date(2026, 1, 3)],
    })
    ps = read_prompt_set(path, key=KEY)
    assert list(ps) == ["two red circles", "a blue square"] and isinstance(ps, list)
    assert ps.fields[0] == {"ground_truth": {"count": 2, "color": "red"}, "data_source": "geneval", "score": 0.5,
                            "made": "2026-01-02"}  # plain data: travels through Ray and into checkpoints
    assert read_prompt_rows(path)[1] == {"prompt": "a blue square", **ps.fields[1]}


def test_parquet_with_another_prompt_column(tmp_path):
    path = _parquet(tmp_path / "c.parquet", {"id": [1, 2], "caption": ["a red circle", "two blue squares"],
                                             "ground_truth": ["1", "2"]})
    with pytest.raises(InputError) as info:
        read_prompts(path, key=KEY)
    assert str(info.value) == (f"`{KEY}`: {path} has no \"prompt\" column (its columns: id, caption, ground_truth); "
                               "name the prompt column in the data, or set `data.prompt_key=caption` if \"caption\" "
                               "holds the prompt.")
    assert read_prompts(path, prompt_key="caption", key=KEY) == ["a red circle", "two blue squares"]


def test_jsonl_without_the_prompt_key_names_its_fields_and_suggests_the_key(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"id": 1, "question": "a red circle", "answer": "circle"}) + "\n")
    with pytest.raises(InputError) as info:
        read_prompts(path, key=KEY)
    assert str(info.value) == (
        f"`{KEY}`: {path}:1: row has no string \"prompt\" field (got '{{\"id\": 1, \"question\": \"a red circle\", "
        "\"answer\": \"circle\"}'; its fields: id, question, answer); each line must look like "
        "{\"prompt\": \"two red circles\"}, or set `data.prompt_key=question` if \"question\" holds the prompt.")


def test_bad_rows_are_named_by_row_number_all_together(tmp_path):
    path = _parquet(tmp_path / "bad.parquet", {"prompt": ["a red circle", None, "two blue squares", "  ", "x"],
                                               "label": [1, 2, 3, 4, 5]})
    with pytest.raises(InputError) as info:
        read_prompts(path, key=KEY)
    assert info.value.problems == [
        f"`{KEY}`: {path} row 2: `prompt` = None is not a prompt (expected a string); fill it in or drop the row.",
        f"`{KEY}`: {path} row 4: `prompt` is blank; write the prompt or drop the row.",
    ]
    many = _parquet(tmp_path / "many.parquet", {"prompt": ["ok"] + [None] * (MAX_LISTED_ROWS + 3)})
    with pytest.raises(InputError) as info:
        read_prompts(many, key=KEY)
    assert len(info.value.problems) == MAX_LISTED_ROWS + 1
    assert info.value.problems[0].startswith(f"`{KEY}`: {many} row 2: ")
    assert info.value.problems[-1] == (f"`{KEY}`: {many}: 3 more bad rows like these ({MAX_LISTED_ROWS + 3} in all); "
                                       "fix them or remove them from the file.")


def test_jsonl_bad_rows_after_the_first_are_listed_by_line(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"prompt": "a red circle", "gt": 1}\n{"prompt": 3}\n\n{"prompt": "b", "gt": 2}\n{oops\n')
    with pytest.raises(InputError) as info:
        read_prompts(path, key=KEY)
    assert [p.split(": ")[1] for p in info.value.problems] == [f"{path}:2", f"{path}:5"]


def test_values_that_cannot_travel_are_named_with_their_row(tmp_path):
    path = _parquet(tmp_path / "d.parquet", {"prompt": ["a", "b"],
                                             "took": [datetime.timedelta(seconds=1), datetime.timedelta(seconds=2)]})
    with pytest.raises(InputError) as info:
        read_prompts(path, key=KEY)
    assert info.value.problems[0] == (f"`{KEY}`: {path} row 1: field `took` holds a timedelta, which cannot travel "
                                      "with the prompt; store it as a string, number, list or object")


def test_unreadable_parquet_names_the_file(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(InputError, match=f"`{KEY}`: dataset .*broken.parquet: not a readable Parquet file"):
        read_prompts(path, key=KEY)


def test_prompt_set_keeps_fields_through_slicing_pickling_and_concatenation():
    ps = PromptSet(["a", "b", "c"], [{"gt": 1}, {}, {"gt": 3}])
    assert ps[1:].fields == [{}, {"gt": 3}] and ps[0] == "a" and ps.row(1) == {}
    again = pickle.loads(pickle.dumps(ps))
    assert again == ["a", "b", "c"] and again.fields == ps.fields and isinstance(again, PromptSet)
    both = PromptSet.concat([ps, ["d"]])
    assert both == ["a", "b", "c", "d"] and both.fields[3] == {}
    assert PromptSet(["x"], [{}]).fields is None  # no row has other fields
    with pytest.raises(ValueError, match="`fields` has 1 entries for 2 prompts"):
        PromptSet(["a", "b"], [{}])


def test_loaders_read_parquet_from_the_config(tmp_path):
    train = _parquet(tmp_path / "train.parquet", {"prompt": ["a", "b"], "ground_truth": [1, 2]})
    val = tmp_path / "val.txt"
    val.write_text("c\nd\ne\n")
    data = SimpleNamespace(train_files=[train, str(val)], val_files=str(val), prompt_key="prompt")
    ps = load_train_prompts(data)
    assert ps == ["a", "b", "c", "d", "e"] and ps.fields == [{"ground_truth": 1}, {"ground_truth": 2}, {}, {}, {}]
    assert load_val_prompts(data, 2) == ["c", "d"] and load_val_prompts(data, 2).fields is None
    assert load_train_prompts(SimpleNamespace(train_files=None)).fields is None  # the embedded prompts


def test_datasets_folders(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["a red circle", "two blue squares"],
                                     "reward_model": [{"ground_truth": "1"}, {"ground_truth": "2"}]})
    ds.save_to_disk(str(tmp_path / "ds"))
    ps = read_prompt_set(tmp_path / "ds", prompt_key="text", key=KEY)
    assert ps == ["a red circle", "two blue squares"]
    assert ps.fields == [{"reward_model": {"ground_truth": "1"}}, {"reward_model": {"ground_truth": "2"}}]
    with pytest.raises(InputError, match=r"no \"prompt\" column \(its columns: text, reward_model\); .*"
                                         r"`data.prompt_key=text`"):
        read_prompts(tmp_path / "ds", key=KEY)
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "one_split"))
    assert read_prompts(tmp_path / "one_split", prompt_key="text") == list(ps)
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "two_splits"))
    with pytest.raises(InputError, match="a DatasetDict with splits \\['train', 'test'\\]; name one split's folder"):
        read_prompts(tmp_path / "two_splits", prompt_key="text", key=KEY)
