"""Emit Numba CUDA source for the FlashAttention-2 backward from an `FA2BackwardSpec` (dq=atomic).

Three kernels, in one module each:

* `<name>_delta(do, o, delta, dq32, H, M, *dO strides)`: Delta = rowsum(dO * O) (FA2's preprocessing), one warp per row;
  it also zeroes the row of the f32 dQ accumulator, so no separate memset is launched.
* `<name>(q, k, v, lse, do, delta, dq32, dk, dv, B, H, M, N, *strides, [table], *grad tables, *captures)`: the main
  kernel. One block per (b, kv head, kv tile): K and V stay in shared memory; the block walks the query
  heads of its group and their non-empty q tiles (classes from `tile_class_fn`, the block table, or for data
  masks classified from range tables (block_mask "list") the list of this kv tile's (head, q tile) pairs that
  block_data.py makes once per data), with the next q tile's Q and dO prefetched by cp.async while the current
  one is computed.
* `<name>_dq(dq32, dq, n, M)`: dQ's f32 accumulator to the input dtype.

The tensor-core schedule ("mma"): warp w owns kv rows 16w .. 16w + 15 of the tile (block_k = 16 * warps)
and computes S^T = K Q^T and dP^T = V dO^T with mma.sync (A = K or V rows, B = Q or dO rows, the forward's
ldmatrix addressing), so P^T and dS^T sit in the accumulators in exactly the A-operand layout of dV += P^T dO
and dK += dS^T Q (the forward's register trick, transposed). Per element the variant's `elem_<branch>`
(emitted from the IR) turns (s, dp, lse, delta) into (p, ds, captured-gradient contributions). dS^T goes to
shared memory once (f16, swizzled); after one barrier warp w computes dQ rows 16w .. 16w + 15 of the q tile
(block_q = 16 * warps) as dS K and adds them into the f32 dQ accumulator with atomic adds, as FA2 does.
dK and dV stay in registers over all q tiles and heads of the group, and are written once.

The SIMT schedule ("simt", any head dim, f32): one kv row per thread, fp32 dot products from shared memory,
dQ by atomic adds per element. Simple and slow; for f32 inputs and head dims the tensor cores do not take.
"""

from __future__ import annotations

from typing import Optional

from .emit_fa2 import (
    _HEADER,
    TileLoader,
    _Code,
    _device_functions,
    _spec_comment,
    _swizzle_mask,
    as_f64,
    bind_offsets,
    dual_step_helper,
    emit_bases,
    emit_ldmatrix_lanes,
    emit_mma_helpers,
    emit_tile_scan,
    mma_step_helper,
    zero_helper,
)

# element strides (batch, head, row) of q, k, v and dO: strided views run without copies
STRIDES = "q_sb, q_sh, q_sm, k_sb, k_sh, k_sm, v_sb, v_sh, v_sm, do_sb, do_sh, do_sm"
from .spec import FA2BackwardSpec
from .ssa_names import ssa_rename

__all__ = ["emit_fa2_backward", "emit_delta", "delta_grid", "emit_dq_convert", "emit_dq_kernel", "emit_parts_sum", "bwd_grid",
           "bwd_smem_bytes", "bwd_threads", "dq_grid", "dq_smem_bytes", "dq_threads", "validate_backward_spec"]


# Accumulator fragments live in per-thread arrays indexed only by constants (LLVM keeps each element in a
# register): element i of n8 tile jj. Loop-carried or branch-merged scalars would each be a variable Numba's
# front end rebuilds SSA form for, the bulk of a cold compile (benchmarks/NOTES.md, "Compile time").
def SA(jj: int, i: int) -> str:  # S^T (kv-outer) or S (q-outer), later P
    return f"sacc[{jj * 4 + i}]"


def PA(jj: int, i: int) -> str:  # dP^T or dP, later dS
    return f"pacc[{jj * 4 + i}]"


def _store_pairs_helper(c: _Code, ND: int, pack: str) -> str:
    """`store_pairs(o, obase, x, i)`: one thread's row of a [*, 8 ND] fragment array (x[i + 4 dn], x[i + 4 dn + 1])
    packed to 16-bit pairs at o[obase + 4 dn] (dK, dV, dQ out)."""
    return c.helper("store_pairs", [
        "@device_function", "def store_pairs(o, obase, x, i):",
        *[f"    o[obase + {dn * 4}] = {pack}(lget(x, i + {dn * 4}), lget(x, i + {dn * 4 + 1}))" for dn in range(ND)]])


DKDV_LINE = "# dK, dV of this warp's kv rows, once"  # the kernels' dK / dV epilogue's first line (probe_bwd's stamp)


def _emit_dkdv_stores(c: _Code, D: int, ND: int, pack: str) -> None:
    """dK and dV of this warp's 16 kv rows from their fragments (`dkacc`, `dvacc`), once, after the walk over the
    q tiles: the mma.sync and wgmma backward kernels' last step."""
    c(DKDV_LINE)
    sp = _store_pairs_helper(c, ND, pack)
    for r in range(2):
        c(f"kvi = kv0 + warp * 16 + {8 * r} + g")
        c("if kvi < N:")
        with c.indent():
            c(f"kvrow = ((kv_head + kvi) * {D} + t2) >> 1")
            c(f"{sp}(dk, kvrow, dkacc, ofs_{2 * r})")
            c(f"{sp}(dv, kvrow, dvacc, ofs_{2 * r})")


def _wgmma(spec: FA2BackwardSpec):
    """emit_fa3_bwd when spec.extra["bwd_schedule"] == "wgmma" (the main kernel on Hopper's wgmma), else None."""
    if spec.extra.get("bwd_schedule") != "wgmma":
        return None
    from . import emit_fa3_bwd

    return emit_fa3_bwd


def _cap_names(spec: FA2BackwardSpec) -> list[str]:
    return [f"cap_{i}_{c.name}" for i, c in enumerate(spec.captures)]


def _cap_args(spec: FA2BackwardSpec) -> str:
    return "".join(f", {c}" for c in _cap_names(spec))


def _grad_args(spec: FA2BackwardSpec) -> str:
    return "".join(f", grad_{i}" for i in range(len(spec.grads)))


def bwd_threads(spec: FA2BackwardSpec) -> int:
    if _wgmma(spec):
        return _wgmma(spec).threads(spec)
    return spec.num_warps * 32 if spec.path == "mma" else spec.block_k


