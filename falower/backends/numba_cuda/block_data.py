"""Block data: what a data-dependent mask's kernels read that is made from the captured data, not given.

A document mask `doc[b, q] == doc[b, kv]` is classified per tile from `mask.ranges` tables (the least and
greatest document id of each granule of rows, O(N) to make), and the forward visits its kv tiles from a
block list (per q tile: how many kv tiles to visit and which, partial ones flagged), made by the kernel's
own `tile_class_fn` over those ranges: O(B * H * nq * nk) scalar work, never a pass over the (q, kv) pairs.
Both arrive at the kernels as captures whose `Capture.derived` says how to make them (spec.py).

`BlockData.derive` makes them for one call, and remembers them with the data they came from: a torch tensor
is recognised by its identity (a weak reference: a new tensor at a recycled address is not mistaken for it)
and its version counter (an in-place write makes it new data), a Python number by its value. So every
layer and every step that passes the same document ids (one `falower.create_block_mask`, or the same
tensor to a compiled call) makes the block data once. numpy inputs (the reference and simulator paths) have
no version counter and are made anew at each call.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import numpy as np

from ...ir.intervals import minmax_table
from .spec import FA2ForwardSpec

_LIMIT = 16  # block data kept per cache (distinct document-id tensors in flight)
THREADS = 128


def caller_count(spec: Any) -> int:
    """How many of the spec's captures the caller passes (its tensors and the sizes): the rest are derived."""
    return next((i for i, c in enumerate(spec.captures) if c.derived), len(spec.captures))


def has_derived(spec: Any) -> bool:
    return caller_count(spec) < len(spec.captures)


def _kind(x: Any) -> str:
    mod = type(x).__module__
    if mod.startswith("torch"):
        return "torch"
    if isinstance(x, np.ndarray) or np.isscalar(x):
        return "numpy"
    return "cai"


