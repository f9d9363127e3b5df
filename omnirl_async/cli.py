"""``omnirl-async`` command line.

    omnirl-async train [--config-name NAME] [--config-dir DIR] key=value ...
    omnirl-async train -m key=a,b,c [key2=x,y] [key=value ...]
                                                 a sweep: one run per combination, one after another, each in
                                                 <trainer.default_local_dir>/sweep/key=a (logs likewise)
    omnirl-async report RUN_DIR... [--out PNG]   compare runs (a sweep folder stands for its runs): a table of
                                                 samples/s, learner idle, reward, held-out accuracy, staleness;
                                                 a PNG of reward vs wall-clock and samples, staleness histograms
    omnirl-async eval [--lora DIR] [--out DIR] [key=value ...]
                                                 score the held-out prompts, save an image grid
    omnirl-async eval --run RUN_DIR [key=value ...]
                                                 the same for a run's newest verified checkpoint, with the
                                                 config the run saved (RUN_DIR/resolved_config.yaml)
    omnirl-async config [key=value ...]          print the resolved, validated config
    omnirl-async build-tiny {sd3,flux} DIR       write a tiny random-weight pipeline folder
    omnirl-async ingest DATASET --run-dir DIR [--skip-invalid] [key=value ...]
                                                 check a preference dataset (docs/PREFERENCE_DATA.md) and
                                                 store it VAE-encoded in DIR/offline/ for the model the
                                                 config names
    omnirl-async buffer inspect DIR              size per table and source, online versions and staleness,
                                                 a few offline pairs: of a run dir's newest checkpoint, a
                                                 checkpoint, or an offline store alone
    omnirl-async export CKPT --out DIR [--base MODEL] [--check]
                                                 write a checkpoint's LoRA as a diffusers LoRA
                                                 (pytorch_lora_weights.safetensors) loadable with
                                                 pipe.load_lora_weights(DIR)

Overrides use Hydra's grammar and the key paths of VeRL-Omni
(``actor_rollout_ref.rollout.n=8``, ``trainer.v1.trainer_mode=sync``).

A user error - a bad config value (``ConfigError``), a file or folder the config
points at that cannot be used (``InputError``, found before Ray starts), an
unusable checkpoint (``CheckpointError``) - is printed to stderr as one line
``omnirl-async: <message>`` and the command exits with code 2, without a
traceback. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["main"]


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config-name", default="diffusion_trainer", help="YAML in the config dir (without .yaml)")
    p.add_argument("--config-dir", default=None, help="folder of the YAML configs (default: the package's configs/)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. data.train_batch_size=16")


def _load(args):
    from omnirl_async.config import load_config

    return load_config(args.overrides, config_name=args.config_name, config_dir=args.config_dir)


def cmd_train(args) -> int:
    from tqdm.auto import tqdm

    from omnirl_async.trainer.task_runner import TaskRunner

    if args.multirun:  # omnirl_async/trainer/sweep.py: the cartesian product of the comma lists
        from omnirl_async.trainer.sweep import sweep

        return sweep(args.overrides, config_name=args.config_name, config_dir=args.config_dir, printer=tqdm.write,
                     user_errors=user_error_types())
    cfg = _load(args)
    try:
        summary = TaskRunner(cfg, printer=tqdm.write).run()
    except KeyboardInterrupt:
        print(f"omnirl-async: interrupted; {_resume_hint(cfg)}", file=sys.stderr)
        return 130
    except run_error_types() as err:  # explained failures: the message, not a traceback
        hint = "" if "trainer.resume_mode" in str(err) else f"\n{_resume_hint(cfg)}"
        print(f"omnirl-async: the run stopped: {err}{hint}", file=sys.stderr)
        return 1
    print(f"finished at step {summary['global_step']} (policy version {summary['version']})")
    print(f"TensorBoard logs: {summary['log_dir']}   (tensorboard --logdir {summary['log_dir']})")
    print(f"checkpoints:      {summary['checkpoint_dir']}   (resolved_config.yaml; "
          f"omnirl-async eval --run {summary['checkpoint_dir']})")
    return 0


def run_error_types() -> tuple[type[BaseException], ...]:
    """Failures of a run whose message says what happened and what to do (a traceback would add nothing)."""
    from omnirl_async.learners.learner_group import LearnerDiedError
    from omnirl_async.trainer.failures import RewardFailureError

    return RewardFailureError, LearnerDiedError, TimeoutError


def _resume_hint(cfg) -> str:
    """Where the run can go on from: its newest complete checkpoint, and the key that resumes it."""
    from omnirl_async.trainer.checkpoint import CheckpointManager

    try:
        latest = CheckpointManager(cfg.trainer.default_local_dir).latest()
    except Exception as err:  # noqa: BLE001 - a damaged folder must not hide why the run stopped
        return f"no checkpoint in {cfg.trainer.default_local_dir} can be resumed from ({err})"
    if latest is None:
        return f"no checkpoint was saved in {cfg.trainer.default_local_dir} (`trainer.save_freq`)"
    return f"the newest checkpoint is {latest}; `trainer.resume_mode=auto` (the default) continues from it"


def _load_run(args):
    """``eval --run``: the run's saved config (plus overrides) and the checkpoint to score."""
    from omnirl_async.preflight import InputError
    from omnirl_async.trainer.run_dir import find_run, load_run_config

    if args.config_dir is not None or args.config_name != "diffusion_trainer":
        raise InputError(f"eval: `--run` {args.run!r} reads the run's own resolved_config.yaml; drop "
                         "`--config-dir` / `--config-name` (put changes as key=value overrides after it).")
    run_dir, ckpt = find_run(args.run, report=lambda line: print(f"omnirl-async: {line}", file=sys.stderr))
    # eval logs nowhere: the run's loggers (wandb may not be installed here) are not needed
    return load_run_config(run_dir, ["trainer.logger=[console]", *args.overrides]), run_dir, ckpt


