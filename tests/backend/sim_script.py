"""What the simulator case scripts (`*_cases.py`, run in a subprocess by simulated.py) share: the main loop that
prints one JSON line per case (a case's exception in its own line, so the other cases still run), a compiled
call's outputs against the reference interpreter's, and the set-up of a case compiled from an example: its graph,
random inputs, a tile size, and the count of the kernel's device-function calls."""

from __future__ import annotations

import json
import os
import runpy
import time
from typing import Callable, Iterable

import numpy as np


def run_main(ids: Iterable[str], run: Callable[[str], dict]) -> None:
    """Run `run(case_id)` for each id and print its JSON line; the simulator must be on."""
    assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run with NUMBA_ENABLE_CUDASIM=1"
    for cid in ids:
        t0 = time.monotonic()
        try:
            r = run(cid)
        except Exception:
            import traceback

            r = {"id": cid, "error": traceback.format_exc()[-3000:]}
        r.setdefault("seconds", round(time.monotonic() - t0, 1))  # what each case costs CI (the suite's budget)
        print(json.dumps(r), flush=True)


def case_rng(case_id: str) -> np.random.Generator:
    """A case's random generator, seeded by its id's CRC (str's hash() changes from process to process, and a case
    whose inputs change from run to run cannot be re-run to look at a failure)."""
    import zlib

    return np.random.default_rng(zlib.crc32(case_id.encode()))


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


EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


def example_graph(stem: str):
    """examples/<stem>.py's graph: its `graph`, or the one Func it defines (naive_tensor_code.py's traced function)."""
    from falower.ir import Func

    ns = runpy.run_path(os.path.join(EXAMPLES, f"{stem}.py"))
    if "graph" in ns:
        return ns["graph"]
    funcs = [v for v in ns.values() if isinstance(v, Func)]
    assert len(funcs) == 1, f"examples/{stem}.py: no `graph` and {len(funcs)} Funcs"
    return funcs[0]


def random_qkv(rng: np.random.Generator, B: int, H: int, M: int, N: int, D: int) -> tuple:
    """q [B, H, M, D], then k and v [B, H, N, D], standard normal rounded to f16, drawn from rng in that order."""
    q = rng.standard_normal((B, H, M, D)).astype(np.float16)
    k, v = (rng.standard_normal((B, H, N, D)).astype(np.float16) for _ in range(2))
    return q, k, v


def tiled_pipeline(bq: int, bk: int) -> str:
    """The fa2-fwd pipeline with its tile pass at bq x bk (the simulator's small tiles)."""
    from falower.passes import NAMED_PIPELINES

    base = NAMED_PIPELINES["fa2-fwd"]
    pipe = base.replace("tile{bq=128,bk=64}", f"tile{{bq={bq},bk={bk}}}")
    assert pipe != base or (bq, bk) == (128, 64), f"no tile{{bq=128,bk=64}} in fa2-fwd: {base}"
    return pipe

