"""benchmarks/bench.py's tile configs: every option's tag survives parse_config -> config_tag.

The tag keys the compiled kernels and the table's columns, so an option the tag drops times the config without
it under its name (the '-lazy' option, now '-eager', did once: both columns were the same kernel)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
bench = pytest.importorskip("bench")


@pytest.mark.parametrize("text", ["128x64w4", "128x64w4-wg-r128", "128x64w4-wg-r128-eager", "128x128w8-wsn-eager",
                                  "128x128w8-wsn-tree", "128x128w8-wsn-notree", "128x128w8-wsn-nowalk-nocs", "128x64w4-wg-nocs-r128-b3", "128x128w8-wsn-nose",
                                  "128x64w4-wg-se-r128-b3", "128x128w8-wsn-ltanh", "128x64w4-wg-norg-ltanh-r128-b3",
                                  "128x64w8-wsn-st3-nott-nopp-b2", "128x128w8-ws-pf2",
                                  "64x128w4-bwg", "64x128w4-bdqk", "128x128w8-wsn-bgt", "64x128w4-bwg-bgt", "128x128w8-wsn-bgg", "64x128w4-bwg-bgt-bgg", "64x128w4-bwg-bnov4", "64x128w4-bwg-bnoread", "128x64w4-wg-ov-qr-2b-hg4-wskip"])
def test_config_tags_round_trip(text):
    assert bench.config_tag(bench.parse_config(text)) == text


def _every_option() -> list[str]:
    """Each option of bench.CONFIG_OPTIONS as its tag writes it (a numeric one with 3)."""
    return [f"{opt[0]}3" if isinstance(opt[0], str) else sfx for opt in bench.CONFIG_OPTIONS
            for sfx in ([None] if isinstance(opt[0], str) else [s for s, _ in opt])]


@pytest.mark.parametrize("option", _every_option())
def test_every_option_round_trips_alone(option):
    text = f"128x128w8-{option}"
    assert bench.config_tag(bench.parse_config(text)) == text


def test_one_option_of_each_group_round_trips_together():
    """The first option of every group and every numeric option in one config, in the table's order: no option's
    extras make the tag write another's."""
    text = "128x128w8-" + "-".join(f"{opt[0]}3" if isinstance(opt[0], str) else opt[0][0]
                                   for opt in bench.CONFIG_OPTIONS)
    assert bench.config_tag(bench.parse_config(text)) == text


@pytest.mark.parametrize("text,extra", [("auto-nocm", {"col_mma": False}),
                                        ("auto-xp4-cm", {"ex2_poly": 4, "col_mma": True})])
def test_the_automatic_choice_with_knobs(text, extra):
    """'auto-<options>': falower.compile's own choice of kernel with those extras (an example's --ex-configs row)."""
    cfg = bench.parse_config(text)
    assert cfg == ("auto", extra) and cfg != bench.AUTO and bench.config_tag(cfg) == text


@pytest.mark.parametrize("text,knobs", [("auto", {}), ("auto-nocm", {"col_mma": False})])
def test_the_automatic_choice_compiles_with_or_without_knobs(text, knobs, monkeypatch):
    """`example_compiled_config` under 'auto' (bench.AUTO, no knobs: timeline.py --config auto once raised an
    IndexError there) and under 'auto-<knobs>' is the example as `example_compiled` builds it with those knobs."""
    seen = []
    monkeypatch.setattr(bench, "example_compiled", lambda stem, **kw: seen.append((stem, kw)) or "compiled")
    assert bench.example_compiled_config("alibi", bench.parse_config(text)) == "compiled"
    assert seen == [("alibi", knobs)]


@pytest.mark.parametrize("bad", ["128x128w8-nosuch", "128x128w8-st", "128x128w8-wsn-zz4", "auto-zz"])
def test_unknown_options_are_refused(bad):
    with pytest.raises(ValueError, match="unknown config option"):
        bench.parse_config(bad)


