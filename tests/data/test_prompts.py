"""Train / held-out prompt sets and prompt files."""

import json

import pytest

from omnirl_async.data.prompts import (
    CATEGORIES,
    HELDOUT_COMPOSITION,
    enumerate_prompts,
    heldout_prompts,
    prompt_category,
    prompt_split,
    read_prompt_rows,
    read_prompts,
    train_prompts,
    write_prompt_file,
)


def test_split_is_disjoint_complete_and_stratified():
    train, heldout = prompt_split()
    assert len(heldout) == 256 == sum(HELDOUT_COMPOSITION.values())
    assert not set(train) & set(heldout)
    everything = {p for c in CATEGORIES for p in enumerate_prompts(c)}
    assert set(train) | set(heldout) == everything and len(everything) == len(train) + len(heldout)
    for category, k in HELDOUT_COMPOSITION.items():
        assert sum(prompt_category(p) == category for p in heldout) == k
        assert any(prompt_category(p) == category for p in train)


def test_split_is_deterministic():
    assert heldout_prompts() == heldout_prompts() == prompt_split()[1]
    assert train_prompts() == prompt_split()[0]
    assert heldout_prompts(seed=1) != heldout_prompts()


def test_split_validates_composition():
    with pytest.raises(ValueError, match="composition\\['single'\\]"):
        prompt_split(composition={"single": 18})


def test_categories():
    assert prompt_category("a red circle") == "single"
    assert prompt_category("three red circles") == "counting"
    assert prompt_category("a red circle and a blue square") == "pair"
    assert prompt_category("a red circle below a blue square") == "position"
    with pytest.raises(ValueError, match="`category`"):
        enumerate_prompts("nope")


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_file_round_trip(tmp_path, suffix):
    path = tmp_path / f"prompts{suffix}"
    prompts = heldout_prompts()[:20] + ["not in the grammar, still fine in a file"]
    assert write_prompt_file(path, prompts) == len(prompts)
    assert read_prompts(path) == prompts
    if suffix == ".jsonl":
        rows = read_prompt_rows(path)
        assert rows[0]["category"] == prompt_category(prompts[0])
        assert "category" not in rows[-1]


def test_file_errors_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a red circle"}) + "\n\n" + json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError) as e:
        read_prompts(path)
    assert f"{path}:3" in str(e.value) and '"prompt"' in str(e.value)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=":1: not valid JSON"):
        read_prompts(path)
    with pytest.raises(ValueError, match="does not exist"):
        read_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="newline"):
        write_prompt_file(tmp_path / "x.txt", ["a\nb"])


def test_loader_errors_name_the_key_file_line_and_fix(tmp_path):
    from omnirl_async.preflight import InputError

    key = "data.val_files"
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"a red circle\n\xffoops\n")
    with pytest.raises(InputError) as e:
        read_prompts(bad, key=key)
    assert str(e.value) == (f"`{key}`: {bad}:2: byte 0xff at offset 13 (column 1) is not valid UTF-8 (invalid start "
                            "byte); save the file as UTF-8.")
    with pytest.raises(InputError) as e:
        read_prompts(tmp_path, key=key)
    assert str(e.value).startswith(f"`{key}`: {tmp_path} is a directory, not a prompt file (it holds bad.txt)")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(InputError, match="holds no prompts"):
        read_prompts(empty)
    (tmp_path / "x.json").write_text('[{"prompt": "a red circle"}]')
    with pytest.raises(InputError, match="has the extension '.json', which is not a prompt file format"):
        read_prompts(tmp_path / "x.json")
    assert isinstance(e.value, ValueError)


def test_custom_prompt_key_bom_and_crlf(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "a red circle"}\r\n\r\n{"text": "a blue square", "id": 2}\r\n')
    assert read_prompts(path, prompt_key="text") == ["a red circle", "a blue square"]
    assert read_prompt_rows(path, prompt_key="text")[1]["id"] == 2
    with pytest.raises(ValueError, match=r':1: row has no string "prompt" field'):
        read_prompts(path)


def test_prompt_file_list():
    from omnirl_async.data.prompts import prompt_file_list
    from omnirl_async.preflight import InputError

    assert prompt_file_list("a.jsonl") == ["a.jsonl"]
    assert prompt_file_list(["a.jsonl", "b.txt"]) == ["a.jsonl", "b.txt"]
    for bad in (5, [], ["a.jsonl", 3], ""):
        with pytest.raises(InputError, match="`data.train_files` = "):
            prompt_file_list(bad)
