"""Random score and mask functions pushed through the whole FA2 forward lowering, checked against the
float64 interpretation of the input graph after every pass."""

from __future__ import annotations

import math

from hypothesis import example, given, settings
from hypothesis import strategies as st

import falower as fl
from falower.passes import PassManager, parse_pipeline

PIPELINE = "decompose-softmax,canonicalize,fuse,tile{bq=16,bk=16},online-softmax{exp2=%s},mask-tiles,score-licm,canonicalize"


def score_terms():
    return st.lists(st.sampled_from(["scale", "softcap", "alibi", "periodic", "square"]), max_size=3)


def build_score(terms):
    def score_mod(s, b, h, q, kv):
        for t in terms:
            if t == "scale":
                s = s * 0.5
            elif t == "softcap":
                s = fl.tanh(s / 5.0) * 5.0
            elif t == "alibi":
                s = s - (q - kv).abs().to("f32") * 0.1
            elif t == "periodic":
                s = s + ((q + kv) % 3).to("f32")
            elif t == "square":
                s = s + s * s * 0.01
        return s

    return score_mod


ATOMS = {
    "causal": lambda q, kv: q >= kv,
    "window": lambda q, kv: q - kv < 12,
    "prefix": lambda q, kv: kv < 5,
    "late_rows": lambda q, kv: kv < q - 20,  # the first rows see nothing: fully masked
    "blocks": lambda q, kv: q // 8 == kv // 8,
    "truncated": lambda q, kv: (q * 0.496).int() <= kv,  # a float index truncated toward zero
    "bit_xor": lambda q, kv: (q ^ kv) >= 2,  # bitwise on ints, not logical
    "bit_not": lambda q, kv: (~(kv % 2)) < 0,  # ~x = -x - 1 on ints
}


def masks():
    atom = st.sampled_from(sorted(ATOMS))
    return st.recursive(atom.map(lambda a: ("atom", a)),
                        lambda inner: st.tuples(st.sampled_from(["and", "or", "not"]), inner, inner),
                        max_leaves=3)


def build_mask(tree):
    def ev(t, q, kv):
        if t[0] == "atom":
            return ATOMS[t[1]](q, kv)
        if t[0] == "not":
            return ~ev(t[1], q, kv)
        a, b = ev(t[1], q, kv), ev(t[2], q, kv)
        return a & b if t[0] == "and" else a | b

    return lambda b, h, q, kv: ev(tree, q, kv)


@settings(max_examples=20, deadline=None)
@given(terms=score_terms(), mask=st.one_of(st.none(), masks()), exp2=st.booleans())
@example(terms=["alibi"], mask=("atom", "late_rows"), exp2=True)  # canonicalize once folded in float32
def test_random_variants_survive_fa2_fwd(terms, mask, exp2) -> None:
    g = fl.attention(score_mod=build_score(terms) if terms else None,
                     mask_mod=build_mask(mask) if mask is not None else None)
    pm = PassManager(parse_pipeline(PIPELINE % ("true" if exp2 else "false")), check=True,
                     shapes={"B": 1, "H": 2, "M": 37, "N": 45, "D": 8})
    pm.run(g)
    assert all(r.check == "ok" for r in pm.records)
