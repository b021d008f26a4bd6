"""ares (ARES / AEPO, reward and KL halves): window entropies and the HWE count respect the sequence end; the
threshold percentile fills short tails as the official code does; difficulty buckets at accuracy 1/3 and 2/3; targets,
alpha updates and every branch of the hierarchical bonus against a scalar restatement of the official formulas; the
reward hook fills the column from the policy's entropies; the per-bucket KL controller and the loss term; bad options
refused; the neutral setting reduces to vanilla TRL; a run with the bonus and the dynamic KL trains; the HWE-triggered
branching: branch points and slots on small tensors, its refusals, and a tiny-model step whose branch rows continue
their roots."""

import functools
import math
from types import SimpleNamespace

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.tasks.tiny import build_and_save
from trl_plugins.testing import (
    assert_reduces_to_vanilla,
    char_encode,
    digit_fraction_reward,
    make_advantage_context,
    make_loss_context,
    make_reward_context,
    make_tiny_trainer,
    record_run,
)
from trl_plugins_builtin._ares_triggers import TRIGGER_WORDS
from trl_plugins_builtin.ares import (
    BRANCH_KEY,
    BUCKET_KEY,
    AresOptions,
    AresPlugin,
    branch_points,
    branch_slot,
    bucket_targets,
    difficulty_buckets,
    entropy_bonus,
    huber,
    hwe_count,
    normalize_token,
    update_alpha,
    window_means,
    window_percentile,
)


def _plugin(**options):
    return build_plugins(["ares"], {"ares": options}).plugins[0]


