"""falower.compile refuses an `extra` key the backend does not read, by name and with the nearest known key: a
typo would otherwise leave its knob silently off. The known set is held to the keys the code reads (a grep of
falower/ for extra["k"], extra.get("k"), "k" in extra) and covers bench.py's config flags."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import falower as fl
from falower.backends.numba_cuda.spec import KNOWN_EXTRAS
from falower.errors import FalowerError

ROOT = Path(__file__).resolve().parents[2]


def _keys_read() -> set:
    keys = set()
    for f in (ROOT / "falower").rglob("*.py"):
        text = f.read_text()
        keys |= set(re.findall(r'extra(?:\.get)?\(?\[?"([a-z_0-9]+)"', text))
        keys |= set(re.findall(r'\(extra or \{\}\)\.get\("([a-z_0-9]+)"', text))
        keys |= set(re.findall(r'"([a-z_0-9]+)" (?:not )?in (?:spec\.|self\.)?extra\b', text))
    return keys


def test_a_typo_is_refused_by_name():
    g = fl.attention(name="plain")
    with pytest.raises(FalowerError, match=r"unknown extra 'kv_revers' \(did you mean 'kv_reverse'\?\)"):
        fl.compile(g, extra={"kv_revers": True})
    with pytest.raises(FalowerError, match="unknown extra 'zzz';"):
        fl.compile(g, extra={"zzz": 1, "schedule": "mma"})
    assert fl.compile(g, extra={"kv_reverse": False, "schedule": "mma"}).extra["schedule"] == "mma"


def test_the_known_set_is_what_the_code_reads():
    assert _keys_read() == set(KNOWN_EXTRAS)


def test_bench_flags_are_known():
    tree = ast.parse((ROOT / "benchmarks" / "bench.py").read_text())
    opts = next(ast.literal_eval(n.value) for n in tree.body
                if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "CONFIG_OPTIONS")
    keys = {o[1] for o in opts if isinstance(o[0], str)}
    keys |= {k for o in opts if not isinstance(o[0], str) for _, ex in o for k in ex}
    assert keys - {"eager"} <= KNOWN_EXTRAS  # bench pops "eager" (a pipeline change) before compiling
