"""The reward manager: turn a config into one callable that scores a batch.

``reward.*`` selects the reward functions in one of three ways, checked in
this order:

1. ``custom_reward_function: {path, name}`` – one function from a user file
   (weight 1). Both null means "not used".
2. ``reward_functions: {name: {path, name, weight, kwargs}}`` – several
   functions combined by ``aggregation: weighted_sum``. ``path: null`` looks
   ``name`` (default: the entry's key) up in the registry; otherwise ``name``
   is the function's name inside the file at ``path``.
3. neither – the registered function ``reward_fn_name`` (default
   ``"tiny_geneval"``, the shapes-world reward).

1 and 2 are mutually exclusive, as in VeRL-Omni. ``reward_kwargs`` are passed
to every function, under each entry's own ``kwargs``. The other fields of each
prompt's dataset row (``rows``) reach the functions that take them, and a
verl-style per-sample ``compute_score(data_source, solution_image,
ground_truth, extra_info)`` is called once per image
(:mod:`omnirl_async.rewards.adapters`).

Failure policy
--------------
A reward that cannot score must never turn into a silent 0 that the learner
trains on. So:

* a function that raises marks **every** sample of the batch failed, with the
  exception type and message as the reason;
* a return value of the wrong type or shape does the same, with a reason that
  names the function and what was wrong;
* a NaN or ±inf score marks **that** sample failed;
* a :class:`~omnirl_async.rewards.base.ScoredSamples` marks the samples it
  gives a reason for failed, with that reason (a per-sample function that
  raised on one image, a judge request that timed out).

Failed samples get score 0.0 and ``failed=True``; the caller decides whether
to drop them (the default of the rollout workers) or to log and keep going.
Arguments that are wrong on the caller's side (not uint8 images, prompt count
≠ batch size) raise ``ValueError`` at once, since no reward could fix them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import numpy as np

from omnirl_async.rewards.adapters import PerSampleReward, call_reward, is_per_sample
from omnirl_async.rewards.base import RewardResult, ScoredSamples, get_reward_fn
from omnirl_async.rewards.custom import load_custom_reward_fn

__all__ = ["RewardComponent", "RewardManager", "DEFAULT_REWARD_FN"]

DEFAULT_REWARD_FN = "tiny_geneval"


def _get(obj: Any, key: str, default: Any = None) -> Any:
    """Read ``key`` from a dict, a dataclass / namespace, or an OmegaConf node."""
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        value = obj.get(key, default)
    else:
        value = getattr(obj, key, default)
    return default if value is None else value


def _to_dict(obj: Any, key: str) -> dict:
    if obj is None:
        return {}
    if isinstance(obj, Mapping):
        return dict(obj)
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    if hasattr(obj, "__dict__"):
        return dict(vars(obj))
    raise ValueError(f"`{key}` must be a mapping, got {type(obj).__name__}: {obj!r}")


@dataclasses.dataclass
class RewardComponent:
    """One weighted reward function and where it came from.

    Exactly one of ``registry_name`` / ``path`` says how to find ``fn`` again
    in another process; with neither, ``fn`` itself is pickled.
    """

    name: str
    weight: float = 1.0
    kwargs: dict = dataclasses.field(default_factory=dict)
    registry_name: str | None = None
    path: str | None = None
    fn_name: str | None = None
    fn: Callable | None = None

    def resolve(self) -> Callable:
        if self.fn is None:
            if self.path is not None:
                self.fn = load_custom_reward_fn(self.path, self.fn_name or self.name)
            elif self.registry_name is not None:
                self.fn = get_reward_fn(self.registry_name)
            else:
                raise ValueError(f"reward component {self.name!r} has no function, registry name or path")
        if is_per_sample(self.fn):  # verl's compute_score(data_source, solution_image, ...): batched for it
            self.fn = PerSampleReward(self.fn, self.name)
        return self.fn

    def __getstate__(self):
        state = dict(self.__dict__)
        if self.path is not None or self.registry_name is not None:
            state["fn"] = None  # found again by name/path after unpickling
        return state


class RewardManager:
    """Scores ``images uint8 [B,H,W,3]`` + ``prompts`` → :class:`RewardResult`.

    Examples:
        >>> from types import SimpleNamespace
        >>> cfg = SimpleNamespace(reward_functions={"brightness": {"weight": 2.0}})
        >>> mgr = RewardManager.from_config(cfg)
        >>> res = mgr(np.full((2, 4, 4, 3), 255, np.uint8), ["x", "y"])
        >>> res.scores.tolist(), res.failed.tolist()
        ([2.0, 2.0], [False, False])
    """

    def __init__(
        self,
        components: Sequence[RewardComponent],
        *,
        reward_kwargs: Mapping | None = None,
        num_workers: int = 1,
    ):
        if not components:
            raise ValueError("`components` is empty; a RewardManager needs at least one reward function")
        names = [c.name for c in components]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be unique, got {names}")
        for c in components:
            if not np.isfinite(float(c.weight)):
                raise ValueError(f"`reward.reward_functions.{c.name}.weight` must be finite, got {c.weight!r}")
            c.resolve()
        self.components = list(components)
        self.reward_kwargs = dict(reward_kwargs or {})
        self.num_workers = int(num_workers)

    # ------------------------------------------------------------ building
    @classmethod
    def from_config(cls, cfg: Any) -> "RewardManager":
        """Build from a ``reward`` config (dataclass, namespace, dict or OmegaConf)."""
        aggregation = _get(cfg, "aggregation", "weighted_sum")
        if aggregation != "weighted_sum":
            raise ValueError(f"`reward.aggregation` must be 'weighted_sum', got {aggregation!r}")
        custom = _get(cfg, "custom_reward_function")
        c_path, c_name = _get(custom, "path"), _get(custom, "name")
        functions = _to_dict(_get(cfg, "reward_functions"), "reward.reward_functions")
        kwargs = _to_dict(_get(cfg, "reward_kwargs"), "reward.reward_kwargs")
        num_workers = int(_get(cfg, "num_workers", 1))

        if c_path is not None or c_name is not None:
            if functions:
                raise ValueError(
                    "`reward.custom_reward_function` and `reward.reward_functions` are mutually "
                    f"exclusive; got path={c_path!r} name={c_name!r} and functions {sorted(functions)}. "
                    "Set `reward.custom_reward_function.path=null` and `.name=null`, or move it into "
                    "`reward.reward_functions`"
                )
            if c_path is None or c_name is None:
                raise ValueError(
                    "`reward.custom_reward_function` needs both `path` and `name`, got "
                    f"path={c_path!r} name={c_name!r}"
                )
            fn = load_custom_reward_fn(c_path, c_name)
            comps = [RewardComponent(c_name, 1.0, {}, path=str(c_path), fn_name=c_name, fn=fn)]
        elif functions:
            comps = []
            for key, entry in functions.items():
                is_mapping = isinstance(entry, Mapping)
                entry = _to_dict(entry, f"reward.reward_functions.{key}")
                unknown = set(entry) - {"path", "name", "weight", "kwargs"}
                if is_mapping and unknown:  # typed config objects are checked by their schema
                    raise ValueError(
                        f"`reward.reward_functions.{key}` has unknown keys {sorted(unknown)}; "
                        "allowed: path, name, weight, kwargs"
                    )
                path, fn_name = entry.get("path"), entry.get("name") or key
                weight = entry.get("weight")
                weight = 1.0 if weight is None else float(weight)
                fkw = _to_dict(entry.get("kwargs"), f"reward.reward_functions.{key}.kwargs")
                if path is None:
                    comps.append(RewardComponent(str(key), weight, fkw, registry_name=fn_name))
                else:
                    fn = load_custom_reward_fn(path, fn_name, key=f"reward.reward_functions.{key}")
                    comps.append(RewardComponent(str(key), weight, fkw, path=str(path), fn_name=fn_name, fn=fn))
        else:
            name = _get(cfg, "reward_fn_name", DEFAULT_REWARD_FN)
            comps = [RewardComponent(name, 1.0, {}, registry_name=name)]
        return cls(comps, reward_kwargs=kwargs, num_workers=num_workers)

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.components]

    def __getstate__(self):
        return {"components": self.components, "reward_kwargs": self.reward_kwargs, "num_workers": self.num_workers}

    def __setstate__(self, state):
        self.__init__(state["components"], reward_kwargs=state["reward_kwargs"], num_workers=state["num_workers"])

    def __repr__(self) -> str:
        parts = ", ".join(f"{c.name}×{c.weight:g}" for c in self.components)
        return f"RewardManager({parts})"

    # ------------------------------------------------------------- scoring
    def __call__(self, images: np.ndarray, prompts: Sequence[str],
                 rows: Sequence[Mapping | None] | None = None) -> RewardResult:
        """Score a batch; ``rows`` are the other fields of each image's prompt row (None = no fields)."""
        images = np.asarray(images)
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"`images` must be uint8 [B, H, W, 3], got {images.dtype} {tuple(images.shape)}")
        prompts = list(prompts)
        batch = images.shape[0]
        if len(prompts) != batch:
            raise ValueError(f"`prompts` has {len(prompts)} entries but `images` holds {batch} images")
        if rows is not None and len(rows) != batch:
            raise ValueError(f"`rows` has {len(rows)} entries but `images` holds {batch} images")
        view = images.view()
        view.flags.writeable = False  # a reward must not edit the images others see

        total = np.zeros(batch, dtype=np.float64)
        failed = np.zeros(batch, dtype=bool)
        reasons: list[list[str]] = [[] for _ in range(batch)]
        extra: dict[str, np.ndarray] = {}

        def fail(mask: np.ndarray, reason: str) -> None:
            failed[mask] = True
            for i in np.flatnonzero(mask):
                reasons[i].append(reason)

        for comp in self.components:
            kwargs = {**self.reward_kwargs, **comp.kwargs}
            try:
                out = call_reward(comp.fn, view, prompts, kwargs, rows)
            except Exception as e:  # noqa: BLE001 - a reward failure is data, not a crash
                extra[f"reward/{comp.name}"] = np.full(batch, np.nan, np.float32)
                fail(np.ones(batch, bool), f"reward `{comp.name}` raised {type(e).__name__}: {e}")
                continue
            score, comp_extra, problem, own = _normalize(out, batch, comp.name)
            if problem is not None:
                extra[f"reward/{comp.name}"] = np.full(batch, np.nan, np.float32)
                fail(np.ones(batch, bool), problem)
                continue
            bad = ~np.isfinite(score)
            for i in np.flatnonzero(bad):
                failed[i] = True
                reasons[i].append(own[i] or f"reward `{comp.name}` returned {score[i]} for this sample")
            total += comp.weight * np.where(bad, 0.0, score)
            extra[f"reward/{comp.name}"] = score.astype(np.float32)
            for key, value in comp_extra.items():
                extra[f"{comp.name}/{key}"] = value

        scores = np.where(failed, 0.0, total).astype(np.float32)
        return RewardResult(
            scores=scores,
            extra=extra,
            failed=failed,
            reasons=["; ".join(r) if r else None for r in reasons],
        )


