"""Compile, cache and launch the generated FA2 kernels.

The emitted source is written to `<cache dir>/<name>_<sha256[:16]>.py` (default cache dir
`~/.cache/falower/kernels`, override with `FALOWER_CACHE_DIR`) and imported from there, so Numba's
`cache=True` can keep the compiled kernel next to it and a second process skips compilation.

    kern = FA2ForwardKernel(spec)
    o, lse = kern(q, k, v, *captures)     # torch CUDA tensors, CUDA-array-interface arrays or numpy

Inputs are checked before anything is launched; a wrong dtype, rank, shape, layout or device raises a
one-line ValueError / TypeError.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from .emit_fa2 import emit_block_mask, emit_fa2_forward, grid, smem_bytes, threads_per_block
from .emit_fa2_bwd import bwd_grid, bwd_smem_bytes, bwd_threads, dq_grid, dq_smem_bytes, dq_threads
from .spec import FA2BackwardSpec, FA2ForwardSpec

__all__ = ["FA2BackwardKernel", "FA2ForwardKernel", "cache_dir", "load_source", "ptx_of", "resource_usage"]

_NP_DTYPES = {"f16": np.float16, "f32": np.float32, "f64": np.float64}


def _acc_np(dtype: str):
    """numpy type of the f32 statistics and accumulators (lse, delta, dQ, tables' gradients); f64 for f64."""
    return np.float64 if dtype == "f64" else np.float32


def _acc_torch(dtype: str):
    import torch

    return torch.float64 if dtype == "f64" else torch.float32


def cache_dir() -> Path:
    d = os.environ.get("FALOWER_CACHE_DIR")
    return Path(d) if d else Path.home() / ".cache" / "falower" / "kernels"


def load_source(source: str, stem: str) -> Any:
    """Write `source` to a content-addressed file under cache_dir() and import it as a module."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stem}_{digest}.py"
    if not path.exists() or path.read_text() != source:
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    modname = f"falower_kernels.{stem}_{digest}"
    if modname in sys.modules:
        return sys.modules[modname]
    spec = importlib.util.spec_from_file_location(modname, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[modname] = module
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------------
# Array handling
# --------------------------------------------------------------------------------------------------


def _kind(x: Any) -> str:
    mod = type(x).__module__
    if mod.startswith("torch"):
        return "torch"
    if isinstance(x, np.ndarray):
        return "numpy"
    if hasattr(x, "__cuda_array_interface__"):
        return "cai"
    raise TypeError(f"expected a torch tensor, a CUDA array or a numpy array, got {type(x).__name__}")


def _dtype_name(x: Any, kind: str) -> str:
    if kind == "torch":
        import torch

        return {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32",
                torch.float64: "f64"}.get(x.dtype, str(x.dtype))
    dt = np.dtype(x.dtype) if kind == "numpy" else np.dtype(x.__cuda_array_interface__["typestr"])
    if dt.name == "bfloat16" or dt == np.dtype(np.uint16):  # ml_dtypes.bfloat16, or raw bf16 bits
        return "bf16"
    return {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}.get(dt, str(dt))


def _is_contiguous(x: Any, kind: str) -> bool:
    if kind == "torch":
        return x.is_contiguous()
    if kind == "numpy":
        return x.flags.c_contiguous
    cai = x.__cuda_array_interface__
    strides = cai.get("strides")
    if strides is None:
        return True
    item = np.dtype(cai["typestr"]).itemsize
    expect, acc = [], item
    for n in reversed(cai["shape"]):
        expect.append(acc)
        acc *= n
    return tuple(strides) == tuple(reversed(expect))


def _device_id(x: Any, kind: str) -> int | None:
    if kind == "torch":
        return x.device.index if x.is_cuda else None
    return -1 if kind == "cai" else None


class FA2ForwardKernel:
    """One compiled FA2 forward kernel for `spec`.

    Attributes: `spec`, `source` (the generated module), `mask_source` (block-mask kernel, table mode).
    """

    def __init__(self, spec: FA2ForwardSpec) -> None:
        self.spec = spec
        self.source = emit_fa2_forward(spec)
        self.mask_source = emit_block_mask(spec) if spec.block_mask == "table" else None
        self._module = load_source(self.source, spec.name)
        self._kernel = getattr(self._module, spec.name)
        self._mask_kernel = None
        if self.mask_source is not None:
            mod = load_source(self.mask_source, spec.name + "_block_mask")
            self._mask_kernel = getattr(mod, spec.name + "_block_mask")
        self.threads = threads_per_block(spec)
        self.smem = smem_bytes(spec)
        self._smem_set: set[tuple] = set()

    # ---------------------------------------------------------------------------- user helpers
    def print_kernel(self) -> None:
        print(self.source)
        if self.mask_source:
            print(self.mask_source)

    def argtypes(self) -> tuple:
        """Numba argument types of the forward kernel (flat contiguous arrays, int64 sizes)."""
        from numba import types

        s = self.spec
        elem = {"f32": types.float32, "f64": types.float64}.get(s.dtype, types.int16)
        acc = types.float64 if s.dtype == "f64" else types.float32
        arr = lambda t: types.Array(t, 1, "C")  # noqa: E731
        o = arr(types.int32) if s.path == "mma" else arr(elem)
        args = [arr(elem), arr(elem), arr(elem), o, arr(acc)] + [types.int64] * (4 + 9)
        if s.block_mask == "table":
            args.append(arr(types.int8))
        args += _capture_types(s)
        return tuple(args)

    def ptx(self, cc: tuple[int, int] = (9, 0)) -> str:
        """PTX of the forward kernel for compute capability `cc` (no GPU needed)."""
        return ptx_of(self._kernel, self.argtypes(), cc)

    # ---------------------------------------------------------------------------- checking
    def _check(self, q: Any, k: Any, v: Any, captures: tuple) -> str:
        s = self.spec
        kinds = {_kind(q), _kind(k), _kind(v)}
        if len(kinds) != 1:
            raise TypeError(f"q, k, v must be the same kind of array, got {sorted(kinds)}")
        kind = kinds.pop()
        for name, x in (("q", q), ("k", k), ("v", v)):
            dt = _dtype_name(x, kind)
            if dt != s.dtype:
                raise TypeError(f"{name} has dtype {dt}, this kernel was built for {s.dtype}")
            if len(x.shape) != 4:
                raise ValueError(f"{name} must be 4-D [B, heads, seq, D], got shape {tuple(x.shape)}")
            if kind == "torch" and x.shape[3] > 1 and x.stride(3) != 1:
                raise ValueError(f"the last dimension of {name} must be contiguous (stride 1), got strides "
                                 f"{tuple(x.stride())}")
            if kind == "numpy" and x.shape[3] > 1 and x.strides[3] != x.itemsize:
                raise ValueError(f"the last dimension of {name} must be contiguous, got strides {x.strides}")
            if kind == "cai" and not _is_contiguous(x, kind):
                raise ValueError(f"{name} must be contiguous (row-major); call .contiguous() first")
        if kind == "torch":
            devs = {x.device for x in (q, k, v)}
            if len(devs) != 1 or not q.is_cuda:
                raise ValueError(f"q, k, v must be on one CUDA device, got {sorted(str(d) for d in devs)}")
        B, H, M, D = (int(n) for n in q.shape)
        Bk, Hk, N, Dk = (int(n) for n in k.shape)
        if tuple(int(n) for n in v.shape) != (Bk, Hk, N, Dk):
            raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
        if D != s.head_dim or Dk != s.head_dim:
            raise ValueError(f"head dim must be {s.head_dim}, got q {D}, k {Dk}")
        if Bk != B:
            raise ValueError(f"batch of q ({B}) and k/v ({Bk}) differ")
        if Hk * s.group_size != H:
            raise ValueError(f"q has {H} heads, k/v {Hk}: expected {H} = {Hk} * group_size {s.group_size}")
        if M < 1 or N < 1 or B < 1 or H < 1:
            raise ValueError(f"empty input: B={B} H={H} M={M} N={N}")
        if len(captures) != len(s.captures):
            raise ValueError(f"expected {len(s.captures)} captured tensors, got {len(captures)}")
        for c, x in zip(s.captures, captures):
            if np.isscalar(x):
                continue
            ck = _kind(x)
            if ck != kind and not (kind != "numpy" and ck == "cai"):
                raise TypeError(f"capture {c.name} is a {ck} array, q/k/v are {kind}")
            if len(x.shape) != c.ndim:
                raise ValueError(f"capture {c.name} must be {c.ndim}-D, got shape {tuple(x.shape)}")
            if not _is_contiguous(x, ck):
                raise ValueError(f"capture {c.name} must be contiguous")
        return kind

    # ---------------------------------------------------------------------------- launching
    def _raise_smem_limit(self, kernel, args, smem: int) -> None:
        from numba import cuda

        if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
            return
        sig_key = (cuda.current_context().device.id,) + tuple(
            (type(a), getattr(a, "dtype", None), getattr(a, "ndim", None)) for a in args)
        if sig_key in self._smem_set:
            return
        from numba.cuda.cudadrv.driver import binding, driver

        # One compiled overload per argument-type tuple (torch tensors and Numba device arrays may
        # type differently), each with its own function handle: set the limit on the one we launch.
        compiled = kernel._compile_for_args(*args)
        cufunc = compiled._codelibrary.get_cufunc()
        key = (id(compiled), cufunc.device.id)
        if key in self._smem_set:
            self._smem_set.add(sig_key)
            return
        attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.cuKernelSetAttribute(attr, smem, cufunc.handle, cufunc.device.id)
        self._smem_set.add(key)
        self._smem_set.add(sig_key)  # the same argument kinds map to the same overload: skip next time

    def __call__(self, q: Any, k: Any, v: Any, *captures: Any):
        """Run the kernel; returns (o, lse) of the same kind as q (numpy in, numpy out)."""
        launch, finish = self.prepare(q, k, v, *captures, _wrap=False)
        launch()
        return finish()

    def block_table(self, q: Any, k: Any, v: Any, *captures: Any) -> np.ndarray:
        """The tile classes the block-mask kernel computes for these inputs, int8 [B, H, nq, nk] on the host:
        the same classes as the IR's `mask.block_table` (0 empty, 1 partial, 2 full; a ragged kv tile is
        never full). For tests, and for seeing which tiles a data-dependent mask visits."""
        if self._mask_kernel is None:
            raise ValueError(f"{self.spec.name}: no block table (its mask is not data-dependent)")
        launch, _ = self.prepare(q, k, v, *captures, _wrap=False)
        launch()
        table = launch.table  # type: ignore[attr-defined]
        host = table.copy_to_host() if hasattr(table, "copy_to_host") else table.cpu().numpy()
        B, H, M = (int(n) for n in q.shape[:3])
        return host.reshape(B, H, -(-M // self.spec.block_q), -(-int(k.shape[2]) // self.spec.block_k))

    def prepare(self, q: Any, k: Any, v: Any, *captures: Any, _wrap: bool = True):
        """Check and convert the inputs once; returns (launch, finish).

        `launch()` runs the block-mask kernel (table mode) and the forward kernel on the prepared
        buffers; `finish()` returns (o, lse). Calling `launch` repeatedly re-runs the kernels with
        the least host work, which is what the benchmark times.
        """
        from numba import cuda

        s = self.spec
        kind = self._check(q, k, v, captures)
        B, H, M, D = (int(n) for n in q.shape)
        N = int(k.shape[2])
        nq = -(-M // s.block_q)
        nk = -(-N // s.block_k)
        if kind == "torch":
            import torch

            # Numba device arrays launch faster than torch tensors (whose array interface Numba re-reads
            # at every launch) but cost a conversion each: worth it only for repeated launches.
            wrap = cuda.as_cuda_array if _wrap else (lambda t: t)
            bits = {"f32": torch.float32, "f64": torch.float64}.get(s.dtype, torch.int16)
            views = [_strided_view(x, bits, s.path == "mma") for x in (q, k, v)]
            flat = [wrap(f) for f, _ in views]
            strides = [n for _, st in views for n in st]
            o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            o_k = wrap(o.view(torch.int32 if s.path == "mma" else bits).reshape(-1))
            lse = torch.empty((B, H, M), dtype=_acc_torch(s.dtype), device=q.device)
            lse_k = wrap(lse.reshape(-1))
            caps = [wrap(x.detach()) if hasattr(x, "detach") else x for x in captures]
            table = (wrap(torch.empty(B * H * nq * nk, dtype=torch.int8, device=q.device))
                     if self._mask_kernel else None)
        else:
            bits = {"f32": np.float32, "f64": np.float64}.get(s.dtype, np.int16)

            def dev(x):
                if kind == "numpy":
                    return cuda.to_device(np.ascontiguousarray(x))
                return cuda.as_cuda_array(x)

            if kind == "numpy":  # bit patterns, viewed on the host (ml_dtypes.bfloat16 included)
                views = [_strided_view_np(x, bits) for x in (q, k, v)]
                flat = [cuda.to_device(f) for f, _ in views]
                strides = [n for _, st in views for n in st]
            else:
                flat = [cuda.as_cuda_array(x).reshape(-1).view(bits) for x in (q, k, v)]
                strides = [n for x in (q, k, v) for n in _contiguous_strides(x.shape)]
            o_k = cuda.device_array(B * H * M * D // 2 if s.path == "mma" else B * H * M * D,
                                    dtype=np.uint32 if s.path == "mma" else bits)
            lse_k = cuda.device_array(B * H * M, dtype=_acc_np(s.dtype))
            caps = [x if np.isscalar(x) else dev(x) for x in captures]
            table = cuda.device_array(B * H * nq * nk, dtype=np.int8) if self._mask_kernel else None

        sizes = [B, H, M, N]
        extra = [table] if table is not None else []
        args = [*flat, o_k, lse_k, *sizes, *strides, *extra, *caps]
        if self.smem > 48 * 1024:
            self._raise_smem_limit(self._kernel, args, self.smem)
        forward = self._kernel[grid(s, B, H, M, N), self.threads, 0, self.smem]
        block_mask = self._mask_kernel[(nk, nq, B * H), 128] if self._mask_kernel is not None else None
        mask_args = [table, *sizes, *caps]

        def launch() -> None:
            if block_mask is not None:
                block_mask(*mask_args)
            forward(*args)

        launch.table = table  # type: ignore[attr-defined]  # the block classes, filled by launch() (table mode)

        def finish():
            if kind == "torch":
                return o, lse
            if kind == "numpy":
                host = o_k.copy_to_host()
                out_dtype = np.dtype(q.dtype) if s.dtype == "bf16" else _NP_DTYPES[s.dtype]
                return host.view(out_dtype).reshape(B, H, M, D), lse_k.copy_to_host().reshape(B, H, M)
            out_dtype = np.dtype(q.__cuda_array_interface__["typestr"])
            return o_k.view(bits).view(out_dtype).reshape(B, H, M, D), lse_k.reshape(B, H, M)

        return launch, finish


def _contiguous_strides(shape) -> tuple[int, int, int]:
    """Element strides (batch, head, row) of a contiguous [B, H, N, D] array."""
    _, H, N, D = (int(n) for n in shape)
    return (H * N * D, N * D, D)


def _strided_view(x: Any, bits: Any, aligned: bool) -> tuple[Any, tuple[int, int, int]]:
    """A torch [B, H, N, D] view whose last dim is contiguous as (1-D view spanning its elements in `bits`,
    element strides (batch, head, row)): the kernels index b*sb + h*sh + r*sm + d, so a transposed
    [B, N, H, D] projection runs without a copy. The tensor-core path copies 16-byte rows with cp.async: rows
    whose start is not 16-byte aligned (a stride or offset not a multiple of 8 halves) are copied contiguous."""
    import torch

    x = x.detach()
    if aligned and (any(st % 8 for st in x.stride()[:3]) or x.data_ptr() % 16):
        x = x.clone(memory_format=torch.contiguous_format)
    xv = x.view(bits)
    span = 1 + sum((n - 1) * st for n, st in zip(xv.shape, xv.stride()))
    flat = torch.as_strided(xv, (span,), (1,), xv.storage_offset())
    return flat, tuple(int(st) for st in xv.stride()[:3])


def _strided_view_np(x: np.ndarray, bits: Any) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The numpy twin of _strided_view: the elements a [B, H, N, D] view spans, in bits, and its element
    strides (batch, head, row), so host arrays in a transposed layout take the same kernel path."""
    item = x.itemsize
    if any(st < 0 or st % item for st in x.strides):
        x = np.ascontiguousarray(x)
    span = 1 + sum((n - 1) * (st // item) for n, st in zip(x.shape, x.strides))
    flat = np.lib.stride_tricks.as_strided(x, (span,), (item,))
    return np.ascontiguousarray(flat).view(bits), tuple(int(st // item) for st in x.strides[:3])


def _capture_types(spec) -> list:
    """Numba types of a spec's captured tensors (and scalar sizes), as the kernels take them."""
    from numba import types

    capty = {"f16": types.float16, "bf16": types.int16, "f32": types.float32, "f64": types.float64,
             "i32": types.int32, "bool": types.boolean}
    return [types.Array(capty[c.dtype], c.ndim, "C") if c.ndim > 0 else capty[c.dtype] for c in spec.captures]


def _numel(x: Any) -> int:
    n = getattr(x, "size", None)
    if n is None or callable(n):
        return int(x.numel())
    return int(n)


def ptx_of(kernel, argtypes: tuple, cc: tuple[int, int] = (9, 0)) -> str:
    """PTX of a generated kernel. Works without a GPU: a device-function dispatcher asks the current
    device for its compute capability when it compiles, so with no driver we answer `cc` for it."""
    from numba import cuda
    import numba.cuda.dispatcher as dispatcher_module

    if cuda.is_available():
        ptx, _ = cuda.compile_ptx(kernel.py_func, argtypes, cc=cc)
        return ptx

    class _NoDevice:
        compute_capability = tuple(cc)

    original = dispatcher_module.get_current_device
    dispatcher_module.get_current_device = lambda: _NoDevice
    try:
        ptx, _ = cuda.compile_ptx(kernel.py_func, argtypes, cc=cc)
    finally:
        dispatcher_module.get_current_device = original
    return ptx


def resource_usage(ptx: str, arch: str = "sm_90") -> dict[str, int]:
    """Link PTX with nvJitLink (no GPU needed) and read registers / spills from its verbose log."""
    import re

    from cuda.bindings import nvjitlink

    handle = nvjitlink.create(2, [f"-arch={arch}", "-verbose"])
    try:
        data = ptx.encode()
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel.ptx")
        nvjitlink.complete(handle)
        size = nvjitlink.get_info_log_size(handle)
        buf = bytearray(size)
        nvjitlink.get_info_log(handle, buf)
        log = bytes(buf).decode(errors="replace")
    finally:
        nvjitlink.destroy(handle)
    out = {"log": log}
    m = re.search(r"Used (\d+) registers", log)
    out["registers"] = int(m.group(1)) if m else -1
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    out["spill_stores"], out["spill_loads"] = (int(m.group(1)), int(m.group(2))) if m else (-1, -1)
    m = re.search(r"(\d+) bytes stack frame", log)
    out["stack_frame"] = int(m.group(1)) if m else -1
    return out


class FA2BackwardKernel:
    """The compiled FA2 backward for `spec`: Delta (+ zeroed dQ accumulator), the block table of a data
    mask, the main kernel (kv tiles outer) and dQ's conversion, launched in that order.

    Attributes: `spec`, `source` (the main kernel's module), `delta_source`, `dq_source`, `mask_source`.
    """

    def __init__(self, spec: FA2BackwardSpec) -> None:
        from .emit_fa2_bwd import emit_delta, emit_dq_convert, emit_dq_kernel, emit_fa2_backward, emit_parts_sum

        self.spec = spec
        self.source = emit_fa2_backward(spec)
        self.delta_source = emit_delta(spec)
        # dq=atomic: the f32 accumulator's conversion; dq=separate: the q-outer dQ kernel
        self.dq_source = emit_dq_convert(spec) if spec.dq == "atomic" else emit_dq_kernel(spec)
        self.parts_source = emit_parts_sum(spec) if spec.deterministic and spec.grads else None
        self.mask_source = emit_block_mask(spec) if spec.block_mask == "table" else None  # type: ignore[arg-type]
        self._kernel = getattr(load_source(self.source, spec.name), spec.name)
        self._delta = getattr(load_source(self.delta_source, spec.name + "_delta"), spec.name + "_delta")
        dq_name = spec.name + ("_dq" if spec.dq == "atomic" else "_dqk")
        self._dq = getattr(load_source(self.dq_source, dq_name), dq_name)
        self._parts = None
        if self.parts_source is not None:
            self._parts = getattr(load_source(self.parts_source, spec.name + "_parts"), spec.name + "_parts")
        self._mask_kernel = None
        if self.mask_source is not None:
            mod = load_source(self.mask_source, spec.name + "_bwd_block_mask")
            self._mask_kernel = getattr(mod, spec.name + "_block_mask")
        self.threads = bwd_threads(spec)
        self.smem = bwd_smem_bytes(spec)
        self.dq_smem = dq_smem_bytes(spec) if spec.dq == "separate" else 0
        self._smem_set: set[tuple] = set()

    _raise_smem_limit = FA2ForwardKernel._raise_smem_limit

    def argtypes(self) -> tuple:
        """Numba argument types of the main kernel (flat contiguous arrays, int64 sizes)."""
        from numba import types

        s = self.spec
        elem = {"f32": types.float32, "f64": types.float64}.get(s.dtype, types.int16)
        acc = types.float64 if s.dtype == "f64" else types.float32
        arr = lambda t: types.Array(t, 1, "C")  # noqa: E731
        out = arr(types.int32) if s.path == "mma" else arr(elem)
        args = [arr(elem), arr(elem), arr(elem), arr(acc), arr(elem), arr(acc), arr(acc), out, out] + [types.int64] * 16
        if s.block_mask == "table":
            args.append(arr(types.int8))
        args += [arr(acc)] * len(s.grads)
        args += _capture_types(s)
        return tuple(args)

    def ptx(self, cc: tuple[int, int] = (9, 0)) -> str:
        """PTX of the main backward kernel for compute capability `cc` (no GPU needed)."""
        return ptx_of(self._kernel, self.argtypes(), cc)

    def __call__(self, q: Any, k: Any, v: Any, o: Any, lse: Any, do: Any, *captures: Any) -> tuple:
        """Gradients (dq, dk, dv, *captured tables' gradients), of the same kind as q."""
        launch, finish = self.prepare(q, k, v, o, lse, do, *captures)
        launch()
        return finish()

    def prepare(self, q: Any, k: Any, v: Any, o: Any, lse: Any, do: Any, *captures: Any):
        """Check and convert the inputs once; returns (launch, finish) as FA2ForwardKernel.prepare does."""
        from numba import cuda

        s = self.spec
        fwd_like = FA2ForwardKernel.__new__(FA2ForwardKernel)
        fwd_like.spec = s  # type: ignore[assignment]
        kind = FA2ForwardKernel._check(fwd_like, q, k, v, captures)  # type: ignore[arg-type]
        for name, x, like in (("o", o, q), ("do", do, q)):
            if tuple(int(n) for n in x.shape) != tuple(int(n) for n in like.shape):
                raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(x.shape)}")
            if _dtype_name(x, _kind(x)) != s.dtype:
                raise TypeError(f"{name} has dtype {_dtype_name(x, _kind(x))}, this kernel was built for {s.dtype}")
            if name == "o" and not _is_contiguous(x, _kind(x)):
                raise ValueError("o must be contiguous (the forward's output is); call .contiguous() first")
            if name == "do" and _kind(x) == "torch" and x.shape[3] > 1 and x.stride(3) != 1:
                raise ValueError(f"the last dimension of do must be contiguous (stride 1), got strides {tuple(x.stride())}")
            if name == "do" and _kind(x) == "cai" and not _is_contiguous(x, _kind(x)):
                raise ValueError("do must be contiguous (row-major); call .contiguous() first")
        B, H, M, D = (int(n) for n in q.shape)
        Hk, N = int(k.shape[1]), int(k.shape[2])
        if tuple(int(n) for n in lse.shape) != (B, H, M):
            raise ValueError(f"lse must have shape {(B, H, M)}, got {tuple(lse.shape)}")
        nq, nk = -(-M // s.block_q), -(-N // s.block_k)
        rows = B * H * M
        grad_caps = [captures[g.capture] for g in s.grads]
        if kind == "torch":
            import torch

            bits = {"f32": torch.float32, "f64": torch.float64}.get(s.dtype, torch.int16)
            pair = torch.int32 if s.path == "mma" else bits
            accd = _acc_torch(s.dtype)
            views = [_strided_view(x, bits, s.path == "mma") for x in (q, k, v, do)]
            flat = [f for f, _ in views] + [o.detach().view(bits).reshape(-1)]
            strides = [n for _, st in views for n in st]
            dev = q.device
            lse_k = lse.detach().reshape(-1)
            delta = torch.empty(rows, dtype=accd, device=dev)
            dq32 = torch.empty(rows * D, dtype=accd, device=dev)
            dq = torch.empty(q.shape, dtype=q.dtype, device=dev)
            dk = torch.empty(k.shape, dtype=k.dtype, device=dev)
            dv = torch.empty(v.shape, dtype=v.dtype, device=dev)
            dq_k, dk_k, dv_k = (x.view(pair).reshape(-1) for x in (dq, dk, dv))
            nblk = bwd_grid(s, B, H, M, N)[0] if s.deterministic else 1  # deterministic: one copy per block
            grads = [torch.zeros(nblk * int(np.prod(x.shape)), dtype=accd, device=dev) for x in grad_caps]
            sums = [torch.empty(int(np.prod(x.shape)), dtype=accd, device=dev) for x in grad_caps]
            caps = [x.detach() if hasattr(x, "detach") else x for x in captures]
            table = torch.empty(B * H * nq * nk, dtype=torch.int8, device=dev) if self._mask_kernel else None
        else:
            bits = {"f32": np.float32, "f64": np.float64}.get(s.dtype, np.int16)
            pair = np.uint32 if s.path == "mma" else bits
            accd = _acc_np(s.dtype)

            def dev_array(x):
                if kind == "numpy":
                    return cuda.to_device(np.ascontiguousarray(x))
                return cuda.as_cuda_array(x)

            if kind == "numpy":
                views = [_strided_view_np(x, bits) for x in (q, k, v, do)]
                flat = [cuda.to_device(f) for f, _ in views]
                flat.append(cuda.to_device(np.ascontiguousarray(o).reshape(-1).view(bits)))
                strides = [n for _, st in views for n in st]
                lse_k = cuda.to_device(np.ascontiguousarray(lse, dtype=accd).reshape(-1))
            else:
                flat = [cuda.as_cuda_array(x).reshape(-1).view(bits) for x in (q, k, v, do, o)]
                strides = [n for x in (q, k, v, do) for n in _contiguous_strides(x.shape)]
                lse_k = cuda.as_cuda_array(lse).reshape(-1)
            delta = cuda.device_array(rows, dtype=accd)
            dq32 = cuda.device_array(rows * D, dtype=accd)
            per = 2 if s.path == "mma" and s.dtype != "f32" else 1
            dq_k = cuda.device_array(rows * D // per, dtype=pair)
            dk_k = cuda.device_array(B * Hk * N * D // per, dtype=pair)
            dv_k = cuda.device_array(B * Hk * N * D // per, dtype=pair)
            nblk = bwd_grid(s, B, H, M, N)[0] if s.deterministic else 1  # deterministic: one copy per block
            grads = [cuda.to_device(np.zeros(nblk * int(np.prod(x.shape)), dtype=accd)) for x in grad_caps]
            sums = [cuda.device_array(int(np.prod(x.shape)), dtype=accd) for x in grad_caps]
            caps = [x if np.isscalar(x) else dev_array(x) for x in captures]
            table = cuda.device_array(B * H * nq * nk, dtype=np.int8) if self._mask_kernel else None

        qf, kf, vf, dof, of = flat
        sizes = [B, H, M, N]
        extra = [table] if table is not None else []
        separate = s.dq == "separate"
        if separate:
            dq32 = delta  # not read: dQ comes from its own kernel
        args = [qf, kf, vf, lse_k, dof, delta, dq32, dk_k, dv_k, *sizes, *strides, *extra, *grads, *caps]
        if self.smem > 48 * 1024:
            self._raise_smem_limit(self._kernel, args, self.smem)
        main = self._kernel[bwd_grid(s, B, H, M, N), self.threads, 0, self.smem]
        delta_k = self._delta[(-(-rows // 4),), 128]
        ndq = rows * D
        if separate:
            dq_args = [qf, kf, vf, lse_k, dof, delta, dq_k, *sizes, *strides, *extra, *caps]
            if self.dq_smem > 48 * 1024:
                self._raise_smem_limit(self._dq, dq_args, self.dq_smem)
            conv = self._dq[dq_grid(s, B, H, M), dq_threads(s), 0, self.dq_smem]
        else:
            dq_args = [dq32, dq_k, ndq]
            conv = self._dq[(-(-(ndq // 2 if s.path == "mma" else ndq) // 128),), 128]
        block_mask = self._mask_kernel[(nk, nq, B * H), 128] if self._mask_kernel is not None else None
        parts = [(self._parts[(-(-_numel(out) // 128),), 128], g_buf, out)
                 for g_buf, out in zip(grads, sums)] if self._parts is not None else []

        zeros = [np.zeros(_numel(g_buf), dtype=_acc_np(s.dtype)) for g_buf in grads] if kind != "torch" else []

        def launch() -> None:
            for i, g_buf in enumerate(grads):  # the tables' gradients are sums: start each launch from zero
                if kind == "torch":
                    g_buf.zero_()
                else:
                    g_buf.copy_to_device(zeros[i])
            delta_k(dof, of, delta, dq32, rows, H, M, *strides[9:12])
            if block_mask is not None:
                block_mask(table, *sizes, *caps)
            main(*args)
            for kern, g_buf, out in parts:
                kern(g_buf, out, nblk, _numel(out))
            conv(*dq_args)

        def finish() -> tuple:
            final = sums if parts else grads
            if kind == "torch":
                outs = [dq, dk, dv]
                for g_buf, x in zip(final, grad_caps):
                    outs.append(g_buf.reshape(x.shape).to(x.dtype))
                return tuple(outs)
            if kind == "numpy":
                out_dtype = np.dtype(q.dtype)
                res = [dq_k.copy_to_host().view(out_dtype).reshape(B, H, M, D),
                       dk_k.copy_to_host().view(out_dtype).reshape(B, Hk, N, D),
                       dv_k.copy_to_host().view(out_dtype).reshape(B, Hk, N, D)]
                for g_buf, x in zip(final, grad_caps):
                    res.append(g_buf.copy_to_host().reshape(x.shape).astype(x.dtype))
                return tuple(res)
            out_dtype = np.dtype(q.__cuda_array_interface__["typestr"])
            res = [dq_k.view(bits).view(out_dtype).reshape(B, H, M, D),
                   dk_k.view(bits).view(out_dtype).reshape(B, Hk, N, D),
                   dv_k.view(bits).view(out_dtype).reshape(B, Hk, N, D)]
            return tuple(res + list(final))

        launch.table = table  # type: ignore[attr-defined]
        return launch, finish
