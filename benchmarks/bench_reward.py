"""Throughput of the shapes-world renderer and the ``tiny_geneval`` reward.

Single core on purpose: the reward runs inside rollout / reward workers that
each get one CPU, so one core is the number that matters. Thread counts are
pinned *before* numpy (and torch, if installed) load their BLAS / OpenMP pools.

    python benchmarks/bench_reward.py [--n 5000] [--repeats 3] [--numpy-labels]

Target (issue "embedded world"): ≥ 2,000 images/s for tiny_geneval at 32×32.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

try:  # torch is not needed here, but pin it too when present
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from omnirl_async.data.shapes import render_batch, sample_spec  # noqa: E402
from omnirl_async.rewards.tiny_geneval import tiny_geneval  # noqa: E402

TARGET = 2000.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5000, help="images per timed run")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs; the best is reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--numpy-labels", action="store_true", help="use the numpy labelling, not scipy")
    args = ap.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    specs = [sample_spec(rng) for _ in range(args.n)]
    prompts = [s.prompt for s in specs]

    render_times, images = [], None
    for _ in range(args.repeats):
        t = time.perf_counter()
        images, _ = render_batch(specs, rng)
        render_times.append(time.perf_counter() - t)

    use_scipy = False if args.numpy_labels else None
    tiny_geneval(images[:64], prompts[:64], use_scipy=use_scipy)  # warm caches
    reward_times, out = [], None
    for _ in range(args.repeats):
        t = time.perf_counter()
        out = tiny_geneval(images, prompts, use_scipy=use_scipy)
        reward_times.append(time.perf_counter() - t)

    render_ips = args.n / min(render_times)
    reward_ips = args.n / min(reward_times)
    print(f"images: {args.n} at {images.shape[1]}x{images.shape[2]}, 1 thread, best of {args.repeats}")
    print(f"renderer:      {render_ips:10.0f} images/s")
    print(f"tiny_geneval:  {reward_ips:10.0f} images/s  (target >= {TARGET:.0f}; "
          f"labelling: {'numpy' if args.numpy_labels else 'scipy if installed'})")
    print(f"agreement with ground truth (strict): {out['strict'].mean():.4f}")
    return 0 if reward_ips >= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
