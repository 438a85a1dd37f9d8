"""benchmarks/mask_ceiling.py: the share of plain's TFLOP/s a mask's tiles leave, counted without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import mask_ceiling  # noqa: E402


def test_plain_is_whole_and_the_masks_lose_what_their_tiles_waste():
    ms = mask_ceiling.masks(1024)
    assert mask_ceiling.kept_per_time(ms["plain"], 128, 128)[0] == 1.0
    # causal on 128 x 128 tiles: 8 diagonal tiles half kept of 36 visited
    work, _ = mask_ceiling.kept_per_time(ms["causal"], 128, 128)
    assert work == pytest.approx((1024 * 1025 / 2) / (36 * 128 * 128))
    # a window of 48 visits 2 tiles a q tile (15 on the first) for 48 keys a row
    work, _ = mask_ceiling.kept_per_time(ms["sliding_window (48)"], 128, 128)
    assert work == pytest.approx(float(ms["sliding_window (48)"].sum()) / (15 * 128 * 128))
    # finer tiles waste less of the window
    assert (mask_ceiling.kept_per_time(ms["sliding_window (48)"], 64, 64)[0]
            > mask_ceiling.kept_per_time(ms["sliding_window (48)"], 128, 128)[0])


def test_the_table_and_a_bad_length():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mask_ceiling.py"), "--n", "1024"],
                         capture_output=True, text=True, check=True).stdout
    rows = {ln.split(" | ")[0].strip("| "): ln for ln in out.splitlines()[2:]}
    assert set(rows) == set(mask_ceiling.masks(256))
    cells = [float(x) for x in rows["plain"].strip("| ").split(" | ")[1:]]
    assert cells[:3] == [1.0, 1.0, 1.0] and cells[3] < 1.0  # 64 x 64: twice the items, each its fixed time
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mask_ceiling.py"), "--n", "1000"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "multiple of every tile side" in bad.stderr
