"""flashattn registered as a transformers attention implementation: a small randomly
initialised Llama (no weights are downloaded) gives the logits of transformers' own
"sdpa" implementation, with and without left padding."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flashattn.hf  # noqa: E402


def _model(attn, device, dtype, sliding_window=None):
    torch.manual_seed(0)
    config_cls = transformers.MistralConfig if sliding_window else transformers.LlamaConfig
    kw = dict(sliding_window=sliding_window) if sliding_window else {}
    # head dim 256 / 4 = 64: compiled into every CUDA build
    config = config_cls(vocab_size=97, hidden_size=256, intermediate_size=256,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=128, **kw)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(device=device, dtype=dtype).eval()


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and flashattn.cuda_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sliding_window", [None, 7], ids=["llama", "mistral-window7"])
def test_logits_match_sdpa(device, sliding_window, seed, monkeypatch):
    name = flashattn.hf.register()
    calls = {"dense": 0, "varlen": 0}

    def counted(kind, fn):
        def wrapper(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(flashattn.hf, "flash_attn_func",
                        counted("dense", flashattn.hf.flash_attn_func))
    monkeypatch.setattr(flashattn.hf, "flash_attn_varlen_func",
                        counted("varlen", flashattn.hf.flash_attn_varlen_func))
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    ours = _model(name, device, dtype, sliding_window)
    theirs = _model("sdpa", device, dtype, sliding_window)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (3, 21), generator=g).to(device)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    mask[2, :11] = 0
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        full_ours = ours(ids).logits
        full_theirs = theirs(ids).logits
        torch.testing.assert_close(full_ours, full_theirs, **tol)
        assert calls == {"dense": 2, "varlen": 0}  # one call per layer
        padded_ours = ours(ids, attention_mask=mask).logits
        padded_theirs = theirs(ids, attention_mask=mask).logits
    assert calls == {"dense": 2, "varlen": 2}  # the padded batch went through varlen
    valid = mask.bool()
    torch.testing.assert_close(padded_ours[valid], padded_theirs[valid], **tol)
