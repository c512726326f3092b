"""flashattn registered as a transformers attention implementation, against transformers'
own "sdpa" implementation on small randomly initialised models (no weights are
downloaded): the logits (Llama, and Mistral with a sliding window), the gradients of one
training step, and greedy generation through flashattn.generation.PagedKVCache (a paged KV
cache attended by flash_attn_with_kvcache with a shuffled block table), each with and
without left padding. CPU in fp32/fp64; CUDA in bf16/fp16 (skipped without a GPU), with
head dim 64, which every CUDA build compiles."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flashattn.generation  # noqa: E402
import flashattn.hf  # noqa: E402

VOCAB = 97
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not (torch.cuda.is_available() and flashattn.cuda_available()),
    reason="no CUDA device or a build without CUDA"))]


def _config(device, sliding_window=None):
    """2 layers, 4 query heads over 2 KV heads; head dim 16 on the CPU, 64 on CUDA."""
    hidden = 64 if device == "cpu" else 256
    config_cls = transformers.MistralConfig if sliding_window else transformers.LlamaConfig
    kw = dict(sliding_window=sliding_window) if sliding_window else {}
    return config_cls(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, eos_token_id=None, **kw)


def _model(attn, device, dtype, sliding_window=None, seed=0):
    """The same random weights for every attn / dtype with the same seed."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(device, sliding_window),
                                                          attn_implementation=attn)
    return model.to(device=device, dtype=dtype).eval()


def _left_padding(ids, padded):
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :5] = 0
        mask[2, :11] = 0
    return mask


def _counted(monkeypatch, module, names):
    """Counts the calls of module.<name> for each name."""
    calls = dict.fromkeys(names, 0)

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    for name in names:
        monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    return calls


def _max_abs(x):
    return x.abs().max().item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sliding_window", [None, 7], ids=["llama", "mistral-window7"])
def test_logits_match_sdpa(device, sliding_window, seed, monkeypatch):
    name = flashattn.hf.register()
    calls = _counted(monkeypatch, flashattn.hf, ["flash_attn_func", "flash_attn_varlen_func"])
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    ours = _model(name, device, dtype, sliding_window)
    theirs = _model("sdpa", device, dtype, sliding_window)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 21), generator=g).to(device)
    mask = _left_padding(ids, True)
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        full_ours = ours(ids).logits
        full_theirs = theirs(ids).logits
        torch.testing.assert_close(full_ours, full_theirs, **tol)
        assert calls == {"flash_attn_func": 2, "flash_attn_varlen_func": 0}  # one per layer
        padded_ours = ours(ids, attention_mask=mask).logits
        padded_theirs = theirs(ids, attention_mask=mask).logits
    # the padded batch went through varlen
    assert calls == {"flash_attn_func": 2, "flash_attn_varlen_func": 2}
    valid = mask.bool()
    torch.testing.assert_close(padded_ours[valid], padded_theirs[valid], **tol)


def _training_step(model, ids, mask, labels):
    """One forward + backward of the cross-entropy loss; returns (loss, {param: grad})."""
    model.train()
    loss = model(ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.detach().to(torch.float64) for n, p in model.named_parameters()}
    return loss.detach().to(torch.float64), grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "left-padded"])