def cmd_eval(args) -> int:
    import dataclasses
    import json

    import torch

    from omnirl_async.data.prompts import load_val_prompts
    from omnirl_async.models.evaluate import evaluate_policy, save_grid, validation_settings
    from omnirl_async.models.setup import build_policy, pick_device
    from omnirl_async.rewards import RewardManager

    if args.run:
        cfg, run_dir, ckpt = _load_run(args)
        args.lora = args.lora or str(ckpt)
        out = Path(args.out) if args.out else run_dir / "eval" / Path(args.lora).name
        print(f"run {run_dir}: {cfg.actor_rollout_ref.model.path}, LoRA {args.lora}")
    else:
        cfg = _load(args)
        out = Path(args.out or "eval_out")
    torch.set_num_threads(args.threads)
    model_cfg = cfg.actor_rollout_ref.model
    if args.lora:
        lora = Path(args.lora)
        if (lora / "lora" / "adapter_config.json").is_file():  # a checkpoint step folder
            lora = lora / "lora"
        if not (lora / "adapter_config.json").is_file():
            print(f"omnirl-async: `--lora` {args.lora!r} is neither a PEFT adapter folder nor a checkpoint "
                  "folder with lora/ inside", file=sys.stderr)
            return 2
        model_cfg = dataclasses.replace(model_cfg, lora_adapter_path=str(lora))
    if args.compare_base and not args.lora:
        print("omnirl-async: `--compare-base` compares a LoRA with the base model: give `--lora` or `--run`",
              file=sys.stderr)
        return 2
    policy = build_policy(model_cfg, pick_device(cfg.trainer.device), seed=cfg.data.seed)
    prompts = load_val_prompts(cfg.data, args.num_prompts or cfg.data.val_max_samples)
    reward = RewardManager.from_config(cfg.reward)
    res = evaluate_policy(policy, reward, prompts, cfg.actor_rollout_ref.rollout.val_kwargs, seed=args.seed,
                          progress=True, **validation_settings(cfg))
    who = f"LoRA {args.lora}" if args.lora else f"base model {model_cfg.path}"
    print(f"\n{who}: {len(res.prompts)} images of {len(prompts)} prompts")
    for key, value in res.metrics.items():
        print(f"  {key:<34} {value:.4f}")
    note = res.failure_note()
    if note:
        print(f"omnirl-async: warning: {note}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    strict_key = next((k for k in res.extra if k.endswith("strict")), None)
    marks = res.extra[strict_key][: args.grid] > 0.5 if strict_key else None
    grid = save_grid(res.images[: args.grid], res.prompts[: args.grid], out / "grid.png", marks=marks,
                     title=f"{who}  strict={res.metrics.get('val/strict', float('nan')):.3f}"
                           + (f"  overall={res.metrics['val/overall']:.3f}" if "val/overall" in res.metrics else ""))
    metrics = dict(res.metrics)
    if args.compare_base and strict_key is None:
        print(f"omnirl-async: `--compare-base` compares strict accuracy, and the reward "
              f"`{cfg.reward.reward_fn_name}` gives no strict field (fields: {sorted(res.extra)}); use a "
              "GenEval-style reward such as tiny_geneval", file=sys.stderr)
        return 2
    if args.compare_base:
        base_cfg = dataclasses.replace(model_cfg, lora_adapter_path=cfg.actor_rollout_ref.model.lora_adapter_path)
        metrics.update(_gain_over_base(res, build_policy(base_cfg, pick_device(cfg.trainer.device),
                                                         seed=cfg.data.seed),
                                       reward, prompts, cfg, args.seed))
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"grid: {grid}\nmetrics: {out / 'metrics.json'}")
    return 0


