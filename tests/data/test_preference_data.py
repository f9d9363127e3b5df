"""Preference datasets: the readers, the row checks and the dataset script (no model needed)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from omnirl_async.data.preference import LatentRef, Record, open_dataset, parse_record
from omnirl_async.data.preference_checks import PreferenceDataError, check_dataset
from omnirl_async.data.shapes import parse_prompt
from omnirl_async.preflight import InputError
from omnirl_async.rewards.tiny_geneval import tiny_geneval

from .conftest import LATENT_SHAPE, PLANTED_BAD, PLANTED_GOOD, SIZE


def _check(path, **kw):
    kw = {"height": SIZE, "width": SIZE, "latent_shape": LATENT_SHAPE, **kw}
    return check_dataset(open_dataset(path), **kw)


def test_planted_bad_rows_are_each_named_with_row_line_and_field(planted):
    path, _ = planted
    res = _check(path)
    assert res.total_rows == 11
    assert [p.id for p in res.pairs] == PLANTED_GOOD
    bad = res.bad_rows
    assert sorted(bad) == sorted(PLANTED_BAD)
    for row, field in PLANTED_BAD.items():
        assert [p.field for p in bad[row]] == [field], (row, [p.text() for p in bad[row]])
    text = {row: bad[row][0].text() for row in bad}
    # JSONL rows carry file:line (a blank line sits between rows 2 and 3)
    assert text[3].startswith(f"{path}:4 (row 3): `chosen` = 'images/nope.png': file ") and "not found" in text[3]
    assert "does not decode as an image" in text[4]
    assert "is 16x16" in text[5] and "32x32" in text[5] and "resize" in text[5]
    assert text[6].startswith(f"{path}:7 (row 6): not valid JSON")
    assert "also the id of" in text[7] and f"{path}:1 (row 1)" in text[7]
    assert "non-empty string" in text[8]
    assert "same file as `chosen`" in text[9]


def test_refusal_lists_every_bad_row_and_the_fix(planted, tmp_path):
    path, _ = planted
    res = _check(path)
    report = res.write_report(tmp_path / "r" / "report.jsonl")
    err = res.error(report)
    assert isinstance(err, PreferenceDataError) and isinstance(err, InputError)
    msg = str(err)
    assert "7 of 11 rows cannot be ingested, so nothing was ingested" in msg
    assert "--skip-invalid" in msg and "4 good rows" in msg and report in msg
    for row in PLANTED_BAD:
        assert f"(row {row})" in msg
    lines = [json.loads(line) for line in open(report)]
    assert [r["row"] for r in lines] == sorted(PLANTED_BAD)
    assert {r["row"]: r["problems"][0]["field"] for r in lines} == PLANTED_BAD
    assert lines[0]["id"] == "b-missing" and lines[0]["problems"][0]["value"] == "images/nope.png"


def test_latent_references_are_checked(tmp_path):
    from safetensors.numpy import save_file

    save_file({"ok": np.zeros(LATENT_SHAPE, np.float32), "ok2": np.ones(LATENT_SHAPE, np.float16),
               "wide": np.zeros((4, 8, 8), np.float32), "nan": np.full(LATENT_SHAPE, np.nan, np.float32),
               "int": np.zeros(LATENT_SHAPE, np.int32)}, str(tmp_path / "z.safetensors"))
    rows = [("a", "ok", "ok2"), ("b", "ok", "wide"), ("c", "ok", "missing"), ("d", "ok", "nan"), ("e", "ok", "int"),
            ("f", "ok", "ok")]
    lines = [json.dumps({"id": i, "prompt": "p", "chosen": f"latents:z.safetensors#{c}",
                         "rejected": f"latents:z.safetensors#{r}"}) for i, c, r in rows]
    lines.append(json.dumps({"id": "g", "prompt": "p", "chosen": "latents:z.pt#ok", "rejected": "x.png"}))
    (tmp_path / "d.jsonl").write_text("\n".join(lines))
    res = _check(tmp_path / "d.jsonl")
    assert [p.id for p in res.pairs] == ["a"]
    msgs = {row: " ".join(p.text() for p in ps) for row, ps in res.bad_rows.items()}
    assert "shape [4, 8, 8]" in msgs[2] and "[4, 16, 16]" in msgs[2]
    assert "no tensor 'missing'" in msgs[3]
    assert "NaN or inf" in msgs[4]
    assert "dtype I32" in msgs[5]
    assert "same file as `chosen`" in msgs[6]
    assert "latents:<shard>.safetensors#<key>" in msgs[7]


def test_schema_problems(tmp_path):
    def parse(d):
        return parse_record(Record(1, "f:1 (row 1)", d), str(tmp_path))

    ok = {"id": 7, "prompt": "p", "chosen": "a.png", "rejected": "b.png", "extra_col": [1, 2]}
    parsed = parse(ok)
    assert not parsed.problems and parsed.fields.id == "7" and parsed.fields.metadata == {"extra_col": [1, 2]}
    assert [p.field for p in parse({**ok, "chosen_scor": 1.0}).problems] == ["chosen_scor"]
    assert [p.field for p in parse({**ok, "chosen_score": float("nan")}).problems] == ["chosen_score"]
    assert [p.field for p in parse({**ok, "id": True}).problems] == ["id"]
    assert [p.field for p in parse({**ok, "metadata": [1]}).problems] == ["metadata"]
    assert [p.field for p in parse({"id": "x", "prompt": "p"}).problems] == ["chosen", "rejected"]
    ref = parse({**ok, "chosen": "latents:sub/s.safetensors#k#1"}).fields.chosen
    assert isinstance(ref, LatentRef) and ref.key == "k#1" and ref.shard == str(tmp_path / "sub" / "s.safetensors")


def test_unusable_dataset_paths(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        open_dataset(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("id\n")
    with pytest.raises(InputError, match="not a dataset format"):
        open_dataset(tmp_path / "d.csv")
    (tmp_path / "a.jsonl").write_text("")
    (tmp_path / "b.jsonl").write_text("")
    with pytest.raises(InputError, match="holds 2"):
        open_dataset(tmp_path)
    (tmp_path / "x.parquet").write_bytes(b"not parquet")
    with pytest.raises(InputError, match="not a readable Parquet file"):
        open_dataset(tmp_path / "x.parquet")


def test_image_size_follows_the_model(planted):
    path, _ = planted
    res = _check(path, height=64, width=64)
    assert [p.id for p in res.pairs] == ["g3"]  # only the latents pair: every image is 32x32
    assert any("the model generates 64x64" in p.text() for p in res.problems)


# ------------------------------------------------------------------------------ the dataset script
def test_broken_clause_breaks_exactly_one_clause(make_dataset_script):
    rng = np.random.default_rng(0)
    for prompt in ["two red circles", "a blue square to the left of a yellow triangle",
                   "a green triangle and three white squares", "a red circle above a blue circle"]:
        spec = parse_prompt(prompt)
        for _ in range(10):
            broken, clause = make_dataset_script.break_one_clause(spec, rng)
            if clause == "position":
                assert broken.groups == spec.groups and broken.relation != spec.relation
                continue
            changed = [(a, b) for a, b in zip(spec.groups, broken.groups) if a != b]
            assert len(changed) == 1 and broken.relation == spec.relation
            a, b = changed[0]
            attr = {"count": "count", "color": "color", "shape": "shape"}[clause]
            diffs = [f for f in ("count", "color", "shape") if getattr(a, f) != getattr(b, f)]
            assert diffs == [attr]


def test_rendered_pairs_meet_and_break_the_prompt(make_dataset_script):
    from omnirl_async.data.prompts import train_prompts

    prompts = train_prompts()[:24]
    rows = make_dataset_script.render_pairs(prompts, size=SIZE, seed=1)
    assert len(rows) >= 22
    chosen = np.stack([r["chosen"] for r in rows])
    rejected = np.stack([r["rejected"] for r in rows])
    assert chosen.shape == (len(rows), SIZE, SIZE, 3) and chosen.dtype == np.uint8
    ps = [r["prompt"] for r in rows]
    assert (tiny_geneval(chosen, ps)["strict"] == 1).all()
    assert (tiny_geneval(rejected, ps)["strict"] == 0).all()
    assert {r["metadata"]["broken"] for r in rows} <= {"count", "color", "shape", "position"}


def test_jsonl_parquet_and_datasets_folder_load_the_same_rows(make_dataset_script, tmp_path):
    from omnirl_async.data.prompts import train_prompts

    rows = make_dataset_script.render_pairs(train_prompts()[:6], size=SIZE, seed=2)
    seen = {}
    for fmt in ("jsonl", "parquet", "datasets"):
        path = make_dataset_script.write_dataset(rows, str(tmp_path / fmt), fmt=fmt)
        res = _check(path)
        assert not res.problems, [p.text() for p in res.problems]
        seen[fmt] = [(p.id, p.content_hash, p.fields.prompt, p.fields.chosen_score, p.fields.metadata)
                     for p in res.pairs]
    assert len(seen["jsonl"]) == len(rows)
    assert seen["jsonl"] == seen["parquet"] == seen["datasets"]


def test_script_cli_writes_an_ingestable_dataset(make_dataset_script, tmp_path, capsys):
    assert make_dataset_script.main(["--out", str(tmp_path / "ds"), "--num-prompts", "5", "--size", "32"]) == 0
    assert "omnirl-async ingest" in capsys.readouterr().out
    res = _check(tmp_path / "ds" / "data.jsonl")
    assert len(res.pairs) == 5 and not res.problems


def test_the_documented_example_is_valid():
    from .conftest import REPO

    res = _check(REPO / "docs" / "examples" / "preference_data" / "data.jsonl")
    assert not res.problems, [p.text() for p in res.problems]
    assert [p.id for p in res.pairs] == ["example-1", "example-2", "example-3", "example-4"]
    assert isinstance(res.pairs[3].fields.chosen, LatentRef)
