"""`--check`: run the interpreter after every pass on random inputs and compare with the input graph.

Inputs are drawn with a fixed seed at sizes that are not multiples of any tile; integer tables (document
ids) include -1, which the examples use for padding tokens, so fully masked rows occur where a mask allows.
The reference is the input graph interpreted in float64; an output the input graph does not have (LSE,
added by online-softmax) is compared with the log-sum-exp of the input graph's softmax operand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

import numpy as np

from ..errors import ShapeError
from ..ir.core import Func
from ..ir.interp import Interpreter
from ..ir.types import is_float

DEFAULT_SHAPES = {"B": 2, "H": 3, "HKV": 2, "M": 77, "N": 93, "D": 16}


def bind_dims(func: Func, shapes: Optional[Mapping[str, int]] = None) -> dict[str, int]:
    """Sizes for every symbol the inputs use: the given ones, then falower's defaults."""
    env = dict(shapes or {})
    syms: set[str] = set()
    for a in func.args:
        for d in a.type.shape:
            syms |= d.symbols()
    for s in sorted(syms):
        if s not in env:
            if s in DEFAULT_SHAPES:
                env[s] = DEFAULT_SHAPES[s]
            else:
                raise ShapeError(f"no size for dimension {s}: give it with --shapes {s}=...")
    return env


def random_inputs(func: Func, env: Mapping[str, int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for a in func.args:
        shape = a.type.concrete(env)
        if any(n <= 0 for n in shape):
            raise ShapeError(f"input %{a.name} would have shape {shape}: sizes must be positive")
        dt = a.type.dtype
        if is_float(dt):
            x = rng.standard_normal(shape)
        elif dt == "bool":
            x = rng.random(shape) < 0.7
        else:
            x = _int_table(rng, shape)
        out.append(x)
    return out


def _int_table(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Non-decreasing ids along the last axis (documents), with a tail of -1 (padding)."""
    if not shape:
        return np.array(rng.integers(0, 4), dtype=np.int32)
    x = np.sort(rng.integers(0, 4, size=shape), axis=-1)
    n = shape[-1]
    x[..., n - max(1, n // 8):] = -1
    return x.astype(np.int32)


def logsumexp_rows(x: np.ndarray, axis: int) -> np.ndarray:
    with np.errstate(all="ignore"):
        m = np.max(x, axis=axis, keepdims=True)
        ms = np.where(np.isneginf(m), 0.0, m)
        s = np.sum(np.exp(x - ms), axis=axis, keepdims=True)
        r = np.where(s == 0, -np.inf, ms + np.log(s))
    return np.squeeze(r, axis=axis)


@dataclass
class Reference:
    func: Func
    env: dict[str, int]
    inputs: list[np.ndarray]
    outputs: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def build(cls, func: Func, shapes: Optional[Mapping[str, int]] = None, seed: int = 0,
              inputs: Optional[list[np.ndarray]] = None) -> "Reference":
        """The float64 outputs of `func` (and the LSE of its softmax) on random inputs, or on `inputs`."""
        env = bind_dims(func, shapes)
        if inputs is None:
            inputs = random_inputs(func, env, seed)
        inputs = [x.astype(np.float64) if x.dtype.kind == "f" else x for x in inputs]
        ref = cls(func, env, inputs)
        it = Interpreter("f64")
        outs = it.run(func, inputs, env)
        ref.outputs = dict(zip(func.result_names, outs))
        sm = [op for op in func.walk() if op.name == "softmax"]
        if len(sm) == 1 and "lse" not in ref.outputs:
            x = it.top_env.get(sm[0].operands[0])
            if x is not None:
                lse = logsumexp_rows(np.asarray(x, dtype=np.float64), sm[0].attrs["axis"])
                # the LSE output has the scores' leading dims: broadcast the reference to them
                ref.outputs["lse"] = lse
        return ref

    def compare(self, func: Func, tol: float = 1e-7) -> list[str]:
        """Problems found running `func` on the reference inputs (empty when the numbers match)."""
        outs = Interpreter("f64").run(func, self.inputs, self.env)
        problems = []
        for name, got in zip(func.result_names, outs):
            want = self.outputs.get(name)
            if want is None:
                continue
            got = np.asarray(got, dtype=np.float64)
            want = np.broadcast_to(np.asarray(want, dtype=np.float64), got.shape) if want.size != got.size \
                else np.asarray(want, dtype=np.float64).reshape(got.shape)
            if np.isnan(got).any() and not np.isnan(want).any():
                problems.append(f"output {name} has NaN where the reference has none")
                continue
            same_inf = np.array_equal(np.isinf(got) & (got > 0), np.isinf(want) & (want > 0)) and \
                np.array_equal(np.isinf(got) & (got < 0), np.isinf(want) & (want < 0))
            if not same_inf:
                problems.append(f"output {name}: infinities differ from the reference")
                continue
            fin = np.isfinite(want)
            if fin.any():
                err = np.max(np.abs(got[fin] - want[fin]) / (1.0 + np.abs(want[fin])))
                if err > tol:
                    problems.append(f"output {name}: max error {err:.3g} > {tol:g}")
        return problems
