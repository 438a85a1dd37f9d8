"""`--check`: run the interpreter after every pass on random inputs and compare with the input graph.

Inputs are drawn with a fixed seed at sizes that are not multiples of any tile; integer tables (document
ids) include -1, which the examples use for padding tokens, so fully masked rows occur where a mask allows.
The reference is the input graph interpreted in float64; an output the input graph does not have (LSE,
added by online-softmax) is compared with the log-sum-exp of the input graph's softmax operand.

Gradients: when a pass (autodiff) turns the function into its joint forward + backward function (cotangent
arguments `d<result>`, gradient results `d<argument>`), every case draws its cotangents (standard normal)
and the check goes on. The pass that made the joint function is checked by an independent method, central
finite differences in float64 of the loss sum(result * cotangent), on the tiny cases (M, N <= 9; some are
added for it); its gradients, interpreted in float64, are then the reference for the passes after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

from ..errors import NaNError, ShapeError
from ..ir.core import Func
from ..ir.interp import Interpreter
from ..ir.types import int_range, is_float, numpy_dtype
from .autodiff import gradient_names, is_joint_of

DEFAULT_SHAPES = {"B": 2, "H": 3, "HKV": 2, "M": 77, "N": 93, "D": 16}

# How captured integer and boolean tables are drawn. Masks hide their bugs in data no one thinks of: ids that
# are sorted with a tail of padding (documents) but also unsorted, constant (every entry kept), all dropped,
# negative, positions (offsets, thresholds, nested gathers), ids in blocks that keep the last tile fully
# (the ragged-tile bug of issue 7 needs that), and the same blocks descending.
DATA_KINDS = ("sorted", "unsorted", "constant", "nothing", "blocks", "descending", "negative", "positions", "wide")


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


def random_inputs(func: Func, env: Mapping[str, int], seed: int = 0, kind: str = "sorted") -> list[np.ndarray]:
    """Inputs for `func` at sizes `env`: floats standard normal, captured tables drawn as `kind` says."""
    if kind not in DATA_KINDS:
        raise ValueError(f"unknown data kind {kind!r} (known: {', '.join(DATA_KINDS)})")
    rng = np.random.default_rng(seed)
    out = []
    for a in func.args:
        shape = a.type.concrete(env)
        if any(n <= 0 for n in shape):
            raise ShapeError(f"input %{a.name} would have shape {shape}: sizes must be positive")
        dt = a.type.dtype
        if is_float(dt):
            x = rng.standard_normal(shape)
            if a.name not in ("q", "k", "v", "do") and kind in ("constant", "wide"):
                x = np.full(shape, 0.5) if kind == "constant" else 10.0 * x
        elif dt == "bool":
            x = _bool_table(rng, shape, kind)
        else:
            x = _int_table(rng, shape, kind)
            if dt != "i32":  # an i8 table: the kind's values clipped to the type's range (order kept)
                lo, hi = int_range(dt)
                x = np.clip(x, lo, hi).astype(numpy_dtype(dt))
        out.append(x)
    return out


def _int_table(rng: np.random.Generator, shape: tuple[int, ...], kind: str = "sorted") -> np.ndarray:
    """An integer table of the given kind, varying along its last axis (the position axis)."""
    if not shape:  # a captured scalar (a window size, a prefix length)
        lo, hi = {"nothing": (0, 1), "negative": (-8, 0), "wide": (-100, 100), "positions": (1, 70)}.get(kind, (0, 4))
        return np.array(rng.integers(lo, hi), dtype=np.int32)
    n = shape[-1]
    pos = np.broadcast_to(np.arange(n), shape)
    if kind == "sorted":  # non-decreasing ids with a tail of -1 (padding tokens)
        x = np.sort(rng.integers(0, 4, size=shape), axis=-1)
        x[..., n - max(1, n // 8):] = -1
    elif kind == "unsorted":
        x = rng.integers(-1, 4, size=shape)
    elif kind == "constant":
        x = np.zeros(shape)
    elif kind == "nothing":
        x = np.full(shape, -1)
    elif kind == "blocks":  # 32 positions each, no padding: the last tile is kept whole
        x = pos // 32
    elif kind == "descending":
        x = (n - 1 - pos) // 32
    elif kind == "negative":
        x = rng.integers(-6, 0, size=shape)
    elif kind == "positions":
        x = pos.copy()
    else:  # wide
        x = rng.integers(-n, n + 1, size=shape)
    return np.asarray(x).astype(np.int32)


def _bool_table(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    if kind == "constant":
        return np.ones(shape, dtype=bool)
    if kind == "nothing":
        return np.zeros(shape, dtype=bool)
    if kind in ("blocks", "descending") and shape:
        return np.broadcast_to((np.arange(shape[-1]) // 32) % 2 == (kind == "blocks"), shape).copy()
    p = {"sorted": 0.7, "unsorted": 0.5, "negative": 0.1, "positions": 0.95, "wide": 0.3}.get(kind, 0.5)
    return rng.random(shape) < p


def edge_sizes(tiles: Iterable[int] = ()) -> list[tuple[int, int]]:
    """(M, N) pairs where tiling bugs hide: 1, 2, a tile minus one, a tile, a tile plus one (for every tile
    size of the pipeline), odd sizes, and M != N both ways."""
    ts = sorted({int(t) for t in tiles if t and t > 2} or {64})
    square = {1, 2}
    for t in ts:
        square |= {t - 1, t, t + 1}
    t0 = ts[0]
    pairs = [(n, n) for n in sorted(square)]
    pairs += [(2, t0 + 1), (t0 + 1, 2), (t0 - 1, 2 * t0 + 3), (2 * t0 + 3, t0 - 1), (1, ts[-1] + 1)]
    return pairs


def reference_bytes(func: Func, env: Mapping[str, int]) -> int:
    """What interpreting `func` in float64 holds at once, about: the interpreter keeps every top-level value
    (inputs and op results, the [B,H,M,N] scores among them) until the function returns."""
    total = 0
    values = list(func.args) + [r for op in func.body.ops for r in op.results]
    for v in values:
        try:
            shape = v.type.concrete(env)
        except Exception:  # a dim only a loop knows: not a whole tensor
            continue
        total += int(np.prod(shape, dtype=np.float64)) * 8
    return total


def available_bytes() -> int:
    """Memory the OS says is available (MemAvailable), or a generous guess where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 << 30


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000:
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} EB"


