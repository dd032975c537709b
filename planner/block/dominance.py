"""Dominance among search states: which states (rows sorted by cost) no cheaper kept state
covers in every component, in plain Python and in numpy arrays."""

from __future__ import annotations

import numpy as np

from ipnext.planner.block.common import DOMINANCE_REFS


def nondominated(vecs: list[tuple[float, ...]]) -> list[int]:
    """Indices of the vectors (sorted by cost) that no earlier kept one covers in every
    component."""
    if len(vecs) > 48:
        return [int(i) for i in nondominated_np(np.asarray(vecs, dtype=np.float64), 0)]
    kept: list[tuple[float, ...]] = []
    out = []
    for i, vec in enumerate(vecs):
        if not any(all(a >= b for a, b in zip(kv, vec, strict=True)) for kv in kept):
            kept.append(vec)
            out.append(i)
    return out


CHUNK = 128  # rows nondominated_np checks against each other at once


def dominance_work(n: int) -> int:
    """Array work units for `nondominated_np` on n rows beside the n it takes to read them:
    each row meets at most DOMINANCE_REFS kept rows and its chunk, so the charge grows as
    n squared only up to that many rows and linearly after (a layer of 343,080 states was
    charged 460M units as n squared, for 1.5 s; it is charged 858k now)."""
    return n * min(n, DOMINANCE_REFS + CHUNK) // 256


def nondominated_np(arr: np.ndarray, beam: int) -> np.ndarray:
    """Indices of the rows (sorted by cost) that no earlier kept row covers in every
    component; with `beam`, only the first that many. Each row is checked against at most
    DOMINANCE_REFS kept rows: keeping a dominated row is only slower, never wrong."""
    n, d = arr.shape
    if n <= 1:
        return np.arange(n)
    cols = np.ascontiguousarray(arr.T)
    kept: list[int] = []
    ref: np.ndarray | None = None  # (components, kept rows) checked against
    step = CHUNK
    lower_tri = np.tri(step, k=-1, dtype=bool)
    for start in range(0, n, step):
        end = min(n, start + step)
        part = cols[:, start:end]
        size = end - start
        if ref is not None:
            cover = np.ones((size, ref.shape[1]), dtype=bool)
            for k in range(d):
                cover &= ref[k][None, :] >= part[k][:, None]
            ok = np.logical_not(cover.any(axis=1))
        else:
            ok = np.ones(size, dtype=bool)
        inner = lower_tri[:size, :size] & ok[None, :]
        for k in range(d):
            inner &= part[k][None, :] >= part[k][:, None]
        ok &= ~inner.any(axis=1)
        kept.extend((np.flatnonzero(ok) + start).tolist())
        if beam and len(kept) >= beam:
            return np.asarray(kept[:beam], dtype=np.int64)
        if ref is None or ref.shape[1] < DOMINANCE_REFS:
            ref = cols[:, kept[:DOMINANCE_REFS]]
    return np.asarray(kept, dtype=np.int64)


def first_unique(y: np.ndarray) -> np.ndarray:
    """Index of the first occurrence of each distinct row, in order."""
    rows = np.ascontiguousarray(y).view(np.dtype((np.void, y.dtype.itemsize * y.shape[1]))).ravel()
    _, first = np.unique(rows, return_index=True)
    first.sort()
    return first
