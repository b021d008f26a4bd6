"""HeadStats: chunked statistics vs brute force on full logits, and hidden-state capture on a fused TRL model."""

import math

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from trl_plugins.runtime.head_stats import (
    OUT_OF_KEEP_SET,
    HeadStats,
    backbone_of,
    capture_hidden_states,
    lm_head_of,
)

B, P, C, D, V = 3, 4, 6, 8, 37
SCALE, SOFTCAP, TEMP = 1.7, 6.0, 0.8


def _setup(seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, P + C, D, generator=g, dtype=torch.float64).float()
    W = (torch.randn(V, D, generator=g) * 0.8).requires_grad_(True)
    b = (torch.randn(V, generator=g) * 0.5).requires_grad_(True) if bias else None
    labels = torch.randint(0, V, (B, C), generator=g)
    mask = torch.ones(B, C, dtype=torch.long)
    mask[0, 4:] = 0  # trailing padding
    mask[1, 0] = 0  # an invalid position in the middle of the stream
    mask[2, 2:4] = 0
    return hidden, W, b, labels, mask


def _full_logits(hidden, W, b):
    """Brute force (B, C, V) transformed logits."""
    h = hidden[:, -(C + 1) : -1]
    z = h @ W.t()
    if b is not None:
        z = z + b
    z = z * SCALE
    z = SOFTCAP * torch.tanh(z / SOFTCAP)
    return z / TEMP


def _stats(hidden, W, b, mask, chunk):
    return HeadStats(hidden, C, mask, W, b, logit_scale=SCALE, softcap=SOFTCAP, temperature=TEMP, chunk_size=chunk)


CHUNKS = [1, 3, B * C]  # "all" = at least the number of valid tokens


def _close(a, b, mask, atol=1e-5):
    m = mask.bool()
    assert a.shape == (B, C)
    assert torch.all(a[~m] == 0)
    torch.testing.assert_close(a[m], b[m].to(a.dtype), atol=atol, rtol=1e-5)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_basic_stats_match_brute_force(chunk):
    hidden, W, b, labels, mask = _setup()
    z = _full_logits(hidden, W, b).detach()
    s = _stats(hidden, W, b, mask, chunk)
    _close(s.logsumexp(), torch.logsumexp(z, -1), mask)
    _close(s.max_logit(), z.amax(-1), mask)
    _close(s.label_logit(labels), z.gather(-1, labels[..., None]).squeeze(-1), mask)
    logp = torch.log_softmax(z, -1)
    _close(s.label_logprob(labels), logp.gather(-1, labels[..., None]).squeeze(-1), mask)
    _close(s.entropy(), -(logp.exp() * logp).sum(-1), mask)
    _close(s.mean_log_softmax(), logp.mean(-1), mask)
    assert s.max_rows_projected == min(chunk, int(mask.sum()))


def test_no_bias_and_no_softcap():
    hidden, W, _, labels, mask = _setup(bias=False)
    s = HeadStats(hidden, C, mask, W, None, logit_scale=1.0, softcap=None, temperature=1.0, chunk_size=4)
    z = (hidden[:, -(C + 1) : -1] @ W.t()).detach()
    _close(s.label_logprob(labels), torch.log_softmax(z, -1).gather(-1, labels[..., None]).squeeze(-1), mask)


def _brute_min_p(z, kappa, mode):
    p = torch.softmax(z, -1)
    thr = kappa * p.amax(-1, keepdim=True) if mode == "minp" else torch.full_like(p[..., :1], kappa)
    keep = p >= thr
    proxy = torch.where(keep, p, torch.zeros_like(p))
    proxy = proxy / proxy.sum(-1, keepdim=True)
    return keep, proxy


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("mode,kappa", [("minp", 0.02), ("minp", 0.3), ("fixed", 0.02), ("fixed", 0.08)])
def test_min_p_proxy(chunk, mode, kappa):
    hidden, W, b, _, mask = _setup(seed=1)
    z = _full_logits(hidden, W, b).detach().double()
    keep, proxy = _brute_min_p(z, kappa, mode)
    assert keep.any(-1).all()  # thresholds are such that K is never empty here
    m = mask.bool()
    s = _stats(hidden, W, b, mask, chunk)
    logp = torch.log_softmax(z, -1)
    n_in = n_out = 0
    # Evaluate the proxy at every vocabulary entry by using it as the label.
    proxy_lp = torch.stack([s.min_p_logprob(torch.full((B, C), v), kappa, mode) for v in range(V)], -1)  # (B,C,V)
    assert torch.all(proxy_lp[~m] == 0)
    for bi, ti in m.nonzero().tolist():
        k = keep[bi, ti]
        # in K: matches brute force, proxy >= plain log-prob; outside K: sentinel
        torch.testing.assert_close(proxy_lp[bi, ti][k].double(), proxy[bi, ti][k].log(), atol=1e-5, rtol=1e-5)
        assert torch.all(proxy_lp[bi, ti][k].double() >= logp[bi, ti][k] - 1e-6)
        assert torch.all(proxy_lp[bi, ti][~k] == OUT_OF_KEEP_SET)
        # proxy probabilities over K sum to one
        assert abs(proxy_lp[bi, ti][k].double().exp().sum().item() - 1.0) < 1e-5
        n_in += int(k.sum())
        n_out += int((~k).sum())
    assert n_in > 0 and n_out > 0  # both branches exercised