def refuse_if_too_large(func: Func, env: Mapping[str, int]) -> None:
    """A clear one-line error before numpy tries to allocate more than the machine has."""
    need, have = reference_bytes(func, env), available_bytes()
    if need > 0.8 * have:
        sizes = ",".join(f"{k}={v}" for k, v in env.items())
        raise ShapeError(f"running @{func.name} at {sizes} needs about {_human(need)} of memory for the float64 "
                         f"reference, and {_human(have)} is available: choose smaller --shapes")


def uses_tables(func: Func) -> bool:
    """Whether `func` reads captured integer or boolean tables (then the data kinds matter)."""
    return any(not is_float(a.type.dtype) for a in func.args)


def logsumexp_rows(x: np.ndarray, axis: int) -> np.ndarray:
    with np.errstate(all="ignore"):
        m = np.max(x, axis=axis, keepdims=True)
        ms = np.where(np.isneginf(m), 0.0, m)
        s = np.sum(np.exp(x - ms), axis=axis, keepdims=True)
        r = np.where(s == 0, -np.inf, ms + np.log(s))
    return np.squeeze(r, axis=axis)


# Finite differences: the step, the tolerance they are held to (their own error is about 1e-9 here), and the
# sizes at which they are affordable (two interpretations of the graph per float input element).
FD_STEP = 1e-6
FD_TOL = 1e-6
FD_MAX_MN = 9
FD_MAX_ELEMENTS = 4000
# the cases added for finite differences: (M, N) pairs, and small batch, head and head-dim sizes (the rules
# do not depend on them; the other cases keep the sizes the user gave)
FD_SIZES = ((9, 7), (6, 9))
FD_DIMS = {"B": 1, "H": 2, "HKV": 1, "D": 4}


