"""O's tensor maps on the GPU (tensor_maps.py, emit_fa3_ws.tma_store): a map written by its launch holds the
driver's bytes, and the D = 128 forward (the persistent kernel, O stored by TMA tensor copies) stays right while O
moves: more distinct outputs than the cache keeps, each call's O a new address, the early maps dropped and made
again."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

import falower as fl  # noqa: E402
from falower.backends.numba_cuda import tensor_maps  # noqa: E402


def test_a_map_written_by_its_launch_holds_the_drivers_bytes():
    o = torch.empty(2, 3, 100, 128, device="cuda", dtype=torch.float16)
    maps = tensor_maps.TensorMaps("f16")
    m = maps.torch_o(o)
    torch.cuda.synchronize()
    want = tensor_maps.encode_o_map(o.data_ptr(), 6, 100, 128, "f16")
    assert m.dtype == torch.uint8 and m.numel() == 128 and m.data_ptr() % 128 == 0
    assert bytes(m.cpu().numpy().tobytes()) == want
    assert maps.torch_o(o) is m  # kept: the same O, the same map
    with pytest.raises(ValueError, match="f16 or bf16"):
        tensor_maps.encode_o_map(o.data_ptr(), 6, 100, 128, "f32")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_forward_stays_right_while_o_moves(dtype):
    """KEEP + 6 calls whose outputs all stay alive (a new O address each), M = 200 (ragged against the 16-row boxes);
    then the first inputs again (their maps were dropped): every output equals torch's."""
    causal = fl.compile(fl.attention(mask_mod=lambda b, h, q, kv: q >= kv, name="causal",
                                     dtype="f16" if dtype == torch.float16 else "bf16"))
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, M, D = 1, 2, 200, 128
    ins = [[torch.randn(B, H, M, D, device="cuda", dtype=dtype, generator=g) for _ in range(3)] for _ in range(3)]
    from falower.backends.numba_cuda.emit_fa2 import uses_o_map

    assert uses_o_map(causal.kernel(*ins[0]).spec)  # the automatic choice on Hopper stores O by TMA
    sdpa = torch.nn.functional.scaled_dot_product_attention
    want = [sdpa(*(x.double() for x in qkv), is_causal=True) for qkv in ins]
    # the error rule of the example tests: within twice torch's own error in this dtype, and a rounding's worth
    bound = [2 * (sdpa(*qkv, is_causal=True).double() - w).abs().max().item() + 1e-3 for qkv, w in zip(ins, want)]
    outs = [(i % 3, causal(*ins[i % 3])[0]) for i in range(tensor_maps.KEEP + 6)]
    assert len({o.data_ptr() for _, o in outs}) == len(outs)
    outs += [(0, causal(*ins[0])[0])]
    for i, o in outs:
        err = (o.double() - want[i]).abs().max().item()
        assert err <= bound[i], (i, err, bound[i])


def test_k_and_v_loaded_by_tma_from_strided_views():
    """tma_loads (the default, asked here explicitly): K and V as [B, N, Hk, D] projections viewed as [B, Hk, N, D]
    (their maps' strides are the views'), GQA, N = 300 (the last tile's rows past N zeros): equal to torch's on
    contiguous copies."""
    B, H, Hk, M, N, D = 2, 4, 2, 200, 300, 128
    g = fl.attention(mask_mod=None, name="tmal", dtype="f16", group_size=2)
    c = fl.compile(g, extra={"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 132,
                             "item_order": "dynamic", "tma_loads": True})
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(B, H, M, D, device="cuda", dtype=torch.float16, generator=gen)
    k, v = (torch.randn(B, N, Hk, D, device="cuda", dtype=torch.float16, generator=gen).transpose(1, 2)
            for _ in range(2))
    from falower.backends.numba_cuda.emit_fa2 import uses_kv_maps

    assert uses_kv_maps(c.kernel(q, k, v).spec) and not k.is_contiguous()
    o, _ = c(q, k, v)
    kk, vv = (x.repeat_interleave(2, dim=1).double() for x in (k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), kk, vv)
    bound = 2 * (torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, dim=1),
                                                                  v.repeat_interleave(2, dim=1)).double()
                 - want).abs().max().item() + 1e-3
    assert (o.double() - want).abs().max().item() <= bound
