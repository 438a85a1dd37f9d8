"""A warm new process on the GPU (issue 10 item 5): kernels come from falower's cubin cache, loaded by the
driver, and Numba is never imported. Two processes on one cache dir: the first runs the calls through
Numba's launch (FALOWER_DIRECT_LAUNCH=0; building the kernel objects fills the cubin cache), the second
through the cached cubins; their results must agree (forward and dK/dV bit for bit, dQ up to the order
of its atomic adds). The second prints its timings (run with -s to see them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent('''
    import json, sys, time
    t0 = time.perf_counter()
    import torch
    torch.zeros(1, device="cuda"); torch.cuda.synchronize()
    t_torch = time.perf_counter()
    import falower as fl
    t_import = time.perf_counter()
    B, H, N, D = 2, 4, 200, 64
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, generator=g).to("cuda", torch.float16) for _ in range(4))
    slope = torch.tensor(-0.05, device="cuda")
    t1 = time.perf_counter()
    c = fl.compile(fl.attention(mask_mod=lambda b, h, qi, kv: qi >= kv, name="causal"))
    o, lse = c(q, k, v)
    torch.cuda.synchronize()
    t_first = time.perf_counter()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slope * (kv_idx - q_idx)

    bm = fl.create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, N, N, device="cuda")
    of = fl.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
    torch.cuda.synchronize()
    t_flex = time.perf_counter()
    dq, dk, dv = c.backward(q, k, v, o, lse, do)
    torch.cuda.synchronize()
    t_bwd = time.perf_counter()
    torch.save({"o": o, "lse": lse, "of": of, "dq": dq, "dk": dk, "dv": dv}, sys.argv[1])
    print(json.dumps({
        "numba": sorted(m for m in sys.modules if m.split(".")[0] in ("numba", "llvmlite")),
        "import torch + CUDA init s": t_torch - t0,
        "import falower s": t_import - t_torch,
        "trace, passes, build, first forward call s": t_first - t1,
        "first call after import torch s": t_first - t_torch - (t1 - t_import),
        "flex_attention (second kernel) s": t_flex - t_first,
        "backward (three kernels) s": t_bwd - t_flex}))
''')


def _run(tmp_path: Path, name: str, **env: str) -> tuple[dict, dict]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = tmp_path / f"{name}.pt"
    full = dict(os.environ, FALOWER_QUIET="1", **env)
    proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, cwd=ROOT,
                          env=full, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), torch.load(out)


def test_a_warm_new_process_loads_cubins_without_numba(tmp_path):
    """One test, run in order: a Numba-launched process (fills the cubin cache), a warm one (no Numba, same
    results), then every cubin truncated: the next process reads them as absent, compiles through Numba
    (its own disk cache) and rewrites them, and the one after is warm again."""
    cache = os.environ.get("FALOWER_CACHE_DIR") or str(tmp_path / "cache")  # reuse Numba's cache when there is one
    info_ref, ref = _run(tmp_path, "numba_launch", FALOWER_CACHE_DIR=cache, FALOWER_DIRECT_LAUNCH="0")
    assert info_ref["numba"]  # the first process launched through Numba
    info, warm = _run(tmp_path, "warm", FALOWER_CACHE_DIR=cache)
    print("\n[warm new process] " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                                               for k, v in info.items()}, indent=1))
    assert info["numba"] == [], f"a warm process imported {info['numba'][:5]}"
    cubins = list((Path(cache) / "cubin").glob("*.bin"))
    assert cubins
    for name in ("o", "lse", "of", "dk", "dv"):
        assert torch.equal(warm[name], ref[name]), name
    torch.testing.assert_close(warm["dq"], ref["dq"], atol=2e-3, rtol=0)
    # the forward against SDPA in float32, as a check that the cached kernels computed attention at all
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 200, 64, generator=g).to("cuda", torch.float16).float() for _ in range(3))
    expect = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(warm["o"].float(), expect, atol=2e-3, rtol=0)

    for path in cubins:  # corrupt every entry (each replaced whole: other processes may be reading them)
        data = path.read_bytes()
        tmp = path.with_suffix(".corrupt")
        tmp.write_bytes(data[: len(data) // 2])
        os.replace(tmp, path)
    info, again = _run(tmp_path, "again", FALOWER_CACHE_DIR=cache)
    assert info["numba"]  # compiled (Numba imported) instead of loading half a cubin
    for name in ("o", "lse", "of", "dk", "dv"):
        assert torch.equal(again[name], warm[name]), name
    info, _ = _run(tmp_path, "warm_again", FALOWER_CACHE_DIR=cache)
    assert info["numba"] == []  # the entries were rewritten whole