def finite_differences(func: Func, inputs: Sequence[np.ndarray], cotangents: Sequence[np.ndarray],
                       env: Mapping[str, int], step: float = FD_STEP) -> list[np.ndarray]:
    """Central differences in float64 of sum(result * cotangent) over the float results, with respect to
    every float input, in argument order (what the joint function's gradients should be). An entry where the
    loss is not differentiable (its one-sided differences disagree: a step, as `kv * 0.5 > thr` with thr on 0.5,
    or a kink) is NaN, which the comparison leaves out: no derivative there to check (once a false failure)."""
    it = Interpreter("f64")
    floats = [i for i, a in enumerate(func.args) if is_float(a.type.dtype)]
    results = [i for i, v in enumerate(func.results) if is_float(v.type.dtype)]

    def loss(xs: list[np.ndarray]) -> float:
        outs = it.run(func, xs, env)
        return float(sum(np.sum(outs[i] * ct) for i, ct in zip(results, cotangents)))

    xs = [np.array(x, dtype=np.float64) if x.dtype.kind == "f" else x for x in inputs]
    here = loss(xs)
    grads = []
    for i in floats:
        x = xs[i]
        d = np.zeros(x.shape)
        for idx in np.ndindex(*x.shape):
            keep = x[idx]
            x[idx] = keep + step
            up = loss(xs)
            x[idx] = keep - step
            down = loss(xs)
            x[idx] = keep
            d[idx] = (up - down) / (2 * step)
            right, left = (up - here) / step, (here - down) / step  # agree to ~step * |f''| where smooth
            if abs(right - left) > 1e-2 * (1.0 + abs(d[idx])):
                d[idx] = np.nan
        grads.append(d)
    return grads


