"""Score saved checkpoints on the held-out prompts with many images each, and the paired differences between them.

    python benchmarks/rescore_checkpoints.py [--images-per-prompt 64] [--num-prompts 256] [--seed 0]
        NAME=LORA_OR_CKPT_DIR ... [--compare NAME:NAME ...]

``NAME=base`` is the base model. Each checkpoint is scored with the GenEval
protocol of the benchmarks (``bench_geneval_rl.evaluate``: ODE sampling, fixed
seeds, strict = all clauses met, ``overall`` = mean over the prompt categories);
every ``--compare A:B`` prints B - A in overall strict accuracy (points) with
its 95 % interval (paired bootstrap over prompts, stratified by category), and
every checkpoint is also compared with ``base`` when one is given. Used for the
offline-mix rescoring in the README (checkpoints of ``bench_offline_mix.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_geneval_rl import RL_DEFAULTS, evaluate  # noqa: E402


def _lora(path: str) -> Path | None:
    if path == "base":
        return None
    p = Path(path)
    p = p / "lora" if (p / "lora" / "adapter_config.json").is_file() else p
    if not (p / "adapter_config.json").is_file():
        raise SystemExit(f"{path!r} is neither `base`, a PEFT adapter folder nor a checkpoint folder with lora/")
    return p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoints", nargs="+", metavar="NAME=PATH", help="PATH: base, a LoRA or a checkpoint folder")
    ap.add_argument("--images-per-prompt", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare", nargs="*", default=[], metavar="A:B", help="print B - A with its interval")
    args = ap.parse_args(argv)
    runs = dict(c.split("=", 1) for c in args.checkpoints if "=" in c)
    if len(runs) != len(args.checkpoints):
        raise SystemExit("give checkpoints as NAME=PATH")
    pairs = [tuple(c.split(":", 1)) for c in args.compare]
    pairs = [("base", n) for n in runs if "base" in runs and n != "base"] + pairs
    unknown = sorted({n for p in pairs for n in p} - set(runs))
    if unknown:
        raise SystemExit(f"--compare names {unknown} that are not among {sorted(runs)}")

    import torch

    from omnirl_async.config import load_config
    from omnirl_async.data.prompts import heldout_prompts
    from omnirl_async.models.heldout import bootstrap_gain, overall_accuracy, per_prompt_strict

    torch.set_num_threads(2)
    cfg = load_config(RL_DEFAULTS + [f"actor_rollout_ref.rollout.val_kwargs.n={args.images_per_prompt}"])
    prompts = heldout_prompts()[: args.num_prompts]
    acc, names = {}, None
    for name, path in runs.items():
        names, acc[name] = per_prompt_strict(evaluate(cfg, _lora(path), prompts, args.seed))
        print(f"{name}: overall {100 * overall_accuracy(names, acc[name]):.1f} %", flush=True)
    print(f"\n{len(prompts)} prompts x {args.images_per_prompt} images, seed {args.seed}:")
    for a, b in pairs:
        gain, lo, hi = bootstrap_gain(names, acc[a], acc[b], seed=args.seed)
        print(f"  {b} - {a}: {gain:+.1f} points (95 % CI {lo:+.1f}, {hi:+.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