# ------------------------------------------------------------------------------------------ HWE counting
def test_window_means_need_a_full_window_after_the_token():
    h = torch.tensor([9.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    assert window_means(h, 4).tolist() == [2.5, 3.5]  # positions 0 and 1 only; 2.. have fewer than 4 followers
    assert window_means(h, 6).numel() == 0 and window_means(h[:5], 4).tolist() == [2.5]
    trigger = torch.tensor([True, True, True, True, True, True])
    assert hwe_count(h, trigger, 4, 3.0) == 1  # 3.5 >= 3; the triggers at 2..5 have no window
    assert hwe_count(h, trigger, 4, 2.5) == 2  # >= is inclusive
    assert hwe_count(h, torch.tensor([False, True, False, False, False, False]), 4, 0.0) == 1


def test_window_percentile_fills_the_tail_with_the_mean_window():
    h = torch.tensor([9.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    # windows [2.5, 3.5], tail of four positions filled with their running mean 3.0
    values = torch.tensor([2.5, 3.5, 3.0, 3.0, 3.0, 3.0])
    assert window_percentile(h, 4, 95.0) == pytest.approx(float(torch.quantile(values, 0.95)))
    assert window_percentile(h, 4, 50.0) == pytest.approx(3.0)
    assert window_percentile(torch.tensor([0.7, 5.0]), 4, 95.0) == pytest.approx(0.7)  # no window: first entropy
    assert window_percentile(torch.zeros(0), 4, 95.0) == 0.0


def test_trigger_words_are_the_official_list_and_tokens_are_normalised():
    assert len(TRIGGER_WORDS) == 174 and len(set(TRIGGER_WORDS)) == 174
    assert {"therefore", "alternatively", "perhaps", "let"} <= set(TRIGGER_WORDS)
    assert normalize_token("\u0120Therefore") == "therefore" and normalize_token("\u2581\u2581wait ") == "wait"
    plugin = _plugin(trigger_words=["b", "Q"])
    assert plugin.is_trigger(char_encode("abqQb"), _CharTok()).tolist() == [False, True, True, True, True]


class _CharTok:
    def batch_decode(self, ids):
        from trl_plugins.testing import CharTokenizer

        return CharTokenizer().batch_decode(ids)


# ------------------------------------------------------------------------------------- buckets and targets
def test_difficulty_buckets_at_one_third_and_two_thirds():
    # G = 3: 3 and 2 correct are easy (2/3 is easy), 1 is medium (1/3 is medium), 0 is hard
    correct = torch.tensor([1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0], dtype=torch.bool)
    assert difficulty_buckets(correct, 3).tolist() == [0, 0, 1, 2]
    # G = 8: 6/8 easy, 5/8 medium, 3/8 medium, 2/8 hard
    rows = [[1] * k + [0] * (8 - k) for k in (6, 5, 3, 2)]
    assert difficulty_buckets(torch.tensor(sum(rows, []), dtype=torch.bool), 8).tolist() == [0, 1, 1, 2]


def test_targets_round_the_bucket_mean_and_alpha_moves_by_the_deviation():
    counts = torch.tensor([1.0, 2.0, 4.0, 4.0, 7.0, 8.0])  # per prompt: 1.5, 4.0, 7.5
    targets, means = bucket_targets(counts, torch.tensor([0, 0, 2]), 2)
    assert means == [2.75, None, 7.5] and targets == [3.0, None, 8.0]  # round half to even: 7.5 -> 8
    alpha = update_alpha([0.5, 0.5, 0.5], means, targets, 0.05, 0.0, 2.0)
    # easy: mean - target = -0.25; hard: target - mean = +0.5; medium absent: unchanged
    assert alpha == pytest.approx([0.5 - 0.0125, 0.5, 0.525])
    assert update_alpha([0.0, 1.0, 2.0], [3.0, 1.0, 0.0], [0.0, 0.0, 4.0], 1.0, 0.0, 2.0) == [2.0, 2.0, 2.0]


# ------------------------------------------------------------------------------------- the bonus
def _official_bonus(n, target, difficulty, correct, alpha):
    """A scalar restatement of ``examples/reward_function/aepo.py`` (shawn0728/ARES @146620e, l.42-122)."""
    frac = {"easy": 0.15, "medium": 0.25, "hard": 0.35}[difficulty]
    kappa = {"easy": 2.0, "medium": 3.0, "hard": 4.0}[difficulty]
    temp = {"easy": 2.0, "medium": 2.5, "hard": 3.0}[difficulty]
    cap = alpha * {"easy": 1.0, "medium": 1.0, "hard": 1.2}[difficulty]

    def hub(x):
        x = max(x, 0.0)
        return 0.5 * x * x / kappa if x <= kappa else x - 0.5 * kappa

    def sig(x):
        return 1.0 / (1.0 + math.exp(-x / temp))

    delta, margin = n - target, max(1.0, frac * max(target, 1.0))
    if difficulty in ("easy", "medium"):
        if correct:
            x = delta - margin if difficulty == "easy" else abs(delta) - margin
            return -min(cap, hub(max(x, 0.0)) / (margin + kappa) * cap)
        return sig(max(delta - margin, 0.0)) * cap * (0.6 if difficulty == "easy" else 0.8)
    if correct:
        if delta >= -margin:
            return sig(delta + margin) * cap
        return -min(cap, 0.5 * hub(-delta - margin) / (margin + kappa) * cap)
    return sig(max(delta - margin, 0.0)) * cap


def test_bonus_matches_the_official_formula_on_every_branch():
    names = ["easy", "medium", "hard"]
    cases = [(n, t, b, c, a) for n in (0, 3, 6, 9, 14, 40) for t in (0, 4, 10) for b in range(3)
             for c in (False, True) for a in (0.5, 1.3)]
    counts, targets, buckets, correct, alpha = (torch.tensor([x[i] for x in cases]) for i in range(5))
    got = entropy_bonus(counts, targets.float(), buckets, correct.bool(), alpha.float(), AresOptions())
    want = [_official_bonus(float(n), float(t), names[b], c, a) for n, t, b, c, a in cases]
    assert got.tolist() == pytest.approx(want, abs=1e-6)


def test_bonus_signs_and_zero_weight():
    o = AresOptions()
    n = torch.tensor([20.0, 20.0, 20.0, 20.0, 0.0, 20.0])
    target = torch.full((6,), 5.0)
    buckets = torch.tensor([0, 0, 1, 2, 2, 2])
    correct = torch.tensor([True, False, True, True, True, False])
    bonus = entropy_bonus(n, target, buckets, correct, torch.full((6,), 0.5), o)
    # easy correct over target: penalty; easy wrong: gain >= 0.3 cap; medium correct far off: penalty;
    # hard correct above target: bonus; hard correct far below: penalty; hard wrong: gain
    assert bonus[0] < 0 and bonus[1] >= 0.3 * 0.5 and bonus[2] < 0 and bonus[3] > 0 and bonus[4] < 0 and bonus[5] > 0
    assert bonus.abs().max() <= 0.5 * 1.2 + 1e-6  # bounded by the cap
    assert entropy_bonus(n, target, buckets, correct, torch.zeros(6), o).abs().max() == 0


def test_huber_is_continuous_at_the_knee():
    k = torch.tensor(3.0)
    eps = 1e-4
    assert float(huber(torch.tensor(3.0 - eps), k)) == pytest.approx(float(huber(torch.tensor(3.0 + eps), k)), abs=1e-3)
    assert float(huber(torch.tensor(3.0), k)) == pytest.approx(1.5) and float(huber(torch.tensor(-2.0), k)) == 0.0


# ------------------------------------------------------------------------------------- the reward hook
def _reward_ctx(correct, completions, entropy_fn, mode="train"):
    rewards = [[float(c), 0.0] for c in correct]
    ctx = make_reward_context(rewards, num_generations=2, reward_func_names=["acc", "ares"], completions=completions,
                              policy_entropies=entropy_fn, mode=mode)
    ctx.set_active_plugin("ares")
    return ctx


def test_reward_hook_counts_triggers_updates_its_state_and_fills_the_column():
    # "b" is the trigger; entropy 2 at every position; a fixed tau = 1: every b with four followers counts
    completions = ["bbbbbbbb", "abbbbbbb", "aaaaaaaa", "bbaaaaaa"]

    def entropies(prompt_ids, completion_ids):
        return [torch.full((len(c),), 2.0) for c in completion_ids]

    plugin = _plugin(trigger_words=["b"], high_entropy_threshold=1.0)
    ctx = _reward_ctx([1, 1, 0, 1], completions, entropies)
    plugin.trl_plugins_transform_rewards(ctx)
    counts = [4, 3, 0, 2]  # windows exist at positions 0..3
    assert ctx.metrics["plugins/ares/hwe_count"] == [pytest.approx(sum(counts) / 4)]
    # group 0 both right: easy, target round(3.5) = 4 (half to even); group 1 one of two: medium, target round(1) = 1
    assert plugin.targets == [4.0, 1.0, None]
    assert plugin.alpha == pytest.approx([0.5 + 0.05 * (3.5 - 4.0), 0.5, 0.5])
    want = [_official_bonus(n, t, d, c, a) for n, t, d, c, a in
            [(4, 4, "easy", True, plugin.alpha[0]), (3, 4, "easy", True, plugin.alpha[0]),
             (0, 1, "medium", False, 0.5), (2, 1, "medium", True, 0.5)]]
    assert ctx.rewards_per_func[:, 1].tolist() == pytest.approx(want, abs=1e-6)
    assert ctx.rewards_per_func[:, 0].tolist() == [1.0, 1.0, 0.0, 1.0]


def test_adaptive_threshold_starts_at_the_batch_median_then_moves_by_ema():
    plugin = _plugin(trigger_words=["b"])
    completions = ["bbbbbbbb", "bbbbbbbb"]

    def entropies(prompt_ids, completion_ids):
        return [torch.arange(len(c), dtype=torch.float32) for c in completion_ids]

    first = _reward_ctx([1, 0], completions, entropies)
    plugin.trl_plugins_transform_rewards(first)
    p95 = window_percentile(torch.arange(8.0), 4, 95.0)
    assert plugin.threshold == pytest.approx(p95)
    # the next batch is counted with the previous tau, then tau moves 1 % toward the new median
    doubled = _reward_ctx([1, 0], completions, lambda p, c: [2 * torch.arange(len(x), dtype=torch.float32) for x in c])
    plugin.trl_plugins_transform_rewards(doubled)
    assert doubled.metrics["plugins/ares/threshold"] == [pytest.approx(p95)]
    assert plugin.threshold == pytest.approx(0.99 * p95 + 0.01 * 2 * p95)
    # evaluation batches change no state
    state = plugin.trl_plugins_state_dict()
    plugin.trl_plugins_transform_rewards(_reward_ctx([1, 1], completions, entropies, mode="eval"))
    assert plugin.trl_plugins_state_dict() == state


def test_neutral_weights_skip_the_forward():
    plugin = _plugin(alpha_init=[0.0, 0.0, 0.0], alpha_lr=0.0)
    ctx = _reward_ctx([1, 0], ["ab", "cd"], lambda p, c: pytest.fail("forward ran"))
    plugin.trl_plugins_transform_rewards(ctx)
    assert ctx.rewards_per_func[:, 1].tolist() == [0.0, 0.0]


# ------------------------------------------------------------------------------------- the dynamic KL
def test_kl_controller_updates_in_log_space_at_its_interval_outside_the_dead_zone():
    plugin = _plugin(kl_update_interval=2)
    plugin.update_kl_controller(torch.tensor([0.04, 0.0, 0.01]), torch.tensor([2.0, 0.0, 1.0]))
    assert plugin.kl_beta == [1.0, 1.0, 1.0]  # first call: not an update step
    assert plugin.kl_last == [pytest.approx(0.02), None, pytest.approx(0.01)]
    plugin.update_kl_controller(torch.tensor([0.02, 0.0, 0.01]), torch.tensor([1.0, 0.0, 1.0]))
    # easy: KL ema 0.02 = 2x target, e = 1, e_ema = 0.03, step 0.05 * 0.03; hard: e = 0 in the dead zone
    assert plugin.kl_error[0] == pytest.approx(0.03)
    assert plugin.kl_beta[0] == pytest.approx(math.exp(0.05 * 0.03))
    assert plugin.kl_beta[1:] == [1.0, 1.0]
    low = _plugin(kl_update_interval=1, kl_ema=0.0, kl_clip=0.2)
    low.update_kl_controller(torch.tensor([0.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 1.0]))  # KL far below target
    assert low.kl_beta == pytest.approx([math.exp(-0.05 * 0.2)] * 3)  # the error is capped at the clip


def test_loss_term_scales_the_reference_kl_per_bucket():
    plugin = _plugin(kl_update_interval=10**6)
    plugin.kl_beta = [2.0, 1.0, 0.5]
    lp = torch.tensor([[-1.0, -2.0], [-1.5, -0.5], [-0.3, -0.9]], requires_grad=True)
    ref = torch.tensor([[-1.2, -1.0], [-1.0, -0.7], [-0.1, -2.0]])
    ctx = make_loss_context(lp, beta=0.04, ref_per_token_logps=ref, extras={BUCKET_KEY: torch.tensor([0, 1, 2])})
    ctx.set_active_plugin("ares")
    plugin.trl_plugins_loss(ctx)
    (term,) = ctx.token_terms
    kl = torch.exp(ref - lp) - (ref - lp) - 1
    expected = 0.04 * torch.tensor([[1.0], [0.0], [-0.5]]) * kl
    assert torch.allclose(term, expected)
    assert plugin.kl_updates == 1 and plugin.kl_beta == [2.0, 1.0, 0.5]  # counted, not yet an update step
    assert ctx.metrics["plugins/ares/kl_beta_easy"] == [2.0]
    # without a reference KL (beta = 0) the loss hook adds nothing
    off = make_loss_context(lp, extras={BUCKET_KEY: torch.tensor([0, 1, 2])})
    plugin.trl_plugins_loss(off)
    assert off.token_terms == []


def test_advantage_stage_sends_each_rows_bucket():
    plugin = _plugin()
    ctx = make_advantage_context([1.0, 1.0, 1.0, 0.0, 0.0, 0.0], num_generations=3,
                                 rewards_per_func=[[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, 0.0],
                                                   [0.0, 0.0]])
    plugin.trl_plugins_transform_advantages(ctx)
    assert ctx.extras[BUCKET_KEY].tolist() == [0, 0, 0, 2, 2, 2]


# ------------------------------------------------------------------------------------- options and runs
@pytest.mark.parametrize("options, message", [
    ({"alpha_init": [0.5, 0.5]}, r"'alpha_init' of plugin 'ares' got \[0.5, 0.5\]; allowed: three"),
    ({"kappa": [2.0, 0.0, 4.0]}, r"'kappa' of plugin 'ares' got \[2.0, 0.0, 4.0\]; allowed: three finite positive"),
    ({"alpha_min": 3.0}, r"'alpha_min' of plugin 'ares' got 3.0 > alpha_max=2.0"),
    ({"kl_beta_init": 1000.0}, r"'kl_beta_init' of plugin 'ares' got 1000.0; allowed: within"),
    ({"trigger_words": []}, r"'trigger_words' of plugin 'ares' got \[\]; allowed"),
    ({"window_size": 0}, r"'window_size' of plugin 'ares' got 0"),
    ({"threshold_percentile": 120.0}, r"'threshold_percentile' of plugin 'ares' got 120.0"),
    ({"branch_rollouts": -1}, r"'branch_rollouts' of plugin 'ares' got -1"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(PluginConfigError, match=message):
        build_plugins(["ares"], {"ares": options})


NEUTRAL = {"alpha_init": [0.0, 0.0, 0.0], "alpha_lr": 0.0, "correct_threshold": 0.2}
RUN = dict(steps=2, num_generations=4, per_device_train_batch_size=8, beta=0.04)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """A locally saved tiny model: with beta != 0 TRL loads the reference model by path."""
    return str(build_and_save(tmp_path_factory.mktemp("ares") / "tiny"))


@pytest.mark.parametrize("kl", [{"dynamic_kl": False}, {"kl_update_interval": 10**9}], ids=["kl-off", "beta_d-1"])
def test_neutral_setting_reduces_to_vanilla(kl, tiny_path):
    # the reference KL is on (beta = 0.04): beta_d = 1 (no controller update) leaves TRL's KL term as it is
    assert_reduces_to_vanilla("ares", {**NEUTRAL, **kl}, loss_types=("dapo",), model=tiny_path, **RUN)


def test_a_run_with_the_bonus_and_dynamic_kl_trains(tmp_path, tiny_path):
    options = {"correct_threshold": 0.2, "kl_update_interval": 1, "trigger_words": list("0123456789")}
    trainer = make_tiny_trainer(
        model=tiny_path, reward_funcs=[digit_fraction_reward], plugins=["ares"], plugin_config={"ares": options},
        output_dir=str(tmp_path), max_steps=2, num_generations=4, per_device_train_batch_size=8, beta=0.04)
    run = record_run(trainer)
    (plugin,) = list(trainer.plugin_stack)
    logs = [log for log in run.logs if "loss" in log]
    assert logs and all("plugins/ares/hwe_count" in log and "plugins/ares/kl_beta_easy" in log for log in logs)
    assert any(float(r[:, 1].abs().sum()) > 0 for r in run.rewards)
    assert all(math.isfinite(log["loss"]) for log in logs)
    # the KL starts near 0, far below its target: the controller lowers beta_d of the buckets it saw
    assert plugin.kl_updates > 0 and min(plugin.kl_beta) < 1.0


# ------------------------------------------------------------------------------------- HWE-triggered branching
def test_branch_points_take_the_hwe_triggers_highest_window_first_else_the_highest_window():
    h = torch.tensor([0.0, 1.0, 3.0, 0.0, 2.0, 2.0, 0.0])  # window 2: W_0..W_4 = mean(H_t+1, H_t+2) = 2 1.5 1 2 1
    trig = torch.tensor([True, True, True, False, True, True, True])
    # HWE (trigger, full window, W >= 1.5): positions 0 (2.0) and 1 (1.5), highest first, cycled; 3 is no trigger
    assert branch_points(h, trig, 2, 1.5, 3) == ([0, 1, 0], 2)
    assert branch_points(h, trig, 2, 2.5, 2) == ([0, 0], 0)  # none above tau: the highest window mean (first)
    assert branch_points(h, torch.zeros(7, dtype=torch.bool), 2, 0.0, 1) == ([0], 0)  # no trigger at all
    assert branch_points(torch.tensor([1.0]), torch.tensor([True]), 2, 0.0, 2) == ([0, 0], 0)  # no full window
    # G = 5, R = 3: rows 0, 1 are roots; rows 2, 3, 4 continue roots 0, 1, 0 from their points 0, 0, 1
    assert [branch_slot(i, 5, 3) for i in range(5)] == [None, None, (0, 0), (1, 0), (0, 1)]


def test_branching_is_off_by_default_and_refused_with_vllm_or_without_a_root():
    assert not build_plugins(["ares"]).has("trl_plugins_after_generation")
    plugin = AresPlugin(AresPlugin.Options(branch_rollouts=4))
    with pytest.raises(PluginConfigError, match="'branch_rollouts' of plugin 'ares' got 4 with num_generations=4"):
        plugin.trl_plugins_configure(None, SimpleNamespace(num_generations=4))
    with pytest.raises(IncompatiblePluginsError, match="use_vllm=False"):
        plugin.trl_plugins_configure(None, SimpleNamespace(use_vllm=True, num_generations=8))
    assert "branching seam" in plugin.multi_turn_refusal()


def test_one_step_on_the_tiny_model_branches_from_the_roots(tmp_path, monkeypatch):
    seen = []
    original = AresPlugin.trl_plugins_after_generation

    @functools.wraps(original)  # keeps the hookimpl marker
    def spy(self, ctx):
        original(self, ctx)
        seen.append(([list(c) for c in ctx.completion_ids], [dict(a) for a in ctx.annotations],
                     list(ctx.index_in_group)))

    monkeypatch.setattr(AresPlugin, "trl_plugins_after_generation", spy)
    options = {"correct_threshold": 0.2, "trigger_words": list("0123456789"), "branch_rollouts": 2}
    trainer = make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=1, plugins=["ares"],
                                plugin_config={"ares": options}, output_dir=str(tmp_path), num_generations=4,
                                per_device_train_batch_size=8)
    run = record_run(trainer)
    ids, notes, index = seen[0]
    branches = [k for k in range(len(ids)) if index[k] >= 2]
    assert branches and all(BRANCH_KEY not in notes[k] for k in range(len(ids)) if index[k] < 2)
    for k in branches:  # rows 2, 3 of a group continue roots 0, 1 (the rows two before them)
        root, cut = notes[k][BRANCH_KEY]
        assert root == index[k] - 2 and cut >= 1
        assert ids[k][:cut] == ids[k - 2][:cut]
    logs = [log for log in run.logs if "plugins/ares/branch_rollouts" in log]
    assert logs and logs[0]["plugins/ares/branch_rollouts"] == len(branches)