@dataclass
class Reference:
    """One check case: sizes, inputs, and the float64 outputs of the input graph on them. Once a pass has
    made the joint function, also its cotangents and the reference gradients (keyed `d<argument>`)."""

    func: Func
    env: dict[str, int]
    inputs: list[np.ndarray]
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    label: str = ""
    seed: int = 0
    cotangents: list[np.ndarray] = field(default_factory=list)
    cotangent_names: list[str] = field(default_factory=list)
    gradients: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def build(cls, func: Func, shapes: Optional[Mapping[str, int]] = None, seed: int = 0,
              inputs: Optional[list[np.ndarray]] = None, kind: str = "sorted") -> "Reference":
        """The float64 outputs of `func` (and the LSE of its softmax) on random inputs, or on `inputs`.

        Raises NaNError when the graph itself produces NaN: a pass cannot be checked against that."""
        env = bind_dims(func, shapes)
        if inputs is None:
            refuse_if_too_large(func, env)
            inputs = random_inputs(func, env, seed, kind)
        inputs = [x.astype(np.float64) if x.dtype.kind == "f" else x for x in inputs]
        label = ",".join(f"{k}={env[k]}" for k in ("M", "N") if k in env)
        label += f" {kind} data" if uses_tables(func) else ""
        ref = cls(func, env, inputs, label=label, seed=seed)
        it = Interpreter("f64")
        outs = it.run(func, inputs, env)
        ref.outputs = dict(zip(func.result_names, outs))
        nan_report(func, ref.outputs, it, label)
        sm = [op for op in func.walk() if op.name == "softmax"]
        if not sm and "lse" not in ref.outputs:  # a softmax written by hand: its LSE from the op it is taken as
            from ..ir.core import clone_func
            from .raise_forms import raise_written_forms

            raised = clone_func(func)
            if raise_written_forms(raised):
                sm = [op for op in raised.walk() if op.name == "softmax"]
                it = Interpreter("f64")
                it.run(raised, inputs, env)
        if len(sm) == 1 and "lse" not in ref.outputs:
            x = it.top_env.get(sm[0].operands[0])
            if x is not None:
                lse = logsumexp_rows(np.asarray(x, dtype=np.float64), sm[0].attrs["axis"])
                # the LSE output has the scores' leading dims: broadcast the reference to them
                ref.outputs["lse"] = lse
        return ref

    def compare(self, func: Func, tol: float = 1e-7) -> list[str]:
        """Problems found running `func` on the reference inputs (empty when the numbers match); a joint
        function also gets the cotangents, and its gradients are compared with `gradients`."""
        outs = Interpreter("f64").run(func, self.inputs_for(func), self.env)
        problems = []
        for name, got in zip(func.result_names, outs):
            want = self.outputs.get(name, self.gradients.get(name))
            if want is None:
                continue
            p = _compare_output(name, got, want, tol)
            if p is not None:
                problems.append(p)
        return [f"{self.label}: {p}" if self.label else p for p in problems]

    # ---------------------------------------------------------------------------------- gradients
    def inputs_for(self, func: Func) -> list[np.ndarray]:
        """The inputs `func` takes, by name: the reference inputs; for a joint function of the input graph, the
        cotangents too (drawn standard normal, once per case, from the case's seed); for a function that takes
        what a forward saved for its backward (O, LSE), the reference's outputs of those names."""
        names = [a.name for a in func.args]
        primal = [a.name for a in self.func.args]
        if names == primal:
            return self.inputs
        if names[:len(primal)] == primal and is_joint_of(func, self.func):
            if not self.cotangents:
                rng = np.random.default_rng([self.seed, 1])
                self.cotangents = [rng.standard_normal(a.type.concrete(self.env)) for a in func.args[len(primal):]]
                self.cotangent_names = names[len(primal):]
            return self.inputs + self.cotangents
        if not self.cotangents and any(a.name not in primal and a.name not in self.outputs for a in func.args):
            self._draw_cotangents()  # a backward function (fa2-bwd's) takes `do` before any joint was seen
        given = dict(zip(primal, self.inputs))
        given.update(zip(self.cotangent_names, self.cotangents))
        out = []
        for a in func.args:
            if a.name in given:
                out.append(given[a.name])
            elif a.name in self.outputs:
                have, want = np.asarray(self.outputs[a.name], dtype=np.float64), a.type.concrete(self.env)
                if have.size != int(np.prod(want)):
                    raise ShapeError(f"--check cannot supply input %{a.name} of @{func.name}: it takes "
                                     f"{list(want)}, the checked graph's {a.name} is {list(have.shape)}")
                out.append(have.reshape(want))
            else:
                raise ShapeError(f"--check cannot supply input %{a.name} of @{func.name}: neither an input, a "
                                 f"cotangent nor an output of the graph it is checked against")
        return out

    def _draw_cotangents(self) -> None:
        """The cotangents a joint function of the input graph would take (`d<result>` of its float results, in order),
        drawn as `inputs_for` draws them for the joint: the same numbers whichever function asks first."""
        rng = np.random.default_rng([self.seed, 1])
        res = [(n, v) for n, v in zip(self.func.result_names, self.func.results) if is_float(v.type.dtype)]
        self.cotangents = [rng.standard_normal(v.type.concrete(self.env)) for _, v in res]
        self.cotangent_names = [f"d{n}" for n, _ in res]

    def adopt_gradients(self, joint: Func, tol: float = 1e-7, finite: bool = False) -> list[str]:
        """Check the first joint function on this case and take its float64 gradients as the reference for
        the passes after it. Its outputs must match the input graph's; its gradients must have no NaN, be 0
        on the rows of q that are fully masked (where the LSE is -inf), and, with `finite`, match central
        finite differences of the input graph."""
        outs = dict(zip(joint.result_names, Interpreter("f64").run(joint, self.inputs_for(joint), self.env)))
        names = gradient_names(self.func)
        problems = [p for n, want in self.outputs.items() if n in outs
                    for p in [_compare_output(n, outs[n], want, tol)] if p is not None]
        for n in names:
            got = np.asarray(outs[n], dtype=np.float64)
            if np.isnan(got).any():
                problems.append(f"gradient {n} has NaN at {_first_index(np.isnan(got))}")
        lse, dq = self.outputs.get("lse"), outs.get("dq")
        if not problems and lse is not None and dq is not None and np.shape(dq)[:np.ndim(lse)] == np.shape(lse):
            bad = np.isneginf(lse) & np.any(np.asarray(dq) != 0, axis=-1)
            if bad.any():
                problems.append(f"gradient dq is not 0 on a fully masked row, at {_first_index(bad)}")
        if not problems and finite:
            fd = finite_differences(self.func, self.inputs, self.cotangents, self.env)
            for n, want in zip(names, fd):
                p = _compare_output(n, outs[n], want, FD_TOL)
                if p is not None:
                    problems.append(f"{p} (reference: finite differences)")
        if not problems:
            self.gradients = {n: np.asarray(outs[n], dtype=np.float64) for n in names}
        return [f"{self.label}: {p}" if self.label else p for p in problems]

    def affordable_by_finite_differences(self) -> bool:
        elems = sum(x.size for x, a in zip(self.inputs, self.func.args) if is_float(a.type.dtype))
        return all(self.env.get(d, 1) <= FD_MAX_MN for d in ("M", "N")) and elems <= FD_MAX_ELEMENTS


