"""rlpr: reference-answer probability reward and std filtering of low-variance groups.

The reward is checked exactly against a direct forward of the tiny policy; the filter on a hand-built
AdvantageContext; the neutral setting (weight 0, no filter) reproduces trl.GRPOTrainer; a short run trains."""

import math
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.testing import (
    build_stack,
    digit_fraction_reward,
    make_advantage_context,
    make_refill_context,
    make_tiny_trainer,
    record_run,
    run_hook,
)
from trl_plugins.api.model_utils import prompt_completion_batch
from trl_plugins_builtin.rlpr import (
    StdThresholdSchedule,
    debiased_reward,
    ema_update,
    group_std,
    mean_token_probability,
    split_reasoning,
)

MARKER = r"(?i)answer\s*:"


def test_pure_functions():
    assert split_reasoning("1+2=3\nAnswer: 5\nAnswer: 6", MARKER, "\nAnswer:") == "1+2=3\nAnswer:"
    assert split_reasoning("1+2=3", MARKER, "\nAnswer:") == "1+2=3\nAnswer:"
    logps = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.2, 0.9, 0.9]]))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert mean_token_probability(logps, mask).tolist() == pytest.approx([0.375, 0.2])
    assert debiased_reward(torch.tensor([0.5, 0.2, 0.9]), torch.tensor([0.3, 0.4, -0.5])).tolist() == pytest.approx(
        [0.2, 0.0, 1.0]
    )
    std = group_std(torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0, float("nan")]), 2)
    assert std.tolist() == pytest.approx([math.sqrt(2), 0.0, 0.0])  # unbiased; a lone value has std 0
    assert ema_update(None, 0.4, 0.9) == 0.4
    assert ema_update(0.4, 0.2, 0.9) == pytest.approx(0.38)
    # the layout of the policy forward behind ctx.policy_logprobs (the framework's, which rlpr uses)
    ids, att, A = prompt_completion_batch([[1, 2, 3], [4]], [[7], [8, 9]], pad_id=0)
    assert A == 2
    assert ids.tolist() == [[1, 2, 3, 7, 0], [0, 0, 4, 8, 9]]
    assert att.tolist() == [[1, 1, 1, 1, 0], [0, 0, 1, 1, 1]]


def _manual_mean_prob(model, ids, n_answer):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    targets = torch.tensor(ids[1:])
    token_lp = logp.gather(1, targets.unsqueeze(1)).squeeze(1)[-n_answer:]
    return token_lp.exp().mean().item()


@pytest.mark.parametrize("debias", [True, False])
def test_reward_is_the_mean_probability_of_the_reference_after_the_reasoning(tmp_path, debias):
    trainer = make_tiny_trainer(plugins=["rlpr"], plugin_config={"rlpr": {"debias": debias}},
                                reward_funcs=[digit_fraction_reward], output_dir=str(tmp_path), log_level="error")
    func = trainer.reward_funcs[-1]
    assert func.__name__ == "rlpr"
    prompt = [{"role": "user", "content": "Compute 4+5 step by step (left to right)."}]
    completions = [[{"role": "assistant", "content": "4+5=9\nAnswer: 9"}],
                   [{"role": "assistant", "content": "4+5=8\nAnswer: 8"}],
                   [{"role": "assistant", "content": "4+5=9 ok"}]]  # no marker: "\nAnswer:" is appended
    rewards = func(prompts=[prompt] * 3, completions=completions, completion_ids=[[1]] * 3, answer=["9"] * 3)
    tok = trainer.processing_class
    p_ids = trainer.generation_service.tokenize([prompt])[0]
    enc = lambda s: tok(text=s, add_special_tokens=False)["input_ids"]  # noqa: E731
    target = enc(" 9")
    base = _manual_mean_prob(trainer.model, p_ids + enc("\nAnswer:") + target, len(target))
    for reasoning, got in zip(["4+5=9\nAnswer:", "4+5=8\nAnswer:", "4+5=9 ok\nAnswer:"], rewards):
        r = _manual_mean_prob(trainer.model, p_ids + enc(reasoning) + target, len(target))
        expected = min(max(r - base, 0.0), 1.0) if debias else r
        assert got == pytest.approx(expected, abs=1e-5)
    if not debias:
        assert len(set(round(r, 6) for r in rewards)) == 3 and all(0 < r < 1 for r in rewards)


