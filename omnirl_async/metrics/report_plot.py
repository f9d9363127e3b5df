"""The PNG of ``omnirl-async report``, drawn with PIL (no plotting library needed).

Four panels, one colour per run (legend on top): reward vs wall-clock, reward
vs samples trained, held-out accuracy vs wall-clock, and the staleness
histograms (the share of trained samples at each lag, bars side by side).
Reward lines show a moving average (window: a twentieth of the run) over the
raw per-step values, drawn pale.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = ["plot_runs", "nice_ticks"]

PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]
PANEL_W, PANEL_H = 620, 400
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 70, 20, 34, 52


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # an old Pillow without a scalable default font
        return ImageFont.load_default()


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values (1, 2, 5 x 10^k apart) covering ``[lo, hi]``."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step - 1e-9) * step
    return [start + i * step for i in range(int((hi - start) / step + 1e-9) + 1)]


def _tick_text(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:
        return f"{v:.0e}"
    return f"{v:.6g}" if abs(v) >= 1 else f"{v:.3g}"


def _limits(arrays: Sequence[np.ndarray], *, zero: bool = False) -> tuple[float, float]:
    vals = np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays] or [np.zeros(0)])
    vals = vals[np.isfinite(vals)]
    if vals.size == 0:
        return 0.0, 1.0
    lo, hi = float(vals.min()), float(vals.max())
    if zero:
        lo = min(lo, 0.0)
    if hi - lo < 1e-12:
        pad = abs(hi) * 0.05 or 0.5
        return lo - pad, hi + pad
    pad = 0.05 * (hi - lo)
    return (lo if zero and lo == 0.0 else lo - pad), hi + pad


class _Axes:
    """One panel: a box, ticks, labels; maps data to pixels."""

    def __init__(self, draw, origin: tuple[int, int], xlim, ylim, *, title: str, xlabel: str, ylabel: str,
                 xticks: Sequence[float] | None = None):
        self.draw = draw
        ox, oy = origin
        self.x0, self.y0 = ox + MARGIN_L, oy + MARGIN_T
        self.x1, self.y1 = ox + PANEL_W - MARGIN_R, oy + PANEL_H - MARGIN_B
        self.xlim, self.ylim = xlim, ylim
        small, big = _font(12), _font(14)
        draw.rectangle([self.x0, self.y0, self.x1, self.y1], outline=(0, 0, 0))
        for t in (nice_ticks(*xlim) if xticks is None else xticks):
            x, _ = self.px(t, ylim[0])
            if self.x0 <= x <= self.x1:
                draw.line([x, self.y1, x, self.y1 + 4], fill=(0, 0, 0))
                draw.line([x, self.y0, x, self.y1], fill=(235, 235, 235))
                draw.text((x, self.y1 + 6), _tick_text(t), fill=(0, 0, 0), font=small, anchor="ma")
        for t in nice_ticks(*ylim):
            _, y = self.px(xlim[0], t)
            if self.y0 <= y <= self.y1:
                draw.line([self.x0 - 4, y, self.x0, y], fill=(0, 0, 0))
                draw.line([self.x0, y, self.x1, y], fill=(235, 235, 235))
                draw.text((self.x0 - 6, y), _tick_text(t), fill=(0, 0, 0), font=small, anchor="rm")
        draw.rectangle([self.x0, self.y0, self.x1, self.y1], outline=(0, 0, 0))
        draw.text(((self.x0 + self.x1) / 2, oy + 8), title, fill=(0, 0, 0), font=big, anchor="ma")
        draw.text(((self.x0 + self.x1) / 2, self.y1 + 26), xlabel, fill=(0, 0, 0), font=small, anchor="ma")
        draw.text((ox + 4, self.y0 - 16), ylabel, fill=(0, 0, 0), font=small)

    def px(self, x: float, y: float) -> tuple[float, float]:
        (a, b), (c, d) = self.xlim, self.ylim
        fx = (x - a) / (b - a) if b > a else 0.5
        fy = (y - c) / (d - c) if d > c else 0.5
        return self.x0 + fx * (self.x1 - self.x0), self.y1 - fy * (self.y1 - self.y0)

    def line(self, xs, ys, color, width: int = 2) -> None:
        pts = [self.px(float(x), float(y)) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)]
        if len(pts) == 1:
            x, y = pts[0]
            self.draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=color)
        elif pts:
            self.draw.line(pts, fill=color, width=width, joint="curve")

    def points(self, xs, ys, color) -> None:
        for x, y in zip(xs, ys):
            if math.isfinite(x) and math.isfinite(y):
                px, py = self.px(float(x), float(y))
                self.draw.ellipse([px - 3, py - 3, px + 3, py + 3], fill=color)

    def note(self, text: str) -> None:
        self.draw.text(((self.x0 + self.x1) / 2, (self.y0 + self.y1) / 2), text, fill=(120, 120, 120),
                       font=_font(13), anchor="mm")


def _pale(color: tuple[int, int, int]) -> tuple[int, int, int]:
    return tuple(int(c + 0.65 * (255 - c)) for c in color)


def _smooth(y: np.ndarray) -> np.ndarray:
    w = max(1, len(y) // 20)
    if w == 1:
        return y
    kernel = np.ones(w) / w
    head = np.array([y[: i + 1].mean() for i in range(w - 1)])
    return np.concatenate([head, np.convolve(y, kernel, mode="valid")])


def _reward_panel(draw, origin, runs, xattr: str, title: str, xlabel: str) -> None:
    xs = [getattr(r, xattr) for r in runs]
    ax = _Axes(draw, origin, _limits(xs, zero=True), _limits([r.reward for r in runs]), title=title,
               xlabel=xlabel, ylabel="critic/rewards/mean")
    if not any(len(r.reward) for r in runs):
        ax.note("no training step logged")
    for i, r in enumerate(runs):
        color = PALETTE[i % len(PALETTE)]
        x = getattr(r, xattr)
        if len(r.reward) > 1 and len(r.reward) // 20 > 1:
            ax.line(x, r.reward, _pale(color), width=1)
        ax.line(x, _smooth(r.reward), color)


def _val_panel(draw, origin, runs) -> None:
    keys = sorted({r.val_key for r in runs if r.val_key})
    ax = _Axes(draw, origin, _limits([r.val_wall for r in runs], zero=True), _limits([r.val for r in runs]),
               title="held-out accuracy vs wall-clock", xlabel="wall-clock since the training loop started, s",
               ylabel=" / ".join(keys) or "val/overall")
    if not keys:
        ax.note("no validation logged (trainer.test_freq)")
    for i, r in enumerate(runs):
        color = PALETTE[i % len(PALETTE)]
        ax.line(r.val_wall, r.val, color)
        ax.points(r.val_wall, r.val, color)


def _staleness_panel(draw, origin, runs) -> None:
    lags = sorted(set().union(*(r.staleness for r in runs)))
    shares = []
    for r in runs:
        total = sum(r.staleness.values())
        shares.append([r.staleness.get(k, 0) / total if total else 0.0 for k in lags])
    lo, hi = (min(lags) - 0.5, max(lags) + 0.5) if lags else (-0.5, 0.5)
    ax = _Axes(draw, origin, (lo, hi), (0.0, 1.05), title="staleness of trained samples",
               xlabel="lag (policy versions behind the learner)", ylabel="share of samples",
               xticks=[k for k in nice_ticks(lo, hi) if float(k).is_integer()] if lags else [0])
    if not lags:
        ax.note("no staleness histogram logged")
        return
    n = max(1, len(runs))
    width = 0.8 / n
    for i, share in enumerate(shares):
        color = PALETTE[i % len(PALETTE)]
        for k, s in zip(lags, share):
            left = k - 0.4 + i * width
            x_a, y_a = ax.px(left, s)
            x_b, y_b = ax.px(left + width, 0.0)
            if s > 0:
                draw.rectangle([x_a, y_a, max(x_a + 1, x_b - 1), y_b], fill=color)


def plot_runs(runs: Sequence, path: str | os.PathLike) -> Path:
    """Draw the four panels for ``runs`` (:class:`omnirl_async.metrics.report.RunData`) into the PNG ``path``."""
    from PIL import Image, ImageDraw

    legend_rows = math.ceil(len(runs) / 3)
    top = 12 + 20 * legend_rows
    img = Image.new("RGB", (2 * PANEL_W, top + 2 * PANEL_H), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    font = _font(13)
    for i, r in enumerate(runs):  # the legend: three runs per row
        x, y = 12 + (i % 3) * (2 * PANEL_W // 3), 8 + 20 * (i // 3)
        draw.rectangle([x, y + 3, x + 22, y + 11], fill=PALETTE[i % len(PALETTE)])
        draw.text((x + 28, y), getattr(r, "label", "") or r.folder.name, fill=(0, 0, 0), font=font)
    _reward_panel(draw, (0, top), runs, "wall", "reward vs wall-clock",
                  "wall-clock since the training loop started, s")
    _reward_panel(draw, (PANEL_W, top), runs, "samples", "reward vs samples trained", "samples trained")
    _val_panel(draw, (0, top + PANEL_H), runs)
    _staleness_panel(draw, (PANEL_W, top + PANEL_H), runs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path