def _gain_over_base(res, base_policy, reward, prompts, cfg, seed: int) -> dict[str, float]:
    """``eval --compare-base``: the base model on the same prompts and seeds; the gain in overall strict accuracy
    with its 95 % interval (paired bootstrap over prompts, stratified by category)."""
    from omnirl_async.models.evaluate import evaluate_policy, validation_settings
    from omnirl_async.models.heldout import bootstrap_gain, overall_accuracy, per_prompt_strict

    base = evaluate_policy(base_policy, reward, prompts, cfg.actor_rollout_ref.rollout.val_kwargs, seed=seed,
                           progress=True, **validation_settings(cfg))
    names, after = per_prompt_strict(res)
    names_b, before = per_prompt_strict(base)
    assert names == names_b, "the base model was scored on other prompts"
    gain, lo, hi = bootstrap_gain(names, before, after, seed=seed)
    n = cfg.actor_rollout_ref.rollout.val_kwargs.n
    print(f"\nheld-out strict accuracy, overall ({len(names)} prompts x {n} images, seed {seed}): base "
          f"{100 * overall_accuracy(names, before):.1f} % -> {100 * overall_accuracy(names, after):.1f} %, gain "
          f"{gain:+.1f} points (95 % CI {lo:+.1f}, {hi:+.1f}; paired bootstrap over prompts within each category)")
    return {"gain/overall_points": gain, "gain/ci_low": lo, "gain/ci_high": hi,
            "base/overall": overall_accuracy(names, before)}


def cmd_config(args) -> int:
    from omnirl_async.config.loader import to_yaml

    cfg = _load(args)
    if args.doc:
        from omnirl_async.config.doc import annotated
        from omnirl_async.config.presets import applied_presets, describe

        print(describe(applied_presets(cfg)) + annotated(cfg), end="")
    else:
        print(to_yaml(cfg, show_presets=True))
    return 0


def cmd_build_tiny(args) -> int:
    from omnirl_async.models.tiny import build_tiny_flux, build_tiny_sd3

    fn = build_tiny_sd3 if args.kind == "sd3" else build_tiny_flux
    print(fn(args.path, seed=args.seed))
    return 0


def cmd_ingest(args) -> int:
    import torch

    from omnirl_async.trainer.ingest import ingest_dataset

    cfg = _load(args)
    torch.set_num_threads(args.threads)
    summary = ingest_dataset(args.dataset, args.run_dir, cfg, skip_invalid=args.skip_invalid, report=args.report,
                             batch_size=args.batch_size, progress=not args.no_progress)
    print(summary.text())
    return 0