def _adv_ctx(rlpr_rewards, G, advantages=None):
    N = len(rlpr_rewards)
    rpf = torch.stack([torch.zeros(N), torch.tensor(rlpr_rewards)], dim=1)
    ctx = make_advantage_context(rpf.sum(1), num_generations=G, rewards_per_func=rpf,
                                 advantages=advantages if advantages is not None else torch.ones(N),
                                 completion_lengths=torch.ones(N))
    ctx.set_active_plugin("rlpr")
    return ctx


#: the cheaper variant: filtered groups stay in the batch with zero advantages (the plugin's filter before 2026-11-27)
ZERO = {"filter_drop": "zero_advantage"}


def test_std_filter_fixed_threshold():
    plugin = build_plugins(["rlpr"], {"rlpr": {"std_threshold": 0.1, **ZERO}}).plugins[0]
    ctx = _adv_ctx([0.5, 0.52, 0.1, 0.9, 0.3, 0.3], G=2, advantages=torch.arange(6.0).unsqueeze(1).repeat(1, 3))
    plugin.trl_plugins_transform_advantages(ctx)
    # group stds: 0.0141, 0.566, 0 -> only group 1 is kept; (N, T) advantages are supported
    assert ctx.advantages[:, 0].tolist() == [0, 0, 2, 3, 0, 0]
    assert ctx.advantages.shape == (6, 3)
    assert ctx.metrics["plugins/rlpr/kept_group_fraction"] == [pytest.approx(1 / 3)]


PREVIOUS_FILTER = {"std_filter_beta": 1.0, "ema_start_step": 1, "filter_start_step": 1,
                   "threshold_uses_current_batch": True}  # the plugin's filter before the official recipe


def test_std_filter_ema_threshold_and_state():
    plugin = build_plugins(["rlpr"], {"rlpr": {"ema_decay": 0.5, **PREVIOUS_FILTER, **ZERO}}).plugins[0]
    ctx = _adv_ctx([0.0, 0.2, 0.0, 1.0], G=2)  # stds sqrt(.02)=0.1414, sqrt(.5)=0.7071 -> mean 0.4243
    plugin.trl_plugins_transform_advantages(ctx)
    first = (math.sqrt(0.02) + math.sqrt(0.5)) / 2
    assert plugin.schedule.ema == pytest.approx(first)
    assert ctx.advantages.tolist() == [0, 0, 1, 1]
    ctx = _adv_ctx([0.0, 0.0, 0.0, 0.3], G=2)  # stds 0, 0.2121 < threshold 0.5 * 0.4243 + 0.5 * 0.1061 = 0.2652
    plugin.trl_plugins_transform_advantages(ctx)
    assert plugin.schedule.ema == pytest.approx(0.5 * first + 0.5 * math.sqrt(0.045) / 2)
    assert ctx.advantages.tolist() == [0, 0, 0, 0]
    fresh = build_plugins(["rlpr"]).plugins[0]
    fresh.trl_plugins_load_state_dict(state=plugin.trl_plugins_state_dict())
    assert fresh.schedule.ema == plugin.schedule.ema


def test_options_and_conflicts_refused():
    with pytest.raises(PluginConfigError, match="answer_template"):
        build_plugins(["rlpr"], {"rlpr": {"answer_template": "no placeholder"}})
    with pytest.raises(PluginConfigError, match="answer_marker"):
        build_plugins(["rlpr"], {"rlpr": {"answer_marker": "("}})
    with pytest.raises(Exception, match="empo"):
        build_plugins(["rlpr", "empo"])


RUN = dict(reward_funcs=[digit_fraction_reward], max_steps=2, log_level="error")


def test_neutral_setting_is_vanilla(tmp_path):
    vanilla = record_run(make_tiny_trainer(GRPOTrainer, output_dir=str(tmp_path / "v"), **RUN))
    ours = record_run(make_tiny_trainer(plugins=["rlpr"],
                                        plugin_config={"rlpr": {"reward_weight": 0.0, "std_filter": False}},
                                        output_dir=str(tmp_path / "p"), **RUN))
    assert any(a.abs().sum() > 0 for a in vanilla.advantages)
    for x, y in zip(vanilla.completion_ids, ours.completion_ids):
        assert torch.equal(x, y)
    for x, y in zip(vanilla.rewards, ours.rewards):
        torch.testing.assert_close(x, y[:, :1], rtol=0, atol=0)
    for x, y in zip(vanilla.advantages, ours.advantages):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    torch.testing.assert_close(torch.tensor(vanilla.losses), torch.tensor(ours.losses), rtol=0, atol=0)
    for key in vanilla.params:
        torch.testing.assert_close(vanilla.params[key], ours.params[key], rtol=0, atol=0)


