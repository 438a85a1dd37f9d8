"""The default GPU kernels at special values against the IR (marked gpu; the simulator's special_values_sim_cases.py
runs the mma.sync kernel at 16 x 16 tiles, this the wgmma kernels falower picks): a NaN table entry a score's maximum
or plain sum reads makes its row NaN in O and LSE, as the IR's (the kernels gave finite O through fmaxf, LSE -inf and
a zero O row through their `> 0` tests); every other row within f16's error of the IR in float64. A dS past f16's
range: the default backward kernels' non-finite dq / dk entries are the native IR's (operand_dtype)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))
import falower as fl  # noqa: E402
from falower.ir.interp import Interpreter  # noqa: E402
from special_values_sim_cases import _graph, assert_as_native, compare_with_native, sharp_graph, sharp_inputs  # noqa: E402

COMPILED: dict = {}


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case, M, N", [("max", 300, 257), ("plain_nan", 300, 257), ("min", 1, 1000),
                                        ("sign", 200, 200)])
def test_a_nan_entry_makes_its_row_nan_as_the_ir(case: str, M: int, N: int, D: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = _graph(case)
    c = COMPILED.setdefault(case, fl.compile(g, "numba-cuda"))
    r = np.random.default_rng(M + D)
    q = r.standard_normal((2, 2, M, D)).astype(np.float16)
    k, v = (r.standard_normal((2, 2, N, D)).astype(np.float16) for _ in range(2))
    bias = (r.standard_normal((2, M, N)) * 0.5).astype(np.float32)
    bias[1, M // 2, N // 3] = np.nan
    dev = [torch.from_numpy(x).cuda() for x in (q, k, v, bias)]
    o, lse = c(*dev)
    o, lse = o.double().cpu().numpy(), lse.double().cpu().numpy()
    ro, rl = (np.asarray(x, np.float64) for x in Interpreter("f64").run(fl.lower(g, "fa2-fwd"), [q, k, v, bias]))
    assert np.isnan(rl).sum() == 2  # head 1's row M // 2 in both batch rows
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(rl))
    np.testing.assert_array_equal(np.isnan(o), np.isnan(ro))
    ok = ~np.isnan(rl)
    assert np.max(np.abs(lse[ok] - rl[ok])) <= 1e-2
    assert np.max(np.abs(o[ok] - ro[ok])) <= 1e-2


@pytest.mark.parametrize("D", [64, 128])
def test_a_gradient_past_f16s_range_is_inf_as_in_the_native_ir(D: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    c = COMPILED.setdefault("sharp", fl.compile(sharp_graph(), "numba-cuda"))
    q, k, v, do = sharp_inputs(2, 2, 300, 257, D, 100, seed=D)
    dev = [torch.from_numpy(x).cuda() for x in (q, k, v, do)]
    o, lse = c(*dev[:3])
    grads = c.backward(dev[0], dev[1], dev[2], o, lse, dev[3])
    by = {"q": q, "k": k, "v": v, "o": o.cpu().numpy(), "lse": lse.cpu().numpy(), "do": do}
    bwd = c.lowered_backward
    got = [x.cpu().numpy() for x in grads]
    assert_as_native(compare_with_native(bwd, [by[a.name] for a in bwd.args], c.gradient_names(), got), 100)
