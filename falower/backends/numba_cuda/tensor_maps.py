"""Tensor maps (CUtensorMap) for the kernels' TMA tensor copies: O's stores in the warp-specialized kernel's kept
epilogue (emit_fa3_ws.tma_store), Q's, K's and V's loads in its producer (emit_fa3_ws.tma_loads).

A TMA tensor copy names its tensor by a 128-byte map that the CUDA driver encodes on the host
(cuTensorMapEncodeTiled). CUDA C passes it as a __grid_constant__ parameter, which Numba cannot; PTX also takes a
map in global memory by its generic address, so the kernels take it as a 128-byte uint8 array (`omap`) and copy by
`elem_addr(omap, (0,))` (benchmarks/probe_tma.py checked this path on an H200: the box's 128-byte swizzle, rows
past the tensor's end not written). A map holds its tensor's address, so a call with a new O needs a new map:
`TensorMaps` keeps them by address and shape, never rewritten once made, so a launch still in flight never reads a
map being changed; torch's caching allocator hands a loop of calls the same O, so the encode (~5 us) and the launch
that writes the map (`put_map`) are paid once. In the simulator a map's bytes are a key to the tensor's description
(intrinsics.sim_tensor_map).
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from typing import Any, Optional

import numpy as np

from . import graph_capture

MAP_BYTES = 128
O_BOX_ROWS = 16  # a consumer warp's rows of O: one box a warp and 64 columns (128 bytes, the swizzle's span)
O_BOX_COLS = 64
KEEP = 1024  # maps kept per kernel (most recently used: a model's layers each keep their O; 128 bytes each); those a
# CUDA graph captured are kept for good

_CU_DTYPE = {"f16": 6, "bf16": 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16, _BFLOAT16
_SWIZZLE_128B = 3


class TensorMapError(RuntimeError):
    """The driver refused a map (its CUresult named)."""


_LIB: Optional[Any] = None


def _driver() -> Any:
    global _LIB
    if _LIB is None:
        lib = ctypes.CDLL("libcuda.so.1")
        u64, u32 = ctypes.c_uint64, ctypes.c_uint32
        lib.cuTensorMapEncodeTiled.argtypes = [ctypes.c_void_p, ctypes.c_int, u32, ctypes.c_void_p,
                                               ctypes.POINTER(u64), ctypes.POINTER(u64), ctypes.POINTER(u32),
                                               ctypes.POINTER(u32), ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                               ctypes.c_int]
        _LIB = lib
    return _LIB


Geometry = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # dims, byte strides of dims 1 .., box


def o_map_geometry(BH: int, M: int, D: int) -> Geometry:
    """O [B H, M, D] of 16-bit values as a rank-3 map (innermost first): dims (D, M, B H), byte strides of dims 1
    and 2, and the box a warp stores (64 columns of 16 rows of one (b, h) slice: rows past M are not written, so
    a box never reaches the next slice's rows)."""
    return (D, M, BH), (2 * D, 2 * D * M), (O_BOX_COLS, O_BOX_ROWS, 1)


def qkv_map_geometry(B: int, Hk: int, N: int, D: int, strides: tuple[int, int, int], rows: int) -> Geometry:
    """Q, K or V [B, Hk, N, D] of 16-bit values, its element strides (batch, head, row) as the kernels take them (a
    strided view included: TMA takes any multiple of 16 bytes), as a rank-4 map: dims (D, N, Hk, B), and the box a
    producer loads (64 columns of `rows` rows: a kv tile's, or a consumer warpgroup's 64 of Q; rows past N arrive as
    zeros)."""
    sb, sh, sm = (2 * int(x) for x in strides)
    # a dimension of one index never moves by its stride, which may then be anything (a broadcast view's 0): the map
    # takes the dense one
    sm = sm if N > 1 else 2 * D
    sh = sh if Hk > 1 else sm * N
    sb = sb if B > 1 else sh * Hk
    return (D, N, Hk, B), (sm, sh, sb), (O_BOX_COLS, rows, 1, 1)


def encode_map(ptr: int, geometry: Geometry, dtype: str, what: str = "O") -> bytes:
    """The driver's CUtensorMap (128-byte swizzle, zeros out of bounds) of the 16-bit tensor at device address
    `ptr` with `geometry`."""
    if dtype not in _CU_DTYPE:
        raise ValueError(f"tensor map of {what}: f16 or bf16, got {dtype!r}")
    dims, strides, box = geometry
    rank = len(dims)
    if any(st % 16 or st <= 0 for st in strides) or ptr % 16:
        raise TensorMapError(f"tensor map of {what}: its address and byte strides must be positive multiples of 16, "
                             f"got {ptr:#x} and {strides}")
    buf = ctypes.create_string_buffer(MAP_BYTES + 64)
    at = (ctypes.addressof(buf) + 63) & ~63  # the map is 64-byte aligned
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    rc = _driver().cuTensorMapEncodeTiled(ctypes.c_void_p(at), _CU_DTYPE[dtype], rank, ctypes.c_void_p(ptr),
                                          (u64 * rank)(*dims), (u64 * (rank - 1))(*strides), (u32 * rank)(*box),
                                          (u32 * rank)(*([1] * rank)), 0, _SWIZZLE_128B, 0, 0)
    if rc != 0:
        raise TensorMapError(f"cuTensorMapEncodeTiled for {what} {list(reversed(dims))} at {ptr:#x}: CUresult {rc}")
    return ctypes.string_at(at, MAP_BYTES)


def encode_o_map(ptr: int, BH: int, M: int, D: int, dtype: str) -> bytes:
    """The driver's CUtensorMap of O at device address `ptr` (o_map_geometry)."""
    return encode_map(ptr, o_map_geometry(BH, M, D), dtype)


_PUT_WORDS = "falower_put_words"


def _put_words_ptx(cc: tuple[int, int]) -> bytes:
    """A one-thread kernel that writes its 16 u64 parameters to dst: a map's bytes reach the device inside a
    launch's parameters, with no pinned host memory to keep until the copy has run (a map made while a CUDA graph
    captures is put by it on graph_capture's side stream, outside the graph)."""
    words = MAP_BYTES // 8
    params = ", ".join(["\t.param .u64 dst"] + [f".param .u64 w{i}" for i in range(words)])
    body = "".join(f"\tld.param.u64 %w, [w{i}];\n\tst.global.u64 [%a+{8 * i}], %w;\n" for i in range(words))
    return (f".version 7.8\n.target sm_{cc[0]}{cc[1]}\n.address_size 64\n"
            f".visible .entry {_PUT_WORDS}({params})\n{{\n\t.reg .b64 %a, %w;\n\tld.param.u64 %a, [dst];\n"
            f"\tcvta.to.global.u64 %a, %a;\n{body}\tret;\n}}\n").encode() + b"\0"


_PUT_FUNCS: dict = {}  # device ordinal -> CUfunction


def put_map(device: int, dst: int, data: bytes, stream: int) -> None:
    """Enqueue on `stream` the write of a map's 128 bytes to the device address `dst` (device `device`)."""
    from . import cubin_cache
    from .runtime import _ctypes_launch

    func = _PUT_FUNCS.get(device)
    if func is None:
        drv = cubin_cache.driver()
        func = _PUT_FUNCS[device] = drv.load_function(device, _put_words_ptx(drv.compute_capability(device)),
                                                      _PUT_WORDS, 0)
    words = np.frombuffer(data, np.uint64)
    vals = (ctypes.c_uint64 * (1 + len(words)))(dst, *(int(w) for w in words))
    base = ctypes.addressof(vals)
    params = (ctypes.c_void_p * len(vals))(*range(base, base + 8 * len(vals), 8))
    launch = _ctypes_launch()
    if launch is None:
        raise TensorMapError("no cuLaunchKernel in libcuda to write a tensor map with")
    err = launch(int(func), 1, 1, 1, 1, 1, 1, 0, stream, ctypes.addressof(params), None)
    if err:
        raise TensorMapError(f"writing a tensor map: cuLaunchKernel CUresult {err}")


class TensorMaps:
    """One kernel's tensor maps, kept by (kind, device, stream, address, geometry) as device arrays of 128 bytes:
    `torch(ptr, device, geometry)` for torch tensors (the map a torch uint8 tensor on the device, written by a launch:
    `put_map`; one made while a CUDA graph captures a graph_capture.DeviceWords: either read by its data_ptr()),
    `numba(arr, geometry)` for Numba device arrays (the simulator's included: `arr` the array the
    kernel reads or writes, whose 16-bit elements the geometry counts). At most KEEP are kept, the least recently
    used dropped; one made or used while a CUDA graph captures is kept for good (the graph holds its address)."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self._maps: OrderedDict = OrderedDict()
        self._captured: dict = {}  # the maps CUDA graphs read, by address: kept alive with the graphs
        self.dropped = 0  # maps dropped from the cache so far: a map's address kept without the map (a plan's
        # memory of its last call, runtime._ForwardPlan.map_memo) is valid while this has not moved

    def _get(self, key: tuple, make) -> Any:
        m = self._maps.get(key)
        if m is None:
            m = self._maps[key] = make()
            while len(self._maps) > KEEP:
                self._maps.popitem(last=False)
                self.dropped += 1
        else:
            self._maps.move_to_end(key)
        return m

    def torch(self, ptr: int, device: Any, geometry: Geometry, capturing: Optional[bool] = None,
              stream: Optional[int] = None, what: str = "O") -> Any:
        """The map of the tensor at `ptr` on torch device `device`, made on and kept for the stream the kernel runs
        on (`stream` its handle; None: torch's current stream): a map dropped from the cache is then reused only after
        the launches of its stream that read it. `capturing`: whether that stream captures a CUDA graph (asked of
        torch when not given); a map made while capturing is written at once outside the capture, into memory of
        graph_capture's own (a put in the graph would run on every replay), and kept for good, as is a cached map a
        graph reads; the capture's later calls on the same tensor find it in the cache. Either is read by its
        `data_ptr()`."""
        import torch

        if stream is None:
            stream = torch.cuda.current_stream(device).cuda_stream
        if capturing is None:
            capturing = torch.cuda.is_current_stream_capturing()

        def make() -> Any:
            data = encode_map(ptr, geometry, self.dtype, what)
            index = graph_capture.device_index(device)
            if capturing:  # (memory of its own: a block of the capture's pool may be one the graph writes)
                slot = graph_capture.map_slot(device)
                graph_capture.outside_capture(index, lambda side: put_map(index, slot.data_ptr(), data, side))
                return slot
            dev = torch.empty(MAP_BYTES // 8, dtype=torch.int64, device=device)  # 8-byte words, 128-byte aligned
            put_map(index, dev.data_ptr(), data, stream)
            return dev.view(torch.uint8)  # the kernel's argument type

        key = ("torch", str(device), stream, ptr, geometry)
        m = self._get(key, make)
        if capturing:
            self._captured[m.data_ptr()] = m
        return m

    def torch_o(self, o: Any, capturing: Optional[bool] = None, stream: Optional[int] = None) -> Any:
        """The map of a contiguous torch O [B, H, M, D] (f16 / bf16): o_map_geometry."""
        B, H, M, D = (int(n) for n in o.shape)
        return self.torch(o.data_ptr(), o.device, o_map_geometry(B * H, M, D), capturing, stream)

    def numba(self, arr: Any, geometry: Geometry, what: str = "O") -> Any:
        """The map of a Numba device array as a Numba device array; in the simulator, intrinsics.sim_tensor_map's
        stand-in over `arr` itself."""
        from numba import cuda

        from .intrinsics import SIMULATOR, sim_tensor_map

        if SIMULATOR:
            return cuda.to_device(sim_tensor_map(np.asarray(arr).view(np.uint16), *geometry))
        ptr = int(arr.device_ctypes_pointer.value)
        key = ("numba", ptr, geometry)
        return self._get(key, lambda: cuda.to_device(np.frombuffer(encode_map(ptr, geometry, self.dtype, what),
                                                                   np.uint8).copy()))
