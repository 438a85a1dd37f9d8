"""tests/gpu/xdist_args.py: the GPU test scripts spread a file's tests over xdist's workers (pyproject's loadfile
ran them one at a time) without overriding a --dist the user gave."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from xdist_args import spread_args  # noqa: E402


@pytest.mark.parametrize("args", [["-n", "14"], ["-n14"], ["-k", "dq", "-n", "8", "-rA"], ["--numprocesses=4"],
                                  ["--numprocesses", "auto"]])
def test_workers_get_load(args: list[str]) -> None:
    assert spread_args(args) == ["--dist", "load"]


@pytest.mark.parametrize("args", [[], ["-k", "n and not nodes"], ["-x", "-q"], ["-n", "14", "--dist", "loadfile"],
                                  ["-n4", "--dist=worksteal"], ["-k", "nodes"]])
def test_no_workers_or_a_named_dist_adds_nothing(args: list[str]) -> None:
    assert spread_args(args) == []