def _as_vector(value: Any, batch: int) -> tuple[np.ndarray | None, str | None]:
    """``value`` as float64 ``[batch]``, or ``(None, what was wrong)``."""
    if isinstance(value, (str, bytes)) or value is None:
        return None, f"a {type(value).__name__}"
    if hasattr(value, "detach"):  # torch tensor
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except Exception as e:  # noqa: BLE001
        return None, f"a {type(value).__name__} that numpy cannot read ({e})"
    if arr.dtype.kind not in "biuf":
        return None, f"an array of dtype {arr.dtype}"
    if arr.shape != (batch,):
        return None, f"shape {tuple(arr.shape)}"
    return arr.astype(np.float64), None


def _normalize(out: Any, batch: int, name: str
               ) -> tuple[np.ndarray, dict[str, np.ndarray], str | None, list[str | None]]:
    """Split a reward function's output into ``(score, extras, problem, per-sample reasons)``.

    ``problem`` says what is wrong with the output as a whole; the reasons
    (from a :class:`ScoredSamples`, else all None) say why single samples
    failed, where their score is NaN.
    """
    expected = f"expected float[{batch}] or a dict with a float[{batch}] 'score'"
    extras: dict[str, np.ndarray] = {}
    none: list[str | None] = [None] * batch
    if isinstance(out, ScoredSamples):
        if len(out.reasons) != batch:
            return None, {}, f"reward `{name}` returned {len(out.reasons)} reasons for {batch} samples", none
        score, extras, problem = _normalize(dict(out.extra, score=out.score), batch, name)[:3]
        if problem is None:
            for i, reason in enumerate(out.reasons):
                if reason is not None:
                    score[i] = np.nan  # a sample with a reason failed, whatever number came with it
        return score, extras, problem, list(out.reasons)
    if isinstance(out, Mapping):
        if "score" not in out:
            return None, {}, f"reward `{name}` returned a dict without 'score' (keys: {sorted(out)}); {expected}", none
        score, what = _as_vector(out["score"], batch)
        if what is not None:
            return None, {}, f"reward `{name}` returned 'score' as {what}; {expected}", none
        for key, value in out.items():
            if key == "score":
                continue
            vec, what = _as_vector(value, batch)
            if what is not None:
                return None, {}, (f"reward `{name}` returned extra {key!r} as {what}; extras must be "
                                  f"float[{batch}]"), none
            extras[str(key)] = vec.astype(np.float32)
        return score, extras, None, none
    score, what = _as_vector(out, batch)
    if what is not None:
        return None, {}, f"reward `{name}` returned {what}; {expected}", none
    return score, extras, None, none
