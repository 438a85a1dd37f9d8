"""On the GPU: a small language model trains with falower's attention as it does with torch's (marked gpu).

The model: embedding -> 2 blocks (pre-LayerNorm; attention with an ALiBi slopes tensor per layer, an
nn.Parameter that learns, causal; MLP) -> logits. Its attention is `examples/alibi.py`'s graph compiled by
falower.compile (forward and backward kernels, through torch autograd), or the same maths written in torch
in float32: softmax(q k^T / sqrt(D) + slopes[h] * (kv - q), causal) v. Both models start from the same
weights, see the same batches and take 5 Adam steps, everything in bf16 (no autocast) but the slopes (f32,
the graph's type for them).

Tolerance, and why: the two runs differ only in the attention kernel, whose outputs and gradients are
rounded to bf16 in different places, and Adam's normalised steps carry such differences on. How far apart
bf16 training may drift is measured, not guessed: the torch model is run a third time in float32 from the
same (bf16-valued) weights, and the falower run must stay within 3x that bf16-vs-f32 gap (FlashAttention's
rule, applied to the losses, the first step's gradients and the learnt slopes), plus a floor of 2e-3 (1e-3
relative for gradients) for steps where the gap happens to be tiny.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
nn = torch.nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_examples_gpu import graph  # noqa: E402

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH, STEPS = 512, 256, 4, 2, 200, 4, 5  # D = 64; N = 200: ragged tiles


def alibi_slopes(H: int) -> torch.Tensor:
    return 2.0 ** (-8.0 * torch.arange(1, H + 1, dtype=torch.float32) / H)


def torch_attention(q, k, v, slopes):
    """The reference: ALiBi with a causal mask in float32 maths, the result in q's dtype."""
    qf, kf, vf = q.float(), k.float(), v.float()
    N, D = q.shape[-2], q.shape[-1]
    pos = torch.arange(N, device=q.device)
    dist = (pos[None, :] - pos[:, None]).float()  # kv - q
    s = qf @ kf.transpose(-1, -2) / math.sqrt(D) + slopes.float()[None, :, None, None] * dist
    s = s.masked_fill(dist > 0, -math.inf)
    return (torch.softmax(s, dim=-1) @ vf).to(q.dtype)


class Block(nn.Module):
    def __init__(self, attention) -> None:
        super().__init__()
        self.attention = attention  # (q, k, v, slopes) -> o, all [B, H, N, D]
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.slopes = nn.Parameter(alibi_slopes(HEADS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        qkv = self.qkv(self.ln1(x)).view(B, N, 3, HEADS, DIM // HEADS)
        q, k, v = (qkv[:, :, i].transpose(1, 2).contiguous() for i in range(3))  # [B, H, N, D] row-major
        o = self.attention(q, k, v, self.slopes)
        x = x + self.proj(o.transpose(1, 2).reshape(B, N, DIM))
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self, attention) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(attention) for _ in range(LAYERS))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def falower_attention(dtype: str = "bf16", backend: str = "numba-cuda"):
    """examples/alibi.py compiled by falower; the call goes through falower.autograd when inputs need grad
    (backend "reference" runs the same IR in the interpreter: a CPU dry run of this test)."""
    import falower as fl

    g, c = graph("alibi", dtype)
    if backend != "numba-cuda":
        c = fl.compile(g, backend)
    return lambda q, k, v, slopes: c(q, k, v, slopes)[0]


def models(attention, device: str, dtype: torch.dtype) -> tuple[LM, LM, LM]:
    """(falower bf16, torch bf16, torch f32), equal weights: the f32 one holds the bf16 values exactly."""
    torch.manual_seed(0)
    ref = LM(torch_attention).to(device=device, dtype=dtype)
    for b in ref.blocks:
        b.slopes.data = b.slopes.data.float()
    ours = copy.deepcopy(ref)
    for b in ours.blocks:
        b.attention = attention
    f32 = copy.deepcopy(ref).float()
    return ours, ref, f32


def batches(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences with structure to learn (each token a fixed function of the one two back), fixed seed."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        t = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
        t[:, :2] = torch.randint(0, VOCAB, (BATCH, 2), generator=gen)
        for i in range(2, SEQ + 1):
            t[:, i] = (t[:, i - 2] * 7 + 3) % VOCAB
        out.append((t[:, :-1].to(device), t[:, 1:].to(device)))
    return out


def train(model: LM, data: list) -> tuple[list[float], dict[str, torch.Tensor], torch.Tensor]:
    """5 Adam steps: (losses, the first step's gradients by parameter name (float32), the learnt slopes)."""
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    losses, first = [], {}
    for step, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        if step == 0:
            first = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    slopes = torch.cat([b.slopes.detach().float() for b in model.blocks])
    return losses, first, slopes


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def compare(ours, ref, f32) -> list[str]:
    """The checks of the module docstring; returns the report lines (raises on a failure)."""
    (l_o, g_o, s_o), (l_r, g_r, s_r), (l_f, g_f, s_f) = ours, ref, f32
    lines = []
    for i, (a, b, c) in enumerate(zip(l_o, l_r, l_f)):
        lines.append(f"step {i}: loss falower {a:.5f} torch {b:.5f} torch-f32 {c:.5f}")
    assert all(math.isfinite(x) for x in l_o), lines
    gap = max(abs(b - c) for b, c in zip(l_r, l_f))
    for i, (a, b) in enumerate(zip(l_o, l_r)):
        assert abs(a - b) <= 3 * gap + 2e-3, f"step {i}: |{a} - {b}| > 3 x {gap:.3g} + 2e-3\n" + "\n".join(lines)
    flat = [torch.cat([g.reshape(-1) for g in gs.values()]) for gs in (g_o, g_r, g_f)]
    err, noise = rel(flat[0], flat[1]), rel(flat[1], flat[2])
    lines.append(f"first step gradients: rel err {err:.3g}, bf16 vs f32 {noise:.3g}")
    assert err <= 3 * noise + 1e-3, "\n".join(lines)
    for name in (n for n in g_o if n.endswith("slopes") or n.endswith("qkv.weight")):
        e, n = rel(g_o[name], g_r[name]), rel(g_r[name], g_f[name])
        lines.append(f"{name} gradient: rel err {e:.3g}, bf16 vs f32 {n:.3g}")
        assert e <= 3 * n + 1e-3, "\n".join(lines)
    e, n = (s_o - s_r).abs().max().item(), (s_r - s_f).abs().max().item()
    lines.append(f"learnt slopes: max diff {e:.3g}, bf16 vs f32 {n:.3g}")
    assert e <= 3 * n + 1e-5, "\n".join(lines)
    assert l_o[-1] < l_o[0], "the loss did not go down:\n" + "\n".join(lines)
    return lines


def test_training_matches_torch_attention() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ours, ref, f32 = models(falower_attention("bf16"), "cuda", torch.bfloat16)
    data = batches("cuda")
    lines = compare(train(ours, data), train(ref, data), train(f32, data))
    print("\n".join(lines))
