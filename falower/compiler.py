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
    `backward(q, k, v, o, lse, do, *captures)` returns the gradients (dq, dk, dv, then one per float
    capture) from the backward pipeline's kernels; torch tensors that require grad make the call
    differentiable (`falower.autograd`), so `loss.backward()` runs those kernels.
    """

    def __init__(self, func: Func, lowered: Func, backend: str, path: str = "auto", num_warps: Optional[int] = None,
                 extra: Optional[dict] = None, backward_pipeline: str = "fa2-bwd"):
        self.func, self.lowered, self.backend = func, lowered, backend
        self.path, self.num_warps, self.extra = path, num_warps, dict(extra or {})
        self.backward_pipeline = backward_pipeline
        self._lowered_bwd: Optional[Func] = None
        self._bwd_analysis: Any = None
        self._kernels: dict[tuple, Any] = {}
        self._bwd_kernels: dict[tuple, Any] = {}
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
        if _wants_grad(inputs):
            from .autograd import differentiable_call

            return differentiable_call(self, inputs)
        return self.forward(*inputs)

    def forward(self, *inputs: Any):
        """(o, lse) without autograd: the forward kernel (or the interpreter for the reference backend)."""
        if self.backend == "reference":
            arrays = [_host_array(x) for x in inputs]
            return tuple(Interpreter("native").run(self.lowered, arrays))
        k, env = self._kernel_and_dims(inputs)
        return k(inputs[0], inputs[1], inputs[2], *self._kernel_captures(inputs, env))

    # ------------------------------------------------------------------------------------ backward
    @property
    def lowered_backward(self) -> Func:
        """The backward function (the backward pipeline's IR, built on first use): it takes q, k, v, the
        captured tensors, o, lse and do, and returns dq, dk, dv and one gradient per float capture."""
        if self._lowered_bwd is None:
            self._lowered_bwd = run_pipeline(self.func, self.backward_pipeline)
        return self._lowered_bwd

    def gradient_names(self) -> list[str]:
        """Names of what backward() returns, in order: dq, dk, dv, d<capture> per float capture."""
        return list(self.lowered_backward.result_names)

    def backward(self, q: Any, k: Any, v: Any, o: Any, lse: Any, do: Any, *captures: Any) -> tuple:
        """Gradients (dq, dk, dv, *d<float capture>) of the forward's o, given the forward's o and lse and
        the cotangent do (all of one kind: torch CUDA tensors, CUDA arrays or numpy)."""
        inputs = (q, k, v, *captures)
        if len(inputs) != len(self.func.args):
            names = ", ".join(a.name or "?" for a in self.func.args[3:])
            raise ShapeError(f"backward of @{self.func.name} takes q, k, v, o, lse, do and {len(self.func.args) - 3} "
                             f"captured tensors ({names or 'none'}), got {len(captures)}")
        by_name = {a.name: x for a, x in zip(self.func.args, inputs)}
        by_name.update(o=o, lse=lse, do=do)
        bwd = self.lowered_backward
        ordered = [by_name[a.name] for a in bwd.args]
        if self.backend == "reference":
            arrays = [_host_array(x) for x in ordered]
            return tuple(Interpreter("native").run(bwd, arrays))
        kern, env = self._backward_kernel_and_dims(inputs)
        caps = [_scalar_if_0d(by_name[c.name]) for c in self._bwd_analysis.captures]
        caps += [int(env[d]) for d in kern.spec.dims]
        return kern(q, k, v, o, lse, do, *caps)

    def backward_kernel(self, *inputs: Any):
        """The FA2BackwardKernel these forward inputs' gradients would run (built on first use)."""
        return self._backward_kernel_and_dims(inputs)[0]

    def _backward_kernel_and_dims(self, inputs: tuple) -> tuple[Any, dict[str, int]]:
        env = self._dims(inputs)
        return self._backward_kernel_and_dims_for(_dtype_of(inputs[0]), env["D"]), env

    def _backward_kernel_and_dims_for(self, dtype: str, D: int):
        """The backward kernel for inputs of `dtype` and head dim D (built on first use)."""
        from .backends.numba_cuda.from_ir import BackendError
        from .backends.numba_cuda.from_ir_bwd import analyse_backward, build_backward_spec
        from .backends.numba_cuda.runtime import FA2BackwardKernel

        if self.backend != "numba-cuda":
            raise FalowerError("only the numba-cuda backend builds kernels")
        env = {"D": D}
        path = self.path
        if path == "auto":
            path = "mma" if dtype in ("f16", "bf16") and env["D"] % 16 == 0 else "simt"
        key = (dtype, path, env["D"])
        if key not in self._bwd_kernels:
            if self._bwd_analysis is None:
                self._bwd_analysis = analyse_backward(self.lowered_backward)
            # the backward's warps follow its kv tile (16 kv rows a warp); num_warps is the forward's
            spec = build_backward_spec(self._bwd_analysis, {"D": env["D"]}, dtype, path, None, self.extra)
            try:
                kern = FA2BackwardKernel(spec)
            except ValueError as e:
                raise BackendError(f"numba-cuda backend: {e} (backward tiles {spec.block_q}x{spec.block_k}, "
                                   f"D = {spec.head_dim}, {path} path)") from None
            level = debug_level()
            if level >= 3:
                print(f"[falower] backward kernel {spec.name}:\n{kern.source}", file=sys.stderr)
            self._bwd_kernels[key] = kern
        return self._bwd_kernels[key]

    def _kernel_captures(self, inputs: tuple, env: dict[str, int]) -> list:
        caps = [_scalar_if_0d(inputs[self.lowered.args.index(c)]) for c in self.analysis.captures]
        return caps + [int(env[d]) for d in self.analysis.runtime_dims]

    @property
    def source(self) -> str:
        """The generated kernel source of the most recent specialisation."""
        if not self._kernels:
            raise FalowerError("no kernel yet: call the compiled function once (or .kernel(*inputs))")
        return list(self._kernels.values())[-1].source


def _wants_grad(inputs: tuple) -> bool:
    """A torch tensor that requires grad, while grad mode is on: the call goes through autograd."""
    for x in inputs:
        if getattr(x, "requires_grad", False) and type(x).__module__.startswith("torch"):
            import torch

            return torch.is_grad_enabled()
    return False


def _host_array(x: Any) -> Any:
    """numpy view of an input for the reference backend (torch tensors are detached and copied to the host)."""
    if type(x).__module__.startswith("torch"):
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


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
            num_warps: Optional[int] = None, extra: Optional[dict] = None, backward: Optional[str] = None,
            deterministic: bool = False, **pipeline_kwargs: Any) -> CompiledAttention:
    """Lower `func` with `pipeline` and build it for `backend` ("numba-cuda" or "reference").

    The backward is lowered on first use with `backward` (default fa2-bwd: dQ by atomic adds, as
    FlashAttention-2), or fa2-bwd-deterministic with `deterministic=True` (no atomics: the same bits every run).
    """
    if backward is None:
        backward = "fa2-bwd-deterministic" if deterministic else "fa2-bwd"
    elif deterministic:
        raise FalowerError("give either backward=PIPELINE or deterministic=True, not both")
    if backend not in BACKENDS:
        raise FalowerError(f"unknown backend {backend!r} (known: {', '.join(BACKENDS)})")
    if path not in ("auto", "mma", "simt"):
        raise FalowerError(f"unknown path {path!r} (auto, mma or simt)")
    lowered = run_pipeline(func, pipeline, **pipeline_kwargs)
    return CompiledAttention(func, lowered, backend, path, num_warps, extra, backward_pipeline=backward)
