"""The numba-cuda backend against hand-edited mask ops (a follow-up of tests/test_edited_ir_refused.py).

mask-tiles gives `mask.kv_range`, `mask.classify` and `mask.block_table` a copy of the score function's mask as a
region; the interpreter takes that region, the op's bq / bk and its operands as the definition of the tile classes
and the kv range, while the forward kernels classify tiles from the fused score function's mask on their own tiles
and indices. A dump whose copy was edited (causal's kv <= q made kv >= q) verified, interpreted to other numbers and
compiled to the kernels' own: now refused in one line naming what differs. Every pipeline's own IR is accepted. The
backward's kernels take the IR's classify regions themselves, but not its q / kv ranges, tiles or operands: those
are asked of the IR the same way (from_ir_bwd._check_mask_ops)."""

from __future__ import annotations

import functools
import re
import runpy
from pathlib import Path

import numpy as np
import pytest

import falower as fl
from falower.errors import FalowerError
from falower.ir.interp import interpret
from falower.ir.verifier import verify
from falower.passes import NAMED_PIPELINES, run_pipeline
from falower.passes.pack_gqa import pack_gqa

from data_masks import MASKS

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
FWD = NAMED_PIPELINES["fa2-fwd"]
CAUSAL = fl.attention(mask_mod=lambda b, h, q, kv: q >= kv, name="causal")
TEMPLATE = r" \(its kernels compute this from their own template\)$"


def _example(stem: str) -> fl.Func:
    return next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, fl.Func))


def _refused(text: str, words: str, backward: bool = False) -> None:
    """The edited dump verifies, and the backend refuses it in one line."""
    from falower.backends.numba_cuda.from_ir import analyse
    from falower.backends.numba_cuda.from_ir_bwd import analyse_backward

    func = fl.parse_func(text)
    verify(func)
    with pytest.raises(FalowerError, match="^numba-cuda backend: " + words + ".*" + TEMPLATE) as e:
        (analyse_backward if backward else analyse)(func)
    assert "\n" not in str(e.value)


def _edit(text: str, old: str, new: str) -> str:
    assert re.search(old, text), old
    return re.sub(old, new, text, count=1)


def _region_op(op: str) -> str:
    """A regex of the first op of `op`'s region (the line after its header): \\1 is everything up to its name."""
    return rf"({op} [^\n]*\n[^\n]*\n\s+%\w+ = )ge "


FULL_WITH_MASK = (r"%x_log2 = mul %s_1, %scale_1 : f32\[128,64\]\n(\s+)yield %x_log2",
                  r"%x_log2 = mul %s_1, %scale_1 : f32[128,64]\n\1%nine = const 9 : i32\n"
                  r"\1%early = lt %kv_2, %nine : bool[1,64]\n\1%ninf = const -inf : f32\n"
                  r"\1%x_early = where %early, %x_log2, %ninf : f32[128,64]\n\1yield %x_early")


@pytest.mark.parametrize("old, new, words", [
    (_region_op("mask.classify"), r"\1le ", "mask.classify's predicate is not the score function's mask"),
    (_region_op("mask.kv_range"), r"\1le ", "mask.kv_range's predicate is not the score function's mask"),
    (r"%15 = ge %q_4, %kv_3", "%15 = le %q_4, %kv_3", "mask.kv_range's predicate is not the score function's mask"),
    (r"(mask.classify [^{]*)\{bk = 64, bq = 128\}", r"\1{bk = 64, bq = 64}",
     "mask.classify's tiles bq = 64, bk = 64 are not the kv loop's 128 x 64"),
    (r"(mask.kv_range [^{]*)\{bk = 64, bq = 128\}", r"\1{bk = 128, bq = 128}",
     "mask.kv_range's tiles bq = 128, bk = 128 are not the kv loop's 128 x 64"),
    (r"mask.classify %b, %h, %q0, %k0", "mask.classify %b, %h, %k0, %q0",
     "mask.classify's q0 is %k0, not the q tile's first row %q0"),
    (r"mask.kv_range %b, %h, %q0", "mask.kv_range %h, %b, %q0",
     "mask.kv_range's b is %h, not the program's batch index %b"),
    (r"mask.kv_range %b, %h, %q0, %nkv", "mask.kv_range %b, %h, %q0, %qi",
     "mask.kv_range's nkv is %qi, not the constant N"),
    (*FULL_WITH_MASK, "the full tiles' score function has a mask"),
], ids=["classify-anticausal", "kv-range-anticausal", "score-mask-anticausal", "classify-bq", "kv-range-bk",
        "classify-q0-k0", "kv-range-b-h", "kv-range-nkv", "full-tiles-masked"])
