"""``omnirl-async`` command line.

    omnirl-async train [--config-name NAME] [--config-dir DIR] key=value ...
    omnirl-async config [key=value ...]          print the resolved, validated config
    omnirl-async build-tiny {sd3,flux} DIR       write a tiny random-weight pipeline folder

Overrides use Hydra's grammar and the key paths of VeRL-Omni
(``actor_rollout_ref.rollout.n=8``, ``trainer.v1.trainer_mode=sync``).
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config-name", default="diffusion_trainer", help="YAML in the config dir (without .yaml)")
    p.add_argument("--config-dir", default=None, help="folder of the YAML configs (default: the repo's configs/)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. data.train_batch_size=16")


def _load(args):
    from omnirl_async.config import load_config

    return load_config(args.overrides, config_name=args.config_name, config_dir=args.config_dir)


def cmd_train(args) -> int:
    from tqdm.auto import tqdm

    from omnirl_async.trainer.task_runner import TaskRunner

    cfg = _load(args)
    summary = TaskRunner(cfg, printer=tqdm.write).run()
    print(f"finished at step {summary['global_step']} (policy version {summary['version']})")
    print(f"TensorBoard logs: {summary['log_dir']}   (tensorboard --logdir {summary['log_dir']})")
    print(f"checkpoints:      {summary['checkpoint_dir']}")
    return 0


def cmd_config(args) -> int:
    from omnirl_async.config.loader import to_yaml

    print(to_yaml(_load(args)))
    return 0


def cmd_build_tiny(args) -> int:
    from omnirl_async.models.tiny import build_tiny_flux, build_tiny_sd3

    fn = build_tiny_sd3 if args.kind == "sd3" else build_tiny_flux
    print(fn(args.path, seed=args.seed))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnirl-async", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="run a training job")
    _add_config_args(p)
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("config", help="print the resolved config")
    _add_config_args(p)
    p.set_defaults(fn=cmd_config)
    p = sub.add_parser("build-tiny", help="build a tiny random-weight diffusers pipeline")
    p.add_argument("kind", choices=["sd3", "flux"])
    p.add_argument("path")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_build_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    from omnirl_async.config.validate import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as err:
        print(f"omnirl-async: config error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
