"""The GPU's SM clock and power while a benchmark runs, from `nvidia-smi` sampling every 20 ms in a thread: what a
timing was taken at. Why: on an H200 at its power cap each kernel run alone settles at its own clock (forty-seventh
session: ALiBi's calls at ~1700 MHz, causal's at ~1610), so a ratio of times taken one kernel at a time (do_bench's
rounds) is a ratio at two clocks, while call pairs (bench --pairs) run both at one clock: a ratio of cycles. With
the clock of each timing known, bench gives both (`--clocks`).

    with ClockSampler() as clocks:
        t0 = time.time(); ...; t1 = time.time()
        mhz, watts, n = clocks.window(t0, t1)
"""

from __future__ import annotations

import datetime
import shutil
import subprocess
import threading
import time
from typing import Optional

QUERY = "timestamp,clocks.sm,power.draw"


def parse_line(line: str) -> Optional[tuple[float, float, float]]:
    """(the sample's time in seconds since the epoch as nvidia-smi's local clock reads it, SM clock in MHz, power in
    W) of one `--format=csv,noheader,nounits` line of QUERY, or None for a line that is not one (a warning, '[N/A]')."""
    parts = [x.strip() for x in line.split(",")]
    if len(parts) != 3:
        return None
    try:
        ts = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        return ts, float(parts[1]), float(parts[2])
    except ValueError:
        return None


class ClockSampler:
    """nvidia-smi in the background: samples as (host time, MHz, W). The host time of a sample is its own
    timestamp moved by the least (read time - timestamp) seen, so output nvidia-smi buffered does not shift it."""

    def __init__(self, period_ms: int = 20, command: Optional[list[str]] = None) -> None:
        self.command = command or ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                   "-lms", str(period_ms)]
        self.raw: list[tuple[float, float, float, float]] = []  # (read time, timestamp, MHz, W)
        self._proc: Optional[subprocess.Popen] = None
        self._thread: Optional[threading.Thread] = None

    @staticmethod
    def available() -> bool:
        return shutil.which("nvidia-smi") is not None

    def __enter__(self) -> "ClockSampler":
        self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            got = parse_line(line)
            if got is not None:
                self.raw.append((time.time(), *got))

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def samples(self) -> list[tuple[float, float, float]]:
        """(host time, MHz, W) of every sample so far."""
        raw = list(self.raw)
        if not raw:
            return []
        offset = min(read - ts for read, ts, _, _ in raw)
        return [(ts + offset, mhz, w) for _, ts, mhz, w in raw]

    def window(self, t0: float, t1: float) -> tuple[float, float, int]:
        """Mean SM clock and power of the samples between host times t0 and t1, and how many there were (NaN, NaN,
        0 where none: a window shorter than the period, or nvidia-smi gone)."""
        inside = [(mhz, w) for t, mhz, w in self.samples() if t0 <= t <= t1]
        if not inside:
            return float("nan"), float("nan"), 0
        return (sum(m for m, _ in inside) / len(inside), sum(w for _, w in inside) / len(inside), len(inside))