def test_the_backend_takes_only_mask_tiles_copy_of_the_mask(old: str, new: str, words: str) -> None:
    _refused(_edit(fl.print_func(run_pipeline(CAUSAL, FWD)), old, new), re.escape(words))


def test_an_edited_tile_class_is_the_irs_definition_and_refused() -> None:
    """The interpreter takes mask.classify's region as it stands (it is the definition of a tile class): the
    anti-causal copy skips every tile below the diagonal as empty, and the IR's O moves by ~3 from the graph's while
    the dump verifies. The kernels classify from the score function's mask, so the backend refuses the dump."""
    text = fl.print_func(run_pipeline(CAUSAL, FWD))
    edited = _edit(text, _region_op("mask.classify"), r"\1le ")
    verify(fl.parse_func(edited))
    rng = np.random.default_rng(0)
    ins = [rng.standard_normal((1, 2, 200, 16)).astype(np.float16) for _ in range(3)]
    want = interpret(CAUSAL, ins)[0]
    assert np.abs(interpret(fl.parse_func(text), ins)[0] - want).max() < 1e-6
    assert np.abs(interpret(fl.parse_func(edited), ins)[0] - want).max() > 1.0
    _refused(edited, re.escape("mask.classify's predicate is not the score function's mask"))


def test_the_kv_bound_is_the_kernels() -> None:
    """The copies hold the score function's kv bound, which the kernels replace by their own kv < N: a dump bounding
    kv by 7 in the score function and in every copy agrees with itself, not with the kernels."""
    text = fl.print_func(run_pipeline(CAUSAL, FWD))
    consts = re.findall(r"(%\w+) = const N : i32\n\s+%in_bounds", text)
    assert len(consts) == 3, consts
    for c in consts:
        text = text.replace(f"{c} = const N : i32", f"{c} = const 7 : i32")
    _refused(text, re.escape("the score function's kv bound is not kv < N"))


DOCUMENT = _example("document")
TABLE = FWD.replace("mask-tiles,", "mask-tiles{data=table},")


@pytest.mark.parametrize("pipeline, old, new, words", [
    (FWD, r"(%cls = mask.classify [^{]*\{bk = 64, bq = 128, )ranges = \[\[0, 1, 64\]\]", r"\1ranges = [[0, 1, 32]]",
     "mask.classify's ranges entry [0, 1, 32] reads %doc_id_ranges, not mask.ranges of %doc_id with axis 1, granule "
     "32"),
    (TABLE, r"(mask.block_table [^\n]*\n[^\n]*\n(\s+%\w+ = gather [^\n]*\n){2}\s+%\w+ = )eq ", r"\1ne ",
     "mask.block_table's predicate is not the score function's mask"),
    (TABLE, r"\{bk = 64, bq = 128, m = M, n = N\}", "{bk = 64, bq = 128, m = N, n = N}",
     "mask.block_table's m = N, n = N are not q's and k's lengths M, N"),
    (TABLE, r"\{bk = 64, bq = 128, m = M, n = N\}", "{bk = 64, bq = 64, m = M, n = N}",
     "mask.block_table's tiles bq = 64, bk = 64 are not the kv loop's 128 x 64"),
    (TABLE, r"tile.load %block_class\[(%\w+), (%\w+), (%\w+), (%\w+)\]", r"tile.load %block_class[\1, \2, \4, \3]",
     "a tile class is not read from mask.block_table at [b, h, qi, kj]"),
    (TABLE, r"%full_tile = eq %cls,", "%full_tile = ne %cls,", "a tile class is read by ne"),
    (TABLE, r"i8\[B,H,cdiv\(M, 128\),cdiv\(N, 64\)\]", "i8[B,H,cdiv(M, 64),cdiv(N, 64)]",
     "mask.block_table's type is i8[B,H,cdiv(M, 64),cdiv(N, 64)], not [B, H, cdiv(M, 128), cdiv(N, 64)]"),
], ids=["ranges-granule", "table-predicate", "table-m", "table-bq", "table-index", "table-class-ne", "table-type"])
def test_the_backend_takes_only_mask_tiles_data_mask_ops(pipeline: str, old: str, new: str, words: str) -> None:
    """The document mask, by range tables (mask.ranges, `ranges = [[0, 1, 64]]`) or the dense table: the ranges
    entry names the table the kernels build, the table's predicate, size, tiles and reads are mask-tiles'; a table's
    class is tested as mask.classify's (the check of its tests covered mask.classify's alone)."""
    _refused(_edit(fl.print_func(run_pipeline(DOCUMENT, pipeline)), old, new), re.escape(words))


