"""falower: lowers attention written as plain tensor code to FlashAttention-2 kernels.

    import falower as fl
    g = fl.attention(mask_mod=lambda b, h, q, kv: q >= kv, name="causal")
    lowered = fl.lower(g, "fa2-fwd")           # the FA2 forward schedule, as IR
    joint = fl.grad(g)                         # forward + backward: (q, k, v, do) -> (o, dq, dk, dv)
"""

from . import passes  # noqa: F401  (registers the passes)
from .errors import FalowerError, ParseError, PassError, ShapeError, VerifyError
from .frontend import absolute as abs  # noqa: A004  (torch's name)
from .frontend import (attention, capture, ceil, cos, erf, exp, exp2, expm1, floor, log, log1p, log2, maximum, minimum,
                       round, rsqrt, sigmoid, sign, sin, softmax, sqrt, tan, tanh, tensor, trace, where)
from .ir import Func, interpret, parse_func, print_func, verify
from .passes import PassManager, parse_pipeline, run_pipeline
from .compiler import CompiledAttention, compile  # noqa: A004  (falower.compile, like torch.compile)


_TORCH_API = ("flex_attention", "create_block_mask", "BlockMask")
_FLEX_HELPERS = ("and_masks", "or_masks", "noop_mask")


def __getattr__(name: str):
    """FlexAttention's API, loaded on first use so that `import falower` never imports torch:
    `from falower import flex_attention, create_block_mask, and_masks, or_masks, noop_mask`; and `lse_merge`
    (backends/numba_cuda/lse_merge.py), loaded on first use so that it never imports numba.cuda before then."""
    if name in _TORCH_API:
        from . import torch_mods

        return getattr(torch_mods, name)
    if name in _FLEX_HELPERS:
        from . import torch_mods

        return torch_mods.helper(name)
    if name == "lse_merge":  # the merge kernel (numba-cuda): a context-parallel forward's last step
        from .backends.numba_cuda.lse_merge import lse_merge

        return lse_merge
    raise AttributeError(f"module 'falower' has no attribute {name!r}")


def lower(func: Func, pipeline: str = "fa2-fwd", **kwargs) -> Func:
    """Run a pipeline string on a graph and return the lowered graph."""
    return run_pipeline(func, pipeline, **kwargs)


def grad(func: Func, **kwargs) -> Func:
    """The joint forward + backward function of a graph (the `autodiff` pass): it takes the arguments and a
    cotangent `d<result>` per float result (`do`), and returns the results and `d<argument>` per float
    argument (`dq`, `dk`, `dv`, captured float tensors). Keyword arguments go to PassManager (check=True)."""
    return run_pipeline(func, "autodiff", **kwargs)


__all__ = ["attention", "capture", "trace", "tensor", "softmax", "where", "exp", "exp2", "log", "tanh",
           "sigmoid", "erf", "sqrt", "sin", "cos", "tan", "log1p", "expm1", "rsqrt", "floor", "ceil", "round",
           "sign", "log2", "abs", "maximum", "minimum", "lower", "grad", "interpret", "print_func", "parse_func",
           "verify", "Func", "compile", "CompiledAttention", "PassManager", "parse_pipeline", "run_pipeline",
           "FalowerError", "ParseError", "PassError", "ShapeError", "VerifyError",
           "flex_attention", "create_block_mask", "BlockMask", "and_masks", "or_masks", "noop_mask", "lse_merge"]