@pytest.mark.parametrize("kappa", [0.0, 1e-30])
def test_min_p_kappa_to_zero_is_log_softmax(kappa):
    hidden, W, b, labels, mask = _setup(seed=2)
    s = _stats(hidden, W, b, mask, 3)
    _close(s.min_p_logprob(labels, kappa, "minp"), s.label_logprob(labels), mask, atol=1e-6)
    _close(s.min_p_logprob(labels, kappa, "fixed"), s.label_logprob(labels), mask, atol=1e-6)


def test_min_p_sampled_labels_mixed():
    """With the sampled labels, tokens outside K get the sentinel and the rest match brute force."""
    hidden, W, b, labels, mask = _setup(seed=3)
    z = _full_logits(hidden, W, b).detach().double()
    keep, proxy = _brute_min_p(z, 0.3, "minp")
    out = _stats(hidden, W, b, mask, 2).min_p_logprob(labels, 0.3)
    lab_in = keep.gather(-1, labels[..., None]).squeeze(-1)
    want = torch.where(lab_in, proxy.gather(-1, labels[..., None]).squeeze(-1).log(), torch.tensor(OUT_OF_KEEP_SET))
    _close(out, want, mask)


def _brute_top_p_entropy(z, top_p, mode, k_max=None):
    """Loop-based brute force of the nucleus entropy on (B, C, V) logits; returns (B, C) and id sets."""
    H = torch.zeros(z.shape[:2], dtype=z.dtype)
    sets = {}
    for bi in range(z.shape[0]):
        for ti in range(z.shape[1]):
            p = torch.softmax(z[bi, ti], -1)
            order = torch.argsort(p, descending=True)
            if k_max is not None:
                order = order[:k_max]
            chosen, mass = [], 0.0
            for v in order.tolist():
                if mode == "cover" and mass >= top_p:
                    break
                if mode == "siren" and mass + p[v].item() >= top_p:
                    break
                chosen.append(v)
                mass += p[v].item()
            sets[bi, ti] = chosen
            if chosen:
                q = torch.softmax(z[bi, ti, chosen], -1)
                H[bi, ti] = -(q * q.log()).sum()
    return H, sets


# ("siren", 1.0) is left out: whether the last token's inclusive mass is "< 1" is decided by rounding.
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize(
    "mode,top_p", [("cover", 0.3), ("cover", 0.8), ("cover", 1.0), ("siren", 0.3), ("siren", 0.8), ("siren", 0.95)]
)
def test_top_p_entropy(chunk, mode, top_p):
    hidden, W, b, _, mask = _setup(seed=4)
    z = _full_logits(hidden, W, b).detach().double()
    want, sets = _brute_top_p_entropy(z, top_p, mode)
    s = _stats(hidden, W, b, mask, chunk)
    _close(s.top_p_entropy(top_p, mode=mode), want, mask)
    _close(s.top_p_entropy(top_p, k_max=V, mode=mode), want, mask)
    if top_p == 1.0 and mode == "cover":  # whole vocabulary: the ordinary entropy
        _close(s.top_p_entropy(top_p), s.entropy(), mask)
    ids = s.nucleus_ids(top_p, k_max=V + 3, mode=mode)
    assert ids.shape == (int(mask.sum()), V)  # at most V candidates, whatever k_max
    for row, (bi, ti) in zip(ids, mask.bool().nonzero().tolist()):
        got = [v for v in row.tolist() if v >= 0]
        assert got == sets[bi, ti]
        assert torch.all(row[len(got) :] == -1)


def test_top_p_truncated_by_k_max():
    hidden, W, b, _, mask = _setup(seed=5)
    z = _full_logits(hidden, W, b).detach().double()
    want, _ = _brute_top_p_entropy(z, 0.99, "cover", k_max=4)
    s = _stats(hidden, W, b, mask, 3)
    _close(s.top_p_entropy(0.99, k_max=4), want, mask)
    assert s.nucleus_ids(0.99, 4).shape == (int(mask.sum()), 4)


