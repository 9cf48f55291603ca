"""Per-group reductions over numpy columns: quantile, median and mean of values keyed by a dense group code.

The cost table, the transfer measurement and the diagnosis compare like with like (a rank with its stage, a transfer
with its class) over millions of rows; these reductions do it with one sort or one ``bincount`` for all groups at
once, never a Python loop over groups. This module knows nothing about records or breakdowns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import NDArray


def distinct(values: NDArray[np.integer[Any]]) -> NDArray[Any]:
    """The distinct values of an integer array, sorted: ``np.unique(values)`` by one sort and a comparison.

    numpy 2.3+ computes a bare ``np.unique`` of integers through a hash table, then sorts its result; with millions of
    distinct keys that took ~30x longer than this on the 16,384-rank benchmark (7.4 s against 0.25 s). The sort is
    numpy's timsort, which is fastest on what this module is given: keys in long presorted runs.
    """
    if values.size == 0:
        return values.copy()
    ordered = np.sort(values, kind="stable")
    new = np.empty(ordered.size, dtype=bool)
    new[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
    return ordered[new]


def grouped_quantile(
    key: NDArray[np.integer[Any]], values: NDArray[np.floating[Any]], n_groups: int, q: float
) -> NDArray[np.float64]:
    """The ``q`` quantile of ``values`` per group ``key`` (0 .. n_groups-1), NaN for empty groups; one sort in all.

    Linear interpolation between the two nearest values (numpy's default), so ``q = 0.5`` is the median.
    """
    out = np.full(n_groups, np.nan)
    if key.size == 0:
        return out
    # By value, then stably by group: the same order as np.lexsort((values, key)), 3-5x faster (a stable sort of
    # 16-bit keys is a radix sort).
    order = np.argsort(values)
    narrow = np.int16 if n_groups <= np.iinfo(np.int16).max else np.int64
    order = order[np.argsort(key[order].astype(narrow), kind="stable")]
    v = values[order].astype(np.float64, copy=False)
    counts = np.bincount(key, minlength=n_groups)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    has = counts > 0
    position = q * (counts[has] - 1)
    lo = np.floor(position).astype(np.int64)
    hi = np.ceil(position).astype(np.int64)
    frac = position - lo
    out[has] = v[starts[has] + lo] * (1.0 - frac) + v[starts[has] + hi] * frac
    return out


def grouped_median(
    key: NDArray[np.integer[Any]], values: NDArray[np.floating[Any]], n_groups: int
) -> NDArray[np.float64]:
    """Median of ``values`` per group ``key`` (0 .. n_groups-1), NaN for empty groups; one sort for all groups."""
    return grouped_quantile(key, values, n_groups, 0.5)


def median_of_others(
    key: NDArray[np.integer[Any]], values: NDArray[np.floating[Any]], n_groups: int
) -> NDArray[np.float64]:
    """Per element: the median of the *other* members of its group ``key``; NaN for an element alone in its group.

    A rank compared with "its peers" is not one of them: in a group of two, the median including itself would credit
    it with half of its own excess. One sort for all groups.
    """
    out = np.full(key.size, np.nan)
    if key.size == 0:
        return out
    order = np.lexsort((values, key))
    v = values[order].astype(np.float64, copy=False)
    counts = np.bincount(key, minlength=n_groups)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    k = key[order]
    start, others = starts[k], counts[k] - 1
    mine = np.arange(key.size) - start  # each sorted element's place in its group
    has = others > 0
    lo_j, hi_j = (others - 1) // 2, others // 2  # the others' median places, among the others

    def other(j: NDArray[np.int64]) -> NDArray[np.float64]:
        """The ``j``-th of the others (sorted), for every element with others: skips the element's own place."""
        at = np.minimum(start + j + (j >= mine), key.size - 1)
        picked: NDArray[np.float64] = v[at]
        return picked

    median = np.where(has, 0.5 * (other(lo_j) + other(hi_j)), np.nan)
    out[order] = median
    return out


def grouped_mean(
    key: NDArray[np.integer[Any]], values: NDArray[np.floating[Any]], n_groups: int
) -> NDArray[np.float64]:
    """Mean of ``values`` per group, NaN for empty groups."""
    counts = np.bincount(key, minlength=n_groups).astype(np.float64)
    sums = np.bincount(key, weights=values, minlength=n_groups)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def median_rank_value(values: NDArray[np.floating[Any]]) -> float:
    """The median rank's figure among one figure per rank: the lower of the two middle ones for an even count.

    A rank's own figure, never a value between two ranks that no rank had: of 2 ranks waiting 4 ms and 100 ms for
    data, the median rank is the one at 4 ms, not a rank at 52 ms. NaN for no ranks.
    """
    if values.size == 0:
        return float("nan")
    return float(np.percentile(values, 50, method="lower"))