def test_end_to_end(tmp_path):
    trainer = make_tiny_trainer(plugins=["rlpr"], plugin_config={"rlpr": {"debias": False}},
                                output_dir=str(tmp_path), **RUN)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    assert all(r[:, 1].std() > 0 for r in run.rewards)  # the probability reward varies within the batch
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        assert log["rewards/rlpr/mean"] > 0
        assert "plugins/rlpr/kept_group_fraction" in log and "plugins/rlpr/std_threshold" in log
        assert "plugins/rlpr/answer_probability" in log


# ------------------------------------------------------------------------------------------ official recipe
def _filter_step(plugin, rlpr_rewards, G=2):
    """One advantage-stage call on a batch whose last reward column is ``rlpr_rewards``; returns the context."""
    rewards = torch.tensor(rlpr_rewards)
    ctx = make_advantage_context(rewards, num_generations=G, rewards_per_func=torch.stack([rewards * 0, rewards], 1),
                                 advantages=torch.ones(len(rlpr_rewards)))
    return run_hook(plugin, "trl_plugins_transform_advantages", ctx)


def test_official_std_filter_warms_up_then_filters_below_half_the_moving_average():
    stack = build_stack("rlpr", {"rlpr": ZERO})
    plugin = stack.plugins[0]
    def batch(s):  # group stds (0, s / 10 / sqrt(2)) (unbiased std of two values)
        return [0.5, 0.5, 0.0, s / 10]

    mean_std = [s / 10 / math.sqrt(2) / 2 for s in range(1, 13)]
    for s in range(1, 11):  # steps 1..10 never filter, whatever the stds
        ctx = _filter_step(stack, batch(s))
        assert ctx.advantages.tolist() == [1, 1, 1, 1]
        assert ctx.metrics["plugins/rlpr/std_threshold"] == [0.0]
    assert plugin.schedule.warmup_means == pytest.approx(mean_std[5:10])  # recorded from step 6
    ema = sum(mean_std[5:10]) / 5  # step 11: the average starts as the mean of steps 6..10
    ctx = _filter_step(stack, [0.0, 0.18, 0.0, 0.4])  # stds 0.127, 0.283 around 0.5 * ema = 0.141
    assert ctx.metrics["plugins/rlpr/std_threshold"] == [pytest.approx(0.5 * ema)]
    assert 0.18 / math.sqrt(2) < 0.5 * ema < 0.4 / math.sqrt(2)
    assert ctx.advantages.tolist() == [0, 0, 1, 1]
    # step 12 folds in step 11's mean (not its own batch) before filtering
    step11_mean = (0.18 / math.sqrt(2) + 0.4 / math.sqrt(2)) / 2
    ema = 0.99 * ema + 0.01 * step11_mean
    ctx = _filter_step(stack, [0.0, 10.0, 0.0, 10.0])
    assert ctx.metrics["plugins/rlpr/std_threshold"] == [pytest.approx(0.5 * ema)]
    assert ctx.advantages.tolist() == [1, 1, 1, 1]


def test_official_schedule_state_survives_a_resume_mid_warm_up():
    config = {"rlpr": {"ema_start_step": 2, "filter_start_step": 3, **ZERO}}
    a, b = build_stack("rlpr", config), build_stack("rlpr", config)
    batches = [[0.0, 0.1, 0.0, 0.3], [0.0, 0.4, 0.0, 0.2], [0.0, 0.25, 0.0, 0.05], [0.0, 0.3, 0.0, 0.3]]
    for i, values in enumerate(batches):
        if i == 2:  # b resumes from a's state after two steps
            b.plugins[0].trl_plugins_load_state_dict(state=a.plugins[0].trl_plugins_state_dict())
        got_a = _filter_step(a, values).advantages
        if i >= 2:
            assert torch.equal(_filter_step(b, values).advantages, got_a)
    assert b.plugins[0].schedule.ema == a.plugins[0].schedule.ema and b.plugins[0].schedule.step == 4


