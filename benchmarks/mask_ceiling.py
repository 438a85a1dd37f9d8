"""The most of plain attention's TFLOP/s a masked example can reach on the persistent kernel's tiles, counted from
its mask alone (no GPU): the work ratio (the pairs the mask keeps over the pairs of the tiles it visits) times the
share an item's tiles are of its time, T / (T + ITEM_COST) with T its tiles, over plain's. ITEM_COST, ~1.4
tile-times an item (Q's wait, the epilogue, the next ticket), is what benchmarks/timeline.py's fits of the
persistent kernel's items measured on the examples. TFLOP/s are counted over the kept pairs, as the issue's bars
are. Finer tiles are counted at the same time an item (so twice the items cost twice), and at the same rate a
pair.

    python3 benchmarks/mask_ceiling.py [--n 4096] [--tiles 128x128,64x64]
"""

from __future__ import annotations

import argparse

import numpy as np

ITEM_COST = 1.4  # tile-times of a 128 x 128 tile an item, beyond its tiles
DOCUMENTS = 8  # bench.py's document example: sorted random ids, the last 1/16 of a row padding (-1)


def masks(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    q, k = np.arange(n)[:, None], np.arange(n)[None, :]
    ids = np.sort(np.random.default_rng(seed).integers(0, DOCUMENTS, n))
    ids[n - n // 16:] = -1
    return {"plain": np.ones((n, n), bool), "causal": q >= k, "prefix_lm": (k <= q) | (k < 32),
            "sliding_window_1024": (q - k >= 0) & (q - k < 1024), "sliding_window (48)": (q - k >= 0) & (q - k < 48),
            "document": (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)}


def kept_per_time(mask: np.ndarray, bq: int, bk: int) -> tuple[float, float]:
    """(work ratio, kept pairs per unit of modelled time) of `mask` on bq x bk tiles (n a multiple of both)."""
    n = mask.shape[0]
    visited = mask.reshape(n // bq, bq, n // bk, bk).any(axis=(1, 3))
    items = int((visited.sum(axis=1) > 0).sum())
    tiles = int(visited.sum())
    size = bq * bk / (128 * 128)  # a tile's time in 128 x 128 tile-times
    time = tiles * size + ITEM_COST * items  # (an item's fixed time whatever its rows: latencies, not bytes)
    kept = float(mask.sum())
    return kept / (tiles * bq * bk), kept / time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--tiles", default="128x128,64x64")
    a = ap.parse_args()
    tiles = [tuple(int(x) for x in t.split("x")) for t in a.tiles.split(",")]
    if any(a.n % bq or a.n % bk for bq, bk in tiles):
        raise SystemExit(f"mask_ceiling: N = {a.n} must be a multiple of every tile side ({a.tiles})")
    ms = masks(a.n)
    plain = {t: kept_per_time(ms["plain"], *t)[1] for t in tiles}
    base = plain[(128, 128)] if (128, 128) in plain else plain[tiles[0]]
    print("| example | " + " | ".join(f"work ratio {bq}x{bk} | ceiling {bq}x{bk}" for bq, bk in tiles) + " |")
    print("|---|" + "---|---|" * len(tiles))
    for name, m in ms.items():
        cells = []
        for t in tiles:
            work, rate = kept_per_time(m, *t)
            cells += [f"{work:.3f}", f"{rate / base:.3f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