def bwd_grid(spec: FA2BackwardSpec, B: int, H: int, M: int, N: int) -> tuple[int, ...]:
    nk = -(-N // spec.block_k)
    if _wgmma(spec):  # a 3-d grid: the wgmma kernel divides by no run-time value
        return _wgmma(spec).grid(spec, B, H, M, N)
    return (nk * B * (H // spec.group_size),)


def _layout(spec: FA2BackwardSpec) -> dict[str, int]:
    """Shared memory of the tensor-core kernel, in uint16 elements: K, V, two Q and two dO buffers, dS^T,
    then f32 lse and delta of the two q tiles (4 * block_q floats)."""
    D, BQ, BK = spec.head_dim, spec.block_q, spec.block_k
    lay = {"K": 0, "V": BK * D, "Q": 2 * BK * D}
    lay["DO"] = lay["Q"] + 2 * BQ * D
    lay["DS"] = lay["DO"] + 2 * BQ * D
    lay["ST"] = lay["DS"] + BK * BQ  # even: the f32 statistics start at float index ST // 2
    lay["GP"] = lay["ST"] + 8 * BQ  # f32 partial sums of the warps (deterministic captured gradients)
    lay["GX"] = lay["GP"] + 2 * spec.num_warps * len(spec.grads)  # deterministic per-element: (addr + 1, value)
    lay["elems"] = lay["GX"] + 4 * BQ * BK * len(_staged(spec))
    return lay


def _staged(spec: FA2BackwardSpec) -> list[int]:
    """Gradients staged in shared memory and added in a fixed order (deterministic, per-element indices)."""
    return [i for i, g in enumerate(spec.grads) if spec.deterministic and not g.reduced]


def bwd_smem_bytes(spec: FA2BackwardSpec) -> int:
    if _wgmma(spec):
        return _wgmma(spec).smem_bytes(spec)
    if spec.path == "simt":
        return 0
    return 2 * _layout(spec)["elems"]


def validate_backward_spec(spec: FA2BackwardSpec) -> None:
    """Raise ValueError if this emitter cannot build the spec's schedule."""
    D, BQ, BK, NW = spec.head_dim, spec.block_q, spec.block_k, spec.num_warps
    for fn in [f"def elem_{b}(" for b in spec.branches] + [f"def elemq_{b}(" for b in spec.q_branches]:
        if fn not in spec.device_source:
            raise ValueError(f"device_source must define {fn[4:-1]}")
    if spec.block_mask in ("static", "list") and "def tile_class_fn" not in spec.device_source:
        raise ValueError(f"block_mask={spec.block_mask!r} needs a tile_class_fn in device_source")
    if spec.block_mask == "list" and not {"q_count", "q_tiles"} <= set(_list_args(spec)):
        raise ValueError("block_mask='list' needs the q_count and q_tiles captures")
    if spec.block_mask == "list" and spec.dq == "separate" and not {"kv_count", "kv_tiles"} <= set(_list_args(spec)):
        raise ValueError("block_mask='list' with dq='separate' needs the kv_count and kv_tiles captures")
    if spec.block_mask == "table" and "def mask_fn" not in spec.device_source:
        raise ValueError("block_mask='table' needs a mask_fn in device_source")
    if spec.path == "simt":
        if BK > 1024 or BK < 1:
            raise ValueError("simt path: block_k (= threads per block) must be 1 .. 1024")
        if 2 * D * 4 > 32 * 1024:
            raise ValueError("simt path: head_dim too large for one staged row of Q and dO")
        return
    if D % 16:
        raise ValueError(f"mma path: head_dim must be a multiple of 16, got {D}")
    if spec.dq == "separate" and BK != 16 * NW:
        raise ValueError(f"mma path: block_k must be 16 * num_warps, got {BK} with {NW} warps")
    if spec.dq == "separate" and (BQ % 16 or BK % 16):
        raise ValueError(f"mma path: the dQ kernel needs block_q and block_k multiples of 16, got {BQ}x{BK}")
    if spec.dq == "atomic" and (BK != 16 * NW or BQ % 16 or NW % (BQ // 16) or (D // 16) % (NW // (BQ // 16))):
        raise ValueError(f"mma path: the backward needs block_k = 16 * num_warps (each warp owns 16 kv rows) and "
                         f"block_q a multiple of 16 whose 16-row groups divide the warps (dQ's rows, the warps left "
                         f"over splitting D), got {BQ}x{BK} with {NW} warps at D = {D}")
    if bwd_smem_bytes(spec) > 227 * 1024:
        raise ValueError(f"mma path: {bwd_smem_bytes(spec)} bytes of shared memory exceed 227 KB")


def _module(spec: FA2BackwardSpec, body: str) -> str:
    header = _HEADER.format(spec_repr=_spec_comment(spec)).replace("emit_fa2 --", "emit_fa2_bwd --")
    header += "SMEM_U32 = np.dtype(np.uint32) if SIMULATOR else np.uint32\n"
    header += "SMEM_F32 = np.dtype(np.float32) if SIMULATOR else np.float32\n"
    code = _device_functions(spec) + "\n\n" + ssa_rename(body)  # unique names: a fast Numba front end
    return header + "\n\n" + (as_f64(code) if spec.dtype == "f64" else code)


def _list_args(spec: FA2BackwardSpec) -> dict[str, str]:
    """The kernel arguments of the block lists (block_mask == "list"), by derived tag (block_data.list_layout)."""
    return {c.derived[0]: n for c, n in zip(spec.captures, _cap_names(spec))
            if c.derived[:1] and c.derived[0] in ("q_count", "q_tiles", "kv_count", "kv_tiles")}


def _emit_first(c: _Code, spec: FA2BackwardSpec) -> None:
    """it = the first (head, q tile) this kv tile visits (total when none; under a static or table block mask total
    becomes the last one's number + 1)."""
    if spec.block_mask == "list":
        a = _list_args(spec)
        c("# the (head, q tile) pairs this kv tile visits, listed once per data (block_data.py): no scan")
        c("q_row = (b * HK + hk) * nk + kj")
        c(f"q_n = {a['q_count']}[q_row]")
        c("q_row = q_row * total")
        c("q_pos = 0")
        c(f"it = ({a['q_tiles']}[q_row] >> 1) if q_n > 0 else total")
        return
    if spec.block_mask in ("static", "table"):
        # the first and the last non-empty pair by a ballot (the mma kernel's block is whole warps); the walk ends at
        # the last (total = it_last + 1) instead of classifying every empty q tile after a window's end
        emit_tile_scan(c, lambda j: _class_expr(spec, j), "total", "it", "it_last")
        c("total = it_last + 1")
        return
    c("it = 0")


def _class_expr(spec: FA2BackwardSpec, it: str) -> str:
    """The class of the (head, q tile) numbered `it` against this block's kv tile."""
    BQ, BK, G = spec.block_q, spec.block_k, spec.group_size
    h = f"hk * {G} + {it} // nq" if G > 1 else "hk"
    qt = f"{it} % nq" if G > 1 else it
    if spec.block_mask == "static":
        return (f"tile_class_fn(b, {h}, ({qt}) * {BQ}, ({qt}) * {BQ} + {BQ - 1}, kv0, kv0 + {BK - 1}"
                f"{_cap_args(spec)})")
    if spec.block_mask == "table":
        return f"table[((b * H + {h}) * nq + {qt}) * nk + kj]"
    if spec.block_mask == "list":
        return "it_cls"  # the current pair's, set by _emit_next
    return "2"


def _emit_next(c: _Code, spec: FA2BackwardSpec, cur: str, out: str) -> None:
    if spec.block_mask == "list":  # cur is entry q_pos of the list
        qtl = _list_args(spec)["q_tiles"]
        c(f"it_cls = 1 if {qtl}[q_row + q_pos] & 1 else 2  # pair {cur}: partial or full")
        c("q_pos += 1")
        c(f"{out} = ({qtl}[q_row + q_pos] >> 1) if q_pos < q_n else total")
        return
    c(f"{out} = {cur} + 1")
    if spec.block_mask != "none":
        c(f"while {out} < total and {_class_expr(spec, out)} == 0:")
        with c.indent():
            c(f"{out} += 1")


def lse_read(spec: FA2BackwardSpec, load: str) -> str:
    """The kernels' read of a row's LSE, `load`, as the element functions take it: through the variant's
    lse_row_fn (from_ir_bwd._lse_row_fn: the guarded LSE times log2(e), once a row where it is read, not in every
    element) where device_source has one, else the LSE itself."""
    return f"lse_row_fn({load})" if "def lse_row_fn(" in spec.device_source else load


def delta_read(spec: FA2BackwardSpec, load: str) -> str:
    """A row's Delta as the element functions take it: through delta_row_fn (from_ir_bwd._scaled_difference:
    -Delta c, dS's scale folded into an FMA with dP) where device_source has one, else Delta itself."""
    return f"delta_row_fn({load})" if "def delta_row_fn(" in spec.device_source else load


def _elem_call(spec: FA2BackwardSpec, branch: str, s: str, dp: str, lse: str, delta: str, q: str, kv: str,
               outs: list[str], interior: str = "interior", given: tuple[str, ...] = ()) -> str:
    """One element's elem_<branch> call, or with `given` (its grid reads' values) elemg_<branch>'s."""
    fn = f"elemg_{branch}" if given else f"elem_{branch}"
    return (f"{', '.join(outs)} = {fn}({s}, {dp}, {lse}, {delta}, b, h, hk, {q}, {kv}, {interior}"
            f"{''.join(f', {x}' for x in given)}{_cap_args(spec)})")


def _elem_quad_helper(c: _Code, spec: FA2BackwardSpec, branch: str) -> str:
    """`elems_<branch>(x, y, i, col, smem_f, lse_f, dlt_f, q0, t2, kvr, b, h, hk, interior, *captures)`: the kv-outer
    kernel's per-element step for one q column (q0 + col + t2) and this thread's two kv rows (kvr, kvr + 8): LSE
    and Delta from shared memory, then elem_<branch> on (x[i], y[i]) and (x[i + 2], y[i + 2]) in place (S^T -> P^T,
    dP^T -> dS^T). Without captured-table gradients only (those add per-element code after each call). One call
    where the written-out form cost ~90 Numba IR statements (benchmarks/NOTES.md, "Compile time", lever 13)."""
    caps = _cap_args(spec)
    lines = ["@device_function",
             f"def elems_{branch}(x, y, i, col, smem_f, lse_f, dlt_f, q0, t2, kvr, b, h, hk, interior{caps}):",
             "    qi = q0 + col + t2",
             "    lq = lget(smem_f, lse_f + t2 + col)",
             "    dq_ = lget(smem_f, dlt_f + t2 + col)",
             *_column_lines(branch, caps, 0, "lq", "dq_")]
    return c.helper(f"elems_{branch}", lines)


def _column_lines(branch: str, caps: str, e: int, lq: str, dq: str) -> list[str]:
    """The element helpers' step on one q column (qi) of this thread's two kv rows (kvr, kvr + 8): elem_<branch>
    on (x[i + e], y[i + e]) and (x[i + e + 2], y[i + e + 2]) in place, the column's LSE and Delta `lq`, `dq`."""
    lines = []
    for r in range(2):
        at = f"i + {e + 2 * r}" if e + 2 * r else "i"
        lines += [f"    s{r}, p{r} = elem_{branch}(lget(x, {at}), lget(y, {at}), {lq}, {dq}, b, h, hk, qi, "
                  f"kvr{' + 8' if r else ''}, interior{caps})",
                  f"    lset(x, {at}, s{r})",
                  f"    lset(y, {at}, p{r})"]
    return lines


def _elem_pair_helper(c: _Code, spec: FA2BackwardSpec, branch: str) -> str:
    """`elems2_<branch>(x, y, i, col, sb0, lse_f, dlt_f, q0, t2, kvr, b, h, hk, interior, *captures)`:
    _elem_quad_helper's step for the thread's two adjacent q columns (q0 + col + t2 and the next; t2 even, col a
    multiple of 8) at once, their LSE and Delta by one 8-byte shared load each (`lds_v2_f32` at the shared byte
    address sb0 + 4 word): 2 loads where the quad helper's two calls take 4 (the wgmma kernel's stat_pairs)."""
    caps = _cap_args(spec)
    lines = ["@device_function",
             f"def elems2_{branch}(x, y, i, col, sb0, lse_f, dlt_f, q0, t2, kvr, b, h, hk, interior{caps}):",
             "    lq0, lq1 = lds_v2_f32(sb0 + 4 * (lse_f + t2 + col))",
             "    dq0, dq1 = lds_v2_f32(sb0 + 4 * (dlt_f + t2 + col))"]
    for e in range(2):
        lines += [f"    qi = q0 + col + t2 + {e}", *_column_lines(branch, caps, e, f"lq{e}", f"dq{e}")]
    return c.helper(f"elems2_{branch}", lines)


def _grad_outs(spec: FA2BackwardSpec) -> list[list[str]]:
    return [[f"gc{i}"] + [f"gi{i}_{j}" for j in range(g.n_index)] for i, g in enumerate(spec.grads)]


def _flat_index(spec: FA2BackwardSpec, i: int, last: str = "") -> str:
    """Row-major offset of gradient i's indices in its table, each clamped as the gather clamps (`last`: the
    last index's clamped value given as an expression instead)."""
    g = spec.grads[i]
    table = _cap_names(spec)[g.capture]
    expr = ""
    for j in range(g.n_index):
        idx = last if last and j == g.n_index - 1 else f"min(max(gi{i}_{j}, 0), {table}.shape[{j}] - 1)"
        expr = idx if not expr else f"({expr}) * {table}.shape[{j}] + {idx}"
    return expr or "0"


def _emit_grad_element(c: _Code, spec: FA2BackwardSpec, stage: str = "", groups: Optional[dict] = None,
                       stash: Optional[dict] = None) -> None:
    """After one element's elem call: its contributions to captured tables' gradients. In deterministic mode
    a per-element contribution is staged (`stage` formats (k, slot) into the shared arrays' indices) and added
    by `_emit_staged_adds` in a fixed order. `groups`: gradient -> the register that sums this element's group
    (emit_fa3_bwd.grouped_grads: the elements at the same entry); `stash`: gradient -> the register that keeps
    this element's contribution for the caller to add (emit_fa3_bwd.v4_grads)."""
    for i, g in enumerate(spec.grads):
        if g.reduced:
            c(f"gsum{i} += gc{i}")
        elif groups and i in groups:
            c(f"{groups[i]} += gc{i}")
        elif stash and i in stash:
            c(f"{stash[i]} = gc{i}")
        elif spec.deterministic:
            k = _staged(spec).index(i)
            addr, val = stage.split("|")
            c(f"{addr.format(k)} = {_flat_index(spec, i)} + 1 if gc{i} != ZERO else 0")
            c(f"{val.format(k)} = gc{i}")
        else:
            c(f"if gc{i} != ZERO:")
            with c.indent():
                c(f"cuda.atomic.add(grad_{i}, {_flat_index(spec, i)}, gc{i})")


def _emit_staged_adds(c: _Code, spec: FA2BackwardSpec, slots: int, threads: int, addr: str, val: str) -> None:
    """Deterministic per-element gradients: after a barrier, thread t adds, slot by slot in order, the staged
    contributions whose table address is t modulo the block size into the block's copy: each address has one
    owner and one order, so the same bits on every run (slow: every thread reads every slot)."""
    if not _staged(spec):
        return
    c("cuda.syncthreads()  # every contribution of the tile is staged")
    for k, i in enumerate(_staged(spec)):
        table = _cap_names(spec)[spec.grads[i].capture]
        c(f"for sl in range({slots}):")
        with c.indent():
            c(f"ga = {addr.format(k, 'sl')}")
            c(f"if ga != 0 and (ga - 1) % {threads} == tid:")
            with c.indent():
                c(f"grad_{i}[cuda.blockIdx.x * {table}.size + ga - 1] += {val.format(k, 'sl')}")
    c("cuda.syncthreads()  # the staged contributions are read")


def _emit_grad_tile_end(c: _Code, spec: FA2BackwardSpec, warp_reduce: bool, partials: str = "{}") -> None:
    """After a tile: the reduced contributions (ALiBi's slope), one atomic add per warp (or thread); in
    deterministic mode summed over the block in a fixed order (warp shuffles, then the warps' or threads'
    partials in `partials` by thread 0) into the block's own copy of the table, with no atomics."""
    if spec.deterministic and any(g.reduced for g in spec.grads):
        n = spec.num_warps if warp_reduce else spec.block_k
        for i, g in enumerate(spec.grads):
            if not g.reduced:
                continue
            if warp_reduce:
                for m in (16, 8, 4, 2, 1):
                    c(f"gsum{i} += shfl_xor_f32(gsum{i}, {m})")
                c("if lane == 0:")
                with c.indent():
                    c(f"{partials.format(f'{i * n} + warp')} = gsum{i}")
            else:
                c(f"{partials.format(f'{i * n} + tid')} = gsum{i}")
        c("cuda.syncthreads()  # every partial sum is in shared memory")
        c("if tid == 0:")
        with c.indent():
            for i, g in enumerate(spec.grads):
                if not g.reduced:
                    continue
                c("tot = ZERO")
                c(f"for w in range({n}):")
                with c.indent():
                    c(f"tot += {partials.format(f'{i * n} + w')}")
                table = _cap_names(spec)[g.capture]
                c(f"grad_{i}[cuda.blockIdx.x * {table}.size + {_flat_index(spec, i)}] += tot")
        c("cuda.syncthreads()  # thread 0 has read the partials")
        return
    if spec.deterministic:
        return
    for i, g in enumerate(spec.grads):
        if not g.reduced:
            continue
        if warp_reduce:
            _emit_warp_add(c, i, f"gsum{i}", _flat_index(spec, i))
        else:
            c(f"if gsum{i} != ZERO:")
            with c.indent():
                c(f"cuda.atomic.add(grad_{i}, {_flat_index(spec, i)}, gsum{i})")


def held_grads(spec: FA2BackwardSpec) -> bool:
    """Whether the tensor-core kernels (mma.sync and wgmma) hold the reduced contributions (ALiBi's slope) across their
    q loop and add them once per warp and index, not once per warp and tile: the index of a reduced gradient is
    a tile's (rank 0: the head's or the batch's, from_ir_bwd._grads), so it changes only where the loop's head
    does. Every warp of every block adding into the same few words once a tile serialized at L2 (ALiBi's backward:
    long-scoreboard stalls 7.6x causal's; benchmarks/NOTES.md, "ALiBi's backward"). spec.extra["hold_grads"] =
    False keeps one add a tile (bench '-bgt')."""
    return not spec.deterministic and any(g.reduced for g in spec.grads) \
        and spec.extra.get("hold_grads", True) is not False


def _emit_dq_reductions(c: _Code, n8: int, at: str = "qrow", guard: str = "qi < M", swap: bool = True) -> None:
    """Add this thread's dQ fragment (dqa: n8 n8-tiles of rows g, g + 8) into dq32 at `at` (the thread's row, qi,
    and first column, set by the caller for `odd`) by 16-byte vector reductions: lanes t and t ^ 1 swap halves in
    place (`_emit_dq_swaps`; `swap` False: the caller did), then even lanes hold 4 consecutive columns of row g
    and odd lanes of row g + 8, and every reduction sits under one `if <guard>:`. Each reduction once sat behind
    its own two branches (a red call per parity: two asm statements LLVM cannot merge), and ptxas, at 255
    registers, recomputed the address from the block index in each (ncu of the wgmma backward: that block was 36%
    of its stall samples)."""
    if swap:
        _emit_dq_swaps(c, n8)
    c(f"if {guard}:")
    with c.indent():
        for dn in range(n8):
            o = f"ofs_{dn * 4}"
            c(f"red_add_v4_f32(dq32, {at} + {dn * 8}, lget(dqa, {o}), lget(dqa, {o} + 1), lget(dqa, {o} + 2), "
              f"lget(dqa, {o} + 3))")


def _emit_dq_swaps(c: _Code, n8: int) -> None:
    """Lanes t and t ^ 1 swap the halves of each of dqa's n8 n8-tiles in place (selects around two shuffles, every
    lane): even lanes then hold 4 consecutive columns of row g, odd lanes of row g + 8."""
    fn = _dq_swap_helper(c)
    for dn in range(n8):
        c(f"{fn}(dqa, ofs_{dn * 4}, odd)")


def _dq_swap_helper(c: _Code) -> str:
    """The device function by which lanes t and t ^ 1 swap the halves of a dQ n8 tile (in place, selects around two
    shuffles): even lanes then hold its 4 columns of row g, odd lanes of row g + 8."""
    return c.helper("dq_swap", [
        "@device_function", "def dq_swap(x, i, odd):",
        "    x0 = lget(x, i) if odd else lget(x, i + 2)",
        "    x1 = lget(x, i + 1) if odd else lget(x, i + 3)",
        "    y0 = shfl_xor_f32(x0, 1)",
        "    y1 = shfl_xor_f32(x1, 1)",
        "    if odd:",
        "        lset(x, i, y0)",
        "        lset(x, i + 1, y1)",
        "    else:",
        "        lset(x, i + 2, y0)",
        "        lset(x, i + 3, y1)"])


def _emit_warp_add(c: _Code, i: int, value: str, index: str) -> None:
    """Warp-sum `value` (a register of every lane) by shuffles; lane 0 adds it to gradient i at `index`."""
    for m in (16, 8, 4, 2, 1):
        c(f"{value} += shfl_xor_f32({value}, {m})")
    c("if lane == 0:")
    with c.indent():
        c(f"cuda.atomic.add(grad_{i}, {index}, {value})")


def _emit_grad_flush(c: _Code, spec: FA2BackwardSpec, i: int) -> None:
    """Gradient i's held contribution, warp-summed, added at the held index."""
    _emit_warp_add(c, i, f"gacc{i}", f"ghold{i}")


def _emit_grad_hold_start(c: _Code, spec: FA2BackwardSpec) -> None:
    """Before the q loop (`held_grads`): nothing held (index -1)."""
    for i, g in enumerate(spec.grads):
        if g.reduced:
            c(f"gacc{i} = ZERO")
            c(f"ghold{i} = -1")


def _emit_grad_hold(c: _Code, spec: FA2BackwardSpec) -> None:
    """After a tile (`held_grads`): where its index differs from the held one (warp-uniform: a head's), add what
    is held there and hold the new index; then hold the tile's sum too."""
    for i, g in enumerate(spec.grads):
        if not g.reduced:
            continue
        c(f"gat{i} = {_flat_index(spec, i)}")
        c(f"if gat{i} != ghold{i}:")
        with c.indent():
            c(f"if ghold{i} >= 0:")
            with c.indent():
                _emit_grad_flush(c, spec, i)
            c(f"gacc{i} = ZERO")
            c(f"ghold{i} = gat{i}")
        c(f"gacc{i} += gsum{i}")


def _emit_grad_hold_end(c: _Code, spec: FA2BackwardSpec) -> None:
    """After the q loop (`held_grads`): add what is held."""
    for i, g in enumerate(spec.grads):
        if g.reduced:
            c(f"if ghold{i} >= 0:")
            with c.indent():
                _emit_grad_flush(c, spec, i)


# --------------------------------------------------------------------------------------------------
# Tensor-core schedule
# --------------------------------------------------------------------------------------------------


def _xor_addressing(D: int) -> bool:
    """Rows of a power-of-two number of 16-byte chunks: a k step of 16 columns is an XOR on a lane's byte offset."""
    CH = D // 8
    return CH & (CH - 1) == 0


def _emit_lane_offsets(c: _Code, D: int) -> None:
    """Byte offsets of each lane's ldmatrix row in a [*, D] tile (the forward's): A operand rows of this warp's 16
    rows (`a_lane`), B operand rows (`k_lane`); k step s (16 columns) is `lane ^ (s << 5)` when D / 8 is a power of
    two (`_xor_addressing`): two operations per ldmatrix address of the score products where the chunk arithmetic
    written out cost nine Numba IR statements (benchmarks/NOTES.md, "Compile time", lever 14)."""
    if not _xor_addressing(D):
        return
    c("# byte offsets of each lane's ldmatrix row in a tile; k step s of 16 columns is `^ (s << 5)`")
    c(f"a_lane = ((warp * 16 + a_row) * {D} + ((a_ch ^ a_x) << 3)) * 2")
    c(f"k_lane = (k_row * {D} + ((k_ch ^ k_x) << 3)) * 2")


def _v_addr(D: int, base: str, kk: int, dd: int) -> str:
    """Shared byte address of the transposed-B ldmatrix of rows 16 kk.., columns 16 dd.. of the tile at `base`.
    Written out: the XOR form here (as in the score products) measured more ptxas spills (deterministic D = 64
    backward 0 -> 4 bytes, D = 128 172 -> 180; benchmarks/NOTES.md, "Compile time", lever 14)."""
    return f"{base} + (({kk * 16} + v_row) * {D} + ((({dd * 2} + v_ch) ^ v_x) << 3)) * 2"


def _emit_score_products(c: _Code, mma: str, D: int, cols: int, a1: str, a2: str, b1: str, b2: str) -> None:
    """The two score-sized products of both backward kernels, sharing their loop: s_ = A1 B1^T and
    p_ = A2 B2^T, where A1, A2 are this warp's 16 rows of two [*, D] tiles at shared byte addresses a1, a2
    (ldmatrix A layout) and B1, B2 `cols` rows of two tiles at b1, b2 (the forward's K-operand layout).
    kv-outer: S^T = K Q^T and dP^T = V dO^T; q-outer: S = Q K^T and dP = dO V^T. Accumulators s_jj_i, p_jj_i."""
    sp_set = dual_step_helper(c, "sp_set", mma, "ldsm_x4", init=True)  # the first k step starts from zero
    sp_acc = dual_step_helper(c, "sp_acc", mma, "ldsm_x4", init=False)
    xor = _xor_addressing(D)
    for ks in range(D // 16):
        arow = f"(a_lane ^ {ks << 5})" if xor else \
            f"((warp * 16 + a_row) * {D} + ((({ks * 2} + a_ch) ^ a_x) << 3)) * 2"
        c(f"xa0, xa1, xa2, xa3 = ldsm_x4({a1} + {arow})")
        c(f"ya0, ya1, ya2, ya3 = ldsm_x4({a2} + {arow})")
        for jp in range(cols // 16):
            off = f"{jp * 16 * D * 2} + (k_lane ^ {ks << 5})" if xor else \
                f"(({jp * 16} + k_row) * {D} + ((({ks * 2} + k_ch) ^ k_x) << 3)) * 2"
            c(f"{sp_set if ks == 0 else sp_acc}(sacc, pacc, ofs_{2 * jp * 4}, xa0, xa1, xa2, xa3, ya0, ya1, ya2, ya3, "
              f"{b1} + {off}, {b2} + {off})")


def _emit_mma_kernel(spec: FA2BackwardSpec) -> str:
    D, BQ, BK, NW, G = spec.head_dim, spec.block_q, spec.block_k, spec.num_warps, spec.group_size
    threads = NW * 32
    NJ = BQ // 8  # n8 tiles of S^T along q
    ND = D // 8  # n8 tiles of dK, dV, dQ along d
    SWZ = _swizzle_mask(D)
    SWZQ = _swizzle_mask(BQ)
    lay = _layout(spec)
    KO, VO, QO, DOO, DSO, STF = lay["K"], lay["V"], lay["Q"], lay["DO"], lay["DS"], lay["ST"] // 2
    GXW = lay["GX"] // 2  # staged addresses (u32 words), then values (f32), per staged gradient
    GXF = GXW + BQ * BK * len(_staged(spec))
    mma = "mma_f16" if spec.dtype == "f16" else "mma_bf16"
    pack = "pack_f16x2" if spec.dtype == "f16" else "pack_bf16x2"
    table = ", table" if spec.block_mask == "table" else ""

    c = _Code()
    emit_mma_helpers(c, mma)
    c("@kernel_jit")
    c(f"def {spec.name}(q, k, v, lse, do, delta, dq32, dk, dv, B, H, M, N, {STRIDES}{table}{_grad_args(spec)}"
      f"{_cap_args(spec)}):")
    with c.indent():
        c(f'"""FA2 backward, tensor cores: D={D}, tiles {BQ}x{BK}, {NW} warps x 16 kv rows, {spec.dtype}."""')
        c("smem = cuda.shared.array(0, SMEM_DTYPE)")
        c("smem_w = cuda.shared.array(0, SMEM_U32)  # the same bytes as 32-bit words (dS^T stores)")
        c("smem_f = cuda.shared.array(0, SMEM_F32)  # ... and as f32 (lse, delta of the q tiles)")
        c("sb = smem_base(smem)")
        c("tid = cuda.threadIdx.x")
        c("lane = tid & 31")
        c("warp = tid >> 5")
        c("g = lane >> 2")
        c("t2 = (lane & 3) * 2")
        c("__OFFSETS__")
        c(f"nq = (M + {BQ - 1}) // {BQ}")
        c(f"nk = (N + {BK - 1}) // {BK}")
        c(f"HK = H // {G}" if G > 1 else "HK = H")
        c("# kv tile 0 of every (b, kv head) first: under a causal mask it sees the most q tiles")
        c("kj = cuda.blockIdx.x // (B * HK)")
        c("bh = cuda.blockIdx.x - kj * (B * HK)")
        c("b = bh // HK")
        c("hk = bh - b * HK")
        c(f"kv0 = kj * {BK}")
        c("kv_head = (b * HK + hk) * N")
        c(f"total = nq * {G}" if G > 1 else "total = nq")
        c()
        emit_ldmatrix_lanes(c, SWZ)
        c(f"kq_x = k_row & {SWZQ}")
        _emit_lane_offsets(c, D)
        loader = TileLoader(c, threads, D)
        loader.setup()

        c("# K and V of this kv tile, once")
        emit_bases(c, ("k", "v"), ("hk", "hk"))
        loader.load(BK, str(KO), "kv0", "N", "k", "kg", "k_sm")
        loader.load(BK, str(VO), "kv0", "N", "v", "vg", "v_sm")
        c()
        c("# the first non-empty (head, q tile)")
        _emit_first(c, spec)

        def head_and_tile(itv: str, hv: str, qv: str) -> None:
            if G > 1:
                c(f"{hv} = hk * {G} + {itv} // nq")
                c(f"{qv} = ({itv} % nq) * {BQ}")
            else:
                c(f"{hv} = hk")
                c(f"{qv} = {itv} * {BQ}")

        def load_q_tile(hv: str, qv: str, bufv: str) -> None:
            c(f"qh = (b * H + {hv}) * M")
            c(f"qg = b * q_sb + {hv} * q_sh")
            c(f"dog = b * do_sb + {hv} * do_sh")
            loader.load(BQ, f"{QO} + {bufv} * {BQ * D}", qv, "M", "q", "qg", "q_sm")
            loader.load(BQ, f"{DOO} + {bufv} * {BQ * D}", qv, "M", "do", "dog", "do_sm")

        c("if it < total:")
        with c.indent():
            head_and_tile("it", "h", "q0")
            load_q_tile("h", "q0", "0")
            c(f"if tid < {BQ}:")
            with c.indent():
                c("qq = q0 + tid")
                c(f"smem_f[{STF} + tid] = {lse_read(spec, 'lse[qh + qq]')} if qq < M else ZERO")
                c(f"smem_f[{STF + 2 * BQ} + tid] = {delta_read(spec, 'delta[qh + qq]')} if qq < M else ZERO")
        c("cp_async_commit()")
        c()
        c("# dK and dV: rows g and g + 8 of this warp's 16 kv rows, in registers over every q tile; S^T, dP^T per tile")
        c(f"dkacc = cuda.local.array({ND * 4}, np.float32)")
        c(f"dvacc = cuda.local.array({ND * 4}, np.float32)")
        c(f"sacc = cuda.local.array({NJ * 4}, np.float32)")
        c(f"pacc = cuda.local.array({NJ * 4}, np.float32)")
        if spec.dq == "atomic":  # this warp's dQ fragments of a tile: D / (warps / (block_q / 16)) columns
            c(f"dqa = cuda.local.array({D // (NW // (BQ // 16)) // 2}, np.float32)")
        c(f"{zero_helper(c, ND * 4)}(dvacc)")
        c(f"{zero_helper(c, ND * 4)}(dkacc)")
        if spec.dq == "atomic":
            c("# dS^T word offsets of this thread's rows r = warp * 16 + g (+ 8): (DS + r * block_q + t2), swizzle r & mask")
            for r in range(2):
                c(f"dsw{r} = {DSO} + (warp * 16 + {8 * r} + g) * {BQ} + t2")
                c(f"dsx{r} = (warp * 16 + {8 * r} + g) & {SWZQ}")
        c("buf = 0")
        c("nl = ZERO")
        c("nd = ZERO")
        HOLD = held_grads(spec)
        if HOLD:
            c("# the reduced gradients (a head's slope) held across tiles: one add a warp and index")
            _emit_grad_hold_start(c, spec)
        c("while it < total:")
        with c.indent():
            _emit_next(c, spec, "it", "itn")
            c("cp_async_wait0()  # Q, dO of this tile (and K, V on the first) have landed")
            c("cuda.syncthreads()  # ... for everyone; and everyone is done with the other buffers")
            c("if itn < total:")
            with c.indent():
                head_and_tile("itn", "hn", "qn0")
                load_q_tile("hn", "qn0", "(buf ^ 1)")
                c(f"if tid < {BQ}:")
                with c.indent():
                    c("qq = qn0 + tid")
                    c(f"nl = {lse_read(spec, 'lse[qh + qq]')} if qq < M else ZERO")
                    c(f"nd = {delta_read(spec, 'delta[qh + qq]')} if qq < M else ZERO")
            c("cp_async_commit()")
            head_and_tile("it", "h", "q0")
            c("q_head = (b * H + h) * M")
            c(f"interior = q0 + {BQ} <= M and kv0 + {BK} <= N")
            c(f"cls = {_class_expr(spec, 'it')}")
            c(f"qb = sb + ({QO} + buf * {BQ * D}) * 2")
            c(f"ob = sb + ({DOO} + buf * {BQ * D}) * 2")
            c(f"lse_f = {STF} + buf * {BQ}")
            c(f"dlt_f = {STF + 2 * BQ} + buf * {BQ}")
            c()
            c("# S^T = K Q^T and dP^T = V dO^T: this warp's 16 kv rows against the tile's q rows")
            _emit_score_products(c, mma, D, BQ, f"sb + {KO * 2}", f"sb + {VO * 2}", "qb", "ob")
            c()
            c("# per element: P and dS from the IR's elementwise code (s_ becomes P^T, p_ becomes dS^T)")
            for i, g in enumerate(spec.grads):
                if g.reduced:
                    c(f"gsum{i} = ZERO")

            if not spec.grads:
                c("kvr = kv0 + warp * 16 + g  # this thread's first kv row (the second is kvr + 8)")

            def elementwise(branch: str) -> None:
                outs_g = _grad_outs(spec)
                if not spec.grads:  # one helper call per (n8 tile, column): 4 elements
                    fn = _elem_quad_helper(c, spec, branch)
                    for jj in range(NJ):
                        for e in range(2):
                            c(f"{fn}(sacc, pacc, ofs_{jj * 4 + e}, ofs_{jj * 8 + e}, smem_f, lse_f, dlt_f, q0, t2, kvr, "
                              f"b, h, hk, interior{_cap_args(spec)})")
                    return
                for jj in range(NJ):
                    for e in range(2):
                        c(f"qi = q0 + {jj * 8 + e} + t2")
                        c(f"lq = lget(smem_f, lse_f + t2 + {jj * 8 + e})")
                        c(f"dq_ = lget(smem_f, dlt_f + t2 + {jj * 8 + e})")
                        for r in range(2):
                            i = 2 * r + e
                            outs = [f"{SA(jj, i)}", f"{PA(jj, i)}"] + [x for og in outs_g for x in og]
                            c(_elem_call(spec, branch, f"{SA(jj, i)}", f"{PA(jj, i)}", "lq", "dq_", "qi",
                                         f"kv0 + warp * 16 + {8 * r} + g", outs))
                            slot = f"(warp * 16 + {8 * r} + g) * {BQ} + {jj * 8 + e} + t2"
                            _emit_grad_element(c, spec, f"smem_w[{GXW} + {{}} * {BQ * BK} + {slot}]|"
                                                        f"smem_f[{GXF} + {{}} * {BQ * BK} + {slot}]")

            emit_by_class(c, spec.branches, elementwise)
            if HOLD:
                _emit_grad_hold(c, spec)
            else:
                _emit_grad_tile_end(c, spec, warp_reduce=True, partials=f"smem_f[{lay['GP'] // 2} + {{}}]")
            _emit_staged_adds(c, spec, BQ * BK, threads, f"smem_w[{GXW} + {{}} * {BQ * BK} + {{}}]",
                              f"smem_f[{GXF} + {{}} * {BQ * BK} + {{}}]")
            c()
            c("# dV += P^T dO and dK += dS^T Q: P^T and dS^T packed straight from the accumulators")
            # helpers (benchmarks/NOTES.md, "Compile time", lever 13): P^T and dS^T of 16 q columns packed to
            # A-operand pairs; dS^T's four words of them to shared memory, rows (warp * 16 + 8 r + g), swizzled
            pk = c.helper("pack_pd", [
                "@device_function", "def pack_pd(x, y, i):",
                *[f"    {v}{e} = {pack}(lget({arr}, i + {2 * e}), lget({arr}, i + {2 * e + 1}))"
                  for v, arr in (("pa", "x"), ("da", "y")) for e in range(4)],
                "    return pa0, pa1, pa2, pa3, da0, da1, da2, da3"])
            if spec.dq == "atomic":
                st = c.helper("store_dst", [
                    "@device_function", "def store_dst(smem_w, jj, w0, x0, w1, x1, d0, d1, d2, d3):",
                    "    smem_w[(w0 + ((jj ^ x0) << 3)) >> 1] = d0",
                    "    smem_w[(w1 + ((jj ^ x1) << 3)) >> 1] = d1",
                    "    smem_w[(w0 + (((jj + 1) ^ x0) << 3)) >> 1] = d2",
                    "    smem_w[(w1 + (((jj + 1) ^ x1) << 3)) >> 1] = d3"])
            for kk in range(BQ // 16):
                c(f"pa0, pa1, pa2, pa3, da0, da1, da2, da3 = {pk}(sacc, pacc, ofs_{kk * 8})")
                if spec.dq == "atomic":
                    c("# dS^T to shared memory (rows = kv, swizzled 16-byte chunks of q) for dQ = dS K")
                    c(f"{st}(smem_w, ofs_{2 * kk}, dsw0, dsx0, dsw1, dsx1, da0, da1, da2, da3)")
                dvdk = dual_step_helper(c, "dvdk_acc", mma, "ldsm_x4_trans", init=False)
                for dd in range(D // 16):
                    c(f"{dvdk}(dvacc, dkacc, ofs_{2 * dd * 4}, pa0, pa1, pa2, pa3, da0, da1, da2, da3, "
                      f"{_v_addr(D, 'ob', kk, dd)}, {_v_addr(D, 'qb', kk, dd)})")
            if spec.dq == "atomic":
                c("cuda.syncthreads()  # dS^T is complete")
                c()
                RG = BQ // 16  # 16-row groups of dQ; with more warps than groups, warps split D as well
                CS = NW // RG
                DC = D // CS  # columns of dQ one warp computes
                c(f"# dQ rows 16 rg .. 16 rg + 15 of this q tile, columns cs * {DC} ..: dS K, into the f32 accumulator")
                c(f"rg = warp % {RG}")
                c(f"cb = (warp // {RG}) * {DC // 8}  # first 8-column chunk of this warp's dQ columns")
                dq_set = mma_step_helper(c, "dqs_set", mma, "ldsm_x4_trans", 1, 0, init=True)
                dq_acc = mma_step_helper(c, "dqs_acc", mma, "ldsm_x4_trans", 1, 0, init=False)
                c(f"ds_lane = ({DSO} + k_row * {BQ} + (((rg * 2 + k_ch) ^ kq_x) << 3)) * 2  # dS^T rows 16 kk.. are + kk * {16 * BQ * 2}")
                # K columns cb * 8 + 16 dd ..: an XOR on one lane offset when chunks and this warp's chunk
                # count are powers of two (cb + 2 dd + v_ch has no carries), else written out
                kxor = _xor_addressing(D) and (DC // 8) & (DC // 8 - 1) == 0
                if kxor:
                    c(f"kd_lane = (v_row * {D} + (((cb + v_ch) ^ v_x) << 3)) * 2")
                for kk in range(BK // 16):
                    c(f"sa0, sa1, sa2, sa3 = ldsm_x4_trans(sb + ds_lane + {kk * 16 * BQ * 2})")
                    for dd in range(DC // 16):
                        addr = (f"sb + {(KO + kk * 16 * D) * 2} + (kd_lane ^ {dd << 5})" if kxor else
                                f"sb + ({KO} + ({kk * 16} + v_row) * {D} + (((cb + {dd * 2} + v_ch) ^ v_x) << 3)) * 2")
                        c(f"{dq_set if kk == 0 else dq_acc}(dqa, ofs_{2 * dd * 4}, sa0, sa1, sa2, sa3, {addr})")
                c("# lanes t and t ^ 1 swap halves: even lanes then hold 4 consecutive columns of row g, odd lanes")
                c("# of row g + 8, added by one 16-byte vector reduction (a quarter of the scalar atomics)")
                c("odd = (lane & 1) == 1")
                c("qi = q0 + rg * 16 + g + (8 if odd else 0)")
                c(f"qrow = (q_head + qi) * {D} + cb * 8 + (t2 - 2 if odd else t2)")
                _emit_dq_reductions(c, DC // 8)
            c(f"if itn < total and tid < {BQ}:")
            with c.indent():
                c(f"smem_f[{STF} + (buf ^ 1) * {BQ} + tid] = nl")
                c(f"smem_f[{STF + 2 * BQ} + (buf ^ 1) * {BQ} + tid] = nd")
            c("it = itn")
            c("buf ^= 1")
        c()
        if HOLD:
            _emit_grad_hold_end(c, spec)
        c("cp_async_wait0()")
        _emit_dkdv_stores(c, D, ND, pack)
    return bind_offsets(c.text())


# --------------------------------------------------------------------------------------------------
# SIMT schedule
# --------------------------------------------------------------------------------------------------


def _emit_simt_kernel(spec: FA2BackwardSpec) -> str:
    D, BQ, BK, G = spec.head_dim, spec.block_q, spec.block_k, spec.group_size
    QC = _simt_chunk(spec)
    load = {"f16": "f16_to_f32({})", "bf16": "bf16_to_f32({})", "f32": "np.float32({})", "f64": "{}"}[spec.dtype]
    store = {"f16": "f32_to_f16({})", "bf16": "f32_to_bf16({})", "f32": "{}", "f64": "{}"}[spec.dtype]
    table = ", table" if spec.block_mask == "table" else ""
    c = _Code()
    c("@kernel_jit")
    c(f"def {spec.name}(q, k, v, lse, do, delta, dq32, dk, dv, B, H, M, N, {STRIDES}{table}{_grad_args(spec)}"
      f"{_cap_args(spec)}):")
    with c.indent():
        c(f'"""FA2 backward, SIMT fp32: D={D}, tiles {BQ}x{BK} (q rows {QC} at a time), one kv row per thread, '
          f'{spec.dtype}."""')
        c(f"q_s = cuda.shared.array(({QC}, {D}), np.float32)")
        c(f"do_s = cuda.shared.array(({QC}, {D}), np.float32)")
        c(f"st_s = cuda.shared.array((2, {QC}), np.float32)")
        if spec.deterministic and spec.grads:
            c(f"gp_s = cuda.shared.array({len(spec.grads) * BK}, np.float32)")
        if _staged(spec):
            c(f"gx_a = cuda.shared.array(({len(_staged(spec))}, {BK}), np.int32)")
            c(f"gx_v = cuda.shared.array(({len(_staged(spec))}, {BK}), np.float32)")
        c(f"k_r = cuda.local.array({D}, np.float32)")
        c(f"v_r = cuda.local.array({D}, np.float32)")
        c(f"dk_r = cuda.local.array({D}, np.float32)")
        c(f"dv_r = cuda.local.array({D}, np.float32)")
        c("tid = cuda.threadIdx.x")
        c(f"nq = (M + {BQ - 1}) // {BQ}")
        c(f"nk = (N + {BK - 1}) // {BK}")
        c(f"HK = H // {G}" if G > 1 else "HK = H")
        c("kj = cuda.blockIdx.x // (B * HK)")
        c("bh = cuda.blockIdx.x - kj * (B * HK)")
        c("b = bh // HK")
        c("hk = bh - b * HK")
        c(f"kv0 = kj * {BK}")
        c("kv_head = (b * HK + hk) * N")
        c(f"total = nq * {G}" if G > 1 else "total = nq")
        emit_bases(c, ("k", "v"), ("hk", "hk"))
        c("kvi = kv0 + tid")
        c("kvc = min(kvi, N - 1)")
        c(f"for d in range({D}):")
        with c.indent():
            c(f"x = {load.format('k[kg + kvc * k_sm + d]')}")
            c("k_r[d] = x if kvi < N else ZERO")
            c(f"y = {load.format('v[vg + kvc * v_sm + d]')}")
            c("v_r[d] = y if kvi < N else ZERO")
            c("dk_r[d] = ZERO")
            c("dv_r[d] = ZERO")
        listed = spec.block_mask == "list"
        if listed:
            _emit_first(c, spec)
        else:
            c("it = 0")
        c("while it < total:")
        with c.indent():
            if listed:
                _emit_next(c, spec, "it", "itn")
            if G > 1:
                c(f"h = hk * {G} + it // nq")
                c(f"q0 = (it % nq) * {BQ}")
            else:
                c("h = hk")
                c(f"q0 = it * {BQ}")
            c(f"cls = {_class_expr(spec, 'it')}")
            c("if cls != 0:")
            with c.indent():
                c("q_head = (b * H + h) * M")
                emit_bases(c, ("q", "do"), ("h", "h"))
                c(f"interior = q0 + {BQ} <= M and kv0 + {BK} <= N")
                for i, g in enumerate(spec.grads):
                    if g.reduced:
                        c(f"gsum{i} = ZERO")
                c(f"for c0 in range(0, {BQ}, {QC}):")
                with c.indent():
                    c("cuda.syncthreads()  # everyone is done with the previous rows")
                    _emit_stage_rows(c, QC, D, BK, "q0 + c0", "M", load,
                                     (("q_s", "q[qg + row * q_sm + d]"), ("do_s", "do[dog + row * do_sm + d]")))
                    c(f"for e in range(tid, {QC}, {BK}):")
                    with c.indent():
                        c("row = min(q0 + c0 + e, M - 1)")
                        c(f"st_s[0, e] = {lse_read(spec, 'lse[q_head + row]')}")
                        c(f"st_s[1, e] = {delta_read(spec, 'delta[q_head + row]')}")
                    c("cuda.syncthreads()")
                    c(f"for r in range({QC}):")
                    with c.indent():
                        c("qi = q0 + c0 + r")
                        c("s = ZERO")
                        c("dpv = ZERO")
                        c(f"for d in range({D}):")
                        with c.indent():
                            c("s += q_s[r, d] * k_r[d]")
                            c("dpv += do_s[r, d] * v_r[d]")
                        outs = ["p", "ds"] + [x for og in _grad_outs(spec) for x in og]

                        def call(branch: str) -> None:
                            c(_elem_call(spec, branch, "s", "dpv", "st_s[0, r]", "st_s[1, r]", "qi", "kvi", outs))
                            _emit_grad_element(c, spec, "gx_a[{}, tid]|gx_v[{}, tid]")

                        emit_by_class(c, spec.branches, call)
                        _emit_staged_adds(c, spec, BK, BK, "gx_a[{}, {}]", "gx_v[{}, {}]")
                        c(f"for d in range({D}):")
                        with c.indent():
                            c("dv_r[d] += p * do_s[r, d]")
                            c("dk_r[d] += ds * q_s[r, d]")
                        c("if ds != ZERO and qi < M:" if spec.dq == "atomic" else "if False:  # dQ: its own kernel")
                        with c.indent():
                            c(f"for d in range({D}):")
                            with c.indent():
                                c(f"cuda.atomic.add(dq32, (q_head + qi) * {D} + d, ds * k_r[d])")
                _emit_grad_tile_end(c, spec, warp_reduce=False, partials="gp_s[{}]")
            c("it = itn" if listed else "it += 1")
        c("if kvi < N:")
        with c.indent():
            c(f"for d in range({D}):")
            with c.indent():
                c(f"dk[(kv_head + kvi) * {D} + d] = {store.format('dk_r[d]')}")
                c(f"dv[(kv_head + kvi) * {D} + d] = {store.format('dv_r[d]')}")
    return c.text()


def _emit_stage_rows(c: _Code, n: int, D: int, step: int, row0: str, limit: str, load: str,
                     arrays: tuple[tuple[str, str], ...]) -> None:
    """The SIMT kernels' chunk of rows row0 .. row0 + n - 1 of two arrays into shared memory (Q and dO, or K and
    V), `step` threads striding over its n x D elements: each read at its row clamped below `limit`, stored as zero
    past it. `arrays`: (shared array, global element read of `row` and `d`) each, `load` its conversion to f32."""
    c(f"for e in range(tid, {n * D}, {step}):")
    with c.indent():
        c(f"r = e // {D}")
        c(f"d = e % {D}")
        c(f"row = min({row0} + r, {limit} - 1)")
        names = ("a", "a2")
        for name, (_, src) in zip(names, arrays):
            c(f"{name} = {load.format(src)}")
        for name, (dst, _) in zip(names, arrays):
            c(f"{dst}[r, d] = {name} if {row0} + r < {limit} else ZERO")


def _simt_chunk(spec: FA2BackwardSpec) -> int:
    """Query rows the SIMT kernel stages in shared memory at a time (Q and dO: 2 * rows * D floats <= 32 KB)."""
    rows = spec.block_q
    while rows > 1 and 2 * rows * spec.head_dim * (8 if spec.dtype == "f64" else 4) > 32 * 1024:
        rows //= 2
    while spec.block_q % rows:
        rows -= 1
    return rows


# --------------------------------------------------------------------------------------------------
# Delta and dQ conversion
# --------------------------------------------------------------------------------------------------


def _delta_pieces(spec: FA2BackwardSpec) -> bool:
    """Whether a Delta row is read as 16-byte pieces, a lane each: f16 / bf16 rows of whole pieces whose count is a
    power of two up to a warp (D = 8 ... 256). The 16-byte loads and stores were measured against a warp's 2-byte
    ones (H200, B = 4, N = 4k: 111 us for 269 MB at D = 128, 145 us at D = 64, about half the memory's rate, then
    66 us at both; benchmarks/NOTES.md, sixty-second session)."""
    n, D = spec.head_dim // 8, spec.head_dim
    return spec.dtype in ("f16", "bf16") and D % 8 == 0 and n <= 32 and n & (n - 1) == 0


def delta_lanes(spec: FA2BackwardSpec) -> int:
    """Threads of a Delta row: one a 16-byte piece (`_delta_pieces`), else a warp."""
    return spec.head_dim // 8 if _delta_pieces(spec) else 32


def delta_rows(spec: FA2BackwardSpec) -> int:
    """Rows of a 128-thread Delta block."""
    return 128 // delta_lanes(spec)


def delta_grid(B: int, H: int, M: int, rows: int) -> tuple[int, int, int]:
    """The Delta kernel's grid: (row groups of `rows` (delta_rows), H, B), so the kernel finds (b, h, m) with no
    division (three 64-bit divisions by run-time values were ~200 of its ~440 instructions a warp: 165 us for B = 4,
    H = 16, N = 4k, D = 128 on the H100, against ~45 us of memory traffic)."""
    return (-(-M // rows), H, B)


def _dq_ws(spec: FA2BackwardSpec) -> bool:
    """Whether dQ's f32 accumulator is kept in the wgmma kernel's slab order (emit_fa3_bwd.dq_ws)."""
    w = _wgmma(spec)
    return bool(w and w.dq_ws(spec))


def emit_delta(spec: FA2BackwardSpec) -> str:
    """`<name>_delta(do, o, delta, dq32, H, M, *dO strides)`: `delta_lanes` threads a row, `delta_rows` rows a
    128-thread block, launched on `delta_grid`. With 8 lanes or more (f16 / bf16) each reads its 16 bytes of dO and
    O by one vector load and zeroes its 32 bytes of dQ's accumulator by two vector stores, where dO's strides and
    the three arrays' starts allow (checked in the kernel; else 2-byte loads at a stride of the lanes)."""
    D = spec.head_dim
    load = {"f16": "f16_to_f32({})", "bf16": "bf16_to_f32({})", "f32": "np.float32({})", "f64": "{}"}[spec.dtype]
    T = delta_lanes(spec)
    R = 128 // T
    vec = _delta_pieces(spec)
    c = _Code()
    if vec:
        c("from falower.backends.numba_cuda.intrinsics import ldg_vec, stg_vec")
        c()
    c("@kernel_jit")
    c(f"def {spec.name}_delta(do, o, delta, dq32, H, M, do_sb, do_sh, do_sm):")
    with c.indent():
        c('"""Delta = rowsum(dO * O) per row (FA2\'s preprocessing); zeroes the row of the f32 dQ accumulator."""')
        c(f"lane = cuda.threadIdx.x & {T - 1}  # this thread's part of its row")
        c(f"m = cuda.blockIdx.x * {R} + (cuda.threadIdx.x >> {T.bit_length() - 1})")
        c("h = cuda.blockIdx.y")
        c("b = cuda.blockIdx.z")
        c("row = (b * H + h) * M + m  # rows past M (the last group's) do nothing")
        c("dorow = b * do_sb + h * do_sh + m * do_sm  # dO may be a strided view")
        if spec.dtype == "f64":  # no f64 shuffle: lane 0 sums the row alone (gradcheck's tiny shapes)
            c("if m < M and lane == 0:")
            with c.indent():
                c("acc = ZERO")
                c(f"for d in range({D}):")
                with c.indent():
                    c(f"acc += do[dorow + d] * o[row * {D} + d]")
                    if spec.dq == "atomic":
                        c(f"dq32[row * {D} + d] = ZERO")
                c("delta[row] = acc")
            return _module(spec, c.text())
        ws = _dq_ws(spec)
        zero = spec.dq == "atomic"
        drow = "zrow" if ws else "row"
        if ws:  # the accumulator in slab order, padded to whole q tiles: zeroed as a contiguous range of rows
            c(f"mp = (M + {spec.block_q - 1}) // {spec.block_q} * {spec.block_q}  # its rows a (batch, head)")
            c("zrow = (b * H + h) * mp + m")
            c("if m == M - 1:  # the padding rows past M, by the last row's threads")
            with c.indent():
                c(f"for z in range(lane, (mp - M) * {D}, {T}):")
                with c.indent():
                    c(f"dq32[(zrow + 1) * {D} + z] = ZERO")
        c("acc = ZERO")
        if vec:
            c("# 16-byte pieces where dO's rows and the arrays' starts are 16-byte aligned (one branch, the same for")
            c("# every thread)")
            c("vec = ((do_sb | do_sh | do_sm) & 7) == 0 and ((elem_addr(do, (0,)) | elem_addr(o, (0,))"
              + (" | elem_addr(dq32, (0,))" if zero else "") + ") & 15) == 0")
            c("if vec and m < M:")
            with c.indent():
                c("x = ldg_vec(do, dorow + 8 * lane)")
                c(f"y = ldg_vec(o, row * {D} + 8 * lane)")
                c("acc = " + " + ".join(f"{load.format(f'x[{e}]')} * {load.format(f'y[{e}]')}" for e in range(8)))
                if zero:
                    c(f"stg_vec(dq32, {drow} * {D} + 8 * lane, (ZERO, ZERO, ZERO, ZERO))")
                    c(f"stg_vec(dq32, {drow} * {D} + 8 * lane + 4, (ZERO, ZERO, ZERO, ZERO))")
            c("elif m < M:")
        else:
            c("if m < M:")
        with c.indent():
            c(f"for d in range(lane, {D}, {T}):")
            with c.indent():
                c(f"acc += {load.format('do[dorow + d]')} * {load.format(f'o[row * {D} + d]')}")
                if zero:
                    c(f"dq32[{drow} * {D} + d] = ZERO")
        k = T // 2
        while k:  # within the row's lanes (every lane of the warp takes part)
            c(f"acc += shfl_xor_f32(acc, {k})")
            k //= 2
        c("if lane == 0 and m < M:")
        with c.indent():
            c("delta[row] = acc")
    return _module(spec, c.text())


DQ_WS_CONVERT_THREADS = 256


def dq_convert_launch(spec: FA2BackwardSpec, B: int, H: int, M: int, n: int) -> tuple[tuple[int], int]:
    """(grid, threads) of `<name>_dq` for n = B H M D elements of dQ: a thread a pair (mma) or an element, or under
    dq_ws a block a (batch, head, q tile)."""
    if _dq_ws(spec):
        return (B * H * -(-M // spec.block_q),), DQ_WS_CONVERT_THREADS
    if _dq_convert_vec(spec):
        return (-(-(n // 8) // 128),), 128
    return (-(-(n // 2 if spec.path == "mma" else n) // 128),), 128


def _dq_convert_vec(spec: FA2BackwardSpec) -> bool:
    """dQ's conversion 8 elements a thread (two 16-byte loads, one 16-byte store): pairs (mma path) in whole
    16-byte pieces of a row. Both arrays are the call's own allocations (16-byte aligned)."""
    return spec.path == "mma" and spec.dtype in ("f16", "bf16") and spec.head_dim % 8 == 0


def _emit_dq_ws_convert(c: _Code, spec: FA2BackwardSpec) -> None:
    """dq_ws's conversion, a block a (batch-head, q tile): the tile's slabs read in order (16-byte chunks, coalesced),
    each chunk's two pairs (rows r and r + 8, wgmma's accumulator order: emit_fa3_bwd.dq_ws_chunk) packed into the
    tile's rows in shared memory (D / 2 + 4 words apart: a warp's 32 lanes in 32 banks), then the rows inside M
    written out a word a thread, in order."""
    D, BQ = spec.head_dim, spec.block_q
    W = D // 2 + 4
    T = DQ_WS_CONVERT_THREADS
    pack = "pack_f16x2" if spec.dtype == "f16" else "pack_bf16x2"
    c.helper("dqws_rc", _wgmma(spec).dq_ws_chunk(spec))
    c(f"tile = cuda.shared.array({BQ * W}, SMEM_U32)  # the tile's rows, packed")
    c(f"nq = (M + {BQ - 1}) // {BQ}")
    c("bh = cuda.blockIdx.x // nq")
    c("qt = cuda.blockIdx.x % nq")
    c(f"base = cuda.blockIdx.x * {BQ * D}")
    c("tid = cuda.threadIdx.x")
    c(f"for p in range(tid, {BQ * D // 4}, {T}):")
    with c.indent():
        c("r, col = dqws_rc(p)")
        c("x = ldg_vec(dq32, base + 4 * p)  # one 16-byte chunk")
        c(f"tile[r * {W} + (col >> 1)] = {pack}(x[0], x[1])")
        c(f"tile[(r + 8) * {W} + (col >> 1)] = {pack}(x[2], x[3])")
    c("cuda.syncthreads()")
    if D % 8 == 0:  # 4 words (8 halves) a store
        c(f"for i in range(tid, {BQ * D // 8}, {T}):")
        with c.indent():
            c(f"r = i // {D // 8}")
            c(f"w = (i % {D // 8}) * 4")
            c(f"m = qt * {BQ} + r")
            c("if m < M:")
            with c.indent():
                c(f"t = r * {W} + w")
                c(f"stg_vec(dq, (bh * M + m) * {D // 2} + w, (tile[t], tile[t + 1], tile[t + 2], tile[t + 3]))")
    else:
        c(f"for i in range(tid, {BQ * D // 2}, {T}):")
        with c.indent():
            c(f"r = i // {D // 2}")
            c(f"m = qt * {BQ} + r")
            c("if m < M:")
            with c.indent():
                c(f"dq[(bh * M + m) * {D // 2} + i % {D // 2}] = tile[r * {W} + i % {D // 2}]")


def emit_dq_convert(spec: FA2BackwardSpec) -> str:
    """`<name>_dq(dq32, dq, n, M)`: the f32 accumulator to the input dtype (dq as uint32 pairs on the mma path), on
    `dq_convert_launch`'s grid; under dq_ws from the slab order, a q tile a block."""
    c = _Code()
    if _dq_ws(spec) or _dq_convert_vec(spec):
        c("from falower.backends.numba_cuda.intrinsics import ldg_vec, stg_vec")
        c()
    c("@kernel_jit")
    c(f"def {spec.name}_dq(dq32, dq, n, M):")
    with c.indent():
        if _dq_ws(spec):
            _emit_dq_ws_convert(c, spec)
            return _module(spec, c.text())
        c("i = cuda.grid(1)")
        if _dq_convert_vec(spec):
            pack = "pack_f16x2" if spec.dtype == "f16" else "pack_bf16x2"
            c("if 8 * i < n:  # 8 elements: two 16-byte loads, one 16-byte store")
            with c.indent():
                c("x = ldg_vec(dq32, 8 * i)")
                c("y = ldg_vec(dq32, 8 * i + 4)")
                words = ", ".join(f"{pack}({a}[{e}], {a}[{e + 1}])" for a in ("x", "y") for e in (0, 2))
                c(f"stg_vec(dq, 4 * i, ({words}))")
        elif spec.dtype in ("f32", "f64"):
            c("if i < n:")
            with c.indent():
                c("dq[i] = dq32[i]")
        elif spec.path == "mma":
            pack = "pack_f16x2" if spec.dtype == "f16" else "pack_bf16x2"
            c("if 2 * i < n:")
            with c.indent():
                c(f"dq[i] = {pack}(dq32[2 * i], dq32[2 * i + 1])")
        else:
            store = "f32_to_f16" if spec.dtype == "f16" else "f32_to_bf16"
            c("if i < n:")
            with c.indent():
                c(f"dq[i] = {store}(dq32[i])")
    return _module(spec, c.text())


def _dq_class_expr(spec: FA2BackwardSpec, j: str) -> str:
    BQ, BK = spec.block_q, spec.block_k
    if spec.block_mask == "static":
        return f"tile_class_q_fn(b, h, q0, q0 + {BQ - 1}, ({j}) * {BK}, ({j}) * {BK} + {BK - 1}{_cap_args(spec)})"
    if spec.block_mask == "table":
        return f"table[((b * H + h) * nq + qt) * nk + {j}]"
    if spec.block_mask == "list":
        return "kv_cls"  # the current tile's, set by _emit_dq_next
    return "2"


def _emit_dq_prologue(c: _Code, spec: FA2BackwardSpec, warp_wide: bool = True) -> None:
    """Block -> (b, h, q tile), heaviest q tiles first (causal), and the non-empty kv tiles' range."""
    G, BQ, BK = spec.group_size, spec.block_q, spec.block_k
    c(f"nq = (M + {BQ - 1}) // {BQ}")
    c(f"nk = (N + {BK - 1}) // {BK}")
    c("qt = nq - 1 - cuda.blockIdx.x // (B * H)")
    c("bh = cuda.blockIdx.x % (B * H)")
    c("b = bh // H")
    c("h = bh - b * H")
    c(f"hk = h // {G}" if G > 1 else "hk = h")
    c(f"q0 = qt * {BQ}")
    c("q_head = (b * H + h) * M")
    emit_bases(c, ("q", "do", "k", "v"), ("h", "h", "hk", "hk"))
    if spec.block_mask == "none":
        c("kv_first = 0")
        c("kv_last = nk - 1")
    elif spec.block_mask == "list":
        a = _list_args(spec)
        c("# the kv tiles this q tile visits, listed once per data (block_data.py): no scan, no empty tile")
        c("kv_row = (b * H + h) * nq + qt")
        c(f"kv_n = {a['kv_count']}[kv_row]")
        c("kv_row = kv_row * nk")
        c("kv_pos = 0")
        c(f"kv_first = ({a['kv_tiles']}[kv_row] >> 1) if kv_n > 0 else 0")
        c(f"kv_last = ({a['kv_tiles']}[kv_row + kv_n - 1] >> 1) if kv_n > 0 else -1")
    else:
        emit_tile_scan(c, lambda j: _dq_class_expr(spec, j), "nk", "kv_first", "kv_last", warp_wide)


def _emit_dq_next(c: _Code, spec: FA2BackwardSpec) -> None:
    if spec.block_mask == "list":  # j is entry kv_pos of the list
        kvt = _list_args(spec)["kv_tiles"]
        c(f"kv_cls = 1 if {kvt}[kv_row + kv_pos] & 1 else 2  # tile j: partial or full")
        c("kv_pos += 1")
        c(f"jn = ({kvt}[kv_row + kv_pos] >> 1) if kv_pos < kv_n else kv_last + 1")
        return
    c("jn = j + 1")
    if spec.block_mask != "none":
        c(f"while jn <= kv_last and {_dq_class_expr(spec, 'jn')} == 0:")
        with c.indent():
            c("jn += 1")


def emit_by_class(c: _Code, branches: tuple, emit_one) -> None:
    """`emit_one(branch)` for the tile's class: once where the elementwise code has one branch, else under `cls`
    (2: full, else partial). Every backward kernel's element code goes through this."""
    if len(branches) == 1:
        emit_one(branches[0])
        return
    c("if cls == 2:")
    with c.indent():
        emit_one("full")
    c("else:")
    with c.indent():
        emit_one("partial")


def _dq_elementwise(c: _Code, spec: FA2BackwardSpec, emit_one) -> None:
    """The branch of the q-outer body for this tile class; `emit_one(branch)` emits the element code."""
    emit_by_class(c, spec.q_branches, emit_one)


def _emit_dq_mma_kernel(spec: FA2BackwardSpec) -> str:
    """dQ by the q-outer nest (dq=separate): one block per (b, h, q tile), warp w owning q rows 16w .. 16w + 15;
    K and V double-buffered by cp.async; S = Q K^T and dP = dO V^T as the forward's S, dS from elemq_<branch>,
    dQ += dS K with dS packed straight from the accumulators (the forward's P V step). No atomics."""
    D, BQ, BK = spec.head_dim, spec.block_q, spec.block_k
    NWQ = BQ // 16
    threads = NWQ * 32
    SWZ = _swizzle_mask(D)
    NJ, ND = BK // 8, D // 8
    QO, DOO, KO = 0, BQ * D, 2 * BQ * D
    T = BK * D  # one K or V buffer; K0 V0 K1 V1
    mma = "mma_f16" if spec.dtype == "f16" else "mma_bf16"
    pack = "pack_f16x2" if spec.dtype == "f16" else "pack_bf16x2"
    table = ", table" if spec.block_mask == "table" else ""
    c = _Code()
    emit_mma_helpers(c, mma)
    c("@kernel_jit")
    c(f"def {spec.name}_dqk(q, k, v, lse, do, delta, dq, B, H, M, N, {STRIDES}{table}{_cap_args(spec)}):")
    with c.indent():
        c(f'"""dQ of the FA2 backward, q tiles outer (no atomics): D={D}, tiles {BQ}x{BK}, {NWQ} warps."""')
        c("smem = cuda.shared.array(0, SMEM_DTYPE)")
        c("sb = smem_base(smem)")
        c("tid = cuda.threadIdx.x")
        c("lane = tid & 31")
        c("warp = tid >> 5")
        c("g = lane >> 2")
        c("t2 = (lane & 3) * 2")
        c("__OFFSETS__")
        _emit_dq_prologue(c, spec)
        emit_ldmatrix_lanes(c, SWZ)
        _emit_lane_offsets(c, D)
        loader = TileLoader(c, threads, D)
        loader.setup()
        loader.load(BQ, str(QO), "q0", "M", "q", "qg", "q_sm")
        loader.load(BQ, str(DOO), "q0", "M", "do", "dog", "do_sm")
        c("if kv_first <= kv_last:")
        with c.indent():
            loader.load(BK, str(KO), f"kv_first * {BK}", "N", "k", "kg", "k_sm")
            loader.load(BK, str(KO + T), f"kv_first * {BK}", "N", "v", "vg", "v_sm")
        c("cp_async_commit()")
        for r in range(2):
            c(f"qr{r} = q0 + warp * 16 + {8 * r} + g")
            c(f"lse{r} = {lse_read(spec, f'lse[q_head + qr{r}]')} if qr{r} < M else ZERO")
            c(f"dlt{r} = {delta_read(spec, f'delta[q_head + qr{r}]')} if qr{r} < M else ZERO")
        c("# dQ of rows g and g + 8 of this warp's 16 q rows over every kv tile; S, dP per tile")
        c(f"dqacc = cuda.local.array({ND * 4}, np.float32)")
        c(f"sacc = cuda.local.array({NJ * 4}, np.float32)")
        c(f"pacc = cuda.local.array({NJ * 4}, np.float32)")
        c(f"{zero_helper(c, ND * 4)}(dqacc)")
        c("j = kv_first")
        c("buf = 0")
        c("while j <= kv_last:")
        with c.indent():
            _emit_dq_next(c, spec)
            c(f"kb_ = sb + ({KO} + buf * {2 * T}) * 2")
            c(f"vb_ = kb_ + {T * 2}")
            c("cp_async_wait0()")
            c("cuda.syncthreads()")
            c("if jn <= kv_last:")
            with c.indent():
                loader.load(BK, f"{KO} + (buf ^ 1) * {2 * T}", f"jn * {BK}", "N", "k", "kg", "k_sm")
                loader.load(BK, f"{KO} + (buf ^ 1) * {2 * T} + {T}", f"jn * {BK}", "N", "v", "vg", "v_sm")
            c("cp_async_commit()")
            c(f"kv0 = j * {BK}")
            c(f"interior = q0 + {BQ} <= M and kv0 + {BK} <= N")
            c(f"cls = {_dq_class_expr(spec, 'j')}")
            _emit_score_products(c, mma, D, BK, f"sb + {QO * 2}", f"sb + {DOO * 2}", "kb_", "vb_")

            def one(branch: str) -> None:
                # one helper call per n8 tile: its 4 elements (rows qr0, qr1; columns kv0 + 8 jj + t2 + 0, 1)
                lines = ["@device_function",
                         f"def elemsq_{branch}(x, y, i, kvc, lse0, dlt0, qr0, lse1, dlt1, qr1, b, h, hk, interior"
                         f"{_cap_args(spec)}):"]
                for i in range(4):
                    r, e = i >> 1, i & 1
                    lines.append(f"    d{i}, = elemq_{branch}(lget(x, i + {i}), lget(y, i + {i}), lse{r}, dlt{r}, b, h, hk, "
                                 f"qr{r}, kvc + {e}, interior{_cap_args(spec)})")
                    lines.append(f"    lset(x, i + {i}, d{i})")
                fn = c.helper(f"elemsq_{branch}", lines)
                for jj in range(NJ):
                    c(f"{fn}(sacc, pacc, ofs_{jj * 4}, kv0 + {jj * 8} + t2, lse0, dlt0, qr0, lse1, dlt1, qr1, b, h, hk, "
                      f"interior{_cap_args(spec)})")

            _dq_elementwise(c, spec, one)
            c("# dQ += dS K, dS packed from the accumulators")
            for kk in range(BK // 16):
                a, bb = 2 * kk, 2 * kk + 1
                c(f"sa0 = {pack}({SA(a, 0)}, {SA(a, 1)})")
                c(f"sa1 = {pack}({SA(a, 2)}, {SA(a, 3)})")
                c(f"sa2 = {pack}({SA(bb, 0)}, {SA(bb, 1)})")
                c(f"sa3 = {pack}({SA(bb, 2)}, {SA(bb, 3)})")
                dq_acc = mma_step_helper(c, "dq_acc", mma, "ldsm_x4_trans", 1, 0, init=False)
                for dd in range(D // 16):
                    c(f"{dq_acc}(dqacc, ofs_{2 * dd * 4}, sa0, sa1, sa2, sa3, {_v_addr(D, 'kb_', kk, dd)})")
            c("j = jn")
            c("buf ^= 1")
        c("cp_async_wait0()")
        sp = _store_pairs_helper(c, ND, pack)
        for r in range(2):
            c(f"if qr{r} < M:")
            with c.indent():
                c(f"qrow = ((q_head + qr{r}) * {D} + t2) >> 1")
                c(f"{sp}(dq, qrow, dqacc, ofs_{2 * r})")
    return _module(spec, bind_offsets(c.text()))


def _emit_dq_simt_kernel(spec: FA2BackwardSpec) -> str:
    """dQ by the q-outer nest on the SIMT path: one q row per thread, K and V rows staged in shared memory."""
    D, BQ, BK = spec.head_dim, spec.block_q, spec.block_k
    load = {"f16": "f16_to_f32({})", "bf16": "bf16_to_f32({})", "f32": "np.float32({})", "f64": "{}"}[spec.dtype]
    store = {"f16": "f32_to_f16({})", "bf16": "f32_to_bf16({})", "f32": "{}", "f64": "{}"}[spec.dtype]
    KC = BK
    while KC > 1 and 2 * KC * D * 4 > 32 * 1024:
        KC //= 2
    while BK % KC:
        KC -= 1
    table = ", table" if spec.block_mask == "table" else ""
    c = _Code()
    c("@kernel_jit")
    c(f"def {spec.name}_dqk(q, k, v, lse, do, delta, dq, B, H, M, N, {STRIDES}{table}{_cap_args(spec)}):")
    with c.indent():
        c(f'"""dQ of the FA2 backward, q tiles outer, SIMT fp32: one q row per thread, kv rows {KC} at a time."""')
        c(f"k_s = cuda.shared.array(({KC}, {D}), np.float32)")
        c(f"v_s = cuda.shared.array(({KC}, {D}), np.float32)")
        c(f"q_r = cuda.local.array({D}, np.float32)")
        c(f"do_r = cuda.local.array({D}, np.float32)")
        c(f"dq_r = cuda.local.array({D}, np.float32)")
        c("tid = cuda.threadIdx.x")
        _emit_dq_prologue(c, spec, warp_wide=BQ % 32 == 0)  # one thread a q row
        c("qi = q0 + tid")
        c("qc = min(qi, M - 1)")
        c(f"for d in range({D}):")
        with c.indent():
            c(f"q_r[d] = {load.format('q[qg + qc * q_sm + d]')}")
            c(f"do_r[d] = {load.format('do[dog + qc * do_sm + d]')}")
            c("dq_r[d] = ZERO")
        c(f"lq = {lse_read(spec, 'lse[q_head + qc]')}")
        c(f"dl = {delta_read(spec, 'delta[q_head + qc]')}")
        c("j = kv_first")
        c("while j <= kv_last:")
        with c.indent():
            _emit_dq_next(c, spec)
            c(f"kv0 = j * {BK}")
            c(f"interior = q0 + {BQ} <= M and kv0 + {BK} <= N")
            c(f"cls = {_dq_class_expr(spec, 'j')}")
            c(f"for c0 in range(0, {BK}, {KC}):")
            with c.indent():
                c("cuda.syncthreads()")
                _emit_stage_rows(c, KC, D, BQ, "kv0 + c0", "N", load,
                                 (("k_s", "k[kg + row * k_sm + d]"), ("v_s", "v[vg + row * v_sm + d]")))
                c("cuda.syncthreads()")
                c(f"for r in range({KC}):")
                with c.indent():
                    c("s = ZERO")
                    c("dpv = ZERO")
                    c(f"for d in range({D}):")
                    with c.indent():
                        c("s += q_r[d] * k_s[r, d]")
                        c("dpv += do_r[d] * v_s[r, d]")

                    def one(branch: str) -> None:
                        c(f"ds, = elemq_{branch}(s, dpv, lq, dl, b, h, hk, qi, kv0 + c0 + r, interior{_cap_args(spec)})")

                    _dq_elementwise(c, spec, one)
                    c(f"for d in range({D}):")
                    with c.indent():
                        c("dq_r[d] += ds * k_s[r, d]")
            c("j = jn")
        c("if qi < M:")
        with c.indent():
            c(f"for d in range({D}):")
            with c.indent():
                c(f"dq[(q_head + qi) * {D} + d] = {store.format('dq_r[d]')}")
    return _module(spec, c.text())


def emit_dq_kernel(spec: FA2BackwardSpec) -> str:
    """`<name>_dqk(q, k, v, lse, do, delta, dq, B, H, M, N, [table], *captures)`: dQ by the q-outer nest."""
    return _emit_dq_mma_kernel(spec) if spec.path == "mma" else _emit_dq_simt_kernel(spec)


def dq_grid(spec: FA2BackwardSpec, B: int, H: int, M: int) -> tuple[int, ...]:
    return (-(-M // spec.block_q) * B * H,)


def dq_threads(spec: FA2BackwardSpec) -> int:
    return (spec.block_q // 16) * 32 if spec.path == "mma" else spec.block_q


def dq_smem_bytes(spec: FA2BackwardSpec) -> int:
    if spec.path == "simt":
        return 0
    return 2 * (2 * spec.block_q * spec.head_dim + 4 * spec.block_k * spec.head_dim)


def emit_parts_sum(spec: FA2BackwardSpec) -> str:
    """`<name>_parts(parts, out, nblocks, size)`: a captured table's gradient as the sum of the blocks' copies,
    block 0 first (deterministic mode)."""
    c = _Code()
    c("@kernel_jit")
    c(f"def {spec.name}_parts(parts, out, nblocks, size):")
    with c.indent():
        c("e = cuda.grid(1)")
        c("if e < size:")
        with c.indent():
            c("acc = ZERO")
            c("for j in range(nblocks):")
            with c.indent():
                c("acc += parts[j * size + e]")
            c("out[e] = acc")
    return _module(spec, c.text())


def emit_fa2_backward(spec: FA2BackwardSpec) -> str:
    """Numba CUDA source of the main backward kernel `spec.name` (a whole module)."""
    if _wgmma(spec):  # the main kernel on Hopper's wgmma (emit_fa3_bwd.py; opt-in: spec.extra["bwd_schedule"])
        return _wgmma(spec).emit_fa3_backward(spec)
    validate_backward_spec(spec)
    body = _emit_mma_kernel(spec) if spec.path == "mma" else _emit_simt_kernel(spec)
    return _module(spec, body)
