"""`falower.compile`: a graph in, a callable out. The graph is lowered (fa2-fwd by default) and handed to
a backend: "numba-cuda" (GPU kernels) or "reference" (the numpy interpreter, for checking)."""

from __future__ import annotations

import itertools
import sys
from typing import Any, Mapping, Optional

import numpy as np

from .errors import FalowerError, PassError, ShapeError
from .ir.core import Func
from .ir.dims import solve_dims
from .ir.interp import Interpreter
from .passes.canonicalize import const_value
from .passes.lse_cotangent import check_dlse, lse_cotangent_arg, with_lse_cotangent
from .passes.manager import debug_level, deep_graphs, run_pipeline

BACKENDS = ("numba-cuda", "reference")


RAGGED_REFERENCE_N = 4160  # a length that leaves 64 padded rows at 128- and 192-row q tiles alike (_ragged_first_pays)


class CompiledAttention:
    """Call with the graph's inputs (q, k, v, then captured tensors in signature order); returns (o, lse).

    The numba-cuda backend specialises on the head dim and dtype at the first call with them and caches
    the kernel; other sizes the score function reads (N for a relative bias) are run-time arguments.
    `backward(q, k, v, o, lse, do, *captures)` returns the gradients (dq, dk, dv, then one per float
    capture) from the backward pipeline's kernels; torch tensors that require grad make the call
    differentiable (`falower.autograd`), so `loss.backward()` runs those kernels.
    """

    def __init__(self, func: Func, lowered: Func, backend: str, path: str = "auto", num_warps: Optional[int] = None,
                 extra: Optional[dict] = None, backward_pipeline: str = "fa2-bwd", pipeline: str = "",
                 pipeline_kwargs: Optional[dict] = None):
        self.func, self.lowered, self.backend = func, lowered, backend
        self.path, self.num_warps, self.extra = path, num_warps, dict(extra or {})
        self.backward_pipeline = backward_pipeline
        self.pipeline, self.pipeline_kwargs = pipeline, dict(pipeline_kwargs or {})
        self._retiled: dict[tuple, tuple[Func, Any]] = {}  # (bq, bk, ragged_q) -> (lowered, analysis)
        self._memo: dict[str, Any] = {}  # choices made once a graph (_wide_tiles_pay)
        self._built: dict[str, tuple[Func, Any]] = {}  # kernel name -> the (lowered, analysis) it came from
        self._lowered_bwd: Optional[Func] = None
        self._bwd_analysis: Any = None
        self._bwd_dlse: Optional[Func] = None  # the backward IR with the LSE's cotangent (reference backend)
        self._kernels: dict[tuple, Any] = {}
        self._bwd_kernels: dict[tuple, Any] = {}
        # warm calls: the input signature (shapes, strides, dtypes, devices) -> what the call runs
        self._calls: dict[tuple, Any] = {}
        self._bwd_calls: dict[tuple, Any] = {}
        self._block_data: dict[str, Any] = {}  # kernel name -> BlockData (data-dependent masks' derived data)
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
        """The FA2ForwardKernel of this graph for these inputs (built on first use); a GQA decoding call runs
        `packed_for(sizes)`'s kernel instead, on q reshaped."""
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
        from .backends.numba_cuda.emit_fa2 import cluster_parts

        if self.backend != "numba-cuda":
            raise FalowerError("only the numba-cuda backend builds kernels")
        if "D" not in env:
            raise ShapeError("specialize needs the head dim D")
        path = self.path
        if path == "auto":
            path = "mma" if dtype in ("f16", "bf16") and env["D"] % 16 == 0 else "simt"
        # decoding's tiles for at most 64 rows, else D = 64's for these sizes (None: not offered)
        tiling = "decode" if self._decode_tiles(dtype, path, env) else self._d64_tiling(dtype, path, env)
        parts = self._kv_parts(dtype, path, env, tiling)  # split-kv's parts for these sizes (1: none)
        if self._fewer_parts_held(dtype, path, env, tiling, parts):  # (only where their clusters are built)
            kern = self._kernel_for(dtype, path, env["D"], tiling, parts // 2, True)
            if cluster_parts(kern.spec):
                return kern
        cluster = self._cluster_small_grid(dtype, path, env, tiling, parts)  # those merged in a cluster
        return self._kernel_for(dtype, path, env["D"], tiling, parts, cluster)

    @deep_graphs()
    def _kernel_for(self, dtype: str, path: str, head_dim: int, tiling: Optional[str], parts: int,
                    cluster: bool) -> Any:
        """The kernel of these choices (built on first use): what specialize returns."""
        from .backends.numba_cuda.from_ir import unbuildable
        from .backends.numba_cuda.runtime import FA2ForwardKernel
        from .backends.numba_cuda.spec import forward_extra

        used = {"D": head_dim}  # other sizes reach the device functions as run-time arguments
        key = (dtype, path, tuple(used.items())) + (() if tiling is None else (("tiles", tiling),)) \
            + (() if parts == 1 else (("kv_parts", parts),)) + ((("cluster", True),) if cluster else ())
        if key not in self._kernels:
            spec, built = self._forward_spec(used, dtype, path, tiling, parts, cluster)
            self._built[spec.name] = built
            try:
                kern = FA2ForwardKernel(spec)
            except ValueError as e:  # the emitter cannot build this schedule (tile sizes, head dim)
                raise unbuildable(e, spec.head_dim, path, spec) from None
            level = debug_level()
            if level >= 3:
                print(f"[falower] kernel {spec.name}:\n{kern.source}", file=sys.stderr)
            if level >= 4:
                print(f"[falower] PTX of {spec.name}:\n{kern.ptx()}", file=sys.stderr)
            # the caller's own cluster_merge True launches its clusters even where the device holds fewer than the
            # grid's at once (a measurement's knob); the automatic choice's take the merge kernel then (plan)
            kern.cluster_asked = forward_extra(self.extra).get("cluster_merge") is True
            self._kernels[key] = kern
        return self._kernels[key]

    def _mask_kind(self) -> str:
        """The block mask kind the kernel choice reads: the analysis's, "none" without a mask."""
        return self.analysis.block_mask if self.analysis.conj else "none"

    def _seq_dims(self) -> tuple[Any, Any]:
        """q's and k's sequence dims ([..., M, D], [..., N, D])."""
        return self.func.args[0].type.shape[-2], self.func.args[1].type.shape[-2]

    def _seq_lengths(self, env: dict[str, int]) -> tuple[Optional[int], Optional[int]]:
        """q's and k's sequence lengths in `env` (an expression of its sizes too: a packed GQA graph's rows are
        M*G), None where `env` lacks a size they need."""
        out = []
        for d in self._seq_dims():
            try:
                out.append(int(d.eval(env)))
            except (ShapeError, KeyError, TypeError):
                out.append(None)
        return out[0], out[1]

    def _auto_choice(self, dtype: str, head_dim: int, path: str, few_rows: bool = False) -> Optional[dict]:
        """emit_fa3.auto_extra for this graph on this device: the Hopper kernel falower.compile picks by itself, or
        None (mma.sync; the caller's own schedule, which _forward_spec takes as asked). `few_rows`: a call of at
        most DECODE_MAX_ROWS query rows, for which a score reading a [q, kv] table tile (a bias[h, q, kv]) takes
        the persistent kernel as any other: its few rows of the table are read where the score uses them, and the
        kernel has decoding's tiles and split-kv's parts, where the table-tile kernel (no producer, one block a q
        tile) ran each q tile through every kv tile on one SM (`_decode_tiles`)."""
        from .backends.numba_cuda import emit_fa3
        from .backends.numba_cuda.from_ir import reads_table_tile
        from .backends.numba_cuda.runtime import device_cc, device_sm_count
        from .backends.numba_cuda.spec import forward_extra

        if path != "mma" or "schedule" in forward_extra(self.extra):
            return None
        sms = device_sm_count()
        # decoding's tiles two blocks an SM (emit_fa3_ws.blocks_per_sm): twice the persistent blocks
        per_sm = 2 if few_rows and self.extra.get("blocks_per_sm") == 2 else 1
        return emit_fa3.auto_extra(dtype, head_dim, self._mask_kind(), device_cc(),
                                   table_tile=reads_table_tile(self.analysis) and not few_rows,
                                   sm_count=sms * per_sm if sms else sms)

    def _d64_tiling(self, dtype: str, path: str, env: dict[str, int]) -> Optional[str]:
        """Which of D = 64's kernels a call with these sizes takes: "wide", the persistent kernel's 192 x 128 tiles
        (three consumer warpgroups), where `_wide_tiles_pay` says at its sequence lengths (the reference length
        where `env` has none), else "narrow" (emit_fa3's 128 x 64) but where a small grid splits on 128 x 128 tiles
        (`_two_tiles_split`: "two"); and of the wide, "two", the same persistent
        kernel on 128 x 128 tiles (two consumer warpgroups), where the call's batch and heads are known and make a
        grid so small that the shorter items finish first (emit_fa3.two_rounds_pay: under a mask only where they
        fit one round; `extra={"small_grid": False}` keeps the wide tiles). None where the automatic choice offers none
        of them (another D or path, the caller's schedule or pipeline, no Hopper GPU or no SM count), so that those keep
        one kernel for every size."""
        if env["D"] != 64 or self.pipeline != "fa2-fwd":
            return None
        from .backends.numba_cuda import emit_fa3

        choice = self._auto_choice(dtype, 64, path)
        if not choice or not choice.get("persistent"):
            return None
        ragged = self._ragged_first_pays(*emit_fa3.WIDE_TILES) and self._ragged_first_runs(dtype, path, choice)
        m, n = self._seq_lengths(env)
        blocks = self.extra.get("persistent", choice["persistent"])  # the caller's block count, if given
        heads = self._heads(env)
        if not self._wide_tiles_pay(64, m, n, ragged=ragged):
            return "two" if self._two_tiles_split(m, n, heads, blocks) else "narrow"
        if not blocks or not self.extra.get("small_grid", True) or heads is None or not m:
            return "wide"  # (the caller's one block an item: the rounds do not apply)
        two, wide = (heads * -(-int(m) // rows) for rows in (emit_fa3.TWO_TILES[0], emit_fa3.WIDE_TILES[0]))
        uniform = self._mask_kind() == "none"  # every q tile the same work
        return "two" if emit_fa3.two_rounds_pay(two, wide, int(blocks), uniform) else "wide"

    def _two_tiles_split(self, m: Optional[int], n: Optional[int], heads: Optional[int], blocks: Any) -> bool:
        """Whether a D = 64 call that the work rule keeps off the wide tiles takes the persistent kernel's 128 x 128
        tiles ("two") instead of emit_fa3's 128 x 64 because its grid is small enough for split-kv's parts there
        (auto_kv_parts > 1 on its longest q tile), which the 128 x 64 kernel has none of. Why: a few q tiles
        against a long cache (M = 65-256, N = 8k, H = 8: 8-16 q tiles on 132 SMs) ran one block a q tile through
        every kv tile, where D = 128's same call splits in 8-16 parts. `extra={"small_grid": False}` keeps
        128 x 64."""
        from .backends.numba_cuda import emit_fa3

        if not (m and n and heads and blocks) or not self.extra.get("small_grid", True):
            return False
        return self._parts_by_longest(*emit_fa3.TWO_TILES, int(m), int(n), 64, heads, int(blocks)) > 1

    def _decode_tiles(self, dtype: str, path: str, env: dict[str, int]) -> bool:
        """Whether a call with these sizes takes the persistent kernel's decoding tiles (emit_fa3.DECODE_TILES: one
        consumer warpgroup of 64 rows): the automatic persistent choice on the default pipeline, no mask or a static
        one (those split-kv parts), `extra={"decode_tiles": False}` not given, and either at most DECODE_MAX_ROWS
        query rows or a small prefill grid where the 64-row tiles' count of kv steps is the smaller
        (emit_fa3.decode_tiles_pay: twice the q tiles fill SMs a 128-row grid would leave idle or fill by split-kv's
        merge; `extra={"small_grid": False}` keeps the tiles the call would take otherwise).
        Why: a 128-row q tile for a few rows runs its second warpgroup's products on padding, half the tensor cores'
        time a kv tile, while decoding is bound by reading K and V (benchmarks/NOTES.md, "Decoding's tiles"); on a
        grid that fills half the SMs or less, twice the q tiles fill them without split-kv's merge, or with fewer
        parts (NOTES, "Small prefill grids on 64-row q tiles")."""
        from .backends.numba_cuda import emit_fa3

        if (self.pipeline != "fa2-fwd" or not self.extra.get("decode_tiles", True)
                or self._mask_kind() not in ("none", "static")):
            return False
        m, n = self._seq_lengths(env)
        choice = self._auto_choice(dtype, env["D"], path, few_rows=bool(m) and m <= emit_fa3.DECODE_MAX_ROWS)
        if not (choice and choice.get("persistent")):
            return False
        if not m:
            return False
        if m <= emit_fa3.DECODE_MAX_ROWS:
            return True
        heads = self._heads(env)
        blocks = int(self.extra.get("persistent", choice["persistent"]) or 0)
        if not self.extra.get("small_grid", True) or heads is None or not n or not blocks:
            return False
        bq, bk = emit_fa3.DECODE_TILES
        items64, items128 = heads * -(-m // bq), heads * -(-m // 128)
        if items128 > emit_fa3.KV_SPLIT_MAX_FILL * blocks:
            return False  # (128-row q tiles past half the SMs: the 64-row ones take two rounds, never the fewer steps)
        tiles64, tiles128 = (self._visited_kv_tiles(rows, bk, m, n, env["D"]) for rows in (bq, 128))
        return (tiles64 is not None and tiles128 is not None
                and emit_fa3.decode_tiles_pay(items64, tiles64, items128, tiles128, blocks))

    def _visited_kv_tiles(self, bq: int, bk: int, m: int, n: int, head_dim: int) -> Optional[float]:
        """The kv tiles a q tile of bq x bk tiles visits at M = m, N = n: all of them, or on average under a static
        mask by the cost model's count (causal at N = 1k visits 4.5 of 8 on 128 x 128 tiles; the count's q tiles
        are those of one (b, h) at every size 1, GQA's G heads included); None where the model cannot count it."""
        tiles = float(-(-n // bk))
        if self._mask_kind() == "static":
            flops = self._visited_flops([(bq, bk, "last")], m, n, head_dim)
            if flops is None:
                return None
            tiles = flops[0] / (4 * bq * bk * head_dim * -(-m // bq) * self._unit_heads())
        return tiles

    def _kv_parts(self, dtype: str, path: str, env: dict[str, int], tiling: Optional[str]) -> int:
        """split-kv's parts for a call with these sizes: `extra["kv_parts"]` where the caller gives a count, else
        (auto) emit_fa3.auto_kv_parts on the call's grid and the kv tiles its longest q tile visits
        (`_longest_kv_tiles`: a grid that splits fits one round of the SMs, so its longest item is its time; causal
        at N = 1k visits 8 kv tiles in its last q tile, 4.5 on average: the average kept it whole, and two parts ran
        1.02-1.28x at B = 1, H = 1-4, N = 1-1.5k, H200 2026-11-30, benchmarks/NOTES.md), where the automatic choice
        is the persistent warp-specialized kernel (D = 64 or 128, Hopper) on the default pipeline, with no mask or
        a static one and the call's batch, heads and lengths known; 1 (no split) otherwise. Decoding's parts (at
        most DECODE_MAX_ROWS rows) keep one kv tile where that makes at most KV_PARTS_CLUSTER parts and the graph has
        no mask or a static one (merged in a cluster at that count), else KV_PART_MIN_TILES_DECODE kv tiles, as a
        small prefill grid's 64-row q tiles do (half a 128-row tile's tensor work a kv tile: 4 parts of 2 tiles ran
        1.09-1.23x 2 parts of 4 at N = 1k, H = 1-2, H200 2026-11-30); prefill's 128-row tiles KV_PART_MIN_TILES
        (specialize halves decoding's 8 where the device holds too few of their clusters: `_fewer_parts_held`). The
        kernel is then the split-kv IR's (`_retile` with split-kv{parts=P,part_dtype=<dtype>} after the pipeline):
        the dump shows what runs."""
        from .backends.numba_cuda import emit_fa3

        asked = self.extra.get("kv_parts", "auto")
        if asked != "auto" and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 1
                                or asked & (asked - 1) or asked > emit_fa3.KV_PARTS_MAX):
            raise FalowerError(f"extra kv_parts must be 'auto' or a power of two from 1 to {emit_fa3.KV_PARTS_MAX}, "
                               f"got {asked!r}")
        if asked == 1:
            return 1
        choice = self._auto_choice(dtype, env["D"], path, few_rows=tiling == "decode")
        why = [w for w, bad in [
            ("the default pipeline fa2-fwd", self.pipeline != "fa2-fwd"), (f"D = 64 or 128 (got {env['D']})",
                                                                           env["D"] not in (64, 128)),
            (f"no mask or a static one (got {self._mask_kind()})", self._mask_kind() not in ("none", "static")),
            ("the persistent warp-specialized kernel (a Hopper GPU, the automatic schedule)",
             not choice or not choice.get("persistent") or choice.get("schedule") != "wgmma-ws")] if bad]
        if why:
            if asked != "auto":
                raise FalowerError(f"extra kv_parts={asked}: split-kv's parts need {', '.join(why)}")
            return 1
        if asked != "auto":
            return int(asked)
        heads = self._heads(env)
        m, n = self._seq_lengths(env)
        if heads is None or not m or not n:
            return 1
        bq, bk, blocks = self._persistent_tiles(env, tiling, choice)
        few_rows = tiling == "decode" and m <= emit_fa3.DECODE_MAX_ROWS  # (decoding's tiles: a kv tile is its bytes)
        if few_rows:  # parts of one kv tile where they make at most KV_PARTS_CLUSTER (merged in a cluster at that
            # count: a masked grid's too, its parts first, _forward_spec; other masks returned 1 above)
            one = self._parts_by_longest(bq, bk, m, n, env["D"], heads, blocks, 1)
            if one <= emit_fa3.KV_PARTS_CLUSTER:
                return one
        return self._parts_by_longest(bq, bk, m, n, env["D"], heads, blocks, emit_fa3.KV_PART_MIN_TILES_DECODE
                                      if tiling == "decode" else emit_fa3.KV_PART_MIN_TILES)

    def _fewer_parts_held(self, dtype: str, path: str, env: dict[str, int], tiling: Optional[str],
                          parts: int) -> bool:
        """Whether decoding's automatic `parts` (KV_PARTS_CLUSTER, one kv tile each, a cluster a q tile) are better
        halved and merged in clusters of that half (specialize keeps the half only where its kernel takes them):
        where the current device holds fewer than the grid's q tiles in clusters of `parts` at once but all of
        them in clusters of the half (runtime.device_clusters_held), and the longest q tile's keys are few enough
        (emit_fa3.KV_FEWER_PARTS_MAX_KEYS at D) that the merge kernel the plan would fall back to costs more than
        the parts' longer loops. The caller's own kv_parts, cluster_merge or blocks_per_sm 2 keep the count.
        Measured (H200 2026-11-30, B = 2, H = 8: 16 q tiles, 15 clusters of 8 held, 30 of 4; CUDA graphs,
        `split_parts.py --set twos`, with the caches in L2 and cold, benchmarks/NOTES.md): 4 parts in clusters of
        4 1.10-1.14x the 8 parts' merge kernel at N = 1k, 1.02-1.17x at 2k for D = 128 (0.98x at D = 64), 0.93-0.97x
        at 3k and 0.88-0.90x at 4k-8k for D = 128."""
        from .backends.numba_cuda import emit_fa3
        from .backends.numba_cuda.runtime import device_clusters_held

        if (parts != emit_fa3.KV_PARTS_CLUSTER or tiling != "decode" or self.extra.get("kv_parts", "auto") != "auto"
                or not self._clusters_unasked()):
            return False
        m, n = self._seq_lengths(env)
        heads = self._heads(env)
        if not (m and n and heads) or m > emit_fa3.DECODE_MAX_ROWS:
            return False
        choice = self._auto_choice(dtype, env["D"], path, few_rows=True)
        if not choice or not choice.get("persistent"):
            return False
        bq, bk, _ = self._persistent_tiles(env, tiling, choice)
        tiles = self._longest_kv_tiles(bq, bk, m, n, env["D"])
        if tiles is None or tiles * bk > emit_fa3.KV_FEWER_PARTS_MAX_KEYS.get(env["D"], 0):
            return False
        items = heads * -(-m // bq)
        held, half = device_clusters_held(parts), device_clusters_held(parts // 2)
        return held is not None and half is not None and held < items <= half

    def _clusters_unasked(self) -> bool:
        """Whether the automatic choice may merge split-kv's parts in clusters: not where the caller set
        cluster_merge, nor under blocks_per_sm 2 (two blocks an SM: not one round of the SMs, not measured)."""
        from .backends.numba_cuda.spec import forward_extra

        return "cluster_merge" not in forward_extra(self.extra) and self.extra.get("blocks_per_sm") != 2

    def _cluster_small_grid(self, dtype: str, path: str, env: dict[str, int], tiling: Optional[str],
                            parts: int) -> bool:
        """Whether a call's grid in 4 parts (`_kv_parts`), or decoding's in 2, merges them in a cluster (extra
        cluster_merge, unless the caller set it; emit_fa3_ws.cluster_merge still says whether the kernel can). A
        small prefill grid's 4 parts: where its blocks are at most half the persistent kernel's, so that its
        clusters surely fit at once (a GPC holds a few; grids of more waited: 4 parts of 32 q tiles in clusters ran
        1.38x and 1.53x slower than with the merge kernel). Measured (H200 2026-11-30, CUDA graphs,
        benchmarks/NOTES.md "Captured calls"): 4 parts in a cluster 1.08-1.15x the merge kernel's calls (decoding
        at N = 512, causal, plain and prefix LM at B = 1, H = 1, N = 1k); 2 parts 0.93-0.95x at D = 128 on small
        prefill grids, 0.98-1.04x elsewhere: not taken there. 8 parts take the cluster anyway
        (emit_fa3.KV_PARTS_CLUSTER).

        Decoding's rows (M <= 64) take a cluster at 2 or 4 parts where the whole grid fits the persistent kernel's
        blocks (its merge kernel's launch is then what a call pays after its one round); where the device holds
        fewer of the grid's clusters at once, the call's plan takes the merge kernel (FA2ForwardKernel.plan: the
        H200 holds 66 of 2, 30 of 4, 15 of 8; "half the SMs" above was a stand-in for that count). Measured (H200
        2026-11-30, CUDA graphs, `split_parts.py`, each set with the caches in L2 and with them cold, `--cold`):
        2 parts at B = 8, H = 8 (64 q tiles, 128 blocks) at D = 128 1.08-1.13x the merge kernel at N = 1k,
        1.04-1.05x at 2k, 1.03x at 4k, at D = 64 1.00-1.04x, GQA (N = 8k) 1.01-1.02x (`--set cluster`, twice); 4
        parts at B = 3 (24 q tiles, 96 blocks, 24 clusters) 1.03-1.15x at D = 128 and 64, N = 1k-4k, GQA and M = 16
        (`--set threes`); none slower. Past the blocks (B = 16 in 2 parts: 256) clusters waited, 0.66-0.68x."""
        from .backends.numba_cuda import emit_fa3

        if parts not in (2, 4) or not self._clusters_unasked():
            return False
        choice = self._auto_choice(dtype, env["D"], path, few_rows=tiling == "decode")
        heads, (m, _) = self._heads(env), self._seq_lengths(env)
        if not choice or not choice.get("persistent") or heads is None or not m:
            return False
        # (decoding's rows, not a small prefill grid on decoding's 64-row tiles: 2 parts lost there)
        decoding = tiling == "decode" and m <= emit_fa3.DECODE_MAX_ROWS
        if parts == 2 and not decoding:
            return False
        bq, _, blocks = self._persistent_tiles(env, tiling, choice)
        return (1 if decoding else 2) * heads * -(-m // bq) * parts <= blocks

    def _persistent_tiles(self, env: dict[str, int], tiling: Optional[str], choice: dict) -> tuple[int, int, int]:
        """(bq, bk, blocks): the persistent kernel's tiles for a call of these sizes and `tiling`, and its blocks
        (the caller's extra persistent, else the automatic `choice`'s), as split-kv's counts take them."""
        from .backends.numba_cuda import emit_fa3
        from .backends.numba_cuda.from_ir import reads_table_tile

        bq, bk = emit_fa3.tiles(env["D"], self._mask_kind(), reads_table_tile(self.analysis), persistent=True,
                                two=tiling == "two", decode=tiling == "decode")
        if tiling == "decode":
            bk = self._decode_block_k(env["D"]) or bk
        return bq, bk, int(self.extra.get("persistent", choice["persistent"]))

    def _decode_block_k(self, head_dim: int) -> Optional[int]:
        """The kv tile width decoding's persistent tiles take where the caller's knobs set it: 64 under
        blocks_per_sm 2 at D = 128 (two blocks' 64 x 128 rings of 128 KB do not fit an SM), else extra
        decode_block_k (64 or 128, spec.EXTRA_CHOICES); None where neither does. The kernel's tiles and split-kv's
        part counts both read it, so the parts are counted on the tiles the kernel runs."""
        from .backends.numba_cuda.from_ir import BackendError

        asked = self.extra.get("decode_block_k")  # (both forward keys: forward_extra keeps them)
        if self.extra.get("blocks_per_sm") == 2 and head_dim == 128:
            if asked == 128:
                raise BackendError("numba-cuda backend: extra blocks_per_sm 2 with decode_block_k 128 at D = 128: "
                                   "two blocks' K / V rings do not fit an SM's shared memory (decode_block_k 64 "
                                   "does, the default with blocks_per_sm 2)")
            return 64
        return None if asked is None else int(asked)

    def _parts_by_longest(self, bq: int, bk: int, m: int, n: int, head_dim: int, heads: int, blocks: int,
                          min_tiles: Optional[int] = None) -> int:
        """emit_fa3.auto_kv_parts for `heads` (b, h) pairs of bq x bk q tiles on `blocks` blocks, counted on the
        longest q tile's kv tiles (`_longest_kv_tiles`), parts keeping `min_tiles` tiles (KV_PART_MIN_TILES by
        default); 1 where the grid fills more than KV_SPLIT_MAX_FILL of the blocks (not counted) or cannot be
        counted."""
        from .backends.numba_cuda import emit_fa3

        items = heads * -(-m // bq)
        if items > emit_fa3.KV_SPLIT_MAX_FILL * blocks:
            return 1
        tiles = self._longest_kv_tiles(bq, bk, m, n, head_dim)
        if tiles is None:
            return 1
        return emit_fa3.auto_kv_parts(items, tiles, blocks, emit_fa3.KV_PART_MIN_TILES if min_tiles is None
                                      else min_tiles)

    def _unit_heads(self) -> int:
        """q's (b, h) pairs with every size 1, as the counts take them: G under GQA, else 1."""
        return self._heads({s: 1 for d in self.func.args[0].type.shape[:-2] for s in d.symbols()}) or 1

    def _heads(self, env: dict[str, int]) -> Optional[int]:
        """The (batch, head) pairs of a call: the product of q's sizes before its rows (GQA's H = HKV * G
        included), or None where one of them is not in `env` (a kernel specialized by its lengths alone)."""
        total = 1
        for d in self.func.args[0].type.shape[:-2]:
            try:
                total *= int(d.eval(env))
            except ShapeError:
                return None
        return total

    def _ragged_first_runs(self, dtype: str, path: str, choice: dict) -> bool:
        """Whether D = 64's persistent kernel, as the automatic choice and the caller's knobs make it, can start its
        q tiles before row 0 (emit_fa3_ws.validate_spec on that spec: a caller's tma_store=False cannot), so that
        the per-size question counts the tiling the kernel will run."""
        from .backends.numba_cuda import emit_fa3
        from .backends.numba_cuda.from_ir import build_spec
        from .backends.numba_cuda.spec import forward_extra

        key = ("ragged_runs", dtype, path)
        if key not in self._memo:
            low = self._retile(*emit_fa3.WIDE_TILES, "first")[1]
            spec = build_spec(low, {"D": 64}, dtype, path, self.num_warps, {**choice, **forward_extra(self.extra)})
            try:
                emit_fa3.validate_spec(spec)
                self._memo[key] = True
            except ValueError:
                self._memo[key] = False
        return self._memo[key]

    def _forward_spec(self, used: dict[str, int], dtype: str, path: str,
                      tiling: Optional[str], parts: int = 1, cluster: bool = False) -> tuple[Any, tuple[Func, Any]]:
        """The forward kernel's spec and the (lowered IR, analysis) it is built from.

        On the tensor-core path the schedule is mma.sync (emit_fa2) or, on a Hopper GPU, wgmma (emit_fa3):
        `extra={"schedule": ...}` decides when given; otherwise `emit_fa3.auto_extra` (compute capability 9.x
        from the driver, f16/bf16, D = 64 or 128; FALOWER_WGMMA=0/1 overrides), and an automatic choice the spec
        machinery cannot build falls back to mma.sync, never to an error. With the default pipeline the wgmma
        kernel gets its own tiles (`emit_fa3.tiles`: 128 x 128 at D = 128, 128 x 64 under a block list): the
        graph is lowered again with them, so the IR says the tiles the kernel runs. `tiling`: "decode" (`_decode_tiles`:
        one consumer warpgroup of 64 rows) or `_d64_tiling`'s
        answer for the call's sizes (None where no D = 64 choice arises); `parts`: `_kv_parts`'s (the persistent
        kernel's tries take split-kv's IR with that many parts first, each then unsplit); `cluster`:
        `_cluster_small_grid`'s (those parts merged in a cluster)."""
        from .backends.numba_cuda import emit_fa3, emit_fa3_ws
        from .backends.numba_cuda.from_ir import BackendError, build_spec, reads_table_tile
        from .backends.numba_cuda.spec import KERNEL_FORM, forward_extra

        fwd = forward_extra(self.extra)  # a backward knob leaves the forward kernel (and its name) as it is
        base = (self.lowered, self.analysis)
        asked = fwd.get("schedule")
        mask_kind = self._mask_kind()
        table_tile = reads_table_tile(self.analysis)
        # (a table-tile graph takes decoding's tiles only for a call of few rows: `_decode_tiles`)
        choice = self._auto_choice(dtype, used["D"], path, few_rows=tiling == "decode")
        if path == "mma" and asked == "wgmma":
            choice = emit_fa3.plain_extra(used["D"], mask_kind)

        def mma_sync():
            return build_spec(self.analysis, used, dtype, path, self.num_warps, fwd), base

        if choice is None:
            return mma_sync()
        ws_tiles = table_tile and choice.get("schedule") == "wgmma-ws"

        def wgmma_tiles(persistent: bool, two: bool) -> tuple[int, int]:
            """emit_fa3.tiles for this call's D, mask, table tile and tiling."""
            bq, bk = emit_fa3.tiles(used["D"], mask_kind, ws_tiles, persistent=persistent, two=two,
                                    decode=tiling == "decode")
            if persistent and tiling == "decode":
                bk = self._decode_block_k(used["D"]) or bk
            return bq, bk

        def built_for(extra: dict, ragged: bool = False, two: bool = False, kvp: int = 1) -> tuple[Func, Any]:
            """The lowered IR this try's kernel takes: the default pipeline's graph lowered again with its tiles
            (`emit_fa3.tiles`; `ragged`: the short q tile first, `ragged_first`; `two`: D = 64's small-grid
            tiles; `kvp`: split-kv's parts), the caller's own pipeline as it is."""
            want = wgmma_tiles(bool(extra.get("persistent")), two)
            if ragged or kvp > 1:
                return self._retile(*want, "first" if ragged else "last", kvp, dtype)
            if self.pipeline == "fa2-fwd" and want != (self.analysis.block_q, self.analysis.block_k):
                return self._retile(*want)
            return base

        def ragged_first(extra: dict, two: bool) -> bool:
            """Whether this try's kernel takes its short q tile first: the persistent producer-warpgroup kernel of
            the automatic choice on the default pipeline, where the cost model counts less work
            (`_ragged_first_pays`)."""
            if asked is not None or not extra.get("persistent") or self.pipeline != "fa2-fwd":
                return False
            return self._ragged_first_pays(*wgmma_tiles(True, two))

        def fit_rows(extra: dict, two: bool) -> dict:
            """128 rows a warpgroup is a default: tiles it does not fit (the caller's 64-row q tiles, the 128-wide kv
            tiles of a fallback from the warp-specialized kernel) or the caller's knobs (the softmax / P V overlap,
            which needs 64) keep 64 rows a warpgroup unless the caller asked for wg_rows itself."""
            low = built_for(extra, two=two)[1]
            if "wg_rows" in fwd or "wg_rows" not in extra or (
                    emit_fa3.wide_rows_fit(low.block_q, low.block_k, used["D"]) and not fwd.get("overlap")):
                return extra
            return {k: v for k, v in extra.items() if k != "wg_rows"}

        # an automatic choice the wgmma kernels refuse falls back: D = 64's small-grid tiles to its 192-row ones,
        # the persistent warp-specialized kernel to one block an item (at D = 128; at D = 64 to emit_fa3's kernel),
        # that to the plain one, that to mma.sync, as if never chosen; each try (extra, its small-grid tiles)
        two0 = tiling == "two"
        tries = [(choice, two0)] + ([(choice, False)] if two0 else []) \
            + ([(dict(emit_fa3.WS_EXTRA), False)] if choice.get("persistent") and used["D"] == 128 else []) \
            + ([(emit_fa3.plain_extra(used["D"], mask_kind), False)] if choice.get("schedule") == "wgmma-ws" else [])

        def loses_wide(extra: dict, two: bool) -> bool:
            """A try on the default pipeline's 192 x 128 tiles where the call's sizes make them visit too much more
            work (a narrow window, short causal: `_wide_tiles_pay`), dropped before its graph is lowered."""
            wants = wgmma_tiles(bool(extra.get("persistent")), two)
            return self.pipeline == "fa2-fwd" and wants == emit_fa3.WIDE_TILES and tiling == "narrow"

        tries = [(fit_rows(e, t), t) for e, t in tries if not loses_wide(e, t)]
        # a persistent try whose kernel refuses the short q tile first (the caller's knobs: no TMA stores) is tried
        # again with it last before the next try
        tries = [(e, t, r) for e, t in tries for r in ((True, False) if ragged_first(e, t) else (False,))]
        # split-kv's parts first where chosen, each try then again unsplit (a kernel that refuses the parts); the
        # caller's own count (extra kv_parts) takes no unsplit try: refused everywhere, it is an error
        explicit = parts > 1 and fwd.get("kv_parts", "auto") != "auto"
        tries = [(e, t, r, p) for e, t, r in tries
                 for p in ((parts,) if explicit else (parts, 1) if parts > 1 else (1,))]
        refused: list[str] = []  # why the split tries were refused (the caller's kv_parts says them)
        first_refused: Optional[tuple] = None  # the automatic choice's own try, where validate_spec refused it

        def note_fallback(ran: dict) -> None:
            """Tell the caller, once, where the automatic choice's kernel refused the caller's own forward knobs
            (it validates without them) and another kernel form (`ran`'s) was built: the knobs then say nothing
            of the kernel that runs (bench's `knobs_refused` leaves such rows untimed)."""
            if first_refused is None or not fwd:
                return
            extra, built, why = first_refused
            if all(ran.get(k) == extra.get(k) for k in KERNEL_FORM):
                return
            try:
                emit_fa3.validate_spec(build_spec(built[1], used, dtype, path, self.num_warps, dict(extra)))
            except ValueError:
                return  # refused without the knobs too: the choice's own limits, not the caller's
            key = ("fallback_note", tuple(sorted(fwd.items(), key=str)), why)
            if key not in self._memo:
                self._memo[key] = True
                print(f"[falower] note: the automatic choice's {_form_words(extra)} kernel refused extra "
                      f"{fwd}: {why.splitlines()[0] if why else 'refused'}; built the {_form_words(ran)} kernel "
                      f"instead", file=sys.stderr)

        for extra, two, ragged, kvp in tries:
            built = built_for(extra, ragged, two, kvp)
            spec = build_spec(built[1], used, dtype, path, self.num_warps, {**extra, **fwd})
            if asked is not None:
                return spec, built
            try:
                emit_fa3.validate_spec(spec)
            except ValueError as e:
                if kvp > 1:
                    refused.append(str(e))
                if first_refused is None:
                    first_refused = (extra, built, str(e))
                continue
            if "persistent" not in fwd and not spec.ragged_q_first and not emit_fa3_ws.persistent_pays(
                    spec, small_grid=two or tiling == "decode"):
                # the automatic choice's persistence, measured slower there: one block an item (IR whose q tiles
                # start before row 0 only the persistent kernel runs: kept)
                continue
            auto = {"ex2_poly": 0 if "ex2_poly" in fwd else emit_fa3_ws.auto_ex2_poly(spec),
                    "kv_reverse": False if "kv_reverse" in fwd else emit_fa3_ws.auto_kv_reverse(spec),
                    # decoding's masked grid in parts is one round of the SMs, whose order then does not matter: the
                    # parts the grid's fastest axis, not the heads, so that 8 of them are a cluster (cluster_merge)
                    "head_group": 1 if ("head_group" not in fwd and tiling == "decode" and kvp > 1
                                        and mask_kind == "static") else 0,
                    "cluster_merge": cluster}
            auto = {k: v for k, v in auto.items() if v}
            if auto:  # the automatic share of exponentials on the FMA pipe and kv order, shown in spec.extra
                spec = build_spec(built[1], used, dtype, path, self.num_warps, {**extra, **auto, **fwd})
            note_fallback(extra)
            return spec, built
        if explicit:
            raise BackendError(f"numba-cuda backend: extra kv_parts={parts}: "
                               + (refused[0] if refused else "no kernel here runs split-kv's parts"))
        note_fallback({"schedule": "mma"})
        return mma_sync()

    def _wide_tiles_pay(self, head_dim: int, m: Optional[int] = None, n: Optional[int] = None,
                        ragged: bool = False) -> bool:
        """emit_fa3.wide_tiles_pay on the FLOPs the cost model counts for the graph lowered with 128 x 64 tiles and
        with emit_fa3.WIDE_TILES, at sequence lengths M = m, N = n, each rounded up to a multiple of 64 and at most
        emit_fa3.WIDE_REFERENCE_N (its value where not given), every other size 1. 64 divides both tilings' rows
        and columns, so a length rounded up visits the same tiles as the length itself; a model fed many lengths
        counts at most 64 buckets a length, each pair in about 0.1 s (at N = 16k causal's count took ~1 s). Past 4k
        a length takes 4k's choice: causal's ratio only grows toward 1 there, but a 640-wide band's is 0.847 at 4k
        and 0.858 at 8k, so it stays on 128 x 64 where the wide tiles would just pay. A graph whose sequence
        lengths are not plain sizes of q and k, or that the cost model cannot count, keeps 128 x 64; so does a kv
        length under emit_fa3.WIDE_MIN_N. `ragged`: the wide kernel takes its short q tile first (`_d64_tiling`), so
        its work is counted that way."""
        from .backends.numba_cuda import emit_fa3

        def bucket(x: Optional[int]) -> int:
            return emit_fa3.WIDE_REFERENCE_N if not x else min(emit_fa3.WIDE_REFERENCE_N, -(-int(x) // 64) * 64)

        key = ("wide_pays", head_dim, bucket(m), bucket(n), ragged)
        if key not in self._memo:
            wide = (*emit_fa3.WIDE_TILES, "first" if ragged else "last")  # as the kernel tiles
            flops = self._visited_flops([(128, 64, "last"), wide], key[2], key[3], head_dim)
            self._memo[key] = flops is not None and emit_fa3.wide_tiles_pay(*flops, key[3])
        return self._memo[key]

    def _visited_flops(self, tilings: list[tuple[int, int, str]], m: int, n: int, head_dim: int) -> Optional[list]:
        """The FLOPs the cost model counts for the default pipeline's graph lowered with each (bq, bk, ragged_q) of
        `tilings` (`_retile`), at M = m, N = n, D = head_dim and every other size 1 (the tiles a static mask
        leaves, as the kernels visit them); the sequence sizes solved from m and n (a packed GQA graph's rows M*G
        give M); None where they cannot be, or the model cannot count it."""
        from .passes.cost import cost_of

        key = ("visited", tuple(tilings), m, n, head_dim)
        if key in self._memo:
            return self._memo[key]
        dims = self._count_dims(m, n, head_dim)
        got = None
        if dims is not None:
            try:
                got = [max(cost_of(self._retile(*t)[0], dims, data).flops for data in self._scalar_samples(n))
                       for t in tilings]
            except FalowerError:
                got = None
        self._memo[key] = got
        return got

    def _count_dims(self, m: int, n: int, head_dim: int) -> Optional[dict[str, int]]:
        """The sizes the counts take: M = m, N = n, D = head_dim, every other size 1 (the sequence sizes solved from
        m and n: a packed GQA graph's rows M*G give M); None where they cannot be."""
        q, k = self._seq_dims()
        seq = q.symbols() | k.symbols()
        dims = {s: 1 for a in self.func.args for d in a.type.shape for s in d.symbols() if s not in seq}
        try:
            dims.update(solve_dims([(q, m), (k, n)], {}))
        except (ShapeError, ValueError, ZeroDivisionError):
            return None
        dims["D"] = head_dim
        return dims

    def _scalar_samples(self, n: int) -> list[dict[str, int]]:
        """Values the counts give the graph's captured integer scalars (a window's offset behind a kv cache, a
        prefix length), which the kernel reads at run time and a count cannot see: each of 0 and n - 1 (decoding's
        offset n - M, within its few rows), within the scalar's dtype, the counts taking the
        largest (each sample is a count: two scalars make four). Without a value the model calls every tile a scalar
        bounds visited: a decoding window behind the cache's offset counted all 64 kv tiles at N = 8k for its 8 and
        split in 16 parts (0.79-0.86x as fast as in 4, H200 2026-11-30, benchmarks/NOTES.md). [{}] where there is
        none (or more than two: every tile, as before)."""
        scalars = [a for a in self.func.args[3:] if a.type.rank == 0 and a.type.dtype in ("i32", "i8")]
        if not scalars or len(scalars) > 2:
            return [{}]
        top = {"i32": 2 ** 31 - 1, "i8": 127}
        choices = [sorted({0, min(n - 1, top[a.type.dtype])}) for a in scalars]
        return [dict(zip([a.name for a in scalars], combo)) for combo in itertools.product(*choices)]

    def _longest_kv_tiles(self, bq: int, bk: int, m: int, n: int, head_dim: int) -> Optional[int]:
        """The most kv tiles one q tile of bq x bk tiles visits at M = m, N = n (a static mask's kv range by
        intervals.kv_range, whose classification the kernels' tile classifier follows; every tile without a mask):
        causal's last q tile visits all, where its average is half. Counted at b = 0 and the heads there are with
        every size 1 (GQA's G), the q tiles last first (causal's longest) until one visits every tile; a mask that
        varies with the batch or head may visit more (only the parts' count reads it). None where it cannot be
        counted."""
        from .ir import intervals

        total = -(-n // bk)
        if self._mask_kind() != "static":
            return total
        key = ("longest", bq, bk, m, n, head_dim)
        if key in self._memo:
            return self._memo[key]
        dims = self._count_dims(m, n, head_dim)
        try:
            op = None if dims is None else next((o for o in self._retile(bq, bk)[0].walk()
                                                 if o.name == "mask.kv_range"), None)
        except FalowerError:
            dims = None
        longest: Optional[int] = None if dims is None else total
        if dims is not None and op is not None:
            rows = int(self._seq_dims()[0].eval(dims))
            args = {a.name for a in self.func.args}
            longest = 0
            for data, h, q0 in itertools.product(self._scalar_samples(n), range(self._unit_heads()),
                                                 reversed(range(0, rows, bq))):
                caps = [np.int32(data[x.name]) if x.name in data and x.name in args else None for x in op.operands[4:]]
                lo, hi = intervals.kv_range(op.regions[0], 0, h, q0, bq, bk, n, caps, dims)
                longest = max(longest, hi - lo)
                if longest == total:
                    break
        self._memo[key] = longest
        return longest

    def _retile(self, bq: int, bk: int, ragged_q: str = "last", parts: int = 1,
                dtype: str = "f16") -> tuple[Func, Any]:
        """The graph lowered by the default pipeline with tile{bq,bk,ragged_q} instead of its tiles (and, for
        `parts` > 1, split-kv{parts,part_dtype=dtype} after it), and its analysis."""
        import re

        from .backends.numba_cuda.from_ir import analyse
        from .passes import NAMED_PIPELINES

        key = (bq, bk, ragged_q) + ((parts, dtype) if parts > 1 else ())
        if key not in self._retiled:
            opt = f",ragged_q={ragged_q}" if ragged_q != "last" else ""
            text = re.sub(r"\btile\{[^}]*\}", f"tile{{bq={bq},bk={bk}{opt}}}", NAMED_PIPELINES[self.pipeline], count=1)
            if parts > 1:
                text += f",split-kv{{parts={parts},part_dtype={dtype}}}"
            lowered = run_pipeline(self.func, text, **self.pipeline_kwargs)
            self._retiled[key] = (lowered, analyse(lowered))
        return self._retiled[key]

    def _ragged_first_pays(self, bq: int, bk: int) -> bool:
        """Whether the persistent kernel's q tiles take tile{ragged_q=first} (the short tile first): under a static
        mask, where the cost model counts less visited work that way at M = N = RAGGED_REFERENCE_N, a length that
        leaves a short tile for 128- and 192-row tiles alike (causal, prefix LM, ALiBi: the last q tile visits the
        most kv tiles, so its padded rows cost the most; 192 x 128 at 4k: -5.5%). Masks whose rows all visit
        alike (windows) count the same and keep the last; a graph the model cannot count keeps the last."""
        key = ("ragged_first", bq, bk)
        if key not in self._memo:
            flops = None
            if self._mask_kind() == "static" and self.pipeline == "fa2-fwd":
                n = RAGGED_REFERENCE_N
                flops = self._visited_flops([(bq, bk, "first"), (bq, bk, "last")], n, n, 64)
            self._memo[key] = flops is not None and flops[0] < flops[1]
        return self._memo[key]

    def lowered_of(self, kernel: Any) -> Func:
        """The lowered IR a forward kernel was built from (`lowered`, or the graph lowered again with the
        wgmma kernel's tiles)."""
        return self._built.get(kernel.spec.name, (self.lowered, None))[0]

    def __call__(self, *inputs: Any):
        if _wants_grad(inputs):
            from .autograd import differentiable_call

            return differentiable_call(self, inputs)
        return self.forward(*inputs)

    def runtime_sizes(self, kernel: Any, env: dict[str, int]) -> list[int]:
        """The sizes a call passes `kernel` after its captures (its lowered graph's runtime dims: a relative bias's
        N), from the dims `env` of the call's inputs."""
        analysis = self._built.get(kernel.spec.name, (self.lowered, self.analysis))[1]
        return [int(env[d]) for d in analysis.runtime_dims]

    def packed_for(self, env: dict[str, int]) -> Optional["CompiledAttention"]:
        """The packed GQA graph (passes/pack_gqa.py: a kv head's G query heads as the rows of one problem),
        compiled with this one's options, where a call with these sizes runs it: a GQA graph that packs (its q read
        only by the score's product; the query head and row rebuilt from the packed row where the mask reads them,
        not taken where the score does: `score_reads_query_index`), the default pipeline, at most
        pack_gqa.PACK_MAX_QUERY_ROWS query rows a head (decoding, speculative decoding), `extra={"pack_gqa": False}`
        not given; else None.
        Its `.func` and `.lowered` are the IR the call runs, its `specialize` the kernel. Why: each query head of a
        group otherwise reads the group's K and V itself, in q tiles of M rows (GQA decoding took 1.8-2.7x MHA
        decoding's time on the same K / V, H200, benchmarks/NOTES.md)."""
        from .passes.pack_gqa import PACK_MAX_QUERY_ROWS

        group = self._pack_group()
        m, _ = self._seq_lengths(env) if group > 1 else (None, None)
        if not m or group == 1 or m > PACK_MAX_QUERY_ROWS:
            return None
        if "packed" not in self._memo:  # compiled on the first call that packs
            self._memo["packed"] = compile(self._memo["pack"], self.backend, self.pipeline, self.path,
                                           self.num_warps, self.extra, backward=self.backward_pipeline,
                                           **self.pipeline_kwargs)
        return self._memo["packed"]

    def _pack_group(self) -> int:
        """G where this graph packs (pack_gqa's preconditions hold, the default pipeline, pack_gqa not turned off,
        the score not reading the query head or row: `score_reads_query_index`), else 1; the packed graph kept in
        `_memo["pack"]`."""
        if "pack" not in self._memo:
            from .passes.pack_gqa import group_of, pack_gqa, score_reads_query_index

            self._memo["pack"], self._memo["pack_group"] = None, 1
            if (self.extra.get("pack_gqa", True) and self.pipeline == "fa2-fwd" and group_of(self.func) > 1
                    and not score_reads_query_index(self.func)):
                try:
                    self._memo["pack"], self._memo["pack_group"] = pack_gqa(self.func)
                except PassError:
                    pass  # (a precondition failed, e.g. a gather of q: the graph runs as written)
        return self._memo["pack_group"]

    def forward(self, *inputs: Any):
        """(o, lse) without autograd: the forward kernel (or the interpreter for the reference backend); a GQA
        decoding call through the packed graph (`packed_for`)."""
        key = _signature(inputs)
        call = self._calls.get(key) if key is not None else None
        if call is not None:
            return call(inputs)
        packed = None
        if self._pack_group() > 1 and len(inputs) == len(self.func.args):
            packed = self.packed_for(self._dims(inputs))
        if packed is not None:
            call = _PackedCall(packed, self._pack_group())
            if key is not None:
                self._calls[key] = call
            return call(inputs)
        if self.backend == "reference":
            arrays = [_host_array(x) for x in inputs]
            return tuple(Interpreter("native").run(self.lowered, arrays))
        k, env = self._kernel_and_dims(inputs)
        lowered, analysis = self._built.get(k.spec.name, (self.lowered, self.analysis))
        call = _WarmCall(k, [lowered.args.index(c) for c in analysis.captures],
                         [c.type.dtype for c in analysis.captures], self.runtime_sizes(k, env), inputs[0],
                         blocks=self.block_data(k))
        if key is not None:
            self._calls[key] = call
        return call(inputs)

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

    def backward(self, q: Any, k: Any, v: Any, o: Any, lse: Any, do: Any, *captures: Any, dlse: Any = None) -> tuple:
        """Gradients (dq, dk, dv, *d<float capture>) of the forward's o, given the forward's o and lse and
        the cotangent do (all of one kind: torch CUDA tensors, CUDA arrays or numpy); with `dlse` (lse's shape),
        of a loss that reads the lse too (passes/lse_cotangent.py: Delta - dlse)."""
        inputs = (q, k, v, *captures)
        if len(inputs) != len(self.func.args):
            names = ", ".join(a.name or "?" for a in self.func.args[3:])
            raise ShapeError(f"backward of @{self.func.name} takes q, k, v, o, lse, do and {len(self.func.args) - 3} "
                             f"captured tensors ({names or 'none'}), got {len(captures)}")
        by_name = {a.name: x for a, x in zip(self.func.args, inputs)}
        out = self.func.result_names[0]  # the backward takes O and its cotangent by the output's name (recompute's)
        by_name.update({"o": o, "lse": lse, "do": do, out: o, f"d{out}": do})
        bwd = self.lowered_backward
        cot = lse_cotangent_arg(bwd)  # a graph returning its LSE: the backward takes its cotangent (d<name>)
        if dlse is not None:
            check_dlse(dlse, lse)
        if self.backend == "reference":
            if dlse is not None and cot is None:
                bwd = self._backward_with_lse_cotangent()
                cot = lse_cotangent_arg(bwd)
            if cot is not None:
                by_name[cot.name] = dlse if dlse is not None else np.zeros_like(_host_array(lse))
            arrays = [_host_array(by_name[a.name]) for a in bwd.args]
            return tuple(Interpreter("native").run(bwd, arrays))
        key = _signature((q, k, v, o, lse, do, *captures))
        call = self._bwd_calls.get(key) if key is not None else None
        if call is None:
            kern, env = self._backward_kernel_and_dims(inputs)
            names = [a.name for a in self.func.args]  # q, k, v, captures; the call adds o, lse, do after v
            call = _WarmCall(kern, [names.index(c.name) + 3 for c in self._bwd_analysis.captures],
                             [c.type.dtype for c in self._bwd_analysis.captures],
                             [int(env[d]) for d in kern.spec.dims], q, backward=True, blocks=self.block_data(kern))
            if key is not None:
                self._bwd_calls[key] = call
        return _with_constant_gradients(bwd, call((q, k, v, o, lse, do, *captures), dlse=dlse), by_name)

    def _backward_with_lse_cotangent(self) -> Func:
        """The backward IR with the LSE's cotangent (passes/lse_cotangent.py), made once."""
        if self._bwd_dlse is None:
            self._bwd_dlse = with_lse_cotangent(self.lowered_backward)
        return self._bwd_dlse

    def block_data(self, kern: Any) -> Any:
        """The BlockData of a kernel whose spec has derived captures (range tables, the block list), one per
        kernel, shared by every signature's call: block data made once per distinct captured data."""
        from .backends.numba_cuda.block_data import BlockData, has_derived

        if not has_derived(kern.spec):
            return None
        bd = self._block_data.get(kern.spec.name)
        if bd is None:
            bd = self._block_data[kern.spec.name] = BlockData(kern.spec)
        return bd

    def backward_kernel(self, *inputs: Any):
        """The FA2BackwardKernel these forward inputs' gradients would run (built on first use)."""
        return self._backward_kernel_and_dims(inputs)[0]

    def _backward_kernel_and_dims(self, inputs: tuple) -> tuple[Any, dict[str, int]]:
        env = self._dims(inputs)
        return self._backward_kernel_and_dims_for(_dtype_of(inputs[0]), env["D"]), env

    @deep_graphs()
    def _backward_kernel_and_dims_for(self, dtype: str, D: int):
        """The backward kernel for inputs of `dtype` and head dim D (built on first use)."""
        from .backends.numba_cuda.from_ir import unbuildable_backward
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
            from .backends.numba_cuda.emit_fa3_bwd import backward_extra  # Hopper at D = 128: the wgmma kernel
            from .backends.numba_cuda.runtime import device_cc

            extra = backward_extra(self.extra, dtype=dtype, head_dim=env["D"],
                                   cc=device_cc() if path == "mma" else None)
            spec = build_backward_spec(self._bwd_analysis, {"D": env["D"]}, dtype, path, None, extra)
            try:
                kern = FA2BackwardKernel(spec)
            except ValueError as e:
                raise unbuildable_backward(e, spec, path) from None
            level = debug_level()
            if level >= 3:
                print(f"[falower] backward kernel {spec.name}:\n{kern.source}", file=sys.stderr)
            self._bwd_kernels[key] = kern
        return self._bwd_kernels[key]


    @property
    def source(self) -> str:
        """The generated source of the forward kernel built last (at D = 64 one compiled object may hold two, chosen by
        the call's lengths: `.kernel(*inputs).source` is the one those inputs run)."""
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


def _with_constant_gradients(bwd: Func, grads: tuple, inputs: dict) -> tuple:
    """The kernels' gradients (dq, dk, dv and each scattered table's, in order) with the backward function's
    constant results put back where it returns them: a float table read only by a mask has a zero gradient, which
    no kernel computes. Each zero is made like its input (a torch tensor, a numpy array or a CUDA array)."""
    const = [i for i, v in enumerate(bwd.results) if const_value(v) is not None]
    if not const:
        return grads
    rest = iter(grads)
    out = []
    for i, (name, v) in enumerate(zip(bwd.result_names, bwd.results)):
        if i not in const:
            out.append(next(rest))
            continue
        like = inputs[name[1:]]
        fill = float(const_value(v))
        if type(like).__module__.startswith("torch"):
            out.append(like.new_full(like.shape, fill))
        elif hasattr(like, "__cuda_array_interface__") and not isinstance(like, np.ndarray):
            from numba import cuda

            out.append(cuda.to_device(np.full(like.shape, fill, dtype=np.dtype(like.dtype))))
        else:
            out.append(np.full(np.shape(like), fill, dtype=np.asarray(like).dtype))
    return tuple(out)


def _host_array(x: Any) -> Any:
    """numpy view of an input for the reference backend (torch tensors are detached and copied to the host)."""
    if type(x).__module__.startswith("torch"):
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


_TENSOR: list = []  # torch.Tensor once torch is imported (falower never imports it for a signature)


def _signature(inputs: tuple) -> Optional[tuple]:
    """The key of a warm call: each torch tensor's shape, strides, dtype and device, each other input's type;
    None when an input is not a torch tensor or a Python number (numpy arrays take the checked path)."""
    if not _TENSOR:
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        _TENSOR.append(torch.Tensor)
    tensor = _TENSOR[0]
    key = []
    for x in inputs:
        if isinstance(x, tensor):
            key.append((x.shape, x.stride(), x.dtype, x.device))
        elif isinstance(x, (int, float, bool)):
            key.append(type(x))
        else:
            return None
    return tuple(key)


_UNSET = object()

def _form_words(extra: Mapping) -> str:
    """A forward kernel's form in words, from its spec.extra: its schedule, producer and persistence."""
    words = [str(extra.get("schedule", "mma"))]
    if extra.get("producer") not in (None, False):
        words.append(f"producer {extra['producer']}")
    if extra.get("persistent"):
        words.append("persistent")
    return " ".join(words)


class _WarmCall:
    """One input signature's call of a forward or backward kernel: which inputs are its captures, in the
    kernel's order, and the run-time sizes it takes (known from the signature). A 0-d captured tensor reaches
    the kernel as a 1-element view the kernel reads, never `.item()` (no synchronisation, capturable in a
    CUDA graph); one of another dtype is converted on the device; a Python number given for it is copied
    to a 1-element array once per value (`_number`)."""

    __slots__ = ("kernel", "order", "dtypes", "dims", "n", "plan", "_numbers", "_device", "blocks")

    def __init__(self, kernel: Any, order: list[int], dtypes: list[str], dims: list[int], like: Any,
                 backward: bool = False, blocks: Any = None):
        self.kernel, self.order, self.dtypes, self.dims = kernel, order, dtypes, dims
        self.blocks = blocks  # BlockData: captures made from the data (range tables, block list), remembered
        self.n = 6 if backward else 3  # q, k, v (o, lse, do), then the captures
        self.plan: Any = _UNSET  # the kernel's direct launches for this signature (None: the Numba path)
        self._numbers: dict[tuple, Any] = {}
        self._device = getattr(like, "device", None) if type(like).__module__.startswith("torch") else None

    def arguments(self, inputs: tuple) -> tuple[tuple, list]:
        """(the arrays, the captures) the kernel takes for `inputs`: the caller's captures in the kernel's order, the
        run-time sizes, then the block data derived from them (made once per data)."""
        caps = [self._capture(inputs[i], dt) for i, dt in zip(self.order, self.dtypes)] + self.dims
        arrays = inputs[:self.n]
        if self.blocks is not None:
            q, k = arrays[0], arrays[1]
            sizes = (int(q.shape[0]), int(q.shape[1]), int(q.shape[2]), int(k.shape[2]))
            caps += self.blocks.derive(caps, sizes, q)
        return arrays, caps

    def __call__(self, inputs: tuple, **lse_cotangent: Any):
        """The kernel's outputs for `inputs` (a backward's `dlse=` goes to the kernel when given)."""
        arrays, caps = self.arguments(inputs)
        plan = self.plan
        if plan is _UNSET:  # the signature fixes everything the kernel's plan depends on: ask once
            plan = self.plan = self.kernel.plan(*arrays, tuple(caps))
        extra = {k: x for k, x in lse_cotangent.items() if x is not None}
        if plan is not None:
            out = plan(*arrays, caps, **extra)
            if out is not None:
                return out
        return self.kernel(*arrays, *caps, **extra)

    def _capture(self, x: Any, dtype: str) -> Any:
        shape = getattr(x, "shape", None)
        if shape is None:  # a Python number for a 0-d capture
            return self._number(x, dtype) if self._device is not None else x
        if len(shape) == 0 and self._device is not None:
            want = _TORCH_DTYPES[dtype]
            if x.dtype != want or x.device != self._device:
                x = x.detach().to(device=self._device, dtype=want)
        return x

    def _number(self, x: Any, dtype: str) -> Any:
        key = (type(x), x, dtype)
        t = self._numbers.get(key)
        if t is None:
            import torch

            if len(self._numbers) > 64:
                self._numbers.clear()
            t = torch.full((), x, dtype=_TORCH_DTYPES[dtype], device=self._device)
            self._numbers[key] = t
        return t


class _PackedCall:
    """A call through the packed GQA graph (CompiledAttention.packed_for): q [B, HKV*G, M, D] as [B, HKV, M*G, D]
    (a view where heads follow rows, always at M = 1; numpy and torch copy otherwise), O and LSE given back in the
    caller's shapes [B, HKV*G, M, D] and [B, HKV*G, M] (views of the packed ones)."""

    __slots__ = ("compiled", "group")

    def __init__(self, compiled: "CompiledAttention", group: int) -> None:
        self.compiled, self.group = compiled, group

    def __call__(self, inputs: tuple):
        q = inputs[0]
        B, H, M, D = (int(n) for n in q.shape)
        o, lse = self.compiled.forward(q.reshape(B, H // self.group, M * self.group, D), *inputs[1:])
        return o.reshape(B, H, M, o.shape[-1]), lse.reshape(B, H, M)


class _TorchDtypes(dict):
    def __missing__(self, dtype: str) -> Any:
        import torch

        out = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32, "f64": torch.float64,
               "i32": torch.int32, "i8": torch.int8, "bool": torch.bool}[dtype]
        self[dtype] = out
        return out


_TORCH_DTYPES = _TorchDtypes()


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
    from .backends.numba_cuda.spec import unknown_extra

    if extra is not None and not isinstance(extra, Mapping):
        raise FalowerError(f"compile's extra must be a dict of knobs, got {type(extra).__name__}")
    bad = unknown_extra(dict(extra or {}))
    if bad:
        raise FalowerError(bad)
    lowered = run_pipeline(func, pipeline, **pipeline_kwargs)
    if "lse_result" in lowered.attrs:  # raise_lse took it out of the results; online-softmax puts it back
        raise FalowerError(f"@{func.name} returns its softmax's LSE ({lowered.attrs['lse_result']}), which pipeline "
                           f"{pipeline} does not compute: end it with online-softmax (as fa2-fwd does)")
    return CompiledAttention(func, lowered, backend, path, num_warps, extra, backward_pipeline=backward,
                             pipeline=pipeline, pipeline_kwargs=pipeline_kwargs)