def test_the_mask_ops_read_the_score_functions_captures_in_its_order() -> None:
    start, stop = fl.capture("start", "i32", "B"), fl.capture("stop", "i32", "B")
    g = fl.attention(mask_mod=lambda b, h, q, kv: (kv >= start[b]) & (q < stop[b]), name="two_tables")
    text = fl.print_func(run_pipeline(g, FWD))
    _refused(_edit(text, r"(%cls = mask.classify %\w+, %\w+, %\w+, %\w+), %start, %stop", r"\1, %stop, %start"),
             re.escape("mask.classify reads captures (%stop, %start) where the score function reads (%start, %stop)"))


def _window_h() -> fl.Func:
    win = fl.capture("window", "i32", "H")
    return fl.attention(mask_mod=lambda b, h, q, kv: (q >= kv) & (q - kv < win[h]), name="window_h")


FWD_VARIANTS = {
    "fa2-fwd": FWD,
    "table": TABLE,
    "no-licm": FWD.replace("score-licm,", ""),
    "eager": FWD.replace("online-softmax{exp2=true,lazy=8}", "online-softmax"),
    "tiles-64x64": FWD.replace("tile{bq=128,bk=64}", "tile{bq=64,bk=64}"),
    "tiles-64x128": FWD.replace("tile{bq=128,bk=64}", "tile{bq=64,bk=128}"),
    "tiles-192x128": FWD.replace("tile{bq=128,bk=64}", "tile{bq=192,bk=128}"),
    "ragged-first": FWD.replace("tile{bq=128,bk=64}", "tile{bq=128,bk=64,ragged_q=first}"),
    "split-kv": FWD + ",split-kv{parts=2}",
    "split-kv-table": TABLE + ",split-kv{parts=3,part_dtype=f32}",
}


@functools.lru_cache(maxsize=1)
def _graphs() -> dict[str, fl.Func]:
    out = {stem: _example(stem) for stem in EXAMPLES}
    out.update((name, make()) for name, make in MASKS.items())
    out["window_h"] = _window_h()
    for mods in ("causal", "head_mask"):
        mask = {"causal": lambda b, h, q, kv: q >= kv, "head_mask": lambda b, h, q, kv: (h % 3 != 1) | (kv < 2)}[mods]
        out[f"packed_{mods}"] = pack_gqa(fl.attention(mask_mod=mask, group_size=4, name="gqa"))[0]
    return out


@pytest.mark.parametrize("name", sorted(_graphs()))
def test_every_pipelines_own_forward_ir_is_accepted(name: str) -> None:
    """Every example, the data masks and packed GQA graphs through fa2-fwd and its variants (mask-tiles' modes,
    without score-licm, other tiles, the short q tile first, split-kv): the IR and its printed dump (split-kv's
    dump too: its parsed part count, an int, was refused before) are accepted."""
    from falower.backends.numba_cuda.from_ir import analyse

    g = _graphs()[name]
    seen = 0
    for variant, pipeline in FWD_VARIANTS.items():
        try:
            low = run_pipeline(g, pipeline)
        except FalowerError:
            continue  # a pass that refuses this graph (ragged_q=first with a data mask, split-kv's preconditions)
        seen += 1
        analyse(low)
        analyse(fl.parse_func(fl.print_func(low)))
    assert seen >= 7


BWD, BWD_DET = NAMED_PIPELINES["fa2-bwd"], NAMED_PIPELINES["fa2-bwd-deterministic"]
BWD_TABLE = BWD.replace("dq=atomic", "dq=atomic,data=table")