def cmd_export(args) -> int:
    from omnirl_async.models.export import export_lora, load_in_diffusers
    from omnirl_async.preflight import InputError

    if args.check and not args.base:
        raise InputError("export: --check needs --base (the model the LoRA was trained on) to load the LoRA into.")
    res = export_lora(args.ckpt, args.out, base=args.base)
    print(f"wrote {res.weights}")
    print(f"  {res.pipeline_class} LoRA: {res.num_modules} transformer modules, rank {res.rank}, "
          f"alpha {res.alpha:g}, from the PEFT adapter {res.source}")
    if args.check:
        from peft.tuners.tuners_utils import BaseTunerLayer

        pipe = load_in_diffusers(res.base, res.folder, pipeline_class=res.pipeline_class)
        n = sum(isinstance(m, BaseTunerLayer) for m in pipe.transformer.modules())
        print(f"  checked: plain diffusers load_lora_weights attached {n} LoRA layers "
              f"(adapters {pipe.get_active_adapters()})")
    print("\nload it with diffusers:\n")
    print(res.snippet())
    return 0


# One example per subcommand, shown by ``omnirl-async --help`` and in each subcommand's own help.
EXAMPLES = {
    "train": "omnirl-async train trainer.v1.trainer_mode=separate_async trainer.total_time_minutes=5",
    "eval": "omnirl-async eval --run checkpoints/omnirl_async/tiny_flow_grpo",
    "config": "omnirl-async config --doc actor_rollout_ref.model.algorithm=grpo_guard",
    "build-tiny": "omnirl-async build-tiny sd3 /tmp/tiny-sd3",
    "ingest": "omnirl-async ingest docs/examples/preference_data/data.jsonl "
              "--run-dir checkpoints/omnirl_async/tiny_flow_grpo",
    "export": "omnirl-async export checkpoints/omnirl_async/tiny_flow_grpo/global_step_20 --out my_lora --check",
    "buffer": "omnirl-async buffer inspect checkpoints/omnirl_async/tiny_flow_grpo",
    "serve-reward": "omnirl-async serve-reward --port 8000 reward.reward_fn_name=tiny_geneval",
    "report": "omnirl-async report checkpoints/omnirl_async/tiny_flow_grpo/sweep/*",
}