def test_rounds_summary_ratios_by_round():
    """--rounds takes the ratios within each round: a clock drift that slows every call of a round alike leaves
    them exact, where the medians of the two series taken apart would not be; a missing Flex time drops only its
    round from that ratio."""
    flops = {"plain": 2e12, "causal": 1e12}
    drift = [1.0, 1.3, 0.8, 1.1, 1.2]  # each round's clock factor: times scale with it
    times = {("plain", "ours"): [4.0 * f for f in drift], ("causal", "ours"): [2.2 * f for f in drift],
             ("plain", "flex"): [5.0 * f for f in drift], ("causal", "flex"): [3.3 * f for f in drift[:4]]}
    rows = {r["example"]: r for r in bench.rounds_summary(times, flops)}
    causal = rows["causal"]
    assert causal["rounds"] == 5
    assert causal["of plain"]["min"] == pytest.approx(causal["of plain"]["max"])
    assert causal["of plain"]["median"] == pytest.approx((1e12 / 2.2) / (2e12 / 4.0))
    assert causal["over flex"]["median"] == pytest.approx(3.3 / 2.2)
    assert causal["ours"] == pytest.approx(1e12 / (2.2 * 1.1) / 1e9)  # the median round's TFLOP/s
    assert causal["ours spread"] == pytest.approx((1 / 0.8 - 1 / 1.3) / (1 / 1.1))
    assert rows["plain"]["of plain"]["median"] == pytest.approx(1.0)
    assert rows["plain"]["over flex"]["median"] == pytest.approx(5.0 / 4.0)


def test_rounds_summary_drops_a_failed_round():
    """A call that failed in one round (NaN) leaves that round out of its medians and ratios, not the table."""
    flops = {"plain": 2e12, "causal": 1e12}
    times = {("plain", "ours"): [4.0, 4.0, 4.0], ("causal", "ours"): [2.0, float("nan"), 2.5],
             ("plain", "flex"): [5.0, 5.0, 5.0], ("causal", "flex"): [3.0, 3.0, 3.0]}
    causal = {r["example"]: r for r in bench.rounds_summary(times, flops)}["causal"]
    assert causal["rounds"] == 2
    assert causal["of plain"]["min"] == pytest.approx((1e12 / 2.5) / (2e12 / 4.0))
    assert causal["of plain"]["max"] == pytest.approx((1e12 / 2.0) / (2e12 / 4.0))
    assert causal["over flex"]["median"] == pytest.approx((3.0 / 2.0 + 3.0 / 2.5) / 2)


def test_rounds_summary_config_rows_share_their_examples_flex():
    """An --ex-configs row ("causal -wsg-p132") is the same example under another kernel: its FLOPs are the
    example's and its Flex ratio is against the example's Flex twin, round by round."""
    flops = {"plain": 2e12, "causal": 1e12, "causal -wsg-p132": 1e12}
    times = {("plain", "ours"): [4.0, 4.0], ("causal", "ours"): [2.0, 2.0], ("causal -wsg-p132", "ours"): [1.6, 1.8],
             ("plain", "flex"): [5.0, 5.0], ("causal", "flex"): [3.2, 3.6]}
    row = {r["example"]: r for r in bench.rounds_summary(times, flops)}["causal -wsg-p132"]
    assert row["rounds"] == 2
    assert row["over flex"]["min"] == pytest.approx(2.0) and row["over flex"]["max"] == pytest.approx(2.0)
    assert row["of plain"]["median"] == pytest.approx(((1e12 / 1.6) / 5e11 + (1e12 / 1.8) / 5e11) / 2)
    assert row["flex"] == pytest.approx((1e12 / 3.2 + 1e12 / 3.6) / 2 / 1e9)


def test_rounds_summary_pairs_a_config_row_with_its_default():
    """An --ex-configs row's "of default": its TFLOP/s over its example's default row round by round (a drift that
    slows a whole round cancels), and the rounds it was faster in; a default row has none."""
    flops = {"plain": 2e12, "causal": 1e12, "causal -tmal": 1e12}
    drift = [1.0, 1.4, 0.7, 1.2]
    times = {("plain", "ours"): [4.0 * f for f in drift], ("causal", "ours"): [2.0 * f for f in drift],
             ("causal -tmal", "ours"): [t * f for t, f in zip((1.9, 2.1, 1.8, 1.95), drift)]}
    rows = {r["example"]: r for r in bench.rounds_summary(times, flops)}
    d = rows["causal -tmal"]["of default"]
    assert d["n"] == 4 and d["wins"] == 3  # 2.1 > 2.0: the second round the default was faster
    assert d["min"] == pytest.approx(2.0 / 2.1) and d["max"] == pytest.approx(2.0 / 1.8)
    assert d["median"] == pytest.approx((2.0 / 1.9 + 2.0 / 1.95) / 2)
    assert rows["causal"]["of default"]["n"] == 0
    rows["causal"]["o diff vs flex"] = rows["causal -tmal"]["o diff vs flex"] = 1e-4
    rows["causal"]["D"] = 128
    table = bench.rounds_table([rows["causal"], rows["causal -tmal"]], "H200", 4)
    assert table[-2].endswith("| - |") and "(3/4) |" in table[-1], table


