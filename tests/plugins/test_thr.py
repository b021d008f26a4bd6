"""THR: prediction errors, the score g^T M_+ h against the explicit double sum over correct tokens, the sign
reweighting, the hook on a stub hidden-state service (groups without a correct response unchanged), bad options,
and the neutral setting (p = 0) reducing to trl.GRPOTrainer."""

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.api import HiddenChunk, PolicyStats
from trl_plugins.testing import assert_reduces_to_vanilla, make_advantage_context
from trl_plugins_builtin.thr import prediction_errors, thr_scores, thr_weights


def test_prediction_errors_hand_values():
    logps = torch.log(torch.tensor([[0.25, 0.5], [0.1, 0.2]]))
    g = prediction_errors(logps, torch.tensor([1, 0]))
    torch.testing.assert_close(g, torch.tensor([[-0.25, 0.5], [0.9, -0.2]]))


def test_score_is_the_double_sum_over_correct_tokens():
    gen = torch.Generator().manual_seed(0)
    g_pos, h_pos = torch.randn(5, 3, generator=gen), torch.randn(5, 4, generator=gen)
    g, h = torch.randn(2, 3, generator=gen), torch.randn(2, 4, generator=gen)
    explicit = torch.tensor([sum(float(g[i] @ g_pos[j]) * float(h[i] @ h_pos[j]) for j in range(5)) for i in range(2)])
    torch.testing.assert_close(thr_scores(g, h, g_pos.T @ h_pos), explicit)


def test_weights_follow_the_sign_of_advantage_times_score():
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0])
    s = torch.tensor([2.0, -2.0, 2.0, -2.0, 3.0])
    torch.testing.assert_close(thr_weights(adv, s, 0.5), torch.tensor([1.5, 0.5, 0.5, 1.5, 1.0]))
    torch.testing.assert_close(thr_weights(adv, s, -0.5), torch.tensor([0.5, 1.5, 1.5, 0.5, 1.0]))


def test_hook_reweights_tokens_of_groups_with_a_correct_response():
    gen = torch.Generator().manual_seed(3)
    N, T, d, V = 4, 3, 4, 6
    hidden = torch.randn(N, T, d, generator=gen)
    W = torch.randn(V, d, generator=gen)
    ids = torch.randint(0, V, (N, T), generator=gen)
    mask = torch.ones(N, T)
    mask[1, 2] = 0

    def service(reduce, layer, head):
        head_fn = (lambda h, v: torch.log_softmax(h @ W.T, -1)[..., v]) if head else None
        return reduce(HiddenChunk(rows=slice(0, N), hidden=hidden, mask=mask, completion_ids=ids, _head=head_fn))

    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])  # group 0 mixed, group 1 without a correct response
    adv = torch.tensor([0.7, -0.7, 0.0, 0.0])
    stats = PolicyStats(torch.zeros(N, T), torch.zeros(N, T), mask, ids, torch.zeros(N))
    ctx = make_advantage_context(rewards, num_generations=2, advantages=adv.clone(), policy_stats=stats,
                                 hidden_states=service)
    build_plugins(["thr"], {"thr": {"p": 0.5}}).call("trl_plugins_transform_advantages", ctx)
    # expected: M_+ from row 0's tokens on group 0's vocabulary, explicit double sum per token of rows 0 and 1
    vocab = torch.unique(ids[:2][mask[:2].bool()])
    q = torch.softmax(hidden @ W.T, -1)[..., vocab]
    err = -q
    for i in range(2):
        for t in range(T):
            err[i, t, (vocab == ids[i, t]).nonzero()[0, 0]] += 1
    expected = adv[:, None].expand(N, T).clone()
    for i in range(2):
        for t in range(T):
            if not mask[i, t]:
                continue
            s = sum(float(err[i, t] @ err[0, k]) * float(hidden[i, t] @ hidden[0, k]) for k in range(T))
            expected[i, t] = adv[i] * (1 + 0.5 * torch.sign(adv[i] * s))
    torch.testing.assert_close(ctx.advantages, expected)
    assert ctx.metrics["plugins/thr/positive_fraction"][0] > 0


def test_bad_options_refused():
    with pytest.raises(PluginConfigError, match="Option 'p' of plugin 'thr' got 2.0"):
        build_plugins(["thr"], {"thr": {"p": 2.0}})


def test_neutral_setting_reduces_to_vanilla():
    assert_reduces_to_vanilla("thr", {"p": 0.0}, loss_types=("grpo",), steps=2, per_device_train_batch_size=4,
                              num_generations=2, max_completion_length=8)