@pytest.mark.parametrize("pipeline, old, new, words", [
    (BWD_DET, _region_op("mask.q_range"), r"\1le ", "mask.q_range's predicate is not its loop's mask.classify's"),
    (BWD_DET, _region_op("mask.kv_range"), r"\1le ", "mask.kv_range's predicate is not its loop's mask.classify's"),
    (BWD_DET, r"(mask.q_range [^{]*)\{bk = 64, bq = 64\}", r"\1{bk = 64, bq = 32}",
     "mask.q_range's attributes are not its loop's mask.classify's"),
    (BWD_DET, r"(%cls = mask.classify [^{]*)\{bk = 64, bq = 64\}", r"\1{bk = 64, bq = 32}",
     "mask.classify's tiles bq = 32, bk = 64 are not the kernels' 64 x 64"),
    (BWD_DET, r"%cls = mask.classify (%\w+), (%\w+), (%\w+), (%\w+)", r"%cls = mask.classify \1, \2, \4, \3",
     "mask.classify's q0 is %k0, not the tile's %q0_1"),
    (BWD_DET, r"mask.q_range (%\w+), (%\w+), (%\w+), (%\w+)", r"mask.q_range \1, \2, \3, \3",
     "mask.q_range's fourth operand is %k0, not the constant M"),
    (BWD_DET, r"= for (%\w+) = %q_lo to %q_hi", r"= for \1 = %q_lo to %q_lo",
     "the loop does not run from mask.q_range's first tile to its past-last"),
    (BWD_DET, r"= for (%\w+) = %kv_lo to %kv_hi", r"= for \1 = %kv_hi to %kv_hi",
     "the loop does not run from mask.kv_range's first tile to its past-last"),
    (BWD_DET, r"%full_tile = eq %cls,", "%full_tile = ne %cls,", "a tile class is read by ne"),
    (BWD_TABLE, r"\{bk = 128, bq = 64, m = M, n = N\}", "{bk = 128, bq = 64, m = N, n = N}",
     "mask.block_table's m = N, n = N are not q's and k's lengths M, N"),
    (BWD_TABLE, r"tile.load %block_class\[(%\w+), (%\w+), (%\w+), (%\w+)\]", r"tile.load %block_class[\1, \2, \4, \3]",
     "a tile class is not read from mask.block_table at [b, h, qi, kj]"),
], ids=["q-range-anticausal", "kv-range-anticausal", "q-range-bq", "classify-bq", "classify-q0-k0", "q-range-nq",
        "q-loop-bounds", "kv-loop-bounds", "class-ne", "table-m", "table-index"])
def test_the_backward_backend_takes_only_tile_bwds_mask_ops(pipeline: str, old: str, new: str, words: str) -> None:
    """The backward kernels classify by the IR's mask.classify regions, but scan those classes for a tile's range
    (not mask.q_range / mask.kv_range, the IR's loop bounds) on their own tiles and indices: an edited range, tile
    size, operand, loop bound, class test or table read was accepted and ran other tiles than the IR's."""
    _refused(_edit(fl.print_func(run_pipeline(CAUSAL if "table" not in pipeline else DOCUMENT, pipeline)), old, new),
             re.escape(words), backward=True)


def test_the_backward_tile_classes_branches_are_tile_bwds() -> None:
    text = fl.print_func(run_pipeline(CAUSAL, BWD_DET))
    swapped = text.replace("= if %full_tile :", "= if %EMPTY :", 1)  # the empty test's branch and the full test's
    swapped = swapped.replace("= if %empty_tile :", "= if %full_tile :", 1)
    _refused(swapped.replace("%EMPTY", "%empty_tile"), re.escape("the tile classes' branches are not tile-bwd's"),
             backward=True)


@pytest.mark.parametrize("pipeline", [BWD, BWD_DET, BWD.replace("dq=atomic", "dq=separate"), BWD_TABLE,
                                      BWD_DET.replace("deterministic=true", "deterministic=true,data=table"),
                                      BWD.replace("dq=atomic", "dq=atomic,skip=false"),
                                      BWD.replace("bq=64,bk=128", "bq=64,bk=64")],
                         ids=["atomic", "deterministic", "separate", "table", "deterministic-table", "no-skip",
                              "64x64"])
def test_every_pipelines_own_backward_ir_is_accepted(pipeline: str) -> None:
    """Every example, the data masks and GQA graphs (no q_range: one loop over the group's heads and q tiles) through
    the backward pipelines: the IR and its printed dump are accepted."""
    from falower.backends.numba_cuda.from_ir_bwd import analyse_backward

    graphs = {k: v for k, v in _graphs().items() if not k.startswith("packed_")}
    graphs["gqa_causal"] = fl.attention(mask_mod=lambda b, h, q, kv: q >= kv, group_size=2, name="gqa_causal")
    for g in graphs.values():
        low = run_pipeline(g, pipeline)
        analyse_backward(low)
        analyse_backward(fl.parse_func(fl.print_func(low)))
