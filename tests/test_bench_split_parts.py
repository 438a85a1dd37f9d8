"""benchmarks/split_parts.py without a GPU (a Hopper faked): every case's calls build, and the automatic choice
takes the parts the fifty-second session measured fastest (BENCHMARKS.md: decoding's one-tile parts merged in a
cluster at 8, masked decoding's too, small prefill grids' parts of two kv tiles), merged in a cluster at 4 parts
where the grid is at most half the SMs (the fifty-third session's), decoding's 2 and 4 parts where the grid fits the
SMs (the fifty-fifth's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import split_parts  # noqa: E402


WANT = {  # (stem, G or H, D, M, N, B) -> the automatic (parts, cluster size)
    ("plain", 1, 128, 1, 512, 1): (4, 4), ("plain", 1, 128, 1, 1024, 1): (8, 8), ("plain", 1, 128, 1, 3000, 1): (8, 8),
    ("gqa", 4, 128, 1, 1024, 1): (8, 8), ("window_off", 4, 128, 1, 8192, 1): (8, 8),
    ("causal_off", 1, 64, 1, 2048, 1): (8, 8), ("causal", 1, 128, 512, 512, 1): (2, 0),
    ("causal", 1, 128, 1024, 1024, 1): (4, 4), ("plain", 2, 64, 1024, 1024, 1): (4, 0),
    ("plain", 1, 128, 1, 1024, 4): (4, 4), ("plain", 1, 128, 1, 1024, 3): (4, 4),  # (4 parts of 128 and 96 blocks:
    # clusters of 4 at compile; B = 4's 32 are more than the H200 holds, and its call's plan takes the merge kernel)
    ("plain", 1, 128, 1, 1024, 8): (2, 2), ("plain", 1, 64, 1, 4096, 8): (2, 2),  # (2 parts of 128 blocks: one round)
    ("plain", 1, 128, 1, 1024, 16): (1, 0),
}  # (4 parts in a cluster where a prefill grid is at most half the SMs, decoding's 2 and 4 where it fits the
#    SMs: compiler._cluster_small_grid)


def test_every_case_builds_and_the_automatic_choice_is_the_one_measured(hopper):
    from falower.backends.numba_cuda.emit_fa3_ws import cluster_push, early_first_item
    from falower.backends.numba_cuda.emit_fa3_ws import stages as kernel_stages

    split_parts._COMPILED.clear()
    seen = set()
    for job in split_parts.jobs(list(split_parts.CASES)):
        _, (parts, cluster) = split_parts.build(job)
        stem, group, var, D, M, N, B = job
        seen.add((stem, group, D, M, N, B))
        if var[0] == "s" and var[1:].isdigit():  # the automatic parts on more stages
            assert kernel_stages(split_parts.kernel(*job).spec) == int(var[1:]), job
        elif var == "nosp":
            assert split_parts.kernel(*job).spec.extra.get("skip_padding") is False, job
        elif var == "mp":  # the tensor maps prefetched: the automatic parts, the knob in the kernel
            assert "tensormap_prefetch(qmap_g)" in split_parts.kernel(*job).source, job
        elif var in ("b2", "k64"):  # two blocks an SM (64-wide kv tiles at D = 128), or one on 64-wide tiles
            spec = split_parts.kernel(*job).spec
            assert spec.block_k == (64 if var == "k64" or D == 128 else 128), job
            assert spec.extra.get("blocks_per_sm", 1) == (2 if var == "b2" else 1), job
            assert int(spec.extra["persistent"]) == (264 if var == "b2" else 132), job
            assert cluster in (0, 8) or var != "b2", job  # (two blocks an SM: no clusters of 2 or 4 unasked)
        elif var == "pull":  # the automatic parts and cluster, merged by the two barriers, not by pushes
            spec = split_parts.kernel(*job).spec
            assert spec.extra.get("cluster_push") is False and not cluster_push(spec), job
            assert (parts, cluster) == split_parts.build(job[:2] + ("auto",) + job[3:])[1], job
        elif var in ("efi", "nosmr", "efinosmr", "smrdec", "efidec"):  # the automatic parts and cluster, the first
            # item sent at entry and / or no setmaxnreg or only the producer's (decoding's one consumer warpgroup)
            src = split_parts.kernel(*job).source
            assert ("fence_proxy_async_smem()" in src) is var.startswith("efi"), job
            assert ("SETMAXNREG_INC()" in src) is (var == "efi"), job
            assert ("SETMAXNREG_DEC()" in src) is (var in ("efi", "smrdec", "efidec")), job
            assert (parts, cluster) == split_parts.build(job[:2] + ("auto",) + job[3:])[1], job
            auto = split_parts.kernel(*job[:2], "auto", *job[3:])
            assert not early_first_item(auto.spec) and "SETMAXNREG_INC()" in auto.source, job
        elif var != "auto":
            assert parts == split_parts.VARIANTS[var]["kv_parts"], job
            assert cluster == (parts if var[0] == "c" else 0), job
        elif (stem, group, D, M, N, B) in WANT:
            assert (parts, cluster) == WANT[(stem, group, D, M, N, B)], job
    assert set(WANT) <= seen  # every case the table names is one the script times


@pytest.mark.parametrize("nbytes", [1, 530_000, 4 << 20, 33_554_432, 200 << 20])
def test_cold_copies_make_the_bytes_the_help_promises(nbytes):
    """--cold: enough copies of a call's inputs that together they pass COLD_BYTES (three times the L2), at least
    two (so consecutive calls never read the same copy), and no more than that needs."""
    n = split_parts.cold_copies(nbytes)
    assert n >= 2 and n * nbytes >= split_parts.COLD_BYTES
    assert n == 2 or (n - 1) * nbytes < split_parts.COLD_BYTES
