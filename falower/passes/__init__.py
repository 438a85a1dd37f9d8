"""Passes, the pass manager and pipelines. Importing this package registers every pass."""

from . import canonicalize, decompose_softmax  # noqa: F401  (registration)
from .base import PASSES, Pass, register
from .manager import PassManager, run_pipeline
from .pipeline import NAMED_PIPELINES, Pipeline, parse_pipeline

__all__ = ["PASSES", "Pass", "register", "PassManager", "run_pipeline", "NAMED_PIPELINES", "Pipeline",
           "parse_pipeline"]

from . import fuse, online_softmax, tile  # noqa: E402,F401  (registration)
from . import mask_tiles  # noqa: E402,F401
from . import score_licm  # noqa: E402,F401
from . import autodiff, delta, recompute, tile_bwd  # noqa: E402,F401  (the backward)
from . import split_kv  # noqa: E402,F401  (kv parts merged by their LSE)
from .pipeline import named as _named  # noqa: E402

# 128 x 64 tiles: what the numba-cuda kernels run fastest on the H100 (benchmarks/NOTES.md); lazy=8: the row max
# moves only past 8 (log2), so the warp-specialized kernel skips O's rescale on most tiles (NOTES, "Conditional
# rescale": the bias table +4-9% at D = 128, the others 0-2%, D = 64 unchanged)
_named("fa2-fwd", "decompose-softmax,canonicalize,fuse,tile{bq=128,bk=64},online-softmax{exp2=true,lazy=8},mask-tiles,"
                  "score-licm,canonicalize")
_named("fa1-fwd", "decompose-softmax,canonicalize,fuse,tile{bq=64,bk=64,order=fa1},online-softmax,canonicalize")
# The FA2 backward: the joint function, Delta, the backward that keeps O and LSE (recompute), tiled with kv
# tiles outer and dQ added atomically, as FlashAttention-2 does (tile-bwd{dq=separate} is the deterministic
# q-outer alternative). The forward it pairs with is fa2-fwd, which produces that O and LSE.
# 64 x 128 tiles: 8 warps of 16 kv rows; on the H100 1.5x the speed of 64 x 64 (half the Q, dO loads and dQ
# atomics per kv row; benchmarks/NOTES.md, 2026-11-23).
_named("fa2-bwd", "autodiff,decompose-softmax,canonicalize,delta,recompute,canonicalize,"
                  "tile-bwd{bq=64,bk=128,dq=atomic},canonicalize")
# The same backward with no atomic adds anywhere: dQ by a q-outer nest, captured tables' gradients summed in a
# fixed order. Same bits on every run (falower.compile(..., deterministic=True)).
_named("fa2-bwd-deterministic", "autodiff,decompose-softmax,canonicalize,delta,recompute,canonicalize,"
                                "tile-bwd{bq=64,bk=64,dq=separate,deterministic=true},canonicalize")
