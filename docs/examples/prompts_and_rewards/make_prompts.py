"""Write prompts.parquet: one-colour shapes prompts with their colour and count as ground truth (verl's layout)."""

import sys

import pandas as pd

from omnirl_async.data.prompts import train_prompts
from omnirl_async.data.shapes import parse_prompt

out = sys.argv[1] if len(sys.argv) > 1 else "prompts.parquet"
prompts = [p for p in train_prompts() if parse_prompt(p).relation is None]  # one colour each
pd.DataFrame({
    "prompt": prompts,
    "data_source": "shapes",
    "reward_model": [{"style": "rule", "ground_truth": {"color": parse_prompt(p).groups[0].color,
                                                        "count": parse_prompt(p).groups[0].count}} for p in prompts],
    "extra_info": [{"index": i} for i in range(len(prompts))],
}).to_parquet(out)
print(f"wrote {len(prompts)} rows to {out}")
