"""Bad input is refused before Ray starts, through the real CLI, with one exact message and exit code 2.

Every case of the table writes a broken input under ``tmp_path``, runs
``omnirl_async.cli.main(["train", ...])`` and checks the whole of stderr
verbatim (tmp paths substituted), the exit code, that Ray was never started
(``init_ray`` is replaced by a tripwire and ``ray.is_initialized()`` stays
false) and that the command returned quickly.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import ray

from omnirl_async import cli
from omnirl_async.config import load_config
from omnirl_async.preflight import InputError, check_lora_adapter, read_safetensors_header
from omnirl_async.trainer.input_checks import check_inputs, find_input_problems

LORA = "actor_rollout_ref.model.lora_adapter_path"
RESAVE = "save the adapter again with `save_lora` or `PeftModel.save_pretrained`"
PEFT_DIR_FIX = ("point it at the folder that holds adapter_config.json and adapter_model.safetensors (a checkpoint's "
                "global_step_<N>/lora)")
GARBAGE = b"not a safetensors file, just some bytes\n"  # 40 bytes; its first 8 read as 7021991845529153390


# ----------------------------------------------------------------------------- builders of broken inputs
def _adapter(folder, *, r=4, a_shape=(4, 16), b_shape=(16, 4), config=None, weights=None):
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": ["to_q"]} if config is None else config
    if cfg is not False:
        (folder / "adapter_config.json").write_text(json.dumps(cfg))
    prefix = "base_model.model.transformer_blocks.0.attn.to_q"
    if weights is None:
        save_file({f"{prefix}.lora_A.weight": np.zeros(a_shape, np.float32),
                   f"{prefix}.lora_B.weight": np.zeros(b_shape, np.float32)},
                  str(folder / "adapter_model.safetensors"))
    else:
        (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def _write(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return path


def _reward_args(path, name="score"):
    return [f"reward.custom_reward_function.path='{path}'", f"reward.custom_reward_function.name={name}"]


def case_prompts_directory(tmp):
    d = tmp / "prompts"
    _write(d / "a.jsonl", '{"prompt": "a red circle"}\n')
    return [f"data.train_files='{d}'"], (
        f"`data.train_files`: {d} is a directory, not a prompt file (it holds a.jsonl); name the prompt file(s) "
        f"themselves, e.g. `data.train_files={d}/a.jsonl`.")


def case_prompts_empty_directory(tmp):
    d = tmp / "nothing_here"
    d.mkdir()
    return [f"data.train_files='{d}'"], (
        f"`data.train_files`: {d} is a directory, not a prompt file, and holds no .jsonl, .parquet or .txt file "
        "nor a `datasets` folder's state.json; name a prompt file (.jsonl, .parquet or .txt) or a folder written by "
        "`Dataset.save_to_disk` instead.")


def case_prompts_not_utf8(tmp):
    p = _write(tmp / "latin1.jsonl", b'{"prompt": "a red circle"}\n{"prompt": "caf\xe9 au lait"}\n')
    return [f"data.train_files='{p}'"], (
        f"`data.train_files`: {p}:2: byte 0xe9 at offset 42 (column 16) is not valid UTF-8 (invalid continuation "
        "byte); save the file as UTF-8.")


def case_prompts_empty(tmp):
    p = _write(tmp / "empty.txt", "\n  \n")
    return [f"data.train_files='{p}'"], (
        f"`data.train_files`: {p} holds no prompts (it is empty or only blank lines); add one prompt per line.")


def case_prompts_missing(tmp):
    p = tmp / "missing.jsonl"
    return [f"data.train_files='{p}'"], (
        f"`data.train_files`: prompt file {p} does not exist; fix the path (null uses the embedded shapes prompts).")


def case_prompts_bad_json(tmp):
    p = _write(tmp / "bad.jsonl", '{"prompt": "a red circle"}\n{"prompt": "two\n')
    return [f"data.train_files='{p}'"], (
        f"`data.train_files`: {p}:2: not valid JSON (Unterminated string starting at, column 12); each line must be "
        'one object such as {"prompt": "two red circles"}.')


def case_prompts_missing_key(tmp):
    p = _write(tmp / "text.jsonl", '{"prompt": "a red circle"}\n\n{"text": "a blue square"}\n')
    return [f"data.train_files='{p}'"], (
        f"`data.train_files`: {p}:3: row has no string \"prompt\" field (got '{{\"text\": \"a blue square\"}}'; its "
        'fields: text); each line must look like {"prompt": "two red circles"}, or set `data.prompt_key=text` if '
        '"text" holds the prompt.')


def case_prompts_bad_extension(tmp):
    p = _write(tmp / "prompts.csv", "prompt\na red circle\n")
    return [f"data.train_files='{p}'"], (
        f"`data.train_files`: {p} has the extension '.csv', which is not a prompt file format; use .jsonl (one "
        'object such as {"prompt": "two red circles"} per line), .parquet (a `prompt` column), .txt (one prompt per '
        "line) or a folder written by `Dataset.save_to_disk`.")


def case_val_prompts_missing(tmp):
    p = tmp / "val.txt"
    return [f"data.val_files=['{p}']"], (
        f"`data.val_files`: prompt file {p} does not exist; fix the path (null uses the embedded shapes prompts).")


def case_lora_garbage_weights(tmp):
    d = _adapter(tmp / "adapter", weights=GARBAGE)
    return [f"{LORA}='{d}'"], (
        f"`{LORA}`: {d}/adapter_model.safetensors is not a valid safetensors file (its 8-byte header length, "
        f"7021991845529153390, exceeds the file size of 40 bytes); the file is damaged or not an adapter: {RESAVE}.")


def case_lora_no_config(tmp):
    d = _adapter(tmp / "adapter", config=False)
    return [f"{LORA}='{d}'"], (
        f"`{LORA}`: {d} has no adapter_config.json, so it is not a PEFT adapter folder; {PEFT_DIR_FIX}.")


def case_lora_config_not_json(tmp):
    d = _adapter(tmp / "adapter")
    (d / "adapter_config.json").write_text('{"r": 4,\n "lora_alpha": }\n')
    return [f"{LORA}='{d}'"], (
        f"`{LORA}`: {d}/adapter_config.json:2:16: not valid JSON (Expecting value); {RESAVE}.")


def case_lora_config_lacks_keys(tmp):
    d = _adapter(tmp / "adapter", config={"peft_type": "LORA", "lora_alpha": 8})
    return [f"{LORA}='{d}'"], (
        f"`{LORA}`: {d}/adapter_config.json lacks the key(s) ['r', 'target_modules'] that peft needs; {RESAVE}.")


def case_lora_rank_mismatch(tmp):
    d = _adapter(tmp / "adapter", r=4, a_shape=(8, 16), b_shape=(16, 8))
    return [f"{LORA}='{d}'"], (
        f"`{LORA}`: {d}/adapter_model.safetensors: tensor base_model.model.transformer_blocks.0.attn.to_q.lora_A."
        "weight has shape [8, 16] (and 1 more tensor(s)), but adapter_config.json says r = 4 (lora_A must be "
        f"[r, in_features]); the two files come from different adapters: {RESAVE}.")


def case_lora_checkpoint_folder(tmp):
    step = tmp / "ckpt" / "global_step_3"
    _adapter(step / "lora")
    return [f"{LORA}='{step}'"], (
        f"`{LORA}`: {step} has no adapter_config.json, so it is not a PEFT adapter folder ({step}/lora holds one: "
        f"point at that); {PEFT_DIR_FIX}.")


def case_lora_missing(tmp):
    d = tmp / "no_adapter"
    return [f"{LORA}='{d}'"], (
        f"`{LORA}`: adapter folder {d} does not exist; fix the path, or set `{LORA}=null` to start a new LoRA "
        "adapter.")


def case_reward_missing(tmp):
    p = tmp / "my_reward.py"
    return _reward_args(p), (
        f"`reward.custom_reward_function.path`: {p} does not exist; fix the path to a .py file that defines "
        "`score`.")


def case_reward_syntax_error(tmp):
    p = _write(tmp / "my_reward.py", "def score(images, prompts):\n    return = 1\n")
    return _reward_args(p), (
        f"`reward.custom_reward_function.path`: {p}:2: Python syntax error: invalid syntax in 'return = 1'; fix the "
        "file so that it defines `score`.")


def case_reward_wrong_name(tmp):
    p = _write(tmp / "my_reward.py", "def reward(images, prompts):\n    return [0.0] * len(prompts)\n")
    return _reward_args(p), (
        f"`reward.custom_reward_function.name` = 'score' is not defined in {p}; functions and classes there: reward; "
        "set `reward.custom_reward_function.name` to one of them, or define score in that file.")


def case_reward_name_is_a_literal(tmp):
    p = _write(tmp / "my_reward.py", "import numpy as np\n\nscore = 0.5\n")
    return _reward_args(p), (
        f"`reward.custom_reward_function.name` = 'score' in {p}:3 is a float, not a function; it must be callable "
        "as fn(images, prompts, **kwargs).")


def case_sampler_is_a_function(tmp):
    p = _write(tmp / "my_sampler.py", "def Newest(*args):\n    return None\n")
    return [f"trainer.v1.sampler.custom_sampler.path='{p}'", "trainer.v1.sampler.custom_sampler.name=Newest"], (
        f"`trainer.v1.sampler.custom_sampler.name` = 'Newest' in {p}:1 is a function, not a class; it must be a "
        "subclass of omnirl_async.buffer.samplers.Sampler.")


def case_reward_unregistered(tmp):
    from omnirl_async.rewards import registered_rewards

    return ["+reward.reward_functions={geo: {name: no_such_reward}}"], (
        f"`reward.reward_functions.geo.name` = 'no_such_reward' is not a registered reward; choose one of "
        f"{registered_rewards()}, or set `reward.reward_functions.geo.path` to a .py file that defines it.")


def case_model_missing(tmp):
    d = tmp / "no_model"
    return [f"actor_rollout_ref.model.path='{d}'"], (
        f"`actor_rollout_ref.model.path`: model folder {d} does not exist; give a local diffusers pipeline folder "
        "(with model_index.json) or an embedded model such as embedded:tiny-sd3.")


def case_model_unknown_embedded(tmp):
    return ["actor_rollout_ref.model.path=embedded:tiny-sd4"], (
        "`actor_rollout_ref.model.path` = 'embedded:tiny-sd4': unknown embedded model 'tiny-sd4'; choose one of "
        "['embedded:tiny-sd3', 'embedded:tiny-flux', 'embedded:shapes'], or give a local diffusers pipeline folder.")


def case_resume_missing(tmp):
    d = tmp / "ckpt" / "global_step_9"
    return ["trainer.resume_mode=resume_path", f"trainer.resume_from_path='{d}'"], (
        f"`trainer.resume_from_path`: checkpoint folder {d} does not exist; point it at a complete global_step_<N> "
        "folder under `trainer.default_local_dir`, or set `trainer.resume_mode=auto` (newest checkpoint there) or "
        "`disable`.")


def case_resume_root_folder(tmp):
    root = tmp / "ckpt"
    for step in (2, 10):
        _write(root / f"global_step_{step}" / "COMPLETE", str(step))
    return ["trainer.resume_mode=resume_path", f"trainer.resume_from_path='{root}'"], (
        f"`trainer.resume_from_path`: {root} holds checkpoints (global_step_2, global_step_10) but is not one "
        f"itself; point it at one of them, e.g. {root}/global_step_10.")


def case_two_problems_at_once(tmp):
    prompts = tmp / "p.txt"
    reward = tmp / "r.py"
    return [f"data.train_files='{prompts}'", *_reward_args(reward)], (
        "2 problems with the files this config points at:\n"
        f"  1. `data.train_files`: prompt file {prompts} does not exist; fix the path (null uses the embedded shapes "
        "prompts).\n"
        f"  2. `reward.custom_reward_function.path`: {reward} does not exist; fix the path to a .py file that "
        "defines `score`.")


CASES = [v for k, v in sorted(globals().items()) if k.startswith("case_")]


# ----------------------------------------------------------------------------- the table, through the CLI
@pytest.fixture(scope="module", autouse=True)
def warm_imports(small_overrides):
    """Import and compose once, so the timing below measures the check, not the first imports."""
    load_config(small_overrides)
    import omnirl_async.rewards  # noqa: F401
    import omnirl_async.trainer.task_runner  # noqa: F401


@pytest.fixture
def no_ray(monkeypatch):
    from omnirl_async.trainer import task_runner

    def tripwire(config):
        raise AssertionError("init_ray was called: the bad input was not caught before Ray")

    monkeypatch.setattr(task_runner, "init_ray", tripwire)
    assert not ray.is_initialized()


@pytest.mark.parametrize("case", CASES, ids=[c.__name__.removeprefix("case_") for c in CASES])
def test_bad_input_is_refused_before_ray(case, tmp_path, small_overrides, capsys, no_ray):
    overrides, expected = case(tmp_path)
    capsys.readouterr()
    t0 = time.perf_counter()
    rc = cli.main(["train", *small_overrides, *overrides])
    elapsed = time.perf_counter() - t0
    captured = capsys.readouterr()
    assert captured.err == f"omnirl-async: {expected}\n"
    assert rc == 2
    assert not ray.is_initialized()
    assert elapsed < 3.0, f"took {elapsed:.2f} s"


# ----------------------------------------------------------------------------- the API, directly
def test_check_inputs_raises_one_error_with_every_problem(tmp_path, small_overrides):
    cfg = load_config([*small_overrides, f"data.train_files='{tmp_path / 'a.txt'}'",
                       f"{LORA}='{tmp_path / 'lora'}'"])
    problems = find_input_problems(cfg)
    assert [p.split(":")[0] for p in problems] == ["`data.train_files`", f"`{LORA}`"]
    with pytest.raises(InputError) as err:
        check_inputs(cfg)
    assert err.value.problems == problems and isinstance(err.value, ValueError)


def test_good_inputs_pass(tmp_path, small_overrides):
    prompts = _write(tmp_path / "p.jsonl", '{"prompt": "a red circle"}\n')
    val = _write(tmp_path / "v.txt", "a blue square\n")
    reward = _write(tmp_path / "r.py", "def score(images, prompts):\n    return [0.0] * len(prompts)\n")
    adapter = _adapter(tmp_path / "adapter")
    ckpt = _write(tmp_path / "ckpt" / "global_step_1" / "COMPLETE", "1").parent
    cfg = load_config([*small_overrides, f"data.train_files='{prompts}'", f"data.val_files='{val}'",
                       *_reward_args(reward), f"{LORA}='{adapter}'", "trainer.resume_mode=resume_path",
                       f"trainer.resume_from_path='{ckpt}'"])
    assert find_input_problems(cfg) == []


def test_user_files_are_read_not_executed(tmp_path, small_overrides):
    """A reward file may load a model at import time; the driver's check must not run it."""
    marker = tmp_path / "executed"
    reward = _write(tmp_path / "r.py", f"open({str(marker)!r}, 'w').close()\n"
                                       "def score(images, prompts):\n    return [0.0] * len(prompts)\n")
    dynamic = _write(tmp_path / "d.py", "from math import *\n")  # may define anything: not refused
    for path, name in ((reward, "score"), (dynamic, "score")):
        cfg = load_config([*small_overrides, *_reward_args(path, name)])
        assert find_input_problems(cfg) == []
    assert not marker.exists()


