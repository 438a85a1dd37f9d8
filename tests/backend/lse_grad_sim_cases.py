"""A loss that reads the forward's LSE too, through the backward kernels in the CUDA simulator (run by
test_lse_grad_simulator.py): c.backward(..., dlse=) against the fa2-bwd IR with the LSE's cotangent
(passes/lse_cotangent.py: Delta - dlse) interpreted in float64, on the atomic and deterministic kernels, a captured
table's gradient (the bias) and a fully masked row included; and a graph that returns its LSE (`returned`:
fl.attention(return_lse=True), rows 0-2 fully masked), whose fa2-bwd IR takes the cotangent itself (raise_lse.py),
and the same with GQA (`gqareturned`: 2 query heads a kv head)."""

from __future__ import annotations

import sys

import numpy as np  # noqa: E402
from sim_script import example_graph, run_main  # noqa: E402

FWD = "decompose-softmax,canonicalize,fuse,tile{bq=16,bk=16},online-softmax{exp2=true},mask-tiles,score-licm,canonicalize"
BWD = "autodiff,decompose-softmax,canonicalize,delta,recompute,canonicalize,tile-bwd{{bq=16,bk=16,dq={dq}}},canonicalize"
DQ = {"atomic": "atomic", "det": "separate,deterministic=true"}


def run_case(case: str) -> dict:
    import falower as fl
    from falower.ir.interp import Interpreter
    from falower.passes.check import bind_dims, random_inputs
    from falower.passes.lse_cotangent import lse_cotangent_arg, with_lse_cotangent

    stem, dq = case.split("-")
    if stem in ("returned", "gqareturned"):  # gqareturned: 2 query heads a kv head, their dK / dV summed
        g = fl.attention(mask_mod=lambda b, h, q, kv: q >= kv + 3, return_lse=True, name=stem,
                         group_size=2 if stem == "gqareturned" else 1)
    else:
        g = example_graph(stem)
    env = bind_dims(g, {"B": 1, "H": 2, "HKV": 1, "M": 20, "N": 19, "D": 16})
    inputs = [x.astype(np.float16) if i < 3 else x.astype(np.float32) if x.dtype.kind == "f" else x
              for i, x in enumerate(random_inputs(g, env, seed=1))]
    c = fl.compile(g, "numba-cuda", pipeline=FWD, backward=BWD.format(dq=DQ[dq]), path="mma")
    o, lse = (np.asarray(x) for x in Interpreter("native").run(c.lowered, inputs))
    o, lse = o.astype(np.float16), lse.astype(np.float32)
    r = np.random.default_rng(5)
    do = r.standard_normal(o.shape).astype(np.float16)
    dlse = r.standard_normal(lse.shape).astype(np.float32)
    got = c.backward(inputs[0], inputs[1], inputs[2], o, lse, do, *inputs[3:], dlse=dlse)
    plain = c.backward(inputs[0], inputs[1], inputs[2], o, lse, do, *inputs[3:])
    f = c.lowered_backward if lse_cotangent_arg(c.lowered_backward) is not None else \
        with_lse_cotangent(c.lowered_backward)
    by = {a.name: x for a, x in zip(g.args, inputs)}
    by.update(o=o, lse=lse, do=do, dlse=dlse)
    want = Interpreter("f64").run(f, [by[a.name] for a in f.args])
    out: dict = {"id": case, "grads": {}}
    for name, a, b, p in zip(c.gradient_names(), got, want, plain):
        a, b, p = (np.asarray(x, np.float64) for x in (a, b, p))
        out["grads"][name] = {"err": float(np.max(np.abs(a - b))), "scale": float(np.max(np.abs(b))),
                              "moved": float(np.max(np.abs(a - p)))}  # what dlse changed (0: not applied)
    return out


CASES = ["causal-atomic", "causal-det", "bias-atomic", "alibi-det", "returned-atomic", "returned-det",
         "gqareturned-atomic"]

if __name__ == "__main__":
    run_main([c for c in CASES if not sys.argv[1:] or c in sys.argv[1:]], run_case)