def _compare_output(name: str, got: np.ndarray, want: np.ndarray, tol: float) -> Optional[str]:
    """What is wrong with output `name` (None when it matches `want` within `tol`, relative to 1 + |want|)."""
    got = np.asarray(got, dtype=np.float64)
    want = np.broadcast_to(np.asarray(want, dtype=np.float64), got.shape) if want.size != got.size \
        else np.asarray(want, dtype=np.float64).reshape(got.shape)
    if np.isnan(got).any() and not np.isnan(want).any():
        return f"output {name} has NaN at {_first_index(np.isnan(got))} where the reference has none"
    same_inf = np.array_equal(np.isinf(got) & (got > 0), np.isinf(want) & (want > 0)) and \
        np.array_equal(np.isinf(got) & (got < 0), np.isinf(want) & (want < 0))
    if not same_inf:
        bad = (np.isinf(got) != np.isinf(want)) | (np.isinf(got) & np.isinf(want) & (got != want))
        return f"output {name}: infinities differ from the reference at {_first_index(bad)}"
    fin = np.isfinite(want)
    if fin.any():
        rel = np.where(fin, np.abs(got - np.where(fin, want, 0)) / (1.0 + np.abs(np.where(fin, want, 0))), 0)
        err = float(np.max(rel))
        if err > tol:
            return f"output {name}: max error {err:.3g} > {tol:g} at {_first_index(rel == err)}"
    return None


