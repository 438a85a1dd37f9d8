"""The pytest arguments a GPU test script adds to its user's (no torch here, so CPU-only CI tests it)."""

from __future__ import annotations


def spread_args(args: list[str]) -> list[str]:
    """`--dist load` where `args` ask xdist for workers (`-n N`, `-nN`, `--numprocesses`) and name no `--dist`.
    pyproject's `--dist loadfile` (for the simulator modules, whose fixtures run their cases once a worker) gives
    every test of one file to one worker, so a GPU file's tests ran one at a time whatever -n said
    (benchmarks/NOTES.md, "Knob tests by name")."""
    workers = any(a == "-n" or (a.startswith("-n") and a[2:].isdigit()) or a.startswith("--numprocesses")
                  for a in args)
    return ["--dist", "load"] if workers and not any(a.startswith("--dist") for a in args) else []