def test_an_adapter_saved_by_save_lora_passes(tmp_path, tiny_sd3_path):
    from omnirl_async.models.policy import FlowMatchPolicy

    policy = FlowMatchPolicy.from_pretrained(tiny_sd3_path)
    policy.add_lora(rank=3, alpha=6.0)
    folder = policy.save_lora(tmp_path / "lora")
    config = check_lora_adapter(str(folder))
    assert config["r"] == 3
    header = read_safetensors_header(folder / "adapter_model.safetensors")
    assert all(k.startswith("base_model.model.") for k in header if k != "__metadata__")


def test_local_model_folder_checks(tmp_path, tiny_sd3_path, small_overrides):
    from omnirl_async.trainer.input_checks import check_model_path

    check_model_path(str(tiny_sd3_path))  # a real pipeline folder passes
    broken = tmp_path / "model"
    _write(broken / "model_index.json", json.dumps({"_class_name": "StableDiffusion3Pipeline",
                                                    "transformer": ["diffusers", "SD3Transformer2DModel"],
                                                    "vae": ["diffusers", "AutoencoderKL"],
                                                    "text_encoder_3": [None, None]}))
    _write(broken / "transformer" / "config.json", "{}")
    with pytest.raises(InputError) as err:
        check_model_path(str(broken))
    assert str(err.value) == (
        f"`actor_rollout_ref.model.path`: {broken}/model_index.json lists the component(s) ['vae'] but {broken} has "
        "no folder for them; the copy or download is incomplete: copy the whole pipeline folder.")