def test_paired_summary_median_and_its_interval():
    """paired_summary: the median of the pairs' ratios, and a bootstrap interval of that median which holds it,
    narrows as pairs are added, and collapses where every pair agrees."""
    import random

    rng = random.Random(1)
    few = [1.02 + rng.gauss(0, 0.05) for _ in range(21)]
    many = [1.02 + rng.gauss(0, 0.05) for _ in range(801)]
    a, b = bench.paired_summary(few), bench.paired_summary(many)
    assert a["n"] == 21 and a["lo"] <= a["median"] <= a["hi"]
    assert b["lo"] <= b["median"] <= b["hi"] and b["hi"] - b["lo"] < (a["hi"] - a["lo"]) / 2
    assert 1.0 < b["lo"] and b["hi"] < 1.04  # 801 pairs resolve a 2% gap under 5% noise
    assert bench.paired_summary([0.97] * 9) == {"median": 0.97, "lo": 0.97, "hi": 0.97, "n": 9, "p05": 0.97,
                                                "p95": 0.97}
    assert b["p05"] < b["lo"] and b["hi"] < b["p95"]  # the pairs spread wider than their median moves
    assert bench.paired_summary([])["n"] == 0


def test_time_examples_paired_pairs_each_row_with_what_it_is_read_against(monkeypatch):
    """--pairs: every row against plain, a default row against its Flex twin (over the same kept pairs), a config row
    against its default (not Flex); a missing Flex twin leaves that ratio out."""
    ms = {("plain", "ours"): 4.0, ("causal", "ours"): 2.5, ("causal", "flex"): 4.0, ("causal -c32", "ours"): 2.4,
          ("plain", "flex"): 5.0}
    calls = {key: key for key in ms if key != ("plain", "flex")}  # plain's Flex twin failed to build
    monkeypatch.setattr(bench, "paired_calls", lambda a, b, n: [(ms[a], ms[b])] * n)
    monkeypatch.setattr(bench, "log", lambda *a: None)
    out = bench.time_examples_paired(calls, {"plain": 2e12, "causal": 1e12, "causal -c32": 1e12}, 5)
    assert set(out) == {("plain", "of plain"), ("causal", "of plain"), ("causal", "over flex"),
                        ("causal -c32", "of plain"), ("causal -c32", "of default")}
    assert out[("plain", "of plain")]["median"] == pytest.approx(1.0)
    assert out[("causal", "of plain")]["median"] == pytest.approx(0.5 * 4.0 / 2.5)
    assert out[("causal", "over flex")]["median"] == pytest.approx(4.0 / 2.5)
    assert out[("causal -c32", "of default")]["median"] == pytest.approx(2.5 / 2.4)
    assert out[("causal", "over flex")]["ms"] == [(2.5, 4.0)] * 5


def test_rounds_table_adds_the_paired_rows():
    """With --pairs the table gains a second part: each row's paired ratio to plain and, for a config row, to its
    default (median [interval]); "-" where a row has none."""
    flops = {"plain": 2e12, "causal -c32": 1e12}
    times = {("plain", "ours"): [4.0, 4.1], ("causal -c32", "ours"): [2.0, 2.1]}
    rows = bench.rounds_summary(times, flops)
    for r in rows:
        r["D"], r["o diff vs flex"] = 128, 1e-4
        r["of plain, paired"] = {"median": 1.0, "lo": 0.99, "hi": 1.01, "n": 200, "p05": 0.95, "p95": 1.05}
    rows[1]["of default, paired"] = {"median": 1.012, "lo": 1.004, "hi": 1.02, "n": 200, "p05": 0.9, "p95": 1.1}
    rows[0]["over flex, paired"] = {"median": 1.3, "lo": 1.29, "hi": 1.31, "n": 200, "p05": 1.2, "p95": 1.4}
    table = bench.rounds_table(rows, "H200", 2)
    assert any("200 pairs of single calls" in line for line in table)
    assert table[-2] == "| plain | 1.000 [0.990, 1.010] (0.950-1.050) | 1.300 [1.290, 1.310] (1.200-1.400) | - |"
    assert table[-1] == ("| causal -c32 | 1.000 [0.990, 1.010] (0.950-1.050) | - | 1.012 [1.004, 1.020] "
                         "(0.900-1.100) |")
    del rows[0]["of plain, paired"]  # plain's pairs failed: the table still says how many pairs the others took
    assert any("200 pairs of single calls" in line for line in bench.rounds_table(rows, "H200", 2))
    assert bench.rounds_table(rows, "H200", 2)[-2].startswith("| plain | - | 1.300 ")
    del rows[1]["of plain, paired"]
    rows[1].pop("of default, paired")
    rows[0].pop("over flex, paired")
    assert not any("pairs of single calls" in line for line in bench.rounds_table(rows, "H200", 2))  # no --pairs


