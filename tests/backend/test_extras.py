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


# the files whose code reads the backward's keys; every other file of the backend builds or runs forward kernels
_BACKWARD_FILES = {"emit_fa2_bwd.py", "emit_fa3_bwd.py", "from_ir_bwd.py", "elem_split.py", "spec.py"}


def test_the_backward_keys_are_read_by_the_backward_only():
    """BACKWARD_EXTRAS (left out of the forward's spec) are known keys, and no forward file reads one: a key the
    forward read would silently drop out of it."""
    from falower.backends.numba_cuda.spec import BACKWARD_EXTRAS

    assert BACKWARD_EXTRAS <= KNOWN_EXTRAS
    for f in (ROOT / "falower").rglob("*.py"):
        if f.name not in _BACKWARD_FILES:
            text = f.read_text()
            assert not {k for k in BACKWARD_EXTRAS if f'"{k}"' in text or f"'{k}'" in text}, f
    bwd = "".join((ROOT / "falower" / "backends" / "numba_cuda" / n).read_text() for n in _BACKWARD_FILES
                  if n != "spec.py")
    assert all(f'"{k}"' in bwd for k in BACKWARD_EXTRAS)


def test_a_backward_knob_leaves_the_forward_kernel_as_it_is(tmp_path, monkeypatch):
    """The same forward kernel (its name: the hash of its source and spec) with and without the backward's knobs,
    on either schedule; a forward knob does change it."""
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))
    g = fl.attention(mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, name="causal")
    for sched in ({"schedule": "mma"}, {"schedule": "wgmma"}):
        names = {fl.compile(g, extra={**sched, **knobs}).specialize("f16", D=64, N=100, M=100).spec.name
                 for knobs in ({}, {"dq_ws": False, "bwd_schedule": "wgmma"}, {"dk_after_dq": True, "kv_group": 2})}
        assert len(names) == 1, names
    assert fl.compile(g, extra={"schedule": "wgmma", "stmatrix": False}).specialize(
        "f16", D=64, N=100, M=100).spec.name not in names