def _refill_round(stack, rlpr_rewards, G=2, **kwargs):
    rewards = torch.tensor(rlpr_rewards)
    ctx = make_refill_context(torch.stack([rewards * 0, rewards], 1), num_generations=G, **kwargs)
    return run_hook(stack, "trl_plugins_reject_groups", ctx)


def test_official_filter_rejects_and_refills_by_default():
    """The official trainer drops the groups below beta x EMA and generates new prompts (DPPR ray_trainer.py:1415,
    1605-1620): the same schedule as above, through the refill stage; nothing is zeroed at the advantage stage."""
    stack = build_stack("rlpr")
    plugin = stack.plugins[0]
    assert plugin.hook_enabled("trl_plugins_reject_groups")
    assert plugin.multi_turn_refusal() is not None  # refill: refused with tools

    def batch(s):
        return [0.5, 0.5, 0.0, s / 10]

    mean_std = [s / 10 / math.sqrt(2) / 2 for s in range(1, 13)]
    for s in range(1, 11):  # steps 1..10 never reject
        ctx = _refill_round(stack, batch(s))
        assert not ctx.rejected.any() and ctx.metrics["plugins/rlpr/std_threshold"] == [0.0]
        assert _filter_step(stack, batch(s)).advantages.tolist() == [1, 1, 1, 1]
    assert plugin.schedule.warmup_means == pytest.approx(mean_std[5:10])  # the final batches of steps 6..10
    ema = sum(mean_std[5:10]) / 5
    first = _refill_round(stack, [0.0, 0.18, 0.0, 0.4])  # stds 0.127, 0.283 around 0.5 * ema = 0.141
    assert first.metrics["plugins/rlpr/std_threshold"] == [pytest.approx(0.5 * ema)]
    assert first.rejected.tolist() == [True, False]
    # the refill round judges only the fresh group, with the same threshold: a flat refill group is rejected again
    second = _refill_round(stack, [0.3, 0.3, 0.0, 0.4], round=1, fresh=[True, False])
    assert second.rejected.tolist() == [True, False] and "plugins/rlpr/std_threshold" not in second.metrics
    third = _refill_round(stack, [0.0, 1.0, 0.0, 0.4], round=2, fresh=[True, False])
    assert not third.rejected.any()
    # the advantage stage zeroes nothing and records the mean over every group generated in step 11 (4 groups)
    assert _filter_step(stack, [0.0, 1.0, 0.0, 0.4]).advantages.tolist() == [1, 1, 1, 1]
    step11 = (0.18 + 0.4 + 0.0 + 1.0) / math.sqrt(2) / 4
    assert plugin.schedule.pending == pytest.approx(step11) and plugin.schedule.step == 11
    ema = 0.99 * ema + 0.01 * step11
    assert _refill_round(stack, [0.0, 10.0, 0.0, 10.0]).metrics["plugins/rlpr/std_threshold"] == \
        [pytest.approx(0.5 * ema)]


def test_filter_off_or_zero_advantage_does_not_refill():
    for options in ({"std_filter": False}, ZERO):
        plugin = build_plugins(["rlpr"], {"rlpr": options}).plugins[0]
        assert not plugin.hook_enabled("trl_plugins_reject_groups") and plugin.multi_turn_refusal() is None
    with pytest.raises(PluginConfigError, match="filter_drop"):
        build_plugins(["rlpr"], {"rlpr": {"filter_drop": "drop"}})


@pytest.mark.parametrize("engine, attributes", [
    ("FSDP", {"is_fsdp_enabled": True}),
    ("ZeRO-3", {"state": SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3))}),
])
def test_refill_is_refused_under_sharded_engines_with_several_processes(engine, attributes):
    """The refill stage scores regenerated rows only where they are; the rlpr reward's policy forward would then be a
    collective not every process joins."""
    from trl_plugins.testing import stub_trainer, tiny_config

    def trainer(processes, **extra):
        accelerator = SimpleNamespace(num_processes=processes, process_index=0, is_main_process=True,
                                      device=torch.device("cpu"), **{k: v for k, v in attributes.items() if k == "state"})
        fsdp = {k: v for k, v in attributes.items() if k != "state"}
        return stub_trainer(tiny_config("/tmp/rlpr-engine"), accelerator=accelerator, **fsdp, **extra)

    with pytest.raises(IncompatiblePluginsError, match=f"filter_drop='refill' is not supported under {engine}"):
        build_stack("rlpr", trainer=trainer(2))
    build_stack("rlpr", {"rlpr": ZERO}, trainer=trainer(2))  # no refill: accepted
    build_stack("rlpr", trainer=trainer(1))  # one process: accepted


