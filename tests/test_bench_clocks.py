"""benchmarks/clocks.py and bench's --clocks: nvidia-smi's lines parsed, a timing's window averaged over the samples
inside it (their host times corrected for output read late), and the rounds' ratio to plain by cycles: the time
ratio times plain's clock over the row's (call I of the forty-seventh session: at the power cap ALiBi ran ~6% faster
clocks than causal, so its time alone matched causal's while it took 4.7% more cycles)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
clocks = pytest.importorskip("clocks")
bench = pytest.importorskip("bench")


def test_parse_line_reads_the_query_and_refuses_the_rest():
    ts, mhz, w = clocks.parse_line("2026/11/30 08:04:40.123, 1696, 687.25\n")
    assert (mhz, w) == (1696.0, 687.25)
    assert ts % 60 == pytest.approx(40.123, abs=1e-3)
    for bad in ("", "nvidia-smi has failed", "2026/11/30 08:04:40.123, [N/A], 687.25", "1, 2"):
        assert clocks.parse_line(bad) is None


def test_the_window_averages_the_samples_inside_it():
    """A fake nvidia-smi (a Python child printing three lines at once, with timestamps 100 ms apart ending now):
    the host times of the samples are their stamps moved onto the host's clock, and a window keeps those inside."""
    script = ("import datetime as d\n"
              "now = d.datetime.now()\n"
              "for i, (m, w) in enumerate(((1500, 600), (1600, 650), (1700, 700))):\n"
              "    t = now - d.timedelta(milliseconds=100 * (2 - i))\n"
              "    print(t.strftime('%Y/%m/%d %H:%M:%S.%f')[:-3] + f', {m}, {w}', flush=True)\n"
              "print('garbage')\n")
    with clocks.ClockSampler(command=[sys.executable, "-c", script]) as s:
        deadline = time.time() + 10
        while len(s.raw) < 3 and time.time() < deadline:
            time.sleep(0.01)
    got = s.samples()
    assert [m for _, m, _ in got] == [1500.0, 1600.0, 1700.0]
    assert got[1][0] - got[0][0] == pytest.approx(0.1, abs=2e-3)
    t0, t2 = got[0][0], got[2][0]
    assert s.window(t0 - 1, t2 + 1) == (pytest.approx(1600.0), pytest.approx(650.0), 3)
    assert s.window(t0 + 0.05, t2 + 1)[:2] == (pytest.approx(1650.0), pytest.approx(675.0))
    mhz, w, n = s.window(t2 + 1, t2 + 2)
    assert n == 0 and mhz != mhz and w != w


def test_rounds_summary_of_plain_by_cycles():
    """ALiBi's case: the same time as causal a call, at a 6% faster clock: of plain by time equal, by cycles 6%
    lower; a round with no clock drops out of the cycles ratio only."""
    flops = {"plain": 2e12, "causal": 1e12, "alibi": 1e12}
    times = {("plain", "ours"): [4.0, 4.0, 4.0], ("causal", "ours"): [2.0, 2.0, 2.0], ("alibi", "ours"): [2.0] * 3}
    mhz = {("plain", "ours"): [1600.0] * 3, ("causal", "ours"): [1600.0] * 3,
           ("alibi", "ours"): [1696.0, float("nan"), 1696.0]}
    rows = {r["example"]: r for r in bench.rounds_summary(times, flops, clocks=mhz)}
    assert rows["alibi"]["of plain"]["median"] == pytest.approx(rows["causal"]["of plain"]["median"])
    assert rows["alibi"]["of plain by cycles"]["median"] == pytest.approx(1.0 * 1600 / 1696)
    assert rows["causal"]["of plain by cycles"]["median"] == pytest.approx(1.0)
    assert rows["alibi"]["MHz"] == pytest.approx(1696.0)
    assert "MHz" not in {k for r in bench.rounds_summary(times, flops) for k in r}  # without --clocks
    md = "\n".join(bench.rounds_table([{**r, "D": 128, "o diff vs flex": 0.0, "flex": 1.0,
                                        "over flex": r["of plain"]} for r in rows.values()], "H200", 3))
    assert "of plain by cycles" in md and "| alibi | 1696 | 1.000 | 0.943" in md
