"""falower as an attention implementation of Hugging Face transformers (Llama-family decoders).

    import falower.integrations.transformers as fl_hf
    fl_hf.register()
    model = LlamaForCausalLM.from_pretrained(..., attn_implementation="falower")
    # or, on a model already loaded: model.config._attn_implementation = "falower"

`register()` puts two functions into transformers' registries under one name:

- a *mask function* (`transformers.masking_utils.AttentionMaskInterface`), called once per forward by the
  model's `create_causal_mask` / `create_sliding_window_causal_mask`. Instead of a dense [B, 1, Q, KV] mask it
  returns a `FalowerMask`: the pattern transformers asked for (causal, sliding window), recognised from its
  mask function, with the per-forward data as small tensors a falower mask_mod closes over: the causal
  diagonal's offset when the queries are the last rows of the keys (decoding with a KV cache), and each
  batch row's first and past-last valid key from the 2-D padding mask (left or right padding). Those tensors
  are *captured* by falower's tracer, so the compiled kernel depends on their shapes ([B], or 0-d) and not on
  their contents or on the sequence lengths: one kernel per (mask kind, dtype, head dim) serves every layer,
  every batch and every decoding step. Patterns it does not recognise (packed sequences, image-token
  overlays, padding with holes) fall back to transformers' own dense boolean mask, captured as a table
  (correct, slower, and one kernel per mask shape).
- an *attention function* (`transformers.AttentionInterface`), called by every layer with q [B, H, N, D] and
  k, v [B, HKV, S, D] (GQA not repeated; transposed views of the projections), which runs
  `falower.flex_attention` with the mask's block mask, `scaling` as the scale, Gemma-style `softcap` as a
  score_mod, and returns (out [B, N, H, D] contiguous, None).

Positions follow transformers' masks exactly (`masking_utils.sdpa_mask` is the reference the CPU tests
compare with): query row i is at absolute position i + q_offset, key column j at j + kv_offset; a key is
kept when it is not in the future (causal), within `sliding_window` of the query (kv > q - window), and
valid in the 2-D mask. Query rows with no key left (left padding's pad rows) come out as zeros.

Dropout, attention sinks (`s_aux`) and position biases are refused with one line each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from transformers import masking_utils

from .. import torch_mods
from ..errors import FalowerError

NAME = "falower"


# ------------------------------------------------------------------------------------------ mask_mods
def make_mask_mod(causal: bool, window: Optional[int], diag: Any, kv_start: Any, kv_end: Any, valid: Any,
                  allowed: Any) -> Optional[Callable]:
    """The falower mask_mod of one mask kind, or None when nothing is masked.

    `causal` and `window` (a Python bool and int) are part of the kernel; the rest are tensors the traced
    mod closes over (captured: passed at each call, their contents free to change): `diag` a 0-d int32,
    the query positions' offset from the key positions (None: 0); `kv_start`, `kv_end` [B] int32, each
    row's valid keys kv_start <= kv < kv_end; `valid` [B, S] bool, valid keys one by one (padding with
    holes); `allowed` [B, L, S] bool, a dense mask (the fallback). Called on real index tensors it
    evaluates the same mask (the CPU tests do that)."""
    if not causal and window is None and all(t is None for t in (kv_start, valid, allowed)):
        return None

    def falower_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        q_pos = q_idx if diag is None else q_idx + diag
        keep = []
        if causal:
            keep.append(kv_idx <= q_pos)
        if window is not None:
            keep.append(q_pos - kv_idx < window)
        if kv_start is not None:
            keep.append(kv_idx >= kv_start[b])
            keep.append(kv_idx < kv_end[b])
        if valid is not None:
            keep.append(valid[b, kv_idx])
        if allowed is not None:
            keep.append(allowed[b, q_idx, kv_idx])
        out = keep[0]
        for term in keep[1:]:
            out = out & term
        return out

    return falower_mask


def make_score_mod(softcap: Optional[float], bias: Any = None) -> Optional[Callable]:
    """Gemma-style logit soft-capping (softcap * tanh(score / softcap)) and/or an additive bias table
    [B, L, S] or [B, H, L, S] (a float 4-D mask handed over as it is); None when there is neither."""
    if softcap is None and bias is None:
        return None
    per_head = bias is not None and bias.dim() == 4

    def falower_score(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if bias is not None:
            score = score + (bias[b, h, q_idx, kv_idx] if per_head else bias[b, q_idx, kv_idx])
        return score

    return falower_score


# ------------------------------------------------------------------------------------- the mask step
@dataclass
class FalowerMask:
    """What the mask step hands every layer of one forward: the mask kind, its captured tensors and the
    falower block mask built from them (once per forward; every layer reuses it)."""
    batch_size: int
    q_length: int
    kv_length: int
    causal: bool
    window: Optional[int] = None
    diag: Any = None        # 0-d int32: query positions minus key positions (None: 0)
    kv_start: Any = None    # [B] int32
    kv_end: Any = None      # [B] int32
    valid: Any = None       # [B, S] bool
    allowed: Any = None     # [B, L, S] bool (transformers' dense mask: the fallback)
    block_mask: Any = None  # falower BlockMask, or None when nothing is masked

    def __post_init__(self) -> None:
        mod = make_mask_mod(self.causal, self.window, self.diag, self.kv_start, self.kv_end, self.valid,
                            self.allowed)
        device = next((t.device for t in (self.kv_start, self.valid, self.allowed, self.diag) if t is not None), None)
        self.mask_mod = mod
        self.block_mask = None if mod is None else torch_mods.create_block_mask(
            mod, self.batch_size, None, self.q_length, self.kv_length, device=device)

    @property
    def kind(self) -> str:
        """A short description, e.g. 'causal+offset+padding' or 'sliding(4096)' or 'dense'."""
        if self.allowed is not None:
            return "dense"
        parts = (["causal"] if self.causal else []) + ([f"sliding({self.window})"] if self.window is not None else [])
        parts += ["offset"] if self.diag is not None else []
        parts += ["padding"] if self.kv_start is not None else []
        parts += ["padding-table"] if self.valid is not None else []
        return "+".join(parts) or "none"

    def dense(self) -> torch.Tensor:
        """The mask as a [B, L, S] bool tensor (tests and debugging)."""
        dev = next((t.device for t in (self.kv_start, self.valid, self.allowed, self.diag) if t is not None), "cpu")
        if self.mask_mod is None:
            return torch.ones(self.batch_size, self.q_length, self.kv_length, dtype=torch.bool, device=dev)
        b = torch.arange(self.batch_size, device=dev).view(-1, 1, 1)
        q = torch.arange(self.q_length, device=dev).view(1, -1, 1)
        kv = torch.arange(self.kv_length, device=dev).view(1, 1, -1)
        out = self.mask_mod(b, torch.zeros_like(b), q, kv)
        return out.expand(self.batch_size, self.q_length, self.kv_length).to(torch.bool)


def _closure(fn: Any, code: Any, name: str) -> Any:
    """The variable `name` closed over by `fn` when `fn` runs `code` (one of transformers' mask factories),
    else None."""
    if getattr(fn, "__code__", None) is not code or fn.__closure__ is None:
        return None
    cells = dict(zip(code.co_freevars, fn.__closure__))
    try:
        return cells[name].cell_contents if name in cells else None
    except ValueError:
        return None


def recognise(mask_function: Callable) -> Optional[tuple[bool, Optional[int]]]:
    """(causal, sliding window) when `mask_function` is one of the patterns transformers builds for decoders
    (`causal_mask_function`, `bidirectional_mask_function`, `sliding_window_causal_mask_function(w)`), else
    None: any other mask function (overlays, packed sequences, chunks) goes through the dense fallback."""
    mu = masking_utils
    if mask_function is mu.causal_mask_function:
        return True, None
    if mask_function is mu.bidirectional_mask_function:
        return False, None
    parts = _closure(mask_function, mu.and_masks(mu.causal_mask_function).__code__, "mask_functions")
    if isinstance(parts, tuple) and len(parts) == 2 and parts[1] is mu.causal_mask_function:
        window = _closure(parts[0], mu.sliding_window_overlay(1).__code__, "sliding_window")
        if isinstance(window, int) and not isinstance(window, bool):
            return True, window
    return None


def valid_keys(attention_mask: Optional[torch.Tensor], kv_length: int, kv_offset: int) -> Optional[torch.Tensor]:
    """[B, kv_length] bool of the keys the 2-D mask keeps (key j is at position j + kv_offset; positions past
    the mask's end are not kept, as in transformers' `prepare_padding_mask`), or None when all are kept.
    Reads one bool back from the device."""
    if attention_mask is None:
        return None
    m = attention_mask.to(torch.bool)
    end = kv_offset + kv_length
    if m.shape[-1] < end:
        m = torch.nn.functional.pad(m, (0, end - m.shape[-1]))
    m = m[:, kv_offset:end]
    return None if bool(m.all()) else m


def key_ranges(valid: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """([B] first valid key, [B] past-last valid key) as int32 when each row's valid keys are one run
    (left or right padding; a row with none gets 0, 0), else None (holes: keep the table). Reads one bool
    back from the device."""
    n = valid.shape[-1]
    idx = torch.arange(n, device=valid.device)
    count = valid.sum(-1)
    start = torch.where(valid, idx, n).amin(-1)
    end = torch.where(valid, idx + 1, 0).amax(-1)
    if not bool(((end - start == count) | (count == 0)).all()):
        return None
    start = torch.where(count == 0, 0, start)
    end = torch.where(count == 0, 0, end)
    return start.to(torch.int32), end.to(torch.int32)


def _offset(q_offset: Any, kv_offset: Any, device: Any) -> Any:
    """The 0-d int32 tensor q_offset - kv_offset, or None when it is statically 0 (a plain prefill: the causal
    diagonal is then part of the kernel and its tile skipping is decided at compile time)."""
    if not torch.is_tensor(q_offset) and not torch.is_tensor(kv_offset):
        d = int(q_offset) - int(kv_offset)
        return None if d == 0 else torch.tensor(d, dtype=torch.int32, device=device)
    d = torch.as_tensor(q_offset, device=device) - torch.as_tensor(kv_offset, device=device)
    return d.to(torch.int32).reshape(())


def falower_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: Any = 0,
                 mask_function: Callable = masking_utils.causal_mask_function,
                 attention_mask: Optional[torch.Tensor] = None, local_size: Optional[int] = None,
                 device: Any = "cpu", **kwargs: Any) -> FalowerMask:
    """The mask function registered with transformers' AttentionMaskInterface (its signature is that of
    `masking_utils.sdpa_mask` / `flex_attention_mask`): a FalowerMask, built once per forward."""
    pattern = recognise(mask_function)
    if pattern is None:
        # not a pattern falower knows: transformers' own dense mask, captured as a [B, L, S] table
        dense = masking_utils.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                                        q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                                        attention_mask=attention_mask, allow_is_causal_skip=False,
                                        allow_is_bidirectional_skip=False, use_vmap=kwargs.get("use_vmap", False),
                                        device=device)
        allowed = dense[:, 0].expand(batch_size, q_length, kv_length).contiguous()
        return FalowerMask(batch_size, q_length, kv_length, causal=False, allowed=allowed)
    causal, window = pattern
    kv_off = int(kv_offset) if not torch.is_tensor(kv_offset) or kv_offset.dim() == 0 else None
    if kv_off is None:
        raise FalowerError(f"falower's mask step takes one kv_offset for the batch, got {tuple(kv_offset.shape)}")
    valid = valid_keys(attention_mask, kv_length, kv_off)
    ranges = key_ranges(valid) if valid is not None else None
    return FalowerMask(batch_size, q_length, kv_length, causal=causal, window=window,
                       diag=_offset(q_offset, kv_offset, device) if (causal or window is not None) else None,
                       kv_start=ranges[0] if ranges else None, kv_end=ranges[1] if ranges else None,
                       valid=valid if valid is not None and ranges is None else None)


# ------------------------------------------------------------------------------------ the attention
def falower_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: Any, dropout: float = 0.0, scaling: Optional[float] = None,
                              softcap: Optional[float] = None, sliding_window: Optional[int] = None,
                              is_causal: Optional[bool] = None, s_aux: Any = None, position_bias: Any = None,
                              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function registered with transformers' AttentionInterface: query [B, H, L, D], key and
    value [B, HKV, S, D]; returns (out [B, L, H, D] contiguous, None)."""
    if dropout:
        raise FalowerError(f"falower attention has no dropout (got dropout={dropout}): use the model in eval() "
                           f"mode or set the config's attention_dropout to 0")
    if s_aux is not None:
        raise FalowerError("falower attention does not support attention sinks (s_aux)")
    if position_bias is not None:
        raise FalowerError("falower attention does not support position_bias (T5-style relative attention)")
    B, _, L, _ = query.shape
    S = key.shape[2]
    bias = None
    mask = attention_mask
    if mask is None:
        # no mask step ran (a module used on its own): causal per the module, with the queries as the last
        # rows of the keys, and the layer's sliding window if it has one
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        mask = FalowerMask(B, L, S, causal=causal, window=sliding_window if causal else None,
                           diag=_offset(S - L, 0, query.device) if causal else None)
    elif torch.is_tensor(mask):
        # a 4-D mask prepared by the caller: boolean (True = attend) or additive float
        if mask.dim() != 4:
            raise FalowerError(f"falower attention takes a FalowerMask or a 4-D mask, got shape {tuple(mask.shape)}")
        mask = mask[..., :S].expand(B, mask.shape[1], L, S)
        if mask.dtype == torch.bool:
            if mask.shape[1] != 1 and not bool((mask == mask[:, :1]).all()):
                raise FalowerError("falower attention takes a boolean 4-D mask shared by all heads ([B, 1, L, S])")
            mask = FalowerMask(B, L, S, causal=False, allowed=mask[:, 0].contiguous())
        else:
            bias = (mask[:, 0] if mask.shape[1] == 1 else mask).float().contiguous()
            mask = None
    elif not isinstance(mask, FalowerMask):
        raise FalowerError(f"falower attention got an attention_mask of type {type(mask).__name__}; register the "
                           f"mask function too (falower.integrations.transformers.register() does both)")
    if mask is not None and (mask.q_length, mask.kv_length, mask.batch_size) != (L, S, B):
        raise FalowerError(f"the mask was made for batch {mask.batch_size}, {mask.q_length} queries and "
                           f"{mask.kv_length} keys, but the layer has {B}, {L} and {S}")
    out = torch_mods.flex_attention(query, key, value, score_mod=make_score_mod(softcap, bias),
                                    block_mask=mask.block_mask if mask is not None else None,
                                    scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register(name: str = NAME) -> str:
    """Make `attn_implementation=name` ("falower") use falower: registers the attention function and the
    mask function under `name` in transformers' registries. Idempotent; returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, falower_attention_forward)
    masking_utils.AttentionMaskInterface.register(name, falower_mask)
    return name
