"""MRT: episodes cut at the separator, the meta-prover's success rate J at every episode boundary from forced-termination
continuations (generation service), and the dense bonus alpha (J_j - J_{j-1}) on episode j's tokens."""

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.testing import (
    StubGenerationService,
    assert_reduces_to_vanilla,
    char_decode,
    char_encode,
    digit_fraction_reward,
    make_advantage_context,
    make_rollout_context,
    make_tiny_trainer,
    record_run,
    run_hook,
)
from trl_plugins_builtin.mrt import PROGRESS_KEY, episode_boundaries, progress_bonus


# ------------------------------------------------------------------------------------------ formula
def test_episode_boundaries():
    sep = [9]
    assert episode_boundaries([1, 9, 2, 9, 3], sep, 6) == [0, 2, 4, 5]
    assert episode_boundaries([1, 9, 2, 9], sep, 6) == [0, 2, 4]  # a trailing separator opens no empty episode
    assert episode_boundaries([1, 9, 2, 9, 3], sep, 2) == [0, 2, 5]  # capped: the last episode runs to the end
    assert episode_boundaries([1, 2, 3], sep, 6) == [0, 3]
    assert episode_boundaries([1, 7, 8, 2, 7, 8], [7, 8], 6) == [0, 3, 6]


def test_progress_bonus_credits_each_episode_its_own_progress():
    bonus = progress_bonus([0, 2, 4, 5], [0.0, 0.25, 1.0, 0.5], alpha=2.0, width=7)
    torch.testing.assert_close(bonus, torch.tensor([0.5, 0.5, 1.5, 1.5, -1.0, 0.0, 0.0]))


# ------------------------------------------------------------------------------------------ sampling hook
def _knows_after_b(request, j):
    """The meta-prover answers correctly once the prefix holds the line 'b'."""
    return "42" if "\nb\n" in char_decode(request) else "0"


def _answer_reward(completions, **kwargs):
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [1.0 if t.rstrip().endswith("42") else 0.0 for t in texts]


def test_hook_estimates_success_rates_at_every_boundary():
    service = StubGenerationService(_knows_after_b)
    ctx = make_rollout_context([["a\nb\nc", "zz"]], service=service, reward_funcs=[_answer_reward],
                               conversational=False)
    run_hook("mrt", "trl_plugins_after_generation", ctx, {"mrt": {"prover_samples": 2, "termination_text": " Time"}})
    assert ctx.annotations[0][PROGRESS_KEY] == [(0, 0.0), (2, 0.0), (4, 1.0), (5, 1.0)]
    assert ctx.annotations[1][PROGRESS_KEY] == [(0, 0.0), (2, 0.0)]
    (requests,) = service.calls
    assert len(requests) == (4 + 2) * 2 and service.used_this_batch == 12
    prompt = list(ctx.prompt_ids[0])
    assert requests[4] == prompt + char_encode("a\nb\n") + char_encode(" Time")  # boundary b_2 = 4
    assert not ctx.changed  # the rollouts themselves are kept
    assert ctx.metrics["plugins/mrt/extra_rollouts"] == [12.0]


def test_alpha_zero_generates_nothing():
    ctx = make_rollout_context([["a\nb", "c"]])
    run_hook("mrt", "trl_plugins_after_generation", ctx, {"mrt": {"alpha": 0.0}})
    assert ctx.service.calls == [] and all(PROGRESS_KEY not in a for a in ctx.annotations)


# ------------------------------------------------------------------------------------------ advantage hook
def test_advantage_hook_adds_the_dense_bonus_on_loss_tokens():
    notes = [{PROGRESS_KEY: [(0, 0.0), (2, 0.5), (4, 1.0)]}, {PROGRESS_KEY: [(0, 0.0), (4, 0.0)]}]
    ctx = make_advantage_context(torch.tensor([1.0, 0.0]), num_generations=2, annotations=notes)
    trl = ctx.advantages.clone()
    run_hook("mrt", "trl_plugins_transform_advantages", ctx, {"mrt": {"alpha": 2.0}})
    expected = trl.unsqueeze(1).expand(2, 4) + torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(ctx.advantages, expected)


def test_bad_options_are_refused():
    with pytest.raises(PluginConfigError, match="episode_separator"):
        build_plugins(["mrt"], {"mrt": {"episode_separator": ""}})
    with pytest.raises(PluginConfigError, match="prover_samples"):
        build_plugins(["mrt"], {"mrt": {"prover_samples": 0}})


# ------------------------------------------------------------------------------------------ real trainer
def test_alpha_zero_is_vanilla():
    assert_reduces_to_vanilla("mrt", {"alpha": 0.0}, loss_types=("dapo",), steps=1)


def test_end_to_end_counts_the_prover_rollouts_and_trains(tmp_path):
    trainer = make_tiny_trainer(plugins=["mrt"], plugin_config={"mrt": {"prover_samples": 1, "max_episodes": 2}},
                                reward_funcs=[digit_fraction_reward], max_steps=1, output_dir=str(tmp_path))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    (advantages,) = run.advantages
    assert advantages.dim() == 2
    # 4 rollouts with 2 or 3 boundaries each (at most 2 episodes), one prover answer per boundary
    assert 4 * 2 <= trainer.generation_service.total <= 4 * 3
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    (log,) = [log for log in run.logs if "loss" in log]
    assert "plugins/mrt/final_success_rate" in log and "plugins/mrt/bonus_abs_mean" in log
