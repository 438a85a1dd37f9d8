"""What the simulator case scripts (`*_cases.py`, run in a subprocess by simulated.py) share: the main loop that
prints one JSON line per case (a case's exception in its own line, so the other cases still run), and a compiled
call's outputs against the reference interpreter's."""

from __future__ import annotations

import json
import os
from typing import Callable, Iterable

import numpy as np


def run_main(ids: Iterable[str], run: Callable[[str], dict]) -> None:
    """Run `run(case_id)` for each id and print its JSON line; the simulator must be on."""
    assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run with NUMBA_ENABLE_CUDASIM=1"
    for cid in ids:
        try:
            r = run(cid)
        except Exception:
            import traceback

            r = {"id": cid, "error": traceback.format_exc()[-3000:]}
        print(json.dumps(r), flush=True)


def against_reference(o, lse, want_o: np.ndarray, want_lse: np.ndarray) -> dict:
    """O and LSE of a call against the reference's (float64): NaNs, the largest errors (LSE over the rows that see
    something), and whether exactly the rows that see nothing have LSE = -inf."""
    fin = np.isfinite(want_lse)
    got = np.asarray(o, dtype=np.float64)
    return {"nan": bool(np.isnan(got).any() or np.isnan(lse).any()),
            "o_err": float(np.max(np.abs(got - want_o))),
            "lse_err": float(np.max(np.abs(lse[fin] - want_lse[fin]))) if fin.any() else 0.0,
            "lse_inf_ok": bool(np.array_equal(np.isneginf(lse), ~fin)), "masked_rows": int((~fin).sum())}


def count_calls(kern, names: Iterable[str]) -> dict[str, int]:
    """Wrap the kernel's device functions `names` (the simulator calls its module globals) so that each call is
    counted; returns the counts, filled in as the kernel runs (a case shows which paths it took)."""
    import threading

    glb = kern._kernel.fn.__globals__
    counts = dict.fromkeys(names, 0)
    lock = threading.Lock()

    def counted(name, fn):
        def call(*a):
            with lock:
                counts[name] += 1
            return fn(*a)
        return call

    for name in counts:
        if name in glb:
            glb[name] = counted(name, glb[name])
    return counts

