"""`falower.compile`: a graph in, a callable out. The graph is lowered (fa2-fwd by default) and handed to
a backend: "numba-cuda" (GPU kernels) or "reference" (the numpy interpreter, for checking)."""

from __future__ import annotations

import sys
from typing import Any, Optional

import numpy as np

from .errors import FalowerError, ShapeError
from .ir.core import Func
from .ir.dims import solve_dims
from .ir.interp import Interpreter
from .passes.manager import debug_level, run_pipeline

BACKENDS = ("numba-cuda", "reference")


class CompiledAttention:
    """Call with the graph's inputs (q, k, v, then captured tensors in signature order); returns (o, lse).

    The numba-cuda backend specialises on the head dim and dtype at the first call with them and caches
    the kernel; other sizes the score function reads (N for a relative bias) are run-time arguments.
    """

    def __init__(self, func: Func, lowered: Func, backend: str, path: str = "auto", num_warps: Optional[int] = None,
                 extra: Optional[dict] = None):
        self.func, self.lowered, self.backend = func, lowered, backend
        self.path, self.num_warps, self.extra = path, num_warps, dict(extra or {})
        self._kernels: dict[tuple, Any] = {}
        if backend == "numba-cuda":
            from .backends.numba_cuda.from_ir import analyse

            self.analysis = analyse(lowered)

    def _dims(self, inputs) -> dict[str, int]:
        pairs = []
        for a, x in zip(self.func.args, inputs):
            shape = tuple(int(n) for n in getattr(x, "shape", ()))  # a Python number is a 0-d input
            if len(shape) != a.type.rank:
                raise ShapeError(f"input %{a.name} must have rank {a.type.rank} ({a.type}), got shape {shape}")
            pairs += list(zip(a.type.shape, shape))
        return solve_dims(pairs, {})

    def kernel(self, *inputs: Any):
        """The FA2ForwardKernel these inputs would run (built on first use)."""
        return self._kernel_and_dims(inputs)[0]

    def _kernel_and_dims(self, inputs: tuple) -> tuple[Any, dict[str, int]]:
        if len(inputs) != len(self.func.args):
            names = ", ".join(a.name or "?" for a in self.func.args)
            raise ShapeError(f"@{self.func.name} takes {len(self.func.args)} inputs ({names}), got {len(inputs)}")
        dtype = _dtype_of(inputs[0])
        want = self.func.args[0].type.dtype
        if dtype != want:
            raise ShapeError(f"q has dtype {dtype} but the graph was traced for {want}")
        env = self._dims(inputs)
        return self.specialize(dtype, **env), env

    def specialize(self, dtype: str, **env: int):
        """The kernel for inputs of `dtype` and these sizes (D at least), without needing the inputs."""
        from .backends.numba_cuda.from_ir import BackendError, build_spec
        from .backends.numba_cuda.runtime import FA2ForwardKernel

        if self.backend != "numba-cuda":
            raise FalowerError("only the numba-cuda backend builds kernels")
        if "D" not in env:
            raise ShapeError("specialize needs the head dim D")
        path = self.path
        if path == "auto":
            path = "mma" if dtype in ("f16", "bf16") and env["D"] % 16 == 0 else "simt"
        used = {"D": env["D"]}  # other sizes reach the device functions as run-time arguments
        key = (dtype, path, tuple(used.items()))
        if key not in self._kernels:
            spec = build_spec(self.analysis, used, dtype, path, self.num_warps, self.extra)
            try:
                kern = FA2ForwardKernel(spec)
            except ValueError as e:  # the emitter cannot build this schedule (tile sizes, head dim)
                raise BackendError(f"numba-cuda backend: {e} (tiles {spec.block_q}x{spec.block_k}, "
                                   f"D = {spec.head_dim}, {path} path; choose tiles with tile{{bq=..,bk=..}})") from None
            level = debug_level()
            if level >= 3:
                print(f"[falower] kernel {spec.name}:\n{kern.source}", file=sys.stderr)
            if level >= 4:
                print(f"[falower] PTX of {spec.name}:\n{kern.ptx()}", file=sys.stderr)
            self._kernels[key] = kern
        return self._kernels[key]

    def __call__(self, *inputs: Any):
        if self.backend == "reference":
            arrays = [np.asarray(x) for x in inputs]
            return tuple(Interpreter("native").run(self.lowered, arrays))
        k, env = self._kernel_and_dims(inputs)
        caps = [_scalar_if_0d(inputs[self.lowered.args.index(c)]) for c in self.analysis.captures]
        caps += [int(env[d]) for d in self.analysis.runtime_dims]
        return k(inputs[0], inputs[1], inputs[2], *caps)

    @property
    def source(self) -> str:
        """The generated kernel source of the most recent specialisation."""
        if not self._kernels:
            raise FalowerError("no kernel yet: call the compiled function once (or .kernel(*inputs))")
        return list(self._kernels.values())[-1].source


def _scalar_if_0d(x: Any) -> Any:
    """A captured scalar reaches the kernel as a scalar argument: its value changes, the kernel does not
    (a 0-d torch tensor on the GPU is read back once, a synchronisation)."""
    shape = getattr(x, "shape", None)
    if shape is not None and len(shape) == 0:
        return x.item()
    return x


def _dtype_of(x: Any) -> str:
    s = str(getattr(x, "dtype", "")).replace("torch.", "")
    return {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}.get(s, s)


def compile(func: Func, backend: str = "numba-cuda", pipeline: str = "fa2-fwd", path: str = "auto",
            num_warps: Optional[int] = None, extra: Optional[dict] = None, **pipeline_kwargs: Any) -> CompiledAttention:
    """Lower `func` with `pipeline` and build it for `backend` ("numba-cuda" or "reference")."""
    if backend not in BACKENDS:
        raise FalowerError(f"unknown backend {backend!r} (known: {', '.join(BACKENDS)})")
    if path not in ("auto", "mma", "simt"):
        raise FalowerError(f"unknown path {path!r} (auto, mma or simt)")
    lowered = run_pipeline(func, pipeline, **pipeline_kwargs)
    return CompiledAttention(func, lowered, backend, path, num_warps, extra)
