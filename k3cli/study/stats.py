"""Small statistics for comparing runs: Student's t interval of paired differences, mean ± std,
and linear interpolation of loss curves (docs/math.md §8). Pure Python: no SciPy needed."""

from __future__ import annotations

import math


def t_two_sided_mass(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with integer `df` degrees of freedom (the finite series in
    θ = atan(t / √df); exact, no special functions needed)."""
    if t <= 0:
        return 0.0
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 0:   # sin θ · (1 + ½ cos²θ + (1·3)/(2·4) cos⁴θ + … up to cos^(df−2) θ)
        term, total = 1.0, 1.0
        for j in range(1, df // 2):
            term *= c2 * (2 * j - 1) / (2 * j)
            total += term
        return s * total
    if df == 1:
        return 2 * theta / math.pi
    term, total = 1.0, 1.0   # (2/π)(θ + sin θ cos θ (1 + ⅔ cos²θ + … up to cos^(df−3) θ))
    for j in range(1, (df - 1) // 2):
        term *= c2 * (2 * j) / (2 * j + 1)
        total += term
    return 2 / math.pi * (theta + s * math.cos(theta) * total)


def t_critical(df: int, level: float = 0.95) -> float:
    """The t with P(|T| < t) = level, by bisection on `t_two_sided_mass`."""
    if df < 1:
        raise ValueError(f"need at least 1 degree of freedom, got {df}")
    lo, hi = 0.0, 1.0
    while t_two_sided_mass(hi, df) < level:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_two_sided_mass(mid, df) < level else (lo, mid)
    return (lo + hi) / 2


def paired_interval(diffs: list[float], level: float = 0.95) -> dict:
    """Mean of paired differences with its t interval; `excludes_zero` is None below two pairs."""
    n = len(diffs)
    mean = sum(diffs) / n
    if n < 2:
        return {"n": n, "mean": mean, "std": None, "half_width": None, "low": None, "high": None,
                "excludes_zero": None}
    std = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    hw = t_critical(n - 1, level) * std / math.sqrt(n)
    return {"n": n, "mean": mean, "std": std, "half_width": hw, "low": mean - hw, "high": mean + hw,
            "excludes_zero": mean - hw > 0 or mean + hw < 0}


def mean_std(xs: list[float]) -> tuple[float, float | None]:
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else None)


def interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Linear interpolation of (xs, ys) at x, xs ascending; clamped to the ends."""
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            w = (x - xs[i - 1]) / (xs[i] - xs[i - 1]) if xs[i] > xs[i - 1] else 1.0
            return ys[i - 1] + w * (ys[i] - ys[i - 1])
    return ys[-1]
