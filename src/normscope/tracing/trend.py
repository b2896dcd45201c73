"""Robust local trends of recorded series, and how far a value left them.

A series' next value is judged against the values before it: over the last ``window`` finite values (log scale for
positive metrics), a resistant line (slope from the medians of the first and last thirds, level from the median
of the detrended values) predicts the next value, and the residuals of that fit give its noise (1.4826·MAD, at
least ``floor``). A departure is measured against the more lenient of two baselines, the trend's prediction and the
recent level (the median of the last third), so that neither a steady trend (warm-up growth, a falling loss) nor
the end of one (a loss that flattens) reads as a jump.
"""

from __future__ import annotations

import dataclasses
from statistics import NormalDist

import numpy as np


@dataclasses.dataclass
class Fit:
    """The baselines of one step for several series at once (arrays over series; NaN where too short)."""
    trend: np.ndarray  # the trend's prediction for this step
    recent: np.ndarray  # the median of the last third of the window
    scale: np.ndarray  # the noise of the fit's residuals, at least the floor
    slope: np.ndarray  # per recorded step
    ok: np.ndarray  # bool: enough finite history to judge

    def up(self, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(robust σ above the more lenient baseline, that baseline)."""
        base = np.fmax(self.trend, self.recent)
        return np.where(self.ok, (y - base) / self.scale, np.nan), base

    def down(self, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        base = np.fmin(self.trend, self.recent)
        return np.where(self.ok, (base - y) / self.scale, np.nan), base


def nanmedian_rows(a: np.ndarray) -> np.ndarray:
    """The median of each row's non-NaN values (NaN for a row without any): one sort of the whole matrix, where
    ``np.nanmedian`` takes a masked-array path that costs ~0.5 ms a call on small rows."""
    rows, width = a.shape
    if width == 0:
        return np.full(rows, np.nan)
    s = np.sort(a, axis=1)  # NaNs sort last
    n = (~np.isnan(a)).sum(1)
    idx = np.arange(rows)
    lo, hi = np.maximum((n - 1) // 2, 0), np.maximum(n // 2, 0)
    with np.errstate(invalid="ignore"):
        med = (s[idx, np.minimum(lo, width - 1)] + s[idx, np.minimum(hi, width - 1)]) / 2
    return np.where(n > 0, med, np.nan)


def fit(history: np.ndarray, min_history: int, floor: float) -> Fit:
    """Baselines for the value after ``history`` (series × values, oldest first, NaN where missing)."""
    s, w = history.shape
    if w == 0:
        nan = np.full(s, np.nan)
        return Fit(nan, nan, nan, nan, np.zeros(s, bool))
    ok = np.isfinite(history).sum(1) >= max(min_history, 1)
    k = max(1, w // 3)
    x = np.arange(w, dtype=float)
    with np.errstate(invalid="ignore"):
        left, right = nanmedian_rows(history[:, :k]), nanmedian_rows(history[:, w - k:])
        slope = (right - left) / (w - k) if w > k else np.zeros(s)
        slope = np.where(np.isfinite(slope), slope, 0.0)
        detrended = history - slope[:, None] * x
        level = nanmedian_rows(detrended)
        scale = 1.4826 * nanmedian_rows(np.abs(detrended - level[:, None]))
    scale = np.fmax(np.where(np.isfinite(scale), scale, floor), floor)
    return Fit(level + slope * w, right, scale, slope, ok & np.isfinite(level))


def departures(values: np.ndarray, window: int, min_history: int, floor: float) -> tuple[np.ndarray, ...]:
    """(up, down, base_up, base_down): for every series (rows) and step (columns), how many robust σ the value
    is above (below) the baseline of the ``window`` values before it, and those baselines."""
    s, t = values.shape
    up, down = np.full((s, t), np.nan), np.full((s, t), np.nan)
    bu, bd = np.full((s, t), np.nan), np.full((s, t), np.nan)
    for i in range(1, t):
        f = fit(values[:, max(0, i - window):i], min_history, floor)
        up[:, i], bu[:, i] = f.up(values[:, i])
        down[:, i], bd[:, i] = f.down(values[:, i])
    return up, down, bu, bd


def log_values(v: np.ndarray) -> np.ndarray:
    """Natural log of positive values; NaN for zero, negative and non-finite ones (judged elsewhere)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(np.isfinite(v) & (v > 0), np.log(np.where(v > 0, v, 1.0)), np.nan)


def gaussian_tail_quantile(p: float) -> float:
    """z with P(Z > z) = p for a standard normal Z."""
    return NormalDist().inv_cdf(1.0 - min(max(p, 1e-15), 0.5))
