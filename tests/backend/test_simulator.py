"""Both kernel schedules in the CUDA simulator (no GPU), against a float64 numpy reference.

The simulator must be switched on before numba.cuda is imported, so the cases run in one subprocess
(sim_cases.py) and this module only reads its JSON lines: the rest of the pytest process is untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from sim_cases import CASES  # noqa: E402

TOL = {"f16": 4e-3, "bf16": 3e-2, "f32": 1e-5}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    env = dict(os.environ)
    env["NUMBA_ENABLE_CUDASIM"] = "1"
    env["FALOWER_CACHE_DIR"] = str(tmp_path_factory.mktemp("kernels"))
    root = HERE.parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(HERE / "sim_cases.py")], env=env, capture_output=True,
                          text=True, timeout=900)
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[r["id"]] = r
    if proc.returncode != 0:
        pytest.fail(f"simulator subprocess failed:\n{proc.stderr[-4000:]}")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case_id", list(CASES))
def test_simulator_case(results, case_id):
    r = results[case_id]
    assert not r["nan"], r
    assert r["o_err"] <= TOL[r["dtype"]], r
    assert r["lse_err"] <= 1e-4, r
    assert r["lse_inf_where_expected"], r
    assert r["masked_ok"], r
    if "masked-rows" in case_id:
        assert r["masked_rows"] > 0