def test_training_step_gradients_match_sdpa(device, padded, seed, monkeypatch):
    """Every parameter's gradient after one step: ours in `dtype` is at most twice as far
    from an fp64 sdpa reference as sdpa in `dtype` is, plus one ulp of the gradient's
    largest entry (the FlashAttention rule); on the CPU (fp32) also within 1e-4 of sdpa's."""
    name = flashattn.hf.register()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    calls = _counted(monkeypatch, flashattn.hf, ["flash_attn_func", "flash_attn_varlen_func"])
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 21), generator=g).to(device)
    mask = _left_padding(ids, padded)
    labels = torch.randint(0, VOCAB, (3, 21), generator=g).to(device).masked_fill(mask == 0, -100)

    loss_ours, ours = _training_step(_model(name, device, dtype), ids, mask, labels)
    kind = "flash_attn_varlen_func" if padded else "flash_attn_func"
    assert calls[kind] == 2 and sum(calls.values()) == 2  # one forward per layer
    loss_low, low = _training_step(_model("sdpa", device, dtype), ids, mask, labels)
    loss_ref, ref = _training_step(_model("sdpa", device, torch.float64), ids, mask, labels)

    eps = torch.finfo(dtype).eps
    assert abs(loss_ours - loss_ref) <= 2 * abs(loss_low - loss_ref) + eps * abs(loss_ref)
    assert ours.keys() == ref.keys()
    for param, want in ref.items():
        scale = _max_abs(want)
        assert scale > 0, f"{param}: zero reference gradient"
        assert torch.isfinite(ours[param]).all(), param
        err_ours = _max_abs(ours[param] - want)
        err_low = _max_abs(low[param] - want)
        assert err_ours <= 2 * err_low + eps * scale, (
            f"{param}: |ours - fp64 sdpa| = {err_ours:.3e} > 2 * |{dtype} sdpa - fp64 sdpa| "
            f"= 2 * {err_low:.3e} + {eps * scale:.3e}")
        if device == "cpu":
            assert _max_abs(ours[param] - low[param]) <= 1e-4 * scale, param


def _teacher_forced_logits(model, sequences, prompt_mask, prompt_len):
    """Logits [b, new, vocab] (fp64) predicting each generated token of `sequences` by one
    forward over the whole sequences, with generate's positions (cumsum of the mask)."""
    new = sequences.shape[1] - prompt_len
    mask = torch.cat([prompt_mask, prompt_mask.new_ones(prompt_mask.shape[0], new)], dim=1)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        logits = model(sequences, attention_mask=mask, position_ids=positions).logits
    return logits[:, prompt_len - 1:-1].to(torch.float64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "left-padded"])
