"""flashattn as an attention implementation of Hugging Face transformers.

One line turns it on for a model (transformers >= 4.53, whose AttentionInterface and
AttentionMaskInterface take registrations):

    model.set_attn_implementation(flashattn.transformers.register())
    # or, at creation: AutoModelForCausalLM.from_config(cfg,
    #                      attn_implementation=flashattn.transformers.register())

register() returns the implementation's name, "fa_c" by default. transformers treats
names containing "flash" as its flash-attn packages (it tries to import or download
them), so the name leaves that word out; the masks it would prepare for them (a 2-D
padding mask, or none) are registered explicitly instead.

What runs: unpadded batches call flashattn::fwd on the (batch, heads, seqlen, headdim)
tensors as they are, causal or not, with the model's scaling, dropout (while training),
softcap and sliding window. A padding mask from the tokenizer (attention_mask) sends
the batch through the variable-length path: the valid tokens are gathered, attended
per sequence and scattered back (padded rows get 0). Generation with a KV cache works
the same way (the cached keys are part of the mask; the causal mask is aligned to the
last key). Masks that are more than padding (packed sequences, image-token overlays,
chunked attention) arrive as a dense (batch, 1, q, k) boolean mask and run as an
element-wise block mask: exact, with the memory cost of the mask.
"""
import torch

from . import _ops

NAME = "fa_c"

__all__ = ["register", "attention_forward", "padding_mask", "NAME"]


def register(name=NAME):
    """Registers the attention (and its mask preparation) with transformers under `name`
    and returns the name, for attn_implementation= or model.set_attn_implementation."""
    if "flash" in name:
        raise ValueError("transformers reserves names containing 'flash' for its flash-attn "
                         "packages; choose another name (got %r)" % (name,))
    from transformers import AttentionInterface
    AttentionInterface.register(name, attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # older transformers: a 4-D mask reaches attention_forward instead
        return name
    AttentionMaskInterface.register(name, padding_mask)
    return name


# ---- masks --------------------------------------------------------------------------

def _standard_mask_functions():
    from transformers import masking_utils as mu
    fns = [getattr(mu, n, None) for n in ("causal_mask_function", "bidirectional_mask_function")]
    return tuple(f for f in fns if f is not None)


def padding_mask(batch_size, q_length=None, kv_length=None, q_offset=0, kv_offset=0,
                 mask_function=None, attention_mask=None, **kwargs):
    """The mask transformers hands attention_forward: the 2-D (batch, kv_length) padding
    mask (True = a real token), or None when nothing is padded, for plain causal or
    bidirectional attention; otherwise the dense 4-D boolean mask."""
    if mask_function is None or mask_function in _standard_mask_functions():
        if attention_mask is None:
            return None
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
            return None
        return attention_mask.bool()
    from transformers.masking_utils import sdpa_mask
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    if q_length is not None:  # older releases pass cache_position (in kwargs) instead
        kwargs["q_length"] = q_length
    return sdpa_mask(batch_size=batch_size, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function,
                     attention_mask=attention_mask, **kwargs)


# ---- the attention ------------------------------------------------------------------

def _offsets(lengths):
    """int32 (batch + 1,) offsets from per-sequence lengths, on their device."""
    cu = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=lengths.device)
    torch.cumsum(lengths, 0, dtype=torch.int32, out=cu[1:])
    return cu


def _window(sliding_window, key_length):
    # transformers counts a window by its size, flash-attn's bounds are inclusive
    if sliding_window is None or key_length <= sliding_window:
        return (-1, -1)
    return (sliding_window - 1, sliding_window - 1)


def _varlen(q, k, v, mask, causal, scale, dropout, window, softcap):
    """q (B, Nq, H, D), k/v (B, Nk, Hk, D) with a (B, Nk) padding mask: attention over each
    sequence's real tokens; padded query rows give 0."""
    b, nq = q.shape[0], q.shape[1]
    keep_k = mask.reshape(-1)
    idx_k = keep_k.nonzero().squeeze(1)
    cu_k = _offsets(mask.sum(1, dtype=torch.int32))
    if nq == mask.shape[1]:
        idx_q, cu_q = idx_k, cu_k
    elif nq == 1 or not causal:  # one new token each, or cross-attention: every query is real
        idx_q = None
        cu_q = torch.arange(0, (b + 1) * nq, nq, dtype=torch.int32, device=q.device)
    else:  # a causal chunk after cached keys: its own rows of the mask
        mq = mask[:, -nq:]
        idx_q = mq.reshape(-1).nonzero().squeeze(1)
        cu_q = _offsets(mq.sum(1, dtype=torch.int32))
    qf = q.reshape(b * nq, *q.shape[2:])
    qu = qf if idx_q is None else qf.index_select(0, idx_q)
    ku = k.reshape(-1, *k.shape[2:]).index_select(0, idx_k)
    vu = v.reshape(-1, *v.shape[2:]).index_select(0, idx_k)
    out = _ops.attention(qu, ku, vu, cu_q, cu_k, None, None, None, scale, causal, window,
                         softcap, dropout, False, "flash2", None)[0]
    if idx_q is None:
        return out.view(b, nq, *out.shape[1:])
    full = out.new_zeros(b * nq, *out.shape[1:])
    full = full.index_copy(0, idx_q, out)  # differentiable scatter back
    return full.view(b, nq, *out.shape[1:])


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' attention function: query (batch, heads, q_len, head_dim), key and
    value (batch, kv_heads, kv_len, head_dim); returns (attn_output (batch, q_len, heads,
    head_dim), None)."""
    if s_aux is not None:
        raise NotImplementedError("flashattn: attention sinks (s_aux) are not supported")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal = bool(is_causal)
    nq, nk = query.shape[2], key.shape[2]
    window = _window(sliding_window, nk)
    if query.dtype != key.dtype:  # e.g. a float32 query from a float32 norm under autocast
        query = query.to(key.dtype)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if attention_mask is None and cu_q is not None and cu_k is not None:
        # padding-free batches (sequences concatenated, offsets from the collator)
        q, k, v = (x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])
                   for x in (query, key, value))
        out = _ops.attention(q, k, v, cu_q, cu_k, None, None, None, scaling, causal, window,
                             softcap, dropout, False, "flash2", None)[0]
        return out.view(query.shape[0], nq, *out.shape[1:]), None
    if attention_mask is None:
        out = _ops.attention(query, key, value, None, None, None, None, None, scaling, causal,
                             window, softcap, dropout, False, "flash2", None, True)[0]
        return out.transpose(1, 2), None
    if attention_mask.dim() == 2:
        if attention_mask.shape[1] < nk:  # a static cache's unused tail is never attended
            key, value = key[:, :, :attention_mask.shape[1]], value[:, :, :attention_mask.shape[1]]
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        return _varlen(q, k, v, attention_mask.bool(), causal, scaling, dropout, window,
                       softcap), None
    # a dense (batch or 1, 1 or heads, q_len, kv_len) mask: boolean (True = attend) or
    # additive (0 = attend), applied element-wise through a block mask of 1x1 blocks
    mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    out = _ops.attention(query, key, value, None, None, None, None, mask.to(torch.uint8), scaling,
                         False, window, softcap, dropout, False, "flash2", (1, 1), True)[0]
    return out.transpose(1, 2), None