def range_table(x: Any, axis: int, granule: int, dtype: str) -> Any:
    """`mask.ranges` of one captured table, as the kernels read it: [..., ceil(n / granule), ..., 2] with the
    least then the greatest entry of each granule along `axis` (intervals.minmax_table), in `dtype`."""
    kind = _kind(x)
    if kind == "torch":
        import torch

        t = x.detach().movedim(axis, -1)
        t = t.to(torch.int32) if t.dtype == torch.bool else t
        n = t.shape[-1]
        ng = -(-n // granule)
        if ng * granule != n:  # the last granule is short: pad with its own last entry (changes no min or max)
            t = torch.cat([t, t[..., -1:].expand(*t.shape[:-1], ng * granule - n)], dim=-1)
        lo, hi = torch.aminmax(t.reshape(*t.shape[:-1], ng, granule), dim=-1)
        want = {"i32": torch.int32, "f32": torch.float32, "f64": torch.float64, "f16": torch.float16}[dtype]
        return torch.stack([lo, hi], dim=-1).movedim(-2, axis).to(want).contiguous()
    from numba import cuda

    host = np.asarray(x) if kind == "numpy" else cuda.as_cuda_array(x).copy_to_host()
    out = np.ascontiguousarray(minmax_table(host, axis, granule).astype(
        {"i32": np.int32, "f32": np.float32, "f64": np.float64, "f16": np.float16}[dtype]))
    return out if kind == "numpy" else cuda.to_device(out)


def emit_block_list(spec: FA2ForwardSpec) -> str:
    """Source of the kernel `<name>_block_list(B, H, M, N, *captures)`: one thread per (b, h, q tile) row
    r = (b * H + h) * nq + qt writes kv_count[r] and the row's kv tiles to visit (block_mask == "list"),
    from `tile_class_fn` as the kernel's static scan would call it (rows q < M; columns up to N - 1, the
    kernel masking a ragged last tile itself). Launch with ceil(B * H * nq / 128) blocks of 128 threads."""
    from .emit_fa2 import _cap_args, _Code, _list_names, _module

    BQ, BK = spec.block_q, spec.block_k
    kc, kt = _list_names(spec)
    c = _Code()
    c("@kernel_jit")
    c(f"def {spec.name}_block_list(B, H, M, N{_cap_args(spec)}):")
    with c.indent():
        c('"""Per (b, h, q tile): how many kv tiles are not empty, and which (j * 2 + 1 if partial)."""')
        c(f"r = cuda.blockIdx.x * {THREADS} + cuda.threadIdx.x")
        c(f"nq = (M + {BQ - 1}) // {BQ}")
        c(f"nk = (N + {BK - 1}) // {BK}")
        c("if r < B * H * nq:")
        with c.indent():
            c("qt = r % nq")
            c("bh = r // nq")
            c("b = bh // H")
            c("h = bh - b * H")
            c(f"q_lo = qt * {BQ}")
            c(f"q_hi = min(q_lo + {BQ}, M) - 1")
            c("cnt = 0")
            c("for j in range(nk):")
            with c.indent():
                c(f"cls = tile_class_fn(b, h, q_lo, q_hi, j * {BK}, min(j * {BK} + {BK}, N) - 1{_cap_args(spec)})")
                c("if cls != 0:")
                with c.indent():
                    c(f"{kt}[r * nk + cnt] = j * 2 + (1 if cls == 1 else 0)")
                    c("cnt += 1")
            c(f"{kc}[r] = cnt")
    return _module(spec, c.text())


class BlockData:
    """The derived captures of one kernel's spec, made per call and remembered with their data."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.first = caller_count(spec)
        self._list_kernel: Any = None
        self._cache: dict[tuple, tuple[list, list]] = {}

    # ------------------------------------------------------------------------------------ caching
    def _key(self, caps: list, sizes: tuple) -> Optional[tuple]:
        """What the derived data depends on: the sizes and each capture's identity and version; None when an
        input cannot be recognised again (numpy, CUDA array interface objects)."""
        key: list = [sizes]
        for x in caps:
            kind = _kind(x)
            if kind == "torch":
                key.append((id(x), x._version, tuple(x.shape), x.stride(), x.dtype, x.device))
            elif np.isscalar(x):
                key.append((type(x), x))
            else:
                return None
        return tuple(key)

    def derive(self, caps: list, sizes: tuple[int, int, int, int], like: Any) -> list:
        """The derived captures for these caller captures (tensors and sizes) and (B, H, M, N)."""
        caps = list(caps[:self.first])
        key = self._key(caps, sizes)
        if key is not None:
            hit = self._cache.get(key)
            if hit is not None and all(r() is x for r, x in zip(hit[0], caps) if r is not None):
                return hit[1]
        out = self._make(caps, sizes, like)
        if key is not None:
            if len(self._cache) >= _LIMIT:
                self._cache.clear()
            refs = [weakref.ref(x) if _kind(x) == "torch" else None for x in caps]
            self._cache[key] = (refs, out)
        return out

    # ------------------------------------------------------------------------------------ making
    def _make(self, caps: list, sizes: tuple[int, int, int, int], like: Any) -> list:
        spec = self.spec
        out: list = []
        for c in spec.captures[self.first:]:
            if c.derived[0] == "ranges":
                _, i, axis, g = c.derived
                out.append(range_table(caps[i], axis, g, c.dtype))
        listed = [c.derived[0] for c in spec.captures[self.first:] if c.derived[0] in ("kv_count", "kv_tiles")]
        if listed:
            out += self._block_list(caps + out, sizes, like)
        return out

    def _block_list(self, caps: list, sizes: tuple[int, int, int, int], like: Any) -> list:
        from numba import cuda

        from .runtime import _one_element_captures, load_source

        spec = self.spec
        B, H, M, N = sizes
        rows = B * H * -(-M // spec.block_q)
        nk = -(-N // spec.block_k)
        kind = _kind(like)
        if self._list_kernel is None:
            mod = load_source(emit_block_list(spec), spec.name + "_block_list")
            self._list_kernel = getattr(mod, spec.name + "_block_list")
        n_caller = len(caps)
        if kind == "torch":
            import torch

            count = torch.empty(rows, dtype=torch.int32, device=like.device)
            tiles = torch.empty(rows * nk, dtype=torch.int32, device=like.device)
            stream = torch.cuda.current_stream(like.device).cuda_stream
            launch_stream = cuda.external_stream(stream) if stream else 0
            # no synchronisation: the launch goes on torch's current stream, behind whatever made the tensors
            args = [cuda.as_cuda_array(x, sync=False) if _kind(x) == "torch" else x
                    for x in _one_element_captures(spec, tuple(caps), "torch", like)]
        else:
            count = cuda.device_array(rows, dtype=np.int32)
            tiles = cuda.device_array(rows * nk, dtype=np.int32)
            launch_stream = 0
            args = [cuda.to_device(x) if isinstance(x, np.ndarray) else x
                    for x in _one_element_captures(spec, tuple(caps), kind, like)]
        wrap = (lambda t: cuda.as_cuda_array(t, sync=False)) if kind == "torch" else (lambda t: t)
        args = args[:n_caller] + [wrap(count), wrap(tiles)]
        blocks = -(-rows // THREADS)
        self._list_kernel[blocks, THREADS, launch_stream](B, H, M, N, *args)
        if kind == "numpy":
            return [count.copy_to_host(), tiles.copy_to_host()]
        return [count, tiles]

    def block_list(self, caps: list, sizes: tuple[int, int, int, int], like: Any) -> tuple[np.ndarray, np.ndarray]:
        """(kv_count [B, H, nq], kv_tiles [B, H, nq, nk]) on the host, for tests and for looking."""
        out = self.derive(caps, sizes, like)
        count, tiles = out[-2], out[-1]
        host = [x.cpu().numpy() if _kind(x) == "torch" else np.asarray(x) if _kind(x) == "numpy"
                else x.copy_to_host() for x in (count, tiles)]
        B, H, M, N = sizes
        nq, nk = -(-M // self.spec.block_q), -(-N // self.spec.block_k)
        return host[0].reshape(B, H, nq), host[1].reshape(B, H, nq, nk)
