"""Run a `*_cases.py` script of this folder under the CUDA simulator, in a subprocess (the simulator must be on
before numba.cuda is imported, and a subprocess keeps its state out of the test process), and collect the one
JSON line per case it prints, by id. Shared by the simulator suites' module fixtures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import pytest

HERE = Path(__file__).resolve().parent
# the wgmma forward's O against the float64 reference, by input dtype (P in the dtype, O stored in it)
FORWARD_O_TOL = {"f16": 4e-3, "bf16": 3e-2}


def assert_forward_close(r: Optional[dict]) -> None:
    """A forward case's result: present, no error, no NaN, O within FORWARD_O_TOL of the float64 reference and the
    kept rows' LSE within 1e-3."""
    assert r is not None and "error" not in r, r
    assert not r["nan"], r
    assert r["o_err"] <= FORWARD_O_TOL[r["dtype"]], r
    assert r["lse_err"] <= 1e-3, r


def spawn(script: str, cache_dir: Optional[Path] = None, ids: Sequence[str] = (),
          env_extra: Optional[dict[str, str]] = None) -> subprocess.Popen:
    """Start `script` (a file of this folder) on the simulator; `ids` limits it to those cases; `env_extra` adds
    to its environment (FALOWER_SIM_SLOW_WARP)."""
    env = {**os.environ, **(env_extra or {})}
    env["NUMBA_ENABLE_CUDASIM"] = "1"
    if cache_dir is not None:  # a fresh kernel cache: nothing compiled by another run is reused
        env["FALOWER_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, str(HERE / script), *ids], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _pin(proc)
    return proc


_LIVE: list[subprocess.Popen] = []


def _pin(proc: subprocess.Popen) -> None:
    """Keep a simulator process on one core: the xdist worker's own (gw0 the first, gw1 the second, ...), and the
    next one for a second process the same fixture runs beside it. Why: a simulator process's hundreds of threads
    hand the GIL to each other through the kernel, and unpinned they spread over ~1.3 cores (a case of 21.0 s took
    15.4 s user and 12.0 s system) where pinned they take one (23.2 s: 11.4 user, 11.7 system); on CI's two cores
    the other worker's tests then keep the other core. Set before the child starts its threads (it imports for
    seconds first), which inherit it; where the call is missing (not Linux) nothing is pinned."""
    if not hasattr(os, "sched_setaffinity"):
        return
    _LIVE[:] = [p for p in _LIVE if p.poll() is None]
    cpus = sorted(os.sched_getaffinity(0))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    try:
        os.sched_setaffinity(proc.pid, {cpus[(index + len(_LIVE)) % len(cpus)]})
    except OSError:  # the child has already exited
        pass
    _LIVE.append(proc)


def collect(proc: subprocess.Popen, timeout: int = 1500) -> dict[str, dict]:
    """The cases' results by id; the test fails with the script's stderr if it did not exit cleanly (a case's
    own exception is reported in its JSON line, so the other cases still run)."""
    stdout, stderr = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"simulator subprocess failed:\n{stderr[-4000:]}")
    return {r["id"]: r for r in map(json.loads, filter(lambda l: l.startswith("{"), stdout.splitlines()))}


def run_cases(script: str, cache_dir: Optional[Path] = None, timeout: int = 1500) -> dict[str, dict]:
    return collect(spawn(script, cache_dir), timeout)