def _with_examples(parser: argparse.ArgumentParser, sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """List every subcommand with its help line and example under ``--help``; each subcommand shows its own."""
    helps = {a.dest: a.help for a in sub._choices_actions}
    lines = ["commands (one example each; `omnirl-async COMMAND --help` for the options):"]
    for name, sp in sub.choices.items():
        example = EXAMPLES.get(name)
        if example is None:  # caught by tests/test_cli_help.py
            raise RuntimeError(f"subcommand {name!r} has no example in omnirl_async.cli.EXAMPLES")
        lines += [f"  {name:<13} {helps.get(name, '')}", f"  {'':<13}   $ {example}"]
        sp.epilog = f"example:\n  $ {example}"
        sp.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "\n".join(lines)
    return parser


def cmd_serve_reward(args) -> int:
    """``serve-reward``: one function (``--reward``, ``--path``) or the ``reward.*`` config the overrides select."""
    from omnirl_async.preflight import InputError
    from omnirl_async.rewards.server import ManagerReward, reward_from_args, serve

    overrides = list(args.overrides)
    if overrides and (args.reward or args.path or args.kwargs):
        raise InputError("serve-reward: give either --reward/--path/--kwargs (one function) or reward.* overrides "
                         f"(the config's reward), not both; got {' '.join(overrides)}")
    if args.reward or args.path:
        reward = reward_from_args(args)
    else:
        from omnirl_async.rewards import RewardManager

        bad = [o for o in overrides if not o.lstrip("+~").startswith("reward.")]
        if bad:
            raise InputError(f"serve-reward: only reward.* keys configure the served reward; got {' '.join(bad)}")
        reward = ManagerReward(RewardManager.from_config(_load(args).reward))
    try:
        return serve(reward, args, prog="omnirl-async serve-reward")
    except (ValueError, KeyError, OSError) as err:  # a bad option, an unknown reward name, a port in use
        if isinstance(err, InputError):
            raise
        raise InputError(f"serve-reward: {err.args[0] if isinstance(err, KeyError) else err}") from err


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnirl-async", usage="%(prog)s [-h] COMMAND [options] [key=value ...]",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="Asynchronous RL fine-tuning of flow-matching diffusion models "
                                                 "(VeRL-Omni's config keys, Hydra overrides).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help=argparse.SUPPRESS)
    p = sub.add_parser("train", help="run a training job")
    p.add_argument("-m", "--multirun", action="store_true",
                   help="sweep: overrides with comma lists (key=0,1,2) run every combination, one after another, "
                        "each in <trainer.default_local_dir>/sweep/<key=value> (logs likewise); compare them with "
                        "`omnirl-async report`")
    _add_config_args(p)
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("eval", help="score held-out prompts with the base model, a LoRA checkpoint or a run")
    p.add_argument("--run", default=None, metavar="RUN_DIR",
                   help="a run's trainer.default_local_dir (or one of its global_step_N folders): use the config "
                        "it saved (resolved_config.yaml) and its newest verified checkpoint")
    p.add_argument("--lora", default=None, help="PEFT adapter folder or checkpoint folder (global_step_N)")
    p.add_argument("--out", default=None,
                   help="folder for grid.png and metrics.json (default eval_out; with --run: "
                        "RUN_DIR/eval/global_step_N)")
    p.add_argument("--num-prompts", type=int, default=None, help="cap on prompts (default data.val_max_samples)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grid", type=int, default=32, help="images in the grid")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compare-base", action="store_true",
                   help="also score the base model on the same prompts and seeds; print the gain in overall strict "
                        "accuracy with its 95 %% interval (needs --lora or --run and a reward with a strict field, "
                        "e.g. tiny_geneval); more images per prompt: actor_rollout_ref.rollout.val_kwargs.n=16")
    _add_config_args(p)
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("config", help="print the resolved config")
    p.add_argument("--doc", action="store_true",
                   help="one line per key: its value and its help text (docs/CONFIG_KEYS.md has the per-mode table)")
    _add_config_args(p)
    p.set_defaults(fn=cmd_config)
    p = sub.add_parser("build-tiny", help="build a tiny random-weight diffusers pipeline")
    p.add_argument("kind", choices=["sd3", "flux"])
    p.add_argument("path")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_build_tiny)
    p = sub.add_parser("ingest", help="check a preference dataset and store it, VAE-encoded, in RUN_DIR/offline/")
    p.add_argument("dataset", metavar="DATASET",
                   help="a .jsonl or .parquet file of preference pairs, or a `datasets` folder (save_to_disk)")
    p.add_argument("--run-dir", required=True, metavar="DIR",
                   help="the run's folder (trainer.default_local_dir); the pairs go to DIR/offline/")
    p.add_argument("--skip-invalid", action="store_true",
                   help="ingest the good rows and list the bad ones in the report (default: refuse the dataset)")
    p.add_argument("--report", default=None,
                   help="JSONL file for the bad rows (default DIR/offline/reports/ingest-<time>-<name>.jsonl)")
    p.add_argument("--batch-size", type=int, default=16, help="images per VAE forward")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_config_args(p)
    p.set_defaults(fn=cmd_ingest)
    p = sub.add_parser("buffer", help="look into a run's replay buffer")
    bsub = p.add_subparsers(dest="buffer_command", required=True)
    q = bsub.add_parser("inspect", help="tables, versions, staleness and offline pairs of a run dir or checkpoint")
    q.add_argument("dir", metavar="DIR", help="a run dir (trainer.default_local_dir), a global_step_N checkpoint, "
                                             "or a buffer snapshot folder")
    q.add_argument("--rows", type=int, default=5, help="offline pairs to list")
    q.set_defaults(fn=cmd_buffer_inspect)
    p = sub.add_parser("export", help="write a checkpoint's LoRA in diffusers' format (load_lora_weights)")
    p.add_argument("ckpt", metavar="CKPT",
                   help="checkpoint step folder (global_step_N), its lora/ folder, or a PEFT adapter folder")
    p.add_argument("--out", required=True, help="folder for pytorch_lora_weights.safetensors (created if missing)")
    p.add_argument("--base", default=None,
                   help="base model the LoRA was trained on (pipeline folder or embedded:NAME); fills the snippet")
    p.add_argument("--check", action="store_true",
                   help="load --base with plain diffusers plus the export and check LoRA layers were attached")
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("serve-reward",
                       help="host a reward (or the reward.* config) as an HTTP service: batching, /health, bearer token")
    from omnirl_async.rewards.server import add_serve_arguments  # the options live beside the server

    add_serve_arguments(p)
    _add_config_args(p)
    p.set_defaults(fn=cmd_serve_reward)
    p = sub.add_parser("report", help="compare runs (a sweep): table of throughput, reward, accuracy, staleness; PNG")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR",
                   help="run folders (trainer.default_local_dir or the log folder; each holds resolved_config.yaml), "
                        "or a sweep folder <dir>/sweep standing for the runs in it")
    p.add_argument("--out", default=None, metavar="PNG",
                   help="where to save the plot: a .png file, or a folder to write report.png into (default: "
                        "report.png in the runs' common folder, else here)")
    p.set_defaults(fn=cmd_report)
    return _with_examples(parser, sub)


