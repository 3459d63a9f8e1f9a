"""flashattn inside Hugging Face transformers (flashattn.transformers): models built from
configs (no downloads), compared with transformers' own SDPA path in float32 on the CPU:
padded batches (left and right padding), causal and bidirectional models, dropout while
training, generation with a KV cache, and masks that are more than padding."""
import pytest

from conftest import needs_torch

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import flashattn.transformers as fat  # noqa: E402

pytestmark = needs_torch

try:
    import transformers.masking_utils as _masking
    _masking.AttentionMaskInterface
except (ImportError, AttributeError):
    pytest.skip("needs transformers >= 4.53 (AttentionMaskInterface)", allow_module_level=True)

NAME = fat.register()
TOL = 2e-5  # float32 against float32: both exact attention, different summation orders


def _llama(**kw):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128, **kw)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _gpt2(**kw):
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=128, n_embd=64, n_layer=2,
                                  n_head=4, **kw)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _with(model, impl):
    model.set_attn_implementation(impl)
    return model


def _batch(padding_side, b=3, n=17):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (b, n), generator=g)
    mask = torch.ones(b, n, dtype=torch.long)
    for i, pad in enumerate([0, 5, 11][:b]):
        if pad:
            if padding_side == "left":
                mask[i, :pad] = 0
            else:
                mask[i, n - pad:] = 0
    return ids, mask


def _max_rel(a, b, keep=None):
    if keep is not None:
        a, b = a[keep], b[keep]
    return ((a - b).norm() / b.norm()).item()


def test_register_name_and_refusal():
    assert NAME == fat.NAME and "flash" not in NAME
    assert NAME in transformers.AttentionInterface._global_mapping
    with pytest.raises(ValueError, match="flash"):
        fat.register("my_flash")


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("padding_side", ["none", "left", "right"])
def test_logits_match_sdpa(make, padding_side):
    model = make()
    ids, mask = _batch(padding_side if padding_side != "none" else "left", b=3)
    if padding_side == "none":
        mask = torch.ones_like(mask)
    with torch.no_grad():
        ref = _with(model, "sdpa")(input_ids=ids, attention_mask=mask).logits
        out = _with(model, NAME)(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()  # padded positions are not compared (SDPA gives them garbage)
    assert _max_rel(out, ref, keep) < TOL
    assert torch.isfinite(out[keep]).all()


def test_one_operator_call_per_layer_without_padding():
    from torch.utils._python_dispatch import TorchDispatchMode
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    model = _with(_llama(), NAME)
    ids, _ = _batch("left")
    with torch.no_grad(), Record():
        model(input_ids=ids)
    assert sum(s == "flashattn.fwd.default" for s in seen) == 2  # two layers
    assert not any("scaled_dot_product" in s for s in seen)


def test_bidirectional_encoder_with_padding():
    cfg = transformers.BertConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=96,
                                  max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    ids, mask = _batch("right")
    with torch.no_grad():
        ref = _with(model, "sdpa")(input_ids=ids, attention_mask=mask).last_hidden_state
        try:
            out = _with(model, NAME)(input_ids=ids, attention_mask=mask).last_hidden_state
        except (ValueError, KeyError) as e:  # a transformers whose BERT has no interface
            pytest.skip("BERT does not take registered attention here: %s" % e)
    assert _max_rel(out, ref, mask.bool()) < TOL


def test_training_step_matches_sdpa_and_dropout_runs():
    model = _llama()
    ids, mask = _batch("right")
    labels = ids.masked_fill(mask == 0, -100)
    grads = {}
    for impl in ("sdpa", NAME):
        model.zero_grad()
        _with(model, impl).train()  # attention_dropout is 0 here: deterministic
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        grads[impl] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert _max_rel(grads[NAME], grads["sdpa"]) < 1e-4
    # with dropout the step runs, the loss is finite and the masks differ between calls
    drop = _with(_llama(attention_dropout=0.3), NAME).train()
    a = drop(input_ids=ids, attention_mask=mask, labels=labels).loss
    b = drop(input_ids=ids, attention_mask=mask, labels=labels).loss
    a.backward()
    assert torch.isfinite(a) and a.item() != b.item()
    assert all(torch.isfinite(p.grad).all() for p in drop.parameters() if p.grad is not None)


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_generation_with_kv_cache_matches_sdpa(make):
    model = make()
    ids, mask = _batch("left", b=3, n=9)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    ref = _with(model, "sdpa").generate(input_ids=ids, attention_mask=mask, **kw)
    out = _with(model, NAME).generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(out, ref)


def test_packed_sequences_mask_is_exact():
    """position_ids restarting inside a row (sequences packed without padding): the mask is
    more than padding, so the dense path runs; no attention across the sequences."""
    model = _llama()
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(3))
    pos = torch.cat([torch.arange(8), torch.arange(12)])[None]
    with torch.no_grad():
        out = _with(model, NAME)(input_ids=ids, position_ids=pos, use_cache=False).logits
        ref = _with(model, "sdpa")(input_ids=ids, position_ids=pos, use_cache=False).logits
        a = _with(model, "sdpa")(input_ids=ids[:, :8], use_cache=False).logits
        b = _with(model, "sdpa")(input_ids=ids[:, 8:], use_cache=False).logits
    assert _max_rel(out, torch.cat([a, b], 1)) < TOL
    assert _max_rel(out, ref) < TOL


@pytest.mark.parametrize("padding_side", ["none", "left"])
def test_sliding_window_model(padding_side):
    """Mistral-shaped, window 6 over 17 tokens: the window comes as a mask and as the
    module's sliding_window; both must agree with SDPA's."""
    cfg = transformers.MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, sliding_window=6,
                                     max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(cfg).eval()
    ids, mask = _batch("left")
    if padding_side == "none":
        mask = torch.ones_like(mask)
    with torch.no_grad():
        ref = _with(model, "sdpa")(input_ids=ids, attention_mask=mask).logits
        out = _with(model, NAME)(input_ids=ids, attention_mask=mask).logits
    assert _max_rel(out, ref, mask.bool()) < TOL


def test_dense_mask_reaches_the_block_mask():
    """attention_forward with a 4-D boolean mask (and an additive float one) against
    masked math."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 9, 16, generator=g) for _ in range(3))
    keep = torch.rand(2, 1, 9, 9, generator=g) < 0.6
    keep[..., 0] = True
    module = torch.nn.Module()
    for mask in (keep, torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)):
        out, _ = fat.attention_forward(module, q, k, v, mask, scaling=0.25)
        s = (q @ k.transpose(-1, -2) * 0.25).masked_fill(~keep, float("-inf"))
        ref = (s.softmax(-1) @ v).transpose(1, 2)
        assert _max_rel(out, ref) < TOL


def test_padding_mask_function():
    m = torch.tensor([[1, 1, 1], [0, 1, 1]])
    from transformers.masking_utils import causal_mask_function
    assert fat.padding_mask(2, 3, 3, mask_function=causal_mask_function,
                            attention_mask=torch.ones(2, 3)) is None
    got = fat.padding_mask(2, 3, 3, mask_function=causal_mask_function, attention_mask=m)
    assert got.dtype == torch.bool and torch.equal(got, m.bool())