def test_schedule_options_validated():
    with pytest.raises(PluginConfigError, match="ema_start_step=12 must not exceed filter_start_step=11"):
        build_plugins(["rlpr"], {"rlpr": {"ema_start_step": 12}})
    with pytest.raises(PluginConfigError, match="baseline"):
        build_plugins(["rlpr"], {"rlpr": {"baseline": "first"}})


@pytest.mark.parametrize("baseline", ["initial", "current"])
def test_debiasing_baseline_comes_from_the_initial_policy(tmp_path, baseline):
    trainer = make_tiny_trainer(plugins=["rlpr"], plugin_config={"rlpr": {"baseline": baseline}},
                                reward_funcs=[digit_fraction_reward], output_dir=str(tmp_path), log_level="error")
    trainer.model.train()
    plugin = trainer.plugin_stack.plugins[0]
    func = trainer.reward_funcs[-1]
    tok = trainer.processing_class
    enc = lambda s: tok(text=s, add_special_tokens=False)["input_ids"]  # noqa: E731
    row = trainer.train_dataset[0]
    p_ids = trainer.generation_service.tokenize([row["prompt"]])[0]
    target = enc(f" {row['answer']}")
    completion = [[{"role": "assistant", "content": "thinking\nAnswer: 1"}]]

    def reward(model):
        r = _manual_mean_prob(model, p_ids + enc("thinking\nAnswer:") + target, len(target))
        return r, _manual_mean_prob(model, p_ids + enc("\nAnswer:") + target, len(target))

    got = func(prompts=[row["prompt"]], completions=completion, completion_ids=[[1]], answer=[row["answer"]])
    r, r0_initial = reward(trainer.model)
    assert got[0] == pytest.approx(min(max(r - r0_initial, 0.0), 1.0), abs=1e-5)
    if baseline == "initial":  # the first call scanned the whole training dataset with the initial policy
        assert len(plugin.baselines) == len({(p, a) for p, a in zip(map(str, trainer.train_dataset["prompt"]),
                                                                     trainer.train_dataset["answer"])})
        resumed = build_plugins(["rlpr"]).plugins[0]  # a checkpoint keeps them (no second scan on resume)
        resumed.trl_plugins_load_state_dict(state=plugin.trl_plugins_state_dict())
        assert resumed.baselines == plugin.baselines and resumed.dataset_scanned
    with torch.no_grad():  # the policy moves on
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    got = func(prompts=[row["prompt"]], completions=completion, completion_ids=[[1]], answer=[row["answer"]])
    r_now, r0_now = reward(trainer.model)
    assert abs(r0_now - r0_initial) > 1e-3
    expected_r0 = r0_initial if baseline == "initial" else r0_now
    assert got[0] == pytest.approx(min(max(r_now - expected_r0, 0.0), 1.0), abs=1e-5)


def test_threshold_schedule_without_warm_up_and_with_non_finite_means():
    s = StdThresholdSchedule(beta=0.5, decay=0.9, ema_start=1, filter_start=1)
    assert s.advance(0.4) == pytest.approx(0.2)  # no records: the first batch starts the average
    assert s.advance(0.8) == pytest.approx(0.2)  # its own batch is not used yet
    assert s.advance(float("nan")) == pytest.approx(0.5 * (0.9 * 0.4 + 0.1 * 0.8))  # folds in 0.8
    assert s.advance(1.0) == pytest.approx(0.5 * (0.9 * 0.4 + 0.1 * 0.8))  # the NaN batch was not recorded
    previous = StdThresholdSchedule(beta=1.0, decay=0.9, ema_start=1, filter_start=1, include_current=True)
    assert previous.advance(0.4) == pytest.approx(0.4)
    assert previous.advance(0.8) == pytest.approx(0.9 * 0.4 + 0.1 * 0.8)  # the batch itself is folded in first
