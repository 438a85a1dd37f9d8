"""The simulator's static shared arrays are shared by every thread of a block, as on the GPU.

numba-cuda's simulator creates one on first use without a lock; a thread switched out between its lookup and
its insert gets an array of its own (uninitialised: garbage or NaN in what it reads). The backward simulator
suite hit it about once a CI run. intrinsics.py guards the allocation; this test widens the race until the
unguarded simulator fails on nearly every thread, and asks the guarded one for exact sums."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from simulated import collect, spawn  # noqa: E402


@pytest.fixture(scope="module")
def results():
    return collect(spawn("shared_array_cases.py", None, ["numba", "falower"]), timeout=300)


def test_the_race_is_provoked_without_the_guard(results):
    """The harness is able to fail: numba-cuda as shipped gives threads their own arrays here. (If a numba-cuda
    release fixes the race, this fails: the guard in intrinsics.py can then go.)"""
    r = results["numba"]
    assert r["wrong_sums"] > 0, r


def test_guarded_shared_arrays_are_shared(results):
    r = results["falower"]
    assert r["wrong_sums"] == 0, r