def report_png_path(out: str | None) -> Path | None:
    """``report --out``: a folder (one that exists, or a path ending in a separator) gets ``report.png`` in it;
    a file must have an extension Pillow writes. Checked before the table, so a bad ``--out`` costs nothing."""
    import os

    from omnirl_async.preflight import InputError

    if out is None:
        return None
    path = Path(os.path.expanduser(out))
    if path.is_dir() or out.endswith(("/", os.sep)):
        return path / "report.png"
    import io

    from PIL import Image

    fix = ("name a .png file (or another image format Pillow writes, e.g. .jpg), or an existing folder "
           "(or a path ending in /) to write report.png into")
    if not path.suffix:
        raise InputError(f"report: --out {out!r} has no file extension and is not an existing folder; {fix}")
    fmt = Image.registered_extensions().get(path.suffix.lower())
    try:  # the plot is an RGB image: try the format on one pixel (some formats Pillow knows it cannot write)
        Image.new("RGB", (1, 1)).save(io.BytesIO(), format=fmt)
    except (KeyError, ValueError, OSError):
        raise InputError(f"report: --out {out!r}: Pillow cannot write an RGB image as {path.suffix!r}; {fix}") from None
    return path


def cmd_report(args) -> int:
    from omnirl_async.metrics.report import report

    report(args.runs, png=report_png_path(args.out))
    return 0


def cmd_buffer_inspect(args) -> int:
    from omnirl_async.trainer.buffer_inspect import inspect_buffer

    print(inspect_buffer(args.dir, rows=args.rows))
    return 0


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exception classes that mean "the user's input is wrong", not "the program is wrong"."""
    from omnirl_async.config.validate import ConfigError
    from omnirl_async.preflight import InputError

    types: list[type[BaseException]] = [ConfigError, InputError]
    try:  # added by the checkpoint module; absent in older trees
        from omnirl_async.trainer.checkpoint import CheckpointError
    except Exception:  # noqa: BLE001 - any import problem there must not hide the user's error
        CheckpointError = None
    if isinstance(CheckpointError, type) and issubclass(CheckpointError, BaseException):
        types.append(CheckpointError)
    return tuple(types)


def _user_message(err: BaseException) -> str:
    """The user error's own message; one raised inside a Ray actor arrives wrapped with the remote traceback."""
    cause = getattr(err, "cause", None)
    if type(err).__name__.startswith("RayTaskError") and isinstance(cause, BaseException):
        return str(cause)
    return str(err)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # key=value overrides after an option (`ingest DATASET --run-dir DIR key=value`) land here
        if getattr(args, "overrides", None) is None or not all("=" in e and not e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    try:
        return args.fn(args)
    except Exception as err:
        if not isinstance(err, user_error_types()):
            raise
        print(f"omnirl-async: {_user_message(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