@pytest.mark.parametrize("sliding_window", [None, 7], ids=["llama", "mistral-window7"])
@pytest.mark.parametrize("block_size", [16, 5])
def test_paged_greedy_generation_matches_sdpa(device, padded, sliding_window, block_size, seed,
                                              monkeypatch):
    """model.generate(do_sample=False) with a PagedKVCache: every step's attention is one
    flash_attn_with_kvcache call per layer with the shuffled block table, and the tokens
    are sdpa's. The per-step logits are within tol of an fp64 reference teacher-forced on
    our tokens, tol = twice the error of sdpa's teacher-forced logits in the same dtype plus
    one ulp of the largest logit. Two sets of logits each within tol of the reference are
    within 2 tol of each other, and a greedy choice is then the reference's argmax within
    2 tol. On the CPU the tokens must be identical; in fp16 on CUDA two implementations may
    part at a near tie, so there a row must agree with sdpa's up to a step where the
    reference's logits of the two tokens are within 2 tol (and not be compared after it)."""
    name = flashattn.hf.register()
    dtype = torch.float32 if device == "cpu" else torch.float16
    prompt_len, new_tokens, batch = 19, 14, 3
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, prompt_len), generator=g).to(device)
    mask = _left_padding(ids, padded)
    gen = dict(attention_mask=mask, max_new_tokens=new_tokens,
               do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)

    calls = []
    kvcache = flashattn.generation.flash_attn_with_kvcache

    def recorded(q, k_cache, v_cache, k=None, v=None, **kwargs):
        calls.append((q.shape[1], k is not None, kwargs.get("block_table")))
        return kvcache(q, k_cache, v_cache, k, v, **kwargs)

    monkeypatch.setattr(flashattn.generation, "flash_attn_with_kvcache", recorded)
    ours_model = _model(name, device, dtype, sliding_window)
    cache = flashattn.generation.PagedKVCache(
        ours_model.config, batch, prompt_len + new_tokens, block_size=block_size,
        num_blocks=batch * -(-(prompt_len + new_tokens) // block_size) + 3,
        generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        ours = ours_model.generate(ids, past_key_values=cache, **gen)
    theirs = _model("sdpa", device, dtype, sliding_window).generate(ids, **gen)

    layers = ours_model.config.num_hidden_layers
    assert len(calls) == new_tokens * layers
    table = cache.block_table.to(device)
    assert all(bt is not None and torch.equal(bt, table) for _, _, bt in calls)
    # the prefill: all prompt tokens at once, appended by the call unless left-padded
    assert [(s_q, append) for s_q, append, _ in calls[:layers]] == [(prompt_len, not padded)] * layers
    # then one token per row per step, appended in place by the call
    assert all((s_q, append) == (1, True) for s_q, append, _ in calls[layers:])
    stored = mask.sum(1) + new_tokens - 1
    for layer in cache.layers:
        assert torch.equal(layer.cache_seqlens.cpu(), stored.to(torch.int32).cpu())

    ref = _teacher_forced_logits(_model("sdpa", device, torch.float64, sliding_window),
                                 ours.sequences, mask, prompt_len)
    low = _teacher_forced_logits(_model("sdpa", device, dtype, sliding_window),
                                 ours.sequences, mask, prompt_len)
    ours_logits = torch.stack(ours.logits, dim=1).to(torch.float64)  # [b, new, vocab]
    theirs_logits = torch.stack(theirs.logits, dim=1).to(torch.float64)
    tol = 2 * _max_abs(low - ref) + torch.finfo(dtype).eps * _max_abs(ref)
    assert _max_abs(ours_logits - ref) <= tol
    ours_tokens = ours.sequences[:, prompt_len:]
    theirs_tokens = theirs.sequences[:, prompt_len:]
    chosen = ref.gather(2, ours_tokens[..., None])[..., 0]
    assert (ref.amax(dim=2) - chosen).max().item() <= 2 * tol  # greedy under the reference
    if device == "cpu":
        assert torch.equal(ours.sequences, theirs.sequences)
        torch.testing.assert_close(ours_logits, theirs_logits, rtol=0, atol=2 * tol)
        return
    for row in range(batch):
        differ = (ours_tokens[row] != theirs_tokens[row]).nonzero()
        steps = new_tokens if differ.numel() == 0 else int(differ[0])
        torch.testing.assert_close(ours_logits[row, :steps + 1], theirs_logits[row, :steps + 1],
                                   rtol=0, atol=2 * tol)
        if steps < new_tokens:
            t = steps
            gap = ref[row, t, theirs_tokens[row, t]] - ref[row, t, ours_tokens[row, t]]
            assert abs(gap.item()) <= 2 * tol, (
                f"row {row} parts from sdpa at step {t}: reference gap {gap.item():.3e} > "
                f"2 * tol = {2 * tol:.3e}")


def test_paged_cache_refuses_other_attention_implementations():
    model = _model("sdpa", "cpu", torch.float32)
    cache = flashattn.generation.PagedKVCache(model.config, 1, 8)
    with pytest.raises(ValueError, match="attn_implementation"):
        model.generate(torch.ones(1, 4, dtype=torch.long), past_key_values=cache,
                       max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_paged_cache_refuses_right_padding():
    name = flashattn.hf.register()
    model = _model(name, "cpu", torch.float32)
    cache = flashattn.generation.PagedKVCache(model.config, 2, 8)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with torch.no_grad(), pytest.raises(ValueError, match="left padding"):
        model(torch.ones(2, 4, dtype=torch.long), attention_mask=mask, past_key_values=cache)


def _gpt_oss(attn, device, dtype, seed=0):
    """A tiny gpt-oss (learnable sinks, a 5-token sliding-window layer then a full one),
    random weights and random sinks, the same for every attn with the same seed."""
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16 if device == "cpu" else 64,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
        max_position_embeddings=128, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    return model.to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_gpt_oss_sinks_match_eager(device, seed, monkeypatch):
    """gpt-oss passes its sinks as s_aux: the logits (dense and left-padded) and one training
    step's gradients, sinks included, against transformers' eager gpt-oss attention. gpt-oss's
    experts run in fp32 at most (grouped_mm): the CPU compares fp32 with fp32 (within 1e-5 of
    the largest value); CUDA compares bf16 with the rule err(ours) <= 2 err(eager bf16) + eps
    against eager fp32."""
    name = flashattn.hf.register()
    calls = _counted(monkeypatch, flashattn.hf, ["flash_attn_func", "flash_attn_varlen_func"])
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 21), generator=g).to(device)
    mask = _left_padding(ids, True)
    labels = torch.randint(0, VOCAB, (3, 21), generator=g).to(device).masked_fill(mask == 0, -100)

    def run(model):
        model.train()
        logits = model(ids).logits.detach().to(torch.float64)
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        grads = {n: p.grad.detach().to(torch.float64) for n, p in model.named_parameters()}
        return logits, out.logits.detach().to(torch.float64), grads

    ours = run(_gpt_oss(name, device, dtype, seed))
    assert calls == {"flash_attn_func": 2, "flash_attn_varlen_func": 2}
    low = run(_gpt_oss("eager", device, dtype, seed))
    ref = low if device == "cpu" else run(_gpt_oss("eager", device, torch.float32, seed))
    valid = mask.bool()
    eps = torch.finfo(dtype).eps
    pairs = [("logits", ours[0], low[0], ref[0]),
             ("padded logits", ours[1][valid], low[1][valid], ref[1][valid])]
    pairs += [(n, ours[2][n], low[2][n], ref[2][n]) for n in ref[2]]
    sinks = [n for n in ref[2] if n.endswith("self_attn.sinks")]
    assert len(sinks) == 2 and all(_max_abs(ref[2][n]) > 0 for n in sinks)
    for what, got, base, want in pairs:
        scale = _max_abs(want)
        if device == "cpu":
            assert _max_abs(got - want) <= 1e-5 * max(scale, 1e-30), what
        else:
            assert _max_abs(got - want) <= 2 * _max_abs(base - want) + eps * scale, what


def test_gpt_oss_paged_greedy_generation_matches_eager(seed, monkeypatch):
    """gpt-oss generation through PagedKVCache (every step one flash_attn_with_kvcache call
    per layer, with the layer's sinks and window): the tokens of eager gpt-oss, and logits
    within 1e-5 of the largest (CPU, fp32)."""
    name = flashattn.hf.register()
    ours = _gpt_oss(name, "cpu", torch.float32, seed).eval()
    theirs = _gpt_oss("eager", "cpu", torch.float32, seed).eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, 19), generator=g)
    mask = _left_padding(ids, True)
    gen = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
               output_logits=True, return_dict_in_generate=True)
    cache = flashattn.generation.PagedKVCache(
        ours.config, 3, 29, block_size=5, num_blocks=3 * 6 + 3,
        generator=torch.Generator().manual_seed(seed + 1))
    sinks_seen = []
    kvcache = flashattn.generation.flash_attn_with_kvcache

    def recorded(*args, **kwargs):
        sinks_seen.append(kwargs.get("learnable_sink"))
        return kvcache(*args, **kwargs)

    monkeypatch.setattr(flashattn.generation, "flash_attn_with_kvcache", recorded)
    with torch.no_grad():
        a = ours.generate(ids, past_key_values=cache, **gen)
        b = theirs.generate(ids, **gen)
    assert len(sinks_seen) == 10 * 2 and all(s is not None for s in sinks_seen)
    assert torch.equal(a.sequences, b.sequences)
    la, lb = torch.stack(a.logits), torch.stack(b.logits)
    assert _max_abs(la - lb) <= 1e-5 * _max_abs(lb)
