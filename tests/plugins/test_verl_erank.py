"""VERL effective-rank shaping: ER, ERV/ERA and the bonus on hand-computed tensors, the clipped last-token
advantage, the hook's two-step EMA protocol with a stub hidden-state service, bad options, and the neutral
setting (aux_weight = 0) reducing to trl.GRPOTrainer."""

import math

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.api import HiddenChunk
from trl_plugins.testing import assert_reduces_to_vanilla, make_advantage_context
from trl_plugins_builtin.verl_erank import effective_rank, erank_bonus, rank_dynamics, shape_advantages


def test_effective_rank_hand_values():
    # two orthogonal directions with equal singular values -> ER = 2; one direction -> ER = 1; < 2 rows -> 0
    square = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    assert effective_rank(square) == pytest.approx(2.0, abs=1e-5)
    assert effective_rank(torch.tensor([[0.0, 0.0], [2.0, 0.0]])) == pytest.approx(1.0, abs=1e-5)
    assert effective_rank(torch.ones(1, 3)) == 0.0


def test_rank_dynamics_differences():
    h = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    m = [effective_rank(h[: t + 1]) for t in (1, 2, 3, 4, 5)]  # stride 1: t = 1..5
    diffs = [m[k] - sum(m[:k]) / k for k in range(1, 5 + 0)]
    diffs2 = [diffs[k] - diffs[k - 1] for k in range(1, len(diffs))]
    era, erv, er = rank_dynamics(h, stride=1, max_len=512)
    assert er == pytest.approx(effective_rank(h))
    assert erv == pytest.approx(sum(diffs) / len(diffs))
    assert era == pytest.approx(sum(diffs2) / len(diffs2))
    # fewer than 2 strides of tokens: no dynamics; max_len keeps the last tokens only
    assert rank_dynamics(h, stride=4, max_len=512)[:2] == (0.0, 0.0)
    assert rank_dynamics(h, stride=1, max_len=3)[:2] == rank_dynamics(h[-3:], stride=1, max_len=3)[:2]


def test_bonus_hand_values():
    x = torch.tensor([[1.0, 2.0, 1.0], [3.0, 1.0, 1.0]])
    aux, tendency = erank_bonus(x, torch.ones(3), 2.0, torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.0, 1.0, 0.0]),
                                1.0)
    # row 0: deviations (0, 1, 0), tendency 1/2, weights (0, .5, .5) -> .5 tanh(1)
    # row 1: deviations (2, 0, 0), tendency sigmoid(4): weights on ER and ERV, both deviations 0 -> 0
    torch.testing.assert_close(aux, torch.tensor([0.5 * math.tanh(1.0), 0.0]))
    torch.testing.assert_close(tendency, torch.tensor([0.5, 1 / (1 + math.exp(-4.0))]))


def test_shape_advantages_last_token_and_all_tokens():
    adv = torch.tensor([1.0, -1.0])
    aux = torch.tensor([0.3, 5.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    got = shape_advantages(adv, aux, 2.0, mask)
    torch.testing.assert_close(got, torch.tensor([[1.0, 1.0, 1.3, 1.0], [-1.0, -0.5, -1.0, -1.0]]))
    torch.testing.assert_close(shape_advantages(adv, aux, 2.0, None), torch.tensor([1.3, -0.5]))
    torch.testing.assert_close(shape_advantages(adv, -aux, 2.0, None), adv)  # negative bonus: relu -> nothing


def _stub_service(hidden):
    def service(reduce, layer, head):
        return reduce(HiddenChunk(rows=slice(0, hidden.size(0)), hidden=hidden, mask=torch.ones(hidden.shape[:2]),
                                  completion_ids=torch.zeros(hidden.shape[:2], dtype=torch.long)))
    return service


def test_hook_waits_one_step_then_shapes_the_last_token():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(4, 6, 5, generator=g)
    stack = build_plugins(["verl_erank"], {"verl_erank": {"stride": 1, "ema_alpha": 0.5}})
    plugin = stack.plugins[0]
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    ctx = make_advantage_context(rewards, num_generations=2, advantages=adv.clone(),
                                 hidden_states=_stub_service(hidden))
    stack.call("trl_plugins_transform_advantages", ctx)
    torch.testing.assert_close(ctx.advantages, adv)  # first step: no baseline, no bonus
    x = torch.tensor([rank_dynamics(h, 1, 512) for h in hidden])
    assert plugin.prev_means == pytest.approx(x.mean(0).tolist())
    ctx2 = make_advantage_context(rewards, num_generations=2, advantages=adv.clone(),
                                  hidden_states=_stub_service(hidden))
    stack.call("trl_plugins_transform_advantages", ctx2)
    # second step: the baselines are still 0 (the official lag), so every deviation saturates at +-5
    aux, _ = erank_bonus(x, torch.zeros(3), 2.0, torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.0, 1.0, 0.0]), 1.0)
    expected = shape_advantages(adv, aux, 2.0, ctx2.completion_mask())
    torch.testing.assert_close(ctx2.advantages, expected)
    assert plugin.mids == pytest.approx((0.5 * x.mean(0)).tolist())
    restored = build_plugins(["verl_erank"]).plugins[0]
    restored.trl_plugins_load_state_dict(plugin.trl_plugins_state_dict())
    assert restored.mids == plugin.mids and restored.prev_means == plugin.prev_means


def test_bad_options_refused():
    with pytest.raises(PluginConfigError, match="Option 'kappa' of plugin 'verl_erank' got 0.0"):
        build_plugins(["verl_erank"], {"verl_erank": {"kappa": 0}})
    with pytest.raises(PluginConfigError, match="kappa=nan; allowed: a number > 0 or inf"):
        build_plugins(["verl_erank"], {"verl_erank": {"kappa": float("nan")}})
    with pytest.raises(PluginConfigError, match="Option 'stride' of plugin 'verl_erank' got 0"):
        build_plugins(["verl_erank"], {"verl_erank": {"stride": 0}})


def test_neutral_setting_reduces_to_vanilla():
    assert_reduces_to_vanilla("verl_erank", {"aux_weight": 0.0, "stride": 4}, loss_types=("grpo",), steps=2,
                              per_device_train_batch_size=4, num_generations=2, max_completion_length=8)
