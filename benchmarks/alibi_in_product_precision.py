"""ALiBi's column term inside the QK^T product (benchmarks/NOTES.md, "The short q tile first", Next): how exact is
slope / scale * kv as fp16 operands with fp32 products and sums? Q's extra columns hold slope / scale split in two
fp16 parts (hi, lo), K's the kv index. Measured here over N up to 64k and ALiBi's slopes for 12 heads: the
absolute index (kv split in 64 * hi + lo) errs by up to 9.4e-3 in the exponent (log2 units: 0.65% on P), the
tile-local one (kv - k0 < 128; slope * (k0 - q) joins the row's addend once a tile, in fp32 from integers) by
7.3e-6. So only the tile-local form is worth building. Run: python benchmarks/alibi_in_product_precision.py"""
import numpy as np
rng = np.random.default_rng(0)
D = 64; scale = 1 / np.sqrt(D); L2E = 1.4426950408889634
worst = {}
for slope in 2.0 ** (-8.0 * np.arange(1, 13) / 12):
    a = slope / scale                      # the column term per unit of kv, in the product's units
    a_hi = np.float16(a); a_lo = np.float16(a - np.float64(a_hi))
    for scheme in ("absolute", "tile-local"):
        kv = np.arange(0, 65536, dtype=np.int64)
        k0 = (kv // 128) * 128
        base = kv if scheme == "absolute" else kv - k0
        if scheme == "absolute":
            hi, lo = (base // 64) * 64, base % 64
        else:
            hi, lo = np.zeros_like(base), base
        # fp16 operands, exact fp32 products, fp32 sum (the order: hi terms then lo terms)
        t = np.float32(np.float32(a_hi) * np.float32(hi))
        t = np.float32(t + np.float32(a_lo) * np.float32(hi).astype(np.float32))
        t = np.float32(t + np.float32(a_hi) * np.float32(lo))
        t = np.float32(t + np.float32(a_lo) * np.float32(lo))
        exact = a * base
        err = np.abs(t.astype(np.float64) - exact) * scale * L2E   # in the exponent (log2 units)
        worst[scheme] = max(worst.get(scheme, 0), err.max())
print({k: f"{v:.2e}" for k, v in worst.items()}, "exponent error, log2 units, N up to 64k")
