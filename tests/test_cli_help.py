"""``omnirl-async --help`` lists every subcommand with an example that parses; ``config --doc``; the dashboard."""

from __future__ import annotations

import argparse
import shlex

import pytest

from omnirl_async.cli import EXAMPLES, build_parser, main


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_subcommand_has_an_example_and_every_example_a_subcommand():
    assert set(_subcommands()) == set(EXAMPLES)


def test_top_level_help_lists_each_subcommand_with_its_example(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name, example in EXAMPLES.items():
        assert f"  {name} " in out and f"$ {example}" in out, name


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_example_parses_and_shows_in_its_own_help(name, capsys):
    argv = shlex.split(EXAMPLES[name])
    assert argv[:2] == ["omnirl-async", name]
    args = build_parser().parse_args(argv[1:])
    assert args.command == name and callable(args.fn)
    with pytest.raises(SystemExit):
        build_parser().parse_args([name, "--help"])
    assert f"$ {EXAMPLES[name]}" in capsys.readouterr().out


def test_config_doc_prints_each_value_beside_its_help(capsys):
    assert main(["config", "--doc", "data.train_batch_size=8", "actor_rollout_ref.model.algorithm=grpo_guard"]) == 0
    out = capsys.readouterr().out
    lines = {line.split(" = ")[0]: line for line in out.splitlines() if " = " in line and not line.startswith("#")}
    assert "data.train_batch_size = 8 " in lines["data.train_batch_size"]
    assert "# Prompts per training step" in lines["data.train_batch_size"]
    # the preset's value, and the preset named at the top as in plain `config`
    assert "= 2e-06" in lines["actor_rollout_ref.actor.diffusion_loss.clip_ratio"]
    assert out.startswith("# Presets")
    from omnirl_async.config.doc import iter_keys

    assert set(lines) == {info.path for info in iter_keys()}


@pytest.mark.slow  # starts Ray twice
@pytest.mark.parametrize("extra, on", [([], True), (["+ray_kwargs.ray_init.include_dashboard=false"], False)])
def test_dashboard_is_on_when_installed_unless_turned_off(small_overrides, extra, on):
    import ray

    from omnirl_async.config import load_config
    from omnirl_async.trainer.task_runner import init_ray

    if ray.is_initialized():
        pytest.skip("needs to start its own Ray")
    printed: list[str] = []
    assert init_ray(load_config(small_overrides + ["ray_kwargs.num_cpus=1", *extra]), printer=printed.append)
    try:
        if not on:
            assert printed == []
            return
        (line,) = printed
        assert line.startswith("Ray dashboard: http://")
        import time
        import urllib.request

        deadline = time.monotonic() + 30
        while True:  # the dashboard answers at the printed address
            try:
                with urllib.request.urlopen(line.split(": ", 1)[1], timeout=5) as reply:
                    assert reply.status == 200
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    finally:
        ray.shutdown()
