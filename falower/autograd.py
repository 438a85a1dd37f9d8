"""torch autograd for compiled attention: `loss.backward()` runs falower's backward.

`CompiledAttention.__call__` comes here when a torch input requires grad. The forward saves what
FlashAttention-2's backward needs (q, k, v, o, lse and the captured tensors), not the [M, N] probabilities;
the backward calls `compiled.backward`, which recomputes P tile by tile from the LSE.

torch is imported here and nowhere else in falower (the IR, the passes and the interpreter never need it;
CI has no torch), so `import falower` works without torch and this module is loaded only on demand.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from torch.autograd.function import once_differentiable


def differentiable_call(compiled: Any, inputs: tuple) -> tuple:
    """(o, lse) of `compiled` on `inputs` (q, k, v, then the captures in the graph's order), recorded by
    autograd: o and lse are differentiable with respect to q, k, v and every float captured tensor that
    requires grad (lse as FlexAttention's is; FlashAttention's is not: passes/lse_cotangent.py)."""
    return _FalowerAttention.apply(compiled, *inputs)


class _FalowerAttention(torch.autograd.Function):
    """One autograd node per attention call. Captures that are not tensors (Python numbers) pass through
    as constants; integer and boolean tensors (document ids) cannot require grad and get None."""

    @staticmethod
    def forward(ctx, compiled: Any, *inputs: Any):  # type: ignore[override]
        # q, k, v may be strided views with a contiguous last dim (the kernels take their strides, so a
        # model's transposed projections need no copy); captured tables are made contiguous. A captured
        # tensor that needs no gradient (document ids, fixed slopes) goes on as the very tensor the caller
        # passed, not a detached alias: the block data derived from it (range tables, block lists) is
        # remembered by that tensor's identity, and a new alias each step would make it again every call.
        inputs = tuple((_contiguous(x.detach()) if i < 3 else _dense(x.detach() if x.requires_grad else x))
                       if torch.is_tensor(x) else x for i, x in enumerate(inputs))
        q = inputs[0]
        o, lse = compiled.forward(*inputs)
        o = _as_torch(o, like=q)
        lse = _as_torch(lse, like=q, keep_dtype=True)  # f32 from the kernels; kept as given (f64 interpreter)
        is_tensor = [torch.is_tensor(x) for x in inputs]
        ctx.compiled = compiled
        ctx.is_tensor = is_tensor
        ctx.constants = [None if t else x for x, t in zip(inputs, is_tensor)]
        ctx.save_for_backward(o, lse, *(x for x, t in zip(inputs, is_tensor) if t))
        ctx.set_materialize_grads(False)  # an output the loss does not read comes back as None, not zeros
        return o, lse

    @staticmethod
    @once_differentiable  # the backward is a kernel, not torch ops: a double backward says so clearly
    def backward(ctx, do: Optional[torch.Tensor], dlse: Optional[torch.Tensor]):  # type: ignore[override]
        compiled = ctx.compiled
        o, lse, *saved = ctx.saved_tensors
        it = iter(saved)
        inputs = [next(it) if t else c for t, c in zip(ctx.is_tensor, ctx.constants)]
        wants = ctx.needs_input_grad[1:]  # [0] is `compiled`
        if not any(wants):
            return (None,) * (1 + len(inputs))
        q, k, v, *captures = inputs
        if do is None:  # o was not used by the loss (autograd may still call us for lse's sake)
            do = torch.zeros_like(o)
        # do arrives with whatever strides the loss produced (a broadcast ones for o.sum()), and perhaps
        # in another float dtype; the backward reads row-major buffers of o's dtype
        do = _contiguous(do.to(o.dtype))
        if dlse is not None:  # the loss reads the lse too (a z-loss): Delta - dlse (passes/lse_cotangent.py)
            dlse = dlse.to(lse.dtype).contiguous()
        grads = compiled.backward(q, k, v, o, lse, do, *captures, dlse=dlse)
        by_name = dict(zip(compiled.gradient_names(), grads))
        out: list[Optional[torch.Tensor]] = [None]
        for arg, x, want in zip(compiled.func.args, inputs, wants):
            g = by_name.get("d" + (arg.name or "")) if want else None
            out.append(None if g is None else _as_torch(g, like=x).reshape(x.shape))
        return tuple(out)


def _dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


def _contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels take strided [B, H, N, D] views whose last dim is contiguous (a model's transposed
    projections, without a copy); anything else (a broadcast gradient of stride 0) is made contiguous."""
    if x.dim() == 4 and (x.shape[3] == 1 or x.stride(3) == 1) and min(x.stride()) >= 0 and all(
            st > 0 or n == 1 for n, st in zip(x.shape, x.stride())):
        return x
    return _dense(x)


def _as_torch(x: Any, like: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
    """`x` as a torch tensor on `like`'s device, of `like`'s dtype (or its own with `keep_dtype`). The
    reference backend returns numpy arrays (bf16 values held in float32: numpy has no bf16), the numba-cuda
    backend tensors of the right kind already, so this is then a no-op."""
    if not torch.is_tensor(x):
        x = torch.from_numpy(np.ascontiguousarray(x))
    dtype = x.dtype if keep_dtype else like.dtype
    if x.device != like.device or x.dtype != dtype:
        x = x.to(device=like.device, dtype=dtype)
    return x