@dataclass
class CheckSuite:
    """The cases `--check` runs every pass on: the given (or default) sizes with sorted tables, then every
    edge size of the pipeline's tiles, each with two data kinds in turn, so that every kind meets ragged
    and exact tiles. Sizes the user gave are kept; only M and N are varied."""

    cases: list[Reference]
    given: dict[str, int] = field(default_factory=dict)  # the sizes the user gave
    joint: bool = False  # whether a pass has made the joint function (the cases then hold gradients)
    finite_difference_cases: int = 0  # how many cases checked the joint function by finite differences

    @classmethod
    def build(cls, func: Func, shapes: Optional[Mapping[str, int]] = None, tiles: Iterable[int] = (),
              seed: int = 0) -> "CheckSuite":
        given = dict(shapes or {})
        cases = [Reference.build(func, given, seed)]
        env = cases[0].env
        varied = [d for d in ("M", "N") if d in env and d not in given]
        if not varied:
            kinds = DATA_KINDS[1:] if uses_tables(func) else ()
            cases += [Reference.build(func, given, seed + 1 + i, kind=k) for i, k in enumerate(kinds)]
            return cls(cases, given)
        kinds = DATA_KINDS if uses_tables(func) else ("sorted",)
        per_size = 2 if len(kinds) > 1 else 1
        i = 0
        for m, n in edge_sizes(tiles):
            size = dict(given)
            if "M" in varied:
                size["M"] = m
            if "N" in varied:
                size["N"] = n
            for _ in range(per_size):
                cases.append(Reference.build(func, size, seed + 1 + i, kind=kinds[i % len(kinds)]))
                i += 1
        return cls(cases, given)

    @property
    def env(self) -> dict[str, int]:
        return self.cases[0].env

    def describe(self) -> str:
        """`27 cases: M x N in 77x93, 1x1, ...; 9 data kinds` (for the --check summary)."""
        sizes = list(dict.fromkeys(f"{c.env.get('M', '-')}x{c.env.get('N', '-')}" for c in self.cases))
        kinds = {c.label.split(" ", 1)[1] for c in self.cases if " " in c.label}
        data = f"; {len(kinds)} data kinds" if kinds else ""
        grads = f"; gradients: finite differences on {self.finite_difference_cases} of them" \
            if self.finite_difference_cases else ""
        return f"{len(self.cases)} cases: M x N in {', '.join(sizes)}{data}{grads}"

    def compare(self, func: Func, tol: float = 1e-7) -> list[str]:
        """Problems of the first failing case (later cases are not run once one fails). The first joint
        function is checked by `start_gradients` instead."""
        primal = self.cases[0].func
        if not self.joint and len(func.args) > len(primal.args) and is_joint_of(func, primal):
            return self.start_gradients(func, tol)
        for case in self.cases:
            problems = case.compare(func, tol)
            if problems:
                return problems
        return []

    def start_gradients(self, joint: Func, tol: float = 1e-7) -> list[str]:
        """Check the pass that made `joint`, the joint function of the input graph: every case's outputs and
        NaN-free gradients, and, on the tiny cases (some added here, at FD_SIZES), gradients equal to finite
        differences. Its gradients are then the reference of the passes after it."""
        self.joint = True
        primal = self.cases[0].func
        kinds = ("sorted", "unsorted") if uses_tables(primal) else ("sorted",)
        seed = max(c.seed for c in self.cases) + 1
        for m, n in FD_SIZES:
            for kind in kinds:
                size = {**self.given, **FD_DIMS, "M": m, "N": n}
                self.cases.append(Reference.build(primal, size, seed, kind=kind))
                seed += 1
        self.finite_difference_cases = 0
        for case in self.cases:
            finite = case.affordable_by_finite_differences()
            problems = case.adopt_gradients(joint, tol, finite=finite)
            if problems:
                return problems
            self.finite_difference_cases += finite
        return []


def _first_index(mask: np.ndarray) -> str:
    idx = np.argwhere(mask)
    return "[" + ", ".join(str(int(i)) for i in idx[0]) + "]" if len(idx) else "?"


def nan_report(func: Func, outputs: Mapping[str, np.ndarray], it: Interpreter, label: str = "") -> None:
    """Raise NaNError naming the output, the place and the op that first made NaN from NaN-free operands."""
    for name, x in outputs.items():
        x = np.asarray(x)
        if x.dtype.kind == "f" and np.isnan(x).any():
            where = f" ({label})" if label else ""
            culprit = ""
            for op in func.body.ops:
                res = [it.top_env.get(r) for r in op.results]
                if any(r is not None and np.asarray(r).dtype.kind == "f" and np.isnan(r).any() for r in res):
                    if not any(np.asarray(it.top_env.get(v, 0.0)).dtype.kind == "f" and
                               np.isnan(it.top_env.get(v, 0.0)).any() for v in op.operands):
                        culprit = f"; the first op to make NaN is '{op.name}'"
                        names = [r.name for r in op.results if r.name]
                        culprit += f" (%{names[0]})" if names else ""
                        break
            raise NaNError(f"the graph itself produces NaN at {name}{_first_index(np.isnan(x))}{where}{culprit}: "
                           "a score or mask function that is NaN on some input (log of a negative score?) "
                           "cannot be checked")
