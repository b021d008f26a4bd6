"""The loss stage: the shaped off-policy branch, how plugin contributions compose, and how off-policy tokens are
kept out of TRL's vLLM importance-sampling correction and off-policy sequence mask."""

import pytest
import torch
from trl import GRPOTrainer

from trl_plugins import Plugin, hookimpl
from trl_plugins.runtime import loss_rules as rules
from trl_plugins.runtime.loss_rules import shaped_offpolicy_loss
from trl_plugins.testing import (
    assert_runs_equal,
    digit_fraction_reward,
    make_loss_context,
    make_tiny_trainer,
    record_run,
    temporary_plugin,
    tiny_tokenizer,
)

GAMMA = 0.3


# ---------------------------------------------------------------------------------------------- the formula


def test_shaped_offpolicy_loss_value_and_gradient():
    g = torch.Generator().manual_seed(0)
    logps = (-3 * torch.rand(4, 5, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(4, 1, generator=g, dtype=torch.float64)
    loss = shaped_offpolicy_loss(logps, adv, GAMMA)
    p = logps.detach().exp()
    torch.testing.assert_close(loss, -adv * p / (p + GAMMA))
    (grad,) = torch.autograd.grad(loss.sum(), logps)
    torch.testing.assert_close(grad, -adv * GAMMA * p / (p + GAMMA) ** 2)


def test_shaped_offpolicy_loss_token_advantages_and_gradcheck():
    g = torch.Generator().manual_seed(1)
    logps = (-2 * torch.rand(3, 4, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(3, 4, generator=g, dtype=torch.float64)
    assert shaped_offpolicy_loss(logps, adv, 0.1).shape == (3, 4)
    assert torch.autograd.gradcheck(lambda x: shaped_offpolicy_loss(x, adv, 0.1), (logps,))
    # f(p) = p / (p + gamma) is bounded by 1: the loss never exceeds |A| in magnitude
    assert (shaped_offpolicy_loss(torch.zeros(3, 4, dtype=torch.float64), adv, 0.1).abs() <= adv.abs()).all()


# ---------------------------------------------------------------------------------------------- test plugins


class MarkOffpolicy(Plugin):
    """Splices a foreign tail (off-policy) onto rows with an even global index, from half-way."""

    name = "test_mark_offpolicy"
    tail = tiny_tokenizer()("Answer: 7", add_special_tokens=False)["input_ids"]

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        for i in range(len(ctx)):
            if ctx.global_index[i] % 2 == 0:
                n = len(ctx.completion_ids[i])
                start = max(1, n // 2)
                ctx.splice(i, start, self.tail[: max(1, n - start)])


class TokenExactOnPolicySplice(Plugin):
    """Splices a row's own tokens back in, flagged on-policy: an all-zero off-policy mask."""

    name = "test_onpolicy_splice"

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        for i in range(len(ctx)):
            if ctx.global_index[i] % 2 == 0:
                ctx.splice(i, 3, ctx.completion_ids[i][3:], offpolicy=False)


class ProbeA(Plugin):
    """Loss-stage probe: records the context, then runs ``ProbeA.action`` / ``ProbeA.adv_action`` if set."""

    name = "test_probe_a"
    action = None
    adv_action = None
    seen: list = []

    @hookimpl
    def trl_plugins_loss_advantages(self, ctx):
        if ProbeA.adv_action is not None:
            ProbeA.adv_action(ctx)

    @hookimpl
    def trl_plugins_loss(self, ctx):
        ProbeA.seen.append(ctx)
        if ProbeA.action is not None:
            ProbeA.action(ctx)


class ProbeB(Plugin):
    """A second loss plugin, allowed to replace the surrogate."""

    name = "test_probe_b"
    replaces_surrogate = True
    action = None

    @hookimpl
    def trl_plugins_loss(self, ctx):
        if ProbeB.action is not None:
            ProbeB.action(ctx)


@pytest.fixture(autouse=True)
def _reset_probes():
    ProbeA.action = ProbeA.adv_action = ProbeB.action = None
    ProbeA.seen = []
    yield
    ProbeA.action = ProbeA.adv_action = ProbeB.action = None
    ProbeA.seen = []


def _aggregate(trainer, per_token_loss, mask, inputs, loss_type=None):
    """The framework's aggregation of ``per_token_loss`` as the trainer's loss path applies it to ``inputs``."""
    loss, _ = rules.aggregate(
        loss_type or trainer.loss_type, per_token_loss, mask, num_items_in_batch=inputs["num_items_in_batch"],
        max_completion_length=trainer.max_completion_length,
        gradient_accumulation_steps=trainer.current_gradient_accumulation_steps,
        steps_per_generation=trainer.args.steps_per_generation,
    )
    return loss


# ---------------------------------------------------------------------------------------------- through a trainer


@pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo"])
def test_offpolicy_tokens_take_shaped_branch_in_training(loss_type):
    grads = []
    ProbeA.action = lambda ctx: ctx.per_token_logps.register_hook(lambda g: grads.append(g.detach().clone()))
    with temporary_plugin(MarkOffpolicy), temporary_plugin(ProbeA):
        trainer = make_tiny_trainer(
            plugins=["test_mark_offpolicy", "test_probe_a"], reward_funcs=[digit_fraction_reward], max_steps=1,
            loss_type=loss_type, offpolicy_shaping_gamma=GAMMA, log_level="error",
        )
        captured = []
        original = trainer.compute_loss

        def compute_loss(model, inputs, *args, **kwargs):
            loss = original(model, inputs, *args, **kwargs)
            input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            with torch.no_grad():  # the same parameters: the optimizer has not stepped yet
                logps, _, _ = trainer._get_per_token_logps_and_entropies(
                    model, input_ids, attention, inputs["completion_ids"].size(1)
                )
            captured.append((inputs, loss.detach(), logps))
            return loss

        trainer.compute_loss = compute_loss
        trainer.train()

    assert len(captured) == 1 and len(ProbeA.seen) == 1 and len(grads) == 1
    inputs, loss, logps = captured[0]
    ctx = ProbeA.seen[0]
    off = inputs["offpolicy_mask"].bool()
    mask = inputs["completion_mask"].float()
    assert (off & mask.bool()).any() and (~off & mask.bool()).any(), "need both kinds of tokens"
    assert torch.equal(ctx.offpolicy_mask, off)
    A = inputs["advantages"].unsqueeze(1).expand_as(logps)
    assert A.abs().sum() > 0

    # the per-token surrogate the loss stage built: the framework's shaped branch on off-policy tokens, TRL's clipped
    # surrogate elsewhere (the kit builds both from the same rules; here the trainer must feed them its tensors)
    kit = dict(old_per_token_logps=inputs.get("old_per_token_logps", logps), advantages=inputs["advantages"],
               mask=mask, loss_type=loss_type, epsilon_low=trainer.epsilon_low, epsilon_high=trainer.epsilon_high)
    shaped = make_loss_context(logps, offpolicy_mask=off, offpolicy_gamma=GAMMA, **kit)
    torch.testing.assert_close(ctx.per_token_loss.detach(), shaped.per_token_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ctx.per_token_loss.detach()[off], rules.shaped_offpolicy_loss(logps, A, GAMMA)[off],
                               atol=1e-6, rtol=1e-5)
    clipped = make_loss_context(logps, **kit)
    assert not torch.allclose(clipped.per_token_loss.expand_as(logps)[off], shaped.per_token_loss[off])
    # the micro-batch loss, recomputed from the recorded micro-batch
    torch.testing.assert_close(loss, _aggregate(trainer, shaped.per_token_loss, mask, inputs), atol=1e-6, rtol=1e-5)

    # gradient w.r.t. log pi: on the first pass (ratio 1) -A per loss token on policy tokens and LUFFY's
    # -A gamma p/(p+gamma)^2 on off-policy tokens, both times the same normaliser of the loss type
    p = logps.exp()
    valid = mask.bool()
    normaliser = grads[0][valid & ~off] / -A[valid & ~off]
    assert torch.allclose(normaliser, normaliser[0].expand_as(normaliser), rtol=1e-5) and normaliser[0] > 0
    luffy = -A * GAMMA * p / (p + GAMMA) ** 2
    torch.testing.assert_close(grads[0][valid & off], normaliser[0] * luffy[valid & off], atol=1e-7, rtol=1e-4)
    assert torch.count_nonzero(grads[0][~valid]) == 0


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_all_zero_offpolicy_mask_is_vanilla(loss_type):
    run = dict(reward_funcs=[digit_fraction_reward], max_steps=2, loss_type=loss_type, log_level="error")
    vanilla = record_run(make_tiny_trainer(GRPOTrainer, **run))
    with temporary_plugin(TokenExactOnPolicySplice):
        trainer = make_tiny_trainer(plugins=["test_onpolicy_splice"], **run)
        assert trainer._uses_plugin_loss
        ours = record_run(trainer)
    assert any(a.abs().sum() > 0 for a in vanilla.advantages)
    assert_runs_equal(vanilla, ours)
    assert all(log.get("plugins/framework/offpolicy_token_fraction", 0.0) == 0.0 for log in ours.logs)


# ---------------------------------------------------------------------------------------------- composition (unit)


@pytest.fixture(scope="module")
def loss_setup():
    """A trainer with an off-policy-marking sampler and two probe loss plugins, and one recorded micro-batch."""
    with temporary_plugin(MarkOffpolicy), temporary_plugin(ProbeA), temporary_plugin(ProbeB):
        trainer = make_tiny_trainer(
            plugins=["test_mark_offpolicy", "test_probe_a", "test_probe_b"], reward_funcs=[digit_fraction_reward],
            max_steps=1, loss_type="bnpo", offpolicy_shaping_gamma=GAMMA, log_level="error",
        )
        captured = []
        original = trainer.compute_loss

        def compute_loss(model, inputs, *args, **kwargs):
            captured.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()})
            return original(model, inputs, *args, **kwargs)

        trainer.compute_loss = compute_loss
        trainer.train()
        trainer.compute_loss = original
        yield trainer, captured[0]


def _loss(trainer, inputs, backward=False):
    """One call of the loss stage; returns (loss, gradients by parameter name or None, ProbeA's context)."""
    ProbeA.seen = []
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    grads = None
    if backward:
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        trainer.model.zero_grad(set_to_none=True)
    return loss.detach(), grads, ProbeA.seen[-1]


def test_setup_has_signal(loss_setup):
    trainer, inputs = loss_setup
    assert inputs["advantages"].abs().sum() > 0
    assert inputs["offpolicy_mask"].any() and not inputs["offpolicy_mask"].all()
    loss, grads, _ = _loss(trainer, inputs, backward=True)
    assert any(g.abs().sum() > 0 for g in grads.values())


def test_scale_tokens_zero_gives_zero_policy_gradient(loss_setup):
    trainer, inputs = loss_setup
    ProbeA.action = lambda ctx: ctx.scale_tokens(torch.zeros_like(ctx.per_token_loss))
    loss, grads, _ = _loss(trainer, inputs, backward=True)
    assert loss.item() == 0.0
    assert grads and all(torch.count_nonzero(g) == 0 for g in grads.values())


def test_scale_tokens_of_two_plugins_multiply(loss_setup):
    trainer, inputs = loss_setup
    base, _, _ = _loss(trainer, inputs)
    ProbeA.action = lambda ctx: ctx.scale_tokens(torch.full_like(ctx.per_token_loss, 2.0))
    ProbeB.action = lambda ctx: ctx.scale_tokens(torch.full_like(ctx.per_token_loss[:, :1], 3.0))  # broadcast
    loss, _, _ = _loss(trainer, inputs)
    torch.testing.assert_close(loss, 6.0 * base)


def test_add_loss_shifts_by_constant_and_keeps_gradients(loss_setup):
    trainer, inputs = loss_setup
    base, base_grads, _ = _loss(trainer, inputs, backward=True)
    ProbeA.action = lambda ctx: ctx.add_loss(torch.tensor(1.25))
    loss, grads, _ = _loss(trainer, inputs, backward=True)
    torch.testing.assert_close(loss, base + 1.25)
    for name, g in base_grads.items():
        torch.testing.assert_close(grads[name], g)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_add_token_loss_aggregates_like_loss_type(loss_setup, loss_type, monkeypatch):
    trainer, inputs = loss_setup
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    mask = inputs["completion_mask"].float()
    term = torch.arange(mask.numel(), dtype=torch.float32).view_as(mask) / mask.numel()
    base, _, _ = _loss(trainer, inputs)
    ProbeA.action = lambda ctx: ctx.add_token_loss(term)
    loss, _, _ = _loss(trainer, inputs)
    torch.testing.assert_close(loss - base, _aggregate(trainer, term, mask, inputs), atol=1e-6, rtol=1e-5)


def test_additive_terms_are_not_scaled_by_token_weights(loss_setup):
    trainer, inputs = loss_setup
    ProbeA.action = lambda ctx: (ctx.scale_tokens(torch.zeros_like(ctx.per_token_loss)), ctx.add_loss(torch.tensor(0.5)))
    ProbeB.action = lambda ctx: ctx.add_token_loss(torch.ones_like(ctx.per_token_loss))
    loss, _, _ = _loss(trainer, inputs)
    torch.testing.assert_close(loss, torch.tensor(1.5))  # bnpo mean of ones (1.0) + scalar 0.5


def test_replace_tokens_then_weights_multiply(loss_setup):
    trainer, inputs = loss_setup
    base, _, ctx = _loss(trainer, inputs)
    base_tokens = ctx.per_token_loss.detach()
    mask = inputs["completion_mask"].float()
    replace = torch.zeros_like(mask, dtype=torch.bool)
    replace[:, 1::3] = True
    values = torch.full_like(mask, 0.7)
    ProbeB.action = lambda c: c.replace_tokens(replace, values)
    loss, _, _ = _loss(trainer, inputs)
    replaced = base_tokens.clone()
    replaced[replace] = 0.7
    expected = _aggregate(trainer, replaced, mask, inputs)
    torch.testing.assert_close(loss, expected)
    ProbeA.action = lambda c: c.scale_tokens(torch.full_like(c.per_token_loss, 0.5))
    loss, _, _ = _loss(trainer, inputs)
    torch.testing.assert_close(loss, 0.5 * expected)


def test_loss_advantages_hook_feeds_surrogate_and_shaped_branch(loss_setup):
    trainer, inputs = loss_setup
    base, _, base_ctx = _loss(trainer, inputs)

    def negate(ctx):
        assert ctx.advantages.shape == ctx.per_token_logps.shape  # expanded to (B, T) for the hook
        ctx.advantages = -ctx.advantages

    ProbeA.adv_action = negate
    loss, _, ctx = _loss(trainer, inputs)
    # ratio is exactly 1 on the first pass: both branches are linear in A
    torch.testing.assert_close(ctx.per_token_loss.detach(), -base_ctx.per_token_loss.detach())
    torch.testing.assert_close(loss, -base)


def test_scale_clip_range_gives_each_token_its_own_clip_range(loss_setup):
    trainer, inputs = loss_setup
    _, _, base_ctx = _loss(trainer, inputs)
    g = torch.Generator().manual_seed(3)
    old = base_ctx.per_token_logps.detach() + 0.6 * (torch.rand(base_ctx.per_token_logps.shape, generator=g) - 0.5)
    batch = dict(inputs, old_per_token_logps=old)  # ratios in about (0.74, 1.35): TRL's 0.2 range clips some
    _, _, vanilla = _loss(trainer, batch)
    scale = torch.ones_like(old)
    scale[:, ::2] = 2.0  # widened on even positions ...
    scale[:, 1::4] = 0.5  # ... narrowed on some odd ones
    ProbeA.adv_action = lambda ctx: ctx.scale_clip_range(scale)
    _, _, ctx = _loss(trainer, batch)
    torch.testing.assert_close(ctx.clip_scale, scale)
    ratio, adv = ctx.coef_1.detach(), ctx.advantages.detach()
    clipped = torch.clamp(ratio, 1 - trainer.epsilon_low * scale, 1 + trainer.epsilon_high * scale)
    expected = -torch.min(ratio * adv, clipped * adv)
    on = ~inputs["offpolicy_mask"].bool() & inputs["completion_mask"].bool()
    torch.testing.assert_close(ctx.per_token_loss.detach()[on], expected[on])
    off = inputs["offpolicy_mask"].bool()
    torch.testing.assert_close(ctx.per_token_loss.detach()[off], vanilla.per_token_loss.detach()[off])  # shaped
    assert not torch.allclose(ctx.per_token_loss.detach()[on], vanilla.per_token_loss.detach()[on])


def test_scale_clip_range_after_the_surrogate_is_refused(loss_setup):
    from trl_plugins import PluginError

    trainer, inputs = loss_setup
    ProbeA.action = lambda ctx: ctx.scale_clip_range(torch.ones_like(ctx.per_token_logps))
    with pytest.raises(PluginError, match="after the surrogate was built"):
        _loss(trainer, inputs)


def test_vllm_is_ratio_is_one_on_offpolicy_tokens(loss_setup, monkeypatch):
    trainer, inputs = loss_setup
    _, _, ctx = _loss(trainer, inputs)
    tokens = ctx.per_token_loss.detach()
    off = inputs["offpolicy_mask"].bool()
    mask = inputs["completion_mask"].float()
    monkeypatch.setattr(trainer, "use_vllm", True)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_correction", True)
    for is_ratio in (torch.full_like(mask, 0.25), torch.full((mask.size(0), 1), 0.25)):  # token / sequence modes
        batch = dict(inputs, importance_sampling_ratio=is_ratio)
        loss, _, _ = _loss(trainer, batch)
        expected = _aggregate(trainer, tokens * torch.where(off, 1.0, 0.25), mask, inputs)
        torch.testing.assert_close(loss, expected)
    # without off-policy tokens the ratio applies everywhere (TRL's behaviour)
    batch = dict(inputs, importance_sampling_ratio=torch.full_like(mask, 0.25))
    batch["offpolicy_mask"] = torch.zeros_like(off)
    loss, _, ctx2 = _loss(trainer, batch)
    torch.testing.assert_close(loss, 0.25 * _aggregate(trainer, ctx2.per_token_loss.detach(), mask, inputs))


def test_trl_off_policy_mask_is_one_on_offpolicy_tokens(loss_setup, monkeypatch):
    trainer, inputs = loss_setup
    # negative advantages and a threshold no sequence meets: TRL's off-policy sequence mask drops every row
    batch = dict(inputs, advantages=-(inputs["advantages"].abs() + 0.1))
    monkeypatch.setattr(trainer, "off_policy_mask_threshold", -1.0)
    loss, _, ctx = _loss(trainer, batch)
    off = batch["offpolicy_mask"].bool()
    mask = batch["completion_mask"].float()
    tokens = ctx.per_token_loss.detach()
    expected = _aggregate(trainer, tokens * off, mask, inputs)
    assert expected.abs() > 0
    torch.testing.assert_close(loss, expected)
    # with no off-policy tokens the whole micro-batch is masked
    batch["offpolicy_mask"] = torch.zeros_like(off)
    loss, _, _ = _loss(trainer, batch)
    assert loss.item() == 0.0


# ---------------------------------------------------------------------------------------------- TRL's metrics


CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                "clip_ratio/high_max")


@pytest.fixture(scope="module")
def sequence_setup(loss_batch):
    """A trainer at sequence-level importance sampling whose stack has a ``trl_plugins_loss_advantages`` hook, and
    a batch where row 0 is clipped high, row 3 clipped low, rows 1-2 inside the range (rows of unequal lengths)."""
    with temporary_plugin(ProbeA):
        trainer = make_tiny_trainer(plugins=["test_probe_a"], reward_funcs=[digit_fraction_reward],
                                    importance_sampling_level="sequence", log_level="error")
        inputs = loss_batch(trainer)
        inputs["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])
        yield trainer, inputs


def _loss_and_clip_metrics(trainer, compute_loss, inputs):
    trainer._metrics["train"].clear()
    loss = compute_loss(trainer, trainer.model, inputs)
    return loss.detach(), {key: trainer._metrics["train"][key] for key in CLIP_METRICS}


@pytest.mark.parametrize("loss_type", ["grpo", "luspo"])
def test_sequence_level_clip_ratios_stay_per_sequence_with_loss_advantage_hooks(sequence_setup, loss_type,
                                                                                 monkeypatch):
    """TRL logs one clip indicator per sequence at sequence-level IS; expanding the advantages to (B, T) for the
    hooks must not turn the clip ratios into token-weighted means (nor change the loss)."""
    trainer, inputs = sequence_setup
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    trl_loss, trl_metrics = _loss_and_clip_metrics(trainer, GRPOTrainer._compute_loss, inputs)
    assert trl_metrics["clip_ratio/low_mean"] == [0.25] and trl_metrics["clip_ratio/high_mean"] == [0.25]

    # the hook keeps the advantages per row: TRL's loss and metrics, exactly
    loss, metrics = _loss_and_clip_metrics(trainer, type(trainer)._compute_loss, inputs)
    assert ProbeA.seen[-1].advantages.shape == (4, inputs["completion_ids"].size(1))  # the hook saw (B, T)
    assert torch.equal(loss, trl_loss)
    assert metrics == trl_metrics

    # token advantages scaled by positive per-token factors: each sequence is still clipped or not as a whole
    def scale_per_token(ctx):
        ctx.advantages = ctx.advantages * torch.linspace(0.5, 2.0, ctx.advantages.size(1))

    ProbeA.adv_action = scale_per_token
    loss, metrics = _loss_and_clip_metrics(trainer, type(trainer)._compute_loss, inputs)
    assert not torch.equal(loss, trl_loss)
    assert metrics == trl_metrics