def test_siren_empty_nucleus_is_zero():
    hidden, W, b, _, mask = _setup(seed=6)
    s = _stats(hidden, W, b, mask, 3)
    tiny = 1e-6  # below every max prob: SIREN's strict rule keeps nothing
    assert torch.all(s.top_p_entropy(tiny, mode="siren") == 0)
    assert torch.all(s.nucleus_ids(tiny, 5, mode="siren") == -1)
    h = hidden.clone().requires_grad_(True)
    s = _stats(h, W, b, mask, 3)
    H = s.top_p_entropy_with_grad(tiny, 5, mode="siren")
    assert torch.all(H == 0)
    H.sum().backward()
    assert torch.all(h.grad == 0) and torch.isfinite(W.grad).all() and torch.all(W.grad == 0)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("mode,top_p", [("cover", 0.7), ("siren", 0.7), ("cover", 1.0)])
def test_top_p_entropy_with_grad_matches_autograd(chunk, mode, top_p):
    hidden, W, b, _, mask = _setup(seed=7)
    m = mask.bool()
    coef = torch.randn(B, C, generator=torch.Generator().manual_seed(9))

    # brute force on the full logits
    h_ref = hidden.clone().requires_grad_(True)
    z = _full_logits(h_ref, W, b)
    _, sets = _brute_top_p_entropy(z.detach().double(), top_p, mode)
    keep = torch.zeros(B, C, V, dtype=torch.bool)
    for (bi, ti), chosen in sets.items():
        keep[bi, ti, chosen] = True
    zk = z.masked_fill(~keep, -math.inf)
    logq = torch.where(keep, zk - torch.logsumexp(zk, -1, keepdim=True), torch.zeros_like(zk))
    H_ref = -(logq.exp() * logq).sum(-1)
    H_ref = torch.where(m & keep.any(-1), H_ref, torch.zeros_like(H_ref))
    (H_ref * coef).sum().backward()
    g_h, g_W, g_b = h_ref.grad, W.grad.clone(), b.grad.clone()
    W.grad = None
    b.grad = None

    h = hidden.clone().requires_grad_(True)
    s = _stats(h, W, b, mask, chunk)
    H = s.top_p_entropy_with_grad(top_p, k_max=V, mode=mode)
    _close(H, H_ref.detach(), mask)
    _close(H.detach(), s.top_p_entropy(top_p, mode=mode), mask)
    (H * coef).sum().backward()
    torch.testing.assert_close(h.grad, g_h, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(W.grad, g_W, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(b.grad, g_b, atol=1e-5, rtol=1e-4)
    assert h.grad[:, : P - 1].abs().sum() == 0  # prompt hidden states get no gradient


def test_bf16_head_matches_float32():
    """A non-float32 head is cast tile by tile; results equal using the float32 copy of the same weights."""
    hidden, W, b, labels, mask = _setup(seed=8)
    W16 = W.detach().to(torch.bfloat16)
    kw = dict(logit_scale=SCALE, softcap=SOFTCAP, temperature=TEMP, chunk_size=4)
    s16 = HeadStats(hidden, C, mask, W16, b.detach(), vocab_tile=5, **kw)
    s32 = HeadStats(hidden, C, mask, W16.float(), b.detach(), **kw)
    _close(s16.label_logprob(labels), s32.label_logprob(labels), mask, atol=1e-6)
    _close(s16.top_p_entropy_with_grad(0.9, 8).detach(), s32.top_p_entropy(0.9, 8), mask)


def test_chunk_memory_does_not_scale_with_tokens():
    """The (rows, V) projection never sees more than chunk_size rows, however many tokens there are."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(V, D, generator=g)
    for n_seq, length in [(2, 5), (8, 40), (16, 100)]:
        hidden = torch.randn(n_seq, length + 1, D, generator=g)
        mask = torch.ones(n_seq, length)
        s = HeadStats(hidden, length, mask, W, chunk_size=7)
        s.logsumexp()
        s.min_p_logprob(torch.zeros(n_seq, length, dtype=torch.long), 0.1)
        s.top_p_entropy(0.9)
        assert s.max_rows_projected == min(7, n_seq * length)
        assert s.num_projections == 3 * math.ceil(n_seq * length / 7)


def test_projection_input_is_bounded_via_monkeypatch(monkeypatch):
    """Independent of the debug counter: every float32 logits block HeadStats builds has <= chunk_size rows."""
    seen = []
    orig = HeadStats._project

    def spy(self, h):
        z = orig(self, h)
        seen.append(tuple(z.shape))
        return z

    monkeypatch.setattr(HeadStats, "_project", spy)
    hidden, W, b, labels, mask = _setup()
    _stats(hidden, W, b, mask, 2).label_logprob(labels)
    assert seen and all(r <= 2 and v == V for r, v in seen)
    assert sum(r for r, _ in seen) == int(mask.sum())


def test_empty_mask():
    hidden, W, b, labels, _ = _setup()
    mask = torch.zeros(B, C)
    s = _stats(hidden, W, b, mask, 3)
    assert torch.all(s.label_logprob(labels) == 0)
    assert torch.all(s.top_p_entropy(0.9) == 0)
    assert s.nucleus_ids(0.9, 4).shape == (0, 4)
    assert s.num_projections == 0


# ---------------------------------------------------------------------------------------------------------------------
# capture on a real (tiny) fused model
# ---------------------------------------------------------------------------------------------------------------------


def _tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).float().eval()
    return model


def _fused_batch(seed=0, p_len=5, c_len=7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (3, p_len + c_len), generator=g)
    attn = torch.ones_like(ids)
    attn[0, :2] = 0  # left-padded prompt
    attn[1, -3:] = 0  # right-padded completion
    attn[2, -1:] = 0
    labels = ids.masked_fill(attn == 0, -100)
    labels[:, :-c_len] = -100
    completion_mask = attn[:, -c_len:]
    return ids, attn, labels, completion_mask, c_len


def _check_capture(model, causal_lm, temperature=0.7):
    ids, attn, labels, cmask, C_ = _fused_batch()
    with capture_hidden_states(model) as cap:
        assert cap.hidden is None
        out = model(input_ids=ids, attention_mask=attn, labels=labels, fused_lm_head=True)
        model(input_ids=ids, attention_mask=attn, labels=labels, fused_lm_head=True)  # second call: ignored
    assert cap.num_calls == 2
    assert cap.hidden is not None and cap.hidden.shape == (3, ids.shape[1], 16)
    assert cap.hidden.requires_grad  # graph kept
    # hook removed on exit
    model(input_ids=ids, attention_mask=attn, labels=labels, fused_lm_head=True)
    assert cap.num_calls == 2

    s = HeadStats.from_model(model, cap.hidden, C_, cmask, temperature=temperature, chunk_size=4)
    fused_lp = out.log_probs[:, -C_:]
    fused_H = out.entropy[:, -C_:]
    m = cmask.bool()
    lp = s.label_logprob(ids[:, -C_:])
    torch.testing.assert_close(lp[m], fused_lp.detach()[m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s.entropy()[m], fused_H.detach()[m], atol=1e-5, rtol=1e-5)
    # the gradient variant reaches the model's parameters through the captured hidden states
    H = s.top_p_entropy_with_grad(0.9, 16)
    H.sum().backward()
    grads = [p.grad for n, p in causal_lm.named_parameters() if p.requires_grad and "layers" in n]
    assert any(gr is not None and gr.abs().sum() > 0 for gr in grads)


def test_capture_with_fused_lm_head():
    from trl.trainer.utils import add_fused_lm_head

    model = _tiny_llama()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    assert backbone_of(model) is model.model
    W, bias, scale, cap = lm_head_of(model)
    assert W is model.lm_head.weight and bias is None and scale == 1.0 and cap is None
    _check_capture(model, model)


def test_capture_through_peft_lora():
    from peft import LoraConfig, get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    base = _tiny_llama(seed=1)
    add_fused_lm_head(base, temperature=0.7, outputs=("log_probs", "entropy"))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    # make the adapter non-trivial so the test would notice a wrong (adapter-free) forward
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.5)
    assert backbone_of(model) is base.model
    assert lm_head_of(model)[0] is base.lm_head.weight
    _check_capture(model, base)
    # the captured states are the adapted ones: disabling the adapter changes them
    ids, attn, labels, _, _ = _fused_batch()
    with torch.no_grad():
        with capture_hidden_states(model) as on:
            model(input_ids=ids, attention_mask=attn, labels=labels, fused_lm_head=True)
        with model.disable_adapter(), capture_hidden_states(model) as off:
            model(input_ids=ids, attention_mask=attn, labels=labels, fused_lm_head=True)
    assert not torch.allclose(on.hidden, off.hidden)


def test_capture_through_module_wrapper():
    from trl.trainer.utils import add_fused_lm_head

    class Wrapper(torch.nn.Module):  # stands in for DDP / accelerate's `.module`
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *a, **k):
            return self.module(*a, **k)

    base = _tiny_llama(seed=2)
    add_fused_lm_head(base, temperature=0.7, outputs=("log_probs", "entropy"))
    _check_capture(Wrapper(base), base)


def test_logit_scale_and_softcap_read_like_trl():
    from transformers import LlamaConfig

    from trl_plugins.runtime.head_stats import _read_logit_scale_and_softcap

    cfg = LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=4)
    assert _read_logit_scale_and_softcap(cfg) == (1.0, None)
    cfg.logits_scaling = 4.0
    assert _read_logit_scale_and_softcap(cfg) == (0.25, None)
    cfg.lm_head_multiplier = 3.0
    assert _read_logit_scale_and_softcap(cfg)[0] == 3.0
    cfg.logit_scale = 0.5
    cfg.final_logit_softcapping = 30.0
    assert _read_logit_scale_and_softcap(cfg) == (0.5, 30.0)


def test_fused_softcap_and_scale_model_matches():
    """A model whose config sets logit_scale and final_logit_softcapping: HeadStats equals TRL's fused output."""
    from trl.trainer.utils import add_fused_lm_head

    model = _tiny_llama(seed=3)
    model.config.logit_scale = 2.5
    model.config.final_logit_softcapping = 3.0
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    assert lm_head_of(model)[2:] == (2.5, 3.0)
    ids, attn, labels, cmask, C_ = _fused_batch(seed=1)
    with torch.no_grad(), capture_hidden_states(model) as cap:
        out = model(input_ids=ids, attention_mask=attn, labels=labels, fused_lm_head=True)
    s = HeadStats.from_model(model, cap.hidden, C_, cmask, temperature=0.7, chunk_size=3)
    m = cmask.bool()
    torch.testing.assert_close(s.label_logprob(ids[:, -C_:])[m], out.log_probs[:, -C_:][m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s.entropy()[m], out.entropy[:, -C_:][m], atol=1e-5, rtol=1e-5)


class _TensorSizes(TorchDispatchMode):
    """Records (element count, dtype, shape) of every tensor any op returns, forward and backward."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.seen.append((t.numel(), t.dtype, tuple(t.shape)))
        return out


@pytest.mark.parametrize(  # k_max >= V: the whole vocabulary is a candidate
    "mode,top_p,k_max", [("cover", 0.99, None), ("siren", 0.99, 10_000), ("cover", 1.0, 10_000)]
)
def test_top_p_entropy_with_grad_memory_never_reaches_tokens_times_vocabulary(k_max, mode, top_p):
    """Forward and backward of the gradient path, with nuclei spanning most of the vocabulary: no tensor is larger
    than one (chunk_size, V) block, and a bfloat16 head is never copied whole to float32."""
    g = torch.Generator().manual_seed(0)
    n_seq, length, d, vocab, chunk = 2, 32, 8, 1000, 8
    hidden = torch.randn(n_seq, length + 1, d, generator=g).requires_grad_(True)
    W = (0.01 * torch.randn(vocab, d, generator=g)).to(torch.bfloat16)  # near-flat: wide nuclei
    s = HeadStats(hidden, length, torch.ones(n_seq, length), W, chunk_size=chunk, vocab_tile=256)
    with _TensorSizes() as probe:
        H = s.top_p_entropy_with_grad(top_p, k_max, mode=mode)
        H.sum().backward()
    assert hidden.grad.abs().sum() > 0
    largest = max(n for n, _, _ in probe.seen)
    assert largest <= chunk * vocab < n_seq * length * vocab
    assert not [shape for _, dtype, shape in probe.seen if dtype == torch.float32 and shape == (vocab, d)]


def test_bf16_head_gradients_match_float32_copy():
    """The backward casts a bfloat16 head tile by tile; the gradients equal those of its float32 copy."""
    hidden, W, b, _, mask = _setup(seed=3)
    W16 = W.detach().to(torch.bfloat16)
    grads = []
    for weight, tile in [(W16.clone(), 5), (W16.float(), 8192)]:
        h = hidden.clone().requires_grad_(True)
        weight.requires_grad_(True)
        bias = b.detach().clone().requires_grad_(True)
        s = HeadStats(h, C, mask, weight, bias, logit_scale=SCALE, softcap=SOFTCAP, temperature=TEMP, chunk_size=4,
                      vocab_tile=tile)
        (s.top_p_entropy_with_grad(0.8, None) * torch.arange(B * C).view(B, C)).sum().backward()
        grads.append((h.grad, weight.grad.float(), bias.grad))
    for got, ref in zip(*grads):
        torch.testing.assert_close(got, ref, atol=1e-2, rtol=1e-2)
    assert grads[0][0].abs().sum() > 0