def test_read_safetensors_header_rejects_truncated_files(tmp_path):
    from safetensors.numpy import save_file

    path = tmp_path / "w.safetensors"
    save_file({"x": np.ones((2, 3), np.float32)}, str(path))
    assert read_safetensors_header(path)["x"]["shape"] == [2, 3]
    path.write_bytes(path.read_bytes()[:-4])  # cut into the tensor bytes
    with pytest.raises(ValueError, match="outside the 20 data bytes"):
        read_safetensors_header(path)


# ----------------------------------------------------------------------------- the CLI's error policy
def test_cli_keeps_tracebacks_for_bugs(monkeypatch):
    def boom(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "cmd_config", boom)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["config"])


def test_cli_reports_checkpoint_errors_as_user_errors(monkeypatch, capsys):
    from omnirl_async.trainer import checkpoint

    error_cls = getattr(checkpoint, "CheckpointError", None)
    if error_cls is None:  # until the checkpoint module defines it, stand one in
        error_cls = type("CheckpointError", (ValueError,), {})
        monkeypatch.setattr(checkpoint, "CheckpointError", error_cls, raising=False)

    def bad_checkpoint(args):
        raise error_cls("`trainer.resume_from_path`: /x is damaged")

    monkeypatch.setattr(cli, "cmd_config", bad_checkpoint)
    assert cli.main(["config"]) == 2
    assert capsys.readouterr().err == "omnirl-async: `trainer.resume_from_path`: /x is damaged\n"


def test_cli_unwraps_user_errors_raised_inside_ray_actors(monkeypatch, capsys):
    cause = InputError("`reward.custom_reward_function.path`: /x/r.py does not exist; fix the path")
    wrapped = type("RayTaskError(InputError)", (InputError,), {})("ray::RolloutWorker.__init__ ... Traceback ...")
    wrapped.cause = cause

    def remote_failure(args):
        raise wrapped

    monkeypatch.setattr(cli, "cmd_config", remote_failure)
    assert cli.main(["config"]) == 2
    assert capsys.readouterr().err == f"omnirl-async: {cause}\n"