class _T:
    """Enough of a torch tensor for config_matching: float(), subtraction, abs(), max(), item()."""

    def __init__(self, a):
        self.a = np.asarray(a, dtype=np.float64)

    def float(self):
        return self

    def __sub__(self, other):
        return _T(self.a - other.a)

    def abs(self):
        return _T(np.abs(self.a))

    def max(self):
        return _T(self.a.max())

    def item(self):
        return float(self.a)


def test_config_matching_times_only_a_config_that_agrees(monkeypatch):
    """--ex-configs, one block an example or in rounds: a config whose output is within 2e-2 of O's scale of the
    automatic choice's is timed; one further off, or one that fails to build, is left out with its reason logged
    (a failure's difference NaN)."""
    logged = []
    monkeypatch.setattr(bench, "log", logged.append)
    o_auto = _T([[0.5, -2.0]])

    def compiled(out):
        return type("C", (), {"forward": lambda self, *x: (_T(out),)})()

    monkeypatch.setattr(bench, "example_compiled_config", lambda stem, cfg: compiled([[0.5, -2.03]]))
    cc, diff = bench.config_matching("causal", bench.parse_config("128x128w8-wsg"), (), o_auto)
    assert cc is not None and diff == pytest.approx(0.03)
    monkeypatch.setattr(bench, "example_compiled_config", lambda stem, cfg: compiled([[0.5, -2.05]]))
    cc, diff = bench.config_matching("causal", bench.parse_config("128x128w8-wsg"), (), o_auto)
    assert cc is None and diff == pytest.approx(0.05) and "differs" in logged[-1]

    def broken(stem, cfg):
        raise ValueError("wgmma-ws: no such thing\nsecond line")

    monkeypatch.setattr(bench, "example_compiled_config", broken)
    cc, diff = bench.config_matching("causal", bench.parse_config("128x128w8-wsg"), (), o_auto)
    assert cc is None and diff != diff and logged[-1].endswith("ValueError: wgmma-ws: no such thing")


def test_documents_must_be_positive():
    """--documents sets the document example's documents a row; 0 is refused by name before anything runs."""
    import subprocess

    r = subprocess.run([sys.executable, str(Path(bench.__file__)), "--documents", "0"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--documents must be at least 1, got 0" in r.stderr
    assert bench.DOCUMENTS == 8


@pytest.mark.parametrize("stem,knobs,falls", [("plain", {"col_mma": True}, True), ("alibi", {"col_mma": False}, False),
                                              ("relative_bias", {"tma_loads": False}, False),
                                              ("plain", {"bwd_schedule": "mma"}, False)])
def test_a_refused_knob_row_is_told_from_the_knobs_kernel(stem, knobs, falls, monkeypatch):
    """'auto-<knobs>' rows: where falower.compile's automatic choice refuses the knobs (validate_spec: col_mma
    without a column step) it falls back to another kernel whose spec still carries the knobs; bench must see the
    refusal and leave the row untimed, and time rows whose knobs the kernel took, also where the choice then
    changed the form for cost (the relative bias without TMA loads at D = 128: one block an item, persistent_pays)
    or the knob is the backward's. Faked Hopper, D = 128, N = 4096."""
    from falower.backends.numba_cuda import runtime

    monkeypatch.setattr(runtime, "device_cc", lambda: (9, 0))
    monkeypatch.setattr(runtime, "device_sm_count", lambda: 132)
    monkeypatch.setattr(runtime, "_has_gpu", lambda: False)

    def spec(**opts):
        return bench.example_compiled(stem, **opts).specialize("f16", D=128, N=4096, M=4096).spec

    why = bench.knobs_refused(knobs, spec(), spec(**knobs).extra)
    assert bool(why) == falls, why
    if falls:
        assert "col_mma" in why and "schedule wgmma" in why, why


def test_batch_heads_keep_the_sweep_unless_given() -> None:
    """B * N = 16k tokens and H * D = 2048 by default; --batch / --heads override each alone (a small grid)."""
    assert bench.batch_heads(128, 4096) == (4, 16) and bench.batch_heads(64, 1024) == (16, 32)
    try:
        bench.SHAPE.update(B=1)
        assert bench.batch_heads(128, 1024) == (1, 16)
        bench.SHAPE.update(H=8)
        assert bench.batch_heads(64, 32768) == (1, 8)
    finally:
        bench.SHAPE.update(B=0, H=0)
