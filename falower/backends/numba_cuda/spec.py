"""The contract between the IR side of the backend and the kernel emitter.

`from_ir.py` reads the final fa2-fwd IR and fills an `FA2ForwardSpec`; `emit_fa2.py` turns a spec into
Numba CUDA source. The schedule (tiles, warps, the tensor-core or SIMT path) is fixed by the spec's
fields; what varies between attention variants (score function, mask, tile classification) arrives as
Python source of three small device functions, so the emitter never needs to know which variant it is.

Contract of `device_source` (plain `def`s, no decorators; `math` and `np` are in scope, and module-level
`np.float32` constants may be defined before them):

    score_fn(s, b, h, q, kv, *captures) -> float32
        s is the raw fp32 dot product q_row . k_row (no scale applied); b, h, q, kv are int32 absolute
        indices (h is the query head). Returns the softmax exponent input, already multiplied by log2(e)
        when `exp2` is set. Does not apply the mask.
    mask_fn(b, h, q, kv, *captures) -> bool              (only when has_mask)
        True keeps the score, False makes it -inf.
    row_bounds_fn(b, h, q, *captures) -> (lo, hi, exact)  (only where the mask keeps one kv interval per row)
        where exact, mask_fn(b, h, q, kv) == (lo <= kv < hi) for every kv (row_bounds.py), and partial tiles
        compare against it instead of calling mask_fn per element; lo may be negative and hi past N. exact is
        False only for rows whose run table (ids that come back) gives no interval: mask_fn per element there.
    score_raw_fn(s, b, h, q, kv, *captures) -> float32   (only where score_scale > 0 and x is not s itself)
        score_fn / score_scale: the score before its last constant factor. Where score_scale > 0 the pair
        functions below return this x, not the score.
    score_pair_fn(s0, s1, b, h, q, kv, *captures) -> (float32, float32)   (only where the score reads a table at
        [.., kv]: from_ir.pair_gathers) score_fn of columns kv and kv + 1 (kv even), the table's two entries by one
        8-byte load; only called where pairs_ok_fn(b, h, *captures) holds (the tables are aligned for it).
    tile_class_fn(b, h, q_lo, q_hi, kv_lo, kv_hi, *captures) -> int32   (block_mask "static" or "list")
        Classifies the tile of rows q_lo..q_hi and columns kv_lo..kv_hi (inclusive) for the user mask:
        0 = empty (skip the tile), 1 = partial (evaluate mask_fn), 2 = full (no mask arithmetic).

Captures with a `derived` recipe are not the caller's: they come after the caller's captures and sizes and
are made from them before the launch (block_data.py): `("ranges", i, axis, granule)` is `mask.ranges` of
capture i (per-granule min / max along axis, [..., 2]); `("kv_count",)` and `("kv_tiles",)` are the
block list of block_mask == "list": for q tile r = (b * H + h) * nq + qt, kv_count[r] kv tiles to visit,
listed ascending in kv_tiles[r * nk : r * nk + kv_count[r]] as j * 2 + (1 if the tile is partial else 0),
made by tile_class_fn (so the kernel visits no empty tile and scans nothing).

Bounds are the kernel's job, not the device functions': rows q >= M are never stored, columns kv >= N
are -inf. Captured tensors are passed after q, k, v in `captures` order; gathers in the device functions
clamp their indices, so padded tile positions never read outside a table. A row whose every score is
masked gives O = 0 and LSE = -inf, never NaN.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

DTYPES = ("f16", "bf16", "f32", "f64")  # f64: SIMT only, for gradcheck
PATHS = ("mma", "simt")
BLOCK_MASKS = ("none", "static", "table", "list")

# Every key of `extra` (falower.compile's, then spec.extra) the backend reads: a key not here would be ignored, so
# falower.compile refuses it by name (a typo's knob silently off). tests/backend/test_extras.py holds this set to the
# keys the code reads and to bench.py's config flags.
KNOWN_EXTRAS = frozenset({
    "blocks_per_sm", "bounds_in_s", "bulk_store", "bwd_batch_inner", "bwd_block_list", "bwd_persistent",
    "bwd_pingpong", "bwd_schedule", "class32", "cluster_merge", "cluster_push", "col_mma", "col_step", "decode_block_k", "decode_tiles", "dk_after_dq",
    "dkdv_bulk", "dkdv_in_tile", "dkdv_stsm", "dkdv_tma", "dq_alternate", "dq_bulk", "dq_late", "dq_split", "dq_ws",
    "dq_ws_slabs", "dv_under_dp", "early_first_item", "early_loads", "epilogue_in_s", "ex2_poly", "exp_fold", "fused_merge", "gather_early",
    "grad_dist", "grad_groups", "grad_v4", "half_tiles", "read_v4", "delta_per_row", "lse_per_row", "stat_pairs",
    "head_group", "hold_grads", "interior_split", "item_carry", "item_order", "keep_bits", "kv_group", "kv_major",
    "kv_parts",
    "kv_reverse", "l2_hints", "list_ahead", "list_head", "map_prefetch", "one_barrier", "opaque_desc", "overlap",
    "own_first_item", "p_under_dp", "pack_gqa", "persistent", "pingpong", "prefetch_tiles", "producer",
    "producer_regs", "q_double", "q_in_regs", "range_shared", "regs", "row_gather", "row_pairs", "row_slice",
    "schedule", "sdp_ahead", "setmaxnreg", "skip_padding", "slice_ahead", "slice_edge", "slice_in_s", "slice_pairs",
    "slice_ptrs", "slice_rows", "small_grid",
    "staged_epilogue", "stages", "stmatrix", "table_tiles", "tanh", "tanh_small", "tanh_tiny", "tma_loads",
    "tma_store", "tree_softmax", "walk", "warp_skip", "wg_rows", "ws_loads",
})

# The extras that say a forward kernel's form (which emitter, its producer, its persistence): what the automatic
# choice's fallback changes when a kernel refuses the caller's knobs (compiler._forward_spec's note, bench's
# knobs_refused)
KERNEL_FORM = ("schedule", "producer", "persistent")

# The keys only the backward's kernels read: the forward's spec leaves them out, so that a backward knob does not
# rename (and recompile) the forward kernel it shares (tests/backend/test_extras.py holds this set to the code).
BACKWARD_EXTRAS = frozenset({
    "bwd_batch_inner", "bwd_block_list", "bwd_persistent", "bwd_pingpong", "bwd_schedule", "dk_after_dq", "dkdv_bulk",
    "dkdv_in_tile", "dkdv_stsm", "dkdv_tma", "dq_alternate", "dq_bulk", "dq_late", "dq_split", "dq_ws", "dq_ws_slabs",
    "dv_under_dp", "exp_fold",
    "grad_dist", "grad_groups", "grad_v4", "hold_grads", "interior_split", "kv_group", "kv_major", "list_ahead",
    "opaque_desc", "p_under_dp", "read_v4", "delta_per_row", "lse_per_row", "sdp_ahead", "stat_pairs",
    "ws_loads",
})


def forward_extra(extra: dict) -> dict:
    """`extra` without the backward's keys (BACKWARD_EXTRAS): what the forward's spec is built with."""
    return {k: v for k, v in extra.items() if k not in BACKWARD_EXTRAS}


EXTRA_CHOICES = {  # the values a knob takes where a value outside them would be read as another silently
    "cluster_merge": (True, False, "auto"),
    "cluster_push": (True, False),
    "skip_padding": (True, False),
    "blocks_per_sm": (1, 2, 3),  # (3: emit_fa3's D = 64 kernels only; 2 on the ws kernel: decoding's tiles only)
    "decode_block_k": (64, 128),
    "map_prefetch": (True, False),
    "item_carry": ("auto", "div", "sub"),
    "read_v4": (True, False, "early", "late"),  # True: the default, "early"
    "bwd_batch_inner": (True, False),
    "bwd_pingpong": (True, False),
    "dq_alternate": (True, False, "auto"),
    "grad_v4": (True, False),
}


def unknown_extra(extra: dict):
    """A one-line message naming the first key of `extra` the backend does not read (with the nearest known
    key), or the first value of an EXTRA_CHOICES knob outside its choices, or None."""
    import difflib

    def same(v, c) -> bool:  # a bool is only itself, a string an equal string, an int an equal integer (no bool)
        if isinstance(c, bool):
            return v is c
        if isinstance(c, str):
            return isinstance(v, str) and v == c
        return isinstance(v, numbers.Integral) and not isinstance(v, bool) and v == c

    for key, choices in EXTRA_CHOICES.items():
        if key in extra and not any(same(extra[key], c) for c in choices):
            return f"extra {key} must be {' or '.join(repr(c) for c in choices)}, got {extra[key]!r}"
    unknown = sorted(k for k in extra if k not in KNOWN_EXTRAS)
    if not unknown:
        return None
    near = difflib.get_close_matches(str(unknown[0]), KNOWN_EXTRAS, n=1)
    return (f"unknown extra {unknown[0]!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
            + f"; the numba-cuda backend reads: {', '.join(sorted(KNOWN_EXTRAS))}")


@dataclass(frozen=True)
class Capture:
    """A tensor the score or mask function reads (ALiBi slopes, a bias table, document ids)."""

    name: str
    dtype: str  # "f16", "bf16", "f32", "i32" or "bool"
    ndim: int
    derived: tuple = ()  # () for the caller's tensors; else how the runtime makes it (module docstring)


@dataclass(frozen=True)
class FA2ForwardSpec:
    """Everything the emitter needs to write one FA2 forward kernel.

    Layouts: q is [B, H, M, D]; k and v are [B, H // group_size, N, D]; o is [B, H, M, D] in `dtype`;
    lse is [B, H, M] float32 (natural log). q, k, v may be strided views whose last dim is contiguous (their
    strides are kernel arguments); o and lse are written contiguous.
    """

    name: str
    head_dim: int
    dtype: str
    path: str
    block_q: int
    block_k: int
    num_warps: int
    group_size: int = 1
    exp2: bool = True
    captures: tuple[Capture, ...] = ()
    device_source: str = ""
    has_mask: bool = False
    block_mask: str = "none"
    # the score reads a table per element that no batch index selects (bias[h, q, kv]): the grid runs the batch
    # innermost, so the batch rows of one (head, q tile) run together and share the table's lines in L2
    batch_inner: bool = False
    # > 0 where the score is c * x with x what `score_raw_fn` returns (or s itself where the source has no
    # score_raw_fn) and c this positive constant: the tensor-core kernels keep x, take the row max on it and fold c
    # into the exponent's FFMA (emit_fa2.folded_scale); 0 otherwise
    score_scale: float = 0.0
    # > 0: online-softmax{lazy=T}'s conditional rescale (the IR's m_new = where(m_max > m_i + T, m_max, m_i)), T in
    # the IR's exponent base; the kernels then skip O's rescale where the correction is 1 (emit_fa2.softmax_row)
    lazy_rescale: float = 0.0
    # tile{ragged_q=first}: q tile qt starts at row qt * block_q - q_pad (q_pad = cdiv(M, block_q) * block_q - M),
    # so the short tile is the first; its rows before 0 load zeros and are never stored (emit_fa2.q_start)
    ragged_q_first: bool = False
    # split-kv{parts=P}: each q tile's kv range in P work items, each storing its O (in `dtype`) and LSE into
    # workspaces [P B, H, M, D] and [P B, H, M] that the LSE merge (lse_merge.py) reads; 1: no split
    kv_parts: int = 1
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        _check_schedule(self)
        if self.kv_parts < 1:
            raise ValueError(f"kv_parts must be at least 1, got {self.kv_parts}")
        if self.block_mask != "none" and not self.has_mask:
            raise ValueError("block_mask needs has_mask")


@dataclass(frozen=True)
class GradSpec:
    """A captured table's gradient: what the elementwise function's outputs add into, and how.

    `reduced`: the IR sums the contribution over the tile before adding it at tile-invariant indices (ALiBi's
    slope per head): the kernel sums per thread and adds once per warp. Otherwise every element adds its
    contribution at its own indices (a relative-position bias)."""

    name: str  # the backward function's result, e.g. "dslopes"
    capture: int  # index of the table in FA2BackwardSpec.captures
    reduced: bool
    n_index: int
    # (a, b): the last index is a q + b kv + c and the others the tile's (a relative bias: (1, -1)); the device
    # source then has gidx<i>_fn(b, h, hk, q, kv, *captures) -> that index. () otherwise
    span: tuple = ()
    # the last two indices are the element's q and kv themselves and the others the tile's (a bias table
    # [h, q, kv]): a warp's entries of four consecutive kv rows make one 16-byte reduction (emit_fa3_bwd.v4_grads)
    grid: bool = False


@dataclass(frozen=True)
class FA2BackwardSpec:
    """Everything the emitter needs to write the FA2 backward kernels (dq=atomic, kv tiles outer).

    Layouts as the forward's: q, o, do [B, H, M, D]; k, v [B, H // group_size, N, D]; lse [B, H, M] f32.
    Contract of `device_source` (from_ir_bwd.py): `elem_<branch>(s, dp, lse, delta, b, h, hk, q, kv,
    interior, *captures) -> (p, ds, contribution, indices..., ...)` for each name in `branches` ("all", or
    "full" and "partial"); `tile_class_fn(b, h, q_lo, q_hi, kv_lo, kv_hi, *captures)` for
    block_mask == "static" or "list"; `mask_fn(b, h, q, kv, *captures)` for block_mask == "table". `captures`
    ends with the run-time sizes the device functions read (dim_M, dim_N, ...: scalar arguments), then the
    derived ones: range tables, and with block_mask == "list" the block lists `("q_count",)`, `("q_tiles",)`
    (per kv tile the (head, q tile) pairs to visit) and with dq == "separate" `("kv_count",)`, `("kv_tiles",)`
    (per q tile the kv tiles), laid out as block_data.list_layout says.
    """

    name: str
    head_dim: int
    dtype: str
    path: str
    block_q: int
    block_k: int
    num_warps: int
    group_size: int = 1
    captures: tuple[Capture, ...] = ()
    device_source: str = ""
    branches: tuple[str, ...] = ("all",)
    block_mask: str = "none"
    grads: tuple[GradSpec, ...] = ()
    dims: tuple[str, ...] = ()
    dq: str = "atomic"  # "atomic": added from the kv-outer kernel; "separate": a q-outer kernel, no atomics
    q_branches: tuple[str, ...] = ()  # elemq_<branch> of the q-outer dQ kernel (dq == "separate")
    deterministic: bool = False  # captured tables' gradients into a copy per block, summed in a fixed order
    # (branch, capture, n_index) per read of a captured f32 table at [the tile's..., q, kv] in a branch's element
    # code (a bias table), in the order of elemg_<branch>'s tv0, tv1, ... parameters: the device source then also
    # has elemg_<branch>(s, dp, lse, delta, b, h, hk, q, kv, interior, tv0, ..., *captures), the element code with
    # those values given, and gtab<j>_<branch>_fn(b, h, hk, q, kv, *captures) -> read j's leading indices (clamped)
    grid_reads: tuple = ()
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def has_mask(self) -> bool:
        return self.block_mask != "none"

    @property
    def exp2(self) -> bool:
        return False

    def __post_init__(self) -> None:
        _check_schedule(self)


def _check_schedule(spec) -> None:
    """The checks both specs share: known dtype, path and block mask; the tensor cores take f16 and bf16."""
    kind = type(spec).__name__
    if spec.dtype not in DTYPES:
        raise ValueError(f"{kind}.dtype must be one of {DTYPES}, got {spec.dtype!r}")
    if spec.path not in PATHS:
        raise ValueError(f"{kind}.path must be one of {PATHS}, got {spec.path!r}")
    if spec.block_mask not in BLOCK_MASKS:
        raise ValueError(f"{kind}.block_mask must be one of {BLOCK_MASKS}, got {spec.block_mask!r}")
    if spec.path == "mma" and spec.dtype in ("f32", "f64"):
        raise ValueError("the tensor-core path takes f16 or bf16 inputs; use path='simt' for f32 and f64")
