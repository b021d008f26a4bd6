"""GTPO (Simoni et al.): no positive/negative pair gives
delta = 1; identical prefixes give conflict runs that stop at the first divergence (and end-aligned terminal runs);
negative completions get zero gradient on conflict tokens; Hbar > 0.7 gives zero gradient for that completion;
group quantities are computed at the advantage stage; neutral settings and end-to-end runs."""

from types import SimpleNamespace

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.api.contexts import PolicyStats
from trl_plugins.testing import (
    assert_runs_equal,
    build_stack,
    digit_fraction_reward,
    loss_from_context,
    make_advantage_context,
    make_loss_context,
    make_tiny_trainer,
    record_run,
    run_hook,
)
from trl_plugins_builtin.gtpo import WEIGHT_KEY, conflict_counts, conflict_runs, conflict_weights, entropy_filter

# Group 0 (rows 0-2): row 0 positive, row 1 negative, row 2 positive (one token shorter, padded with 0).
# Group 1 (rows 3-5): no negative completion, although it shares every token with group 0's rows.
IDS = torch.tensor([
    [5, 6, 7, 8, 9],
    [5, 6, 1, 8, 9],
    [5, 2, 7, 3, 0],
    [5, 6, 7, 8, 9],
    [5, 6, 1, 8, 9],
    [5, 6, 1, 8, 9],
])
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1],
                     [1, 1, 1, 1, 1]])
ADV = torch.tensor([1.0, -1.0, 0.5, 0.4, 0.0, 0.2])


def test_conflict_runs_hand_made():
    forward, terminal = conflict_runs(IDS, MASK, ADV, 3)
    # t=0: token 5 is in positive and negative rows -> all three; t=1: 6 is in row 0 (+) and row 1 (-), row 2 has 2;
    # t=2: 7 (+) vs 1 (-) -> the run stops; t=3 (8 in rows 0 and 1) is a raw conflict but after the divergence.
    assert forward[:3].tolist() == [
        [True, True, False, False, False],
        [True, True, False, False, False],
        [True, False, False, False, False],
    ]
    # aligned at the end: rows 0 and 1 end with 8, 9; row 2 ends with 7, 3 (its padding is not a token)
    assert terminal[:3].tolist() == [
        [False, False, False, True, True],
        [False, False, False, True, True],
        [False, False, False, False, False],
    ]
    assert not forward[3:].any() and not terminal[3:].any()  # no positive/negative pair in group 1


def test_runs_are_per_row_and_stop_at_the_first_divergence():
    ids = IDS[:3].clone()
    ids[1, 2] = 7  # now 7 at t=2 is also in the negative row: rows 0 and 1 continue, row 2 stopped at t=1
    ids[1, 3] = 4  # rows 0 and 1 diverge at t=3; t=4 (9 in both) is a raw conflict after the divergence
    forward, _ = conflict_runs(ids, MASK[:3], ADV[:3], 3, terminal_run=False)
    assert forward.tolist() == [
        [True, True, True, False, False],
        [True, True, True, False, False],
        [True, False, False, False, False],
    ]


def test_no_positive_negative_pair_gives_unit_weights():
    adv = torch.tensor([1.0, 0.5, 0.0])
    forward, terminal = conflict_runs(IDS[:3], MASK[:3], adv, 3)
    assert not forward.any() and not terminal.any()
    assert torch.all(conflict_weights(forward, terminal, adv, 2.0, 0.0) == 1)


def test_padding_positions_never_conflict():
    ids = torch.tensor([[4, 0, 0], [4, 0, 0]])  # the pad id 0 repeats in both rows at the same positions
    mask = torch.tensor([[1, 0, 0], [1, 0, 0]])
    forward, terminal = conflict_runs(ids, mask, torch.tensor([1.0, -1.0]), 2)
    assert forward.tolist() == [[True, False, False]] * 2 and terminal.tolist() == [[True, False, False]] * 2


def test_conflict_weights_multiply_over_the_two_passes():
    forward, terminal = conflict_runs(IDS, MASK, ADV, 3)
    delta = conflict_weights(forward, terminal, ADV, 2.0, 0.0)
    assert delta[:3].tolist() == [[2, 2, 1, 2, 2], [0, 0, 1, 0, 0], [2, 1, 1, 1, 1]]
    both = torch.ones(1, 2, dtype=torch.bool)
    assert conflict_weights(both, both, torch.tensor([1.0]), 2.0, 0.0).tolist() == [[4.0, 4.0]]


def test_entropy_filter():
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0])
    h = torch.tensor([0.5, 0.8, 0.7, 0.2])
    new, dropped = entropy_filter(adv, h, 0.7, 0.1)
    assert dropped.tolist() == [False, True, False, False]  # strictly above the threshold
    assert new.tolist() == pytest.approx([0.95, 0.0, 0.43, -0.02])
    new2d, _ = entropy_filter(adv[:, None].expand(4, 3), h, 0.7, 0.1)
    assert new2d[:, 0].tolist() == pytest.approx([0.95, 0.0, 0.43, -0.02]) and new2d.shape == (4, 3)
    same, dropped = entropy_filter(adv, h, None, 0.0)
    assert torch.equal(same, adv) and not dropped.any()


# ------------------------------------------------------------------------------------------ advantage stage
def _adv_ctx(advantages, entropy):
    N = IDS.size(0)
    stats = PolicyStats(per_token_logps=torch.zeros(N, 5), entropies=torch.zeros(N, 5), mask=MASK, completion_ids=IDS,
                        mean_entropy=entropy)
    return make_advantage_context(torch.zeros(N), num_generations=3, advantages=advantages.clone(),
                                  completion_lengths=MASK.sum(-1).float(), policy_stats=stats)


ENTROPY = torch.tensor([0.3, 0.5, 0.9, 0.1, 0.2, 0.6])


def test_advantage_stage_weights_and_filter():
    ctx = _adv_ctx(ADV, ENTROPY)
    sink = ctx.metrics
    build_plugins(["gtpo"], {"gtpo": {"conflict_count": "union"}}).call("trl_plugins_transform_advantages", ctx)
    w = ctx.local_extras[WEIGHT_KEY]
    # delta / max(n_conflict, 1), union count: rows 0 and 1 have 4 conflict tokens, row 2 one
    assert w[:3].tolist() == [[0.5, 0.5, 0.25, 0.5, 0.5], [0, 0, 0.25, 0, 0], [2, 1, 1, 1, 1]]  # exact in binary
    assert torch.all(w[3:] == 1)
    # row 2 (0.9 > 0.7) dropped; others shifted by -0.1 Hbar (row 4 had A = 0 and gets -0.02)
    assert ctx.advantages.tolist() == pytest.approx([0.97, -1.05, 0.0, 0.39, -0.02, 0.14])
    assert sink["plugins/gtpo/conflict_token_fraction"] == [pytest.approx(9 / 29)]
    assert sink["plugins/gtpo/negative_conflict_token_fraction"] == [pytest.approx(4 / 29)]
    assert sink["plugins/gtpo/dropped_completion_fraction"] == [pytest.approx(1 / 6)]


def test_without_conflict_division_and_terminal_run():
    ctx = _adv_ctx(ADV, ENTROPY)
    build_plugins(["gtpo"], {"gtpo": {"divide_by_conflicts": False, "terminal_run": False}}).call(
        "trl_plugins_transform_advantages", ctx
    )
    assert ctx.local_extras[WEIGHT_KEY][:3].tolist() == [[2, 2, 1, 1, 1], [0, 0, 1, 1, 1], [2, 1, 1, 1, 1]]


def _loss_ctx(lp, adv, weights):
    B, T = lp.shape
    return make_loss_context(lp, advantages=adv, mask=MASK, extras={WEIGHT_KEY: weights}, loss_type="grpo",
                             completion_ids=IDS, entropies=torch.zeros(B, T))


def test_loss_gradients_conflict_tokens_and_dropped_completions():
    """Negative completions get zero gradient on their conflict tokens, positive ones an amplified gradient, and a
    completion with Hbar > 0.7 gets no gradient at all (TRL's grpo aggregation: per-completion token-mean)."""
    actx = _adv_ctx(ADV, ENTROPY)
    stack = build_plugins(["gtpo"], {"gtpo": {"divide_by_conflicts": False, "completion_reduction": "mean"}})
    stack.call("trl_plugins_transform_advantages", actx)
    weights = actx.local_extras[WEIGHT_KEY]
    lp = (-torch.rand(6, 5, generator=torch.Generator().manual_seed(0))).requires_grad_(True)
    adv = actx.advantages[:, None].expand(6, 5)
    ctx = _loss_ctx(lp, adv, weights)
    stack.call("trl_plugins_loss", ctx)
    per_token = ctx.per_token_loss * ctx.token_weights[0]
    loss = ((per_token * MASK).sum(-1) / MASK.sum(-1)).mean()
    (grad,) = torch.autograd.grad(loss, lp)
    base = (-adv * MASK / MASK.sum(-1, keepdim=True) / 6)  # d(vanilla loss)/d(lp) at r = 1
    assert torch.all(grad[1, [0, 1, 3, 4]] == 0)  # negative row, conflict tokens
    torch.testing.assert_close(grad[1, 2], base[1, 2])  # its non-conflict token is trained as usual
    torch.testing.assert_close(grad[0], base[0] * torch.tensor([2.0, 2.0, 1.0, 2.0, 2.0]))  # amplified
    assert torch.all(grad[2] == 0)  # Hbar = 0.9 > 0.7: dropped


def test_configure_and_conflicts():
    with pytest.warns(UserWarning, match="beta"):
        build_plugins(["gtpo"]).call("trl_plugins_configure", trainer=None, args=SimpleNamespace(beta=0.04))
    with pytest.raises(IncompatiblePluginsError, match="gtpo.*llds.*likelihood"):
        build_plugins(["gtpo", "llds"])
    with pytest.raises(PluginConfigError, match="positive_weight"):
        build_plugins(["gtpo"], {"gtpo": {"positive_weight": -1.0}})


# ------------------------------------------------------------------------------------------ end to end (tiny model)
NEUTRAL = {"positive_weight": 1.0, "negative_weight": 1.0, "divide_by_conflicts": False, "entropy_threshold": None,
           "entropy_scale": 0.0, "completion_reduction": "mean"}


def _trainer(tmp_path, name, reward=digit_fraction_reward, max_steps=2, **config):
    return make_tiny_trainer(reward_funcs=[reward], max_steps=max_steps, output_dir=str(tmp_path / name), **config)


def test_neutral_setting_end_to_end_is_vanilla(tmp_path):
    from trl import GRPOTrainer

    run = record_run(_trainer(tmp_path, "a", plugins=["gtpo"], plugin_config={"gtpo": NEUTRAL}))
    vanilla = record_run(_trainer(tmp_path, "b", trainer_cls=GRPOTrainer))
    assert_runs_equal(run, vanilla)


def test_default_entropy_filter_drops_an_untrained_model_end_to_end(tmp_path):
    """The untrained tiny model's completions have mean entropy ~ ln(102) > 0.7: all are dropped (A = 0), and
    nothing moves."""
    trainer = _trainer(tmp_path, "c", plugins=["gtpo"], max_steps=1)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert all(torch.all(a == 0) for a in run.advantages)
    assert all(torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert [log["plugins/gtpo/dropped_completion_fraction"] for log in logs] == [1.0]
    assert all(log["plugins/gtpo/mean_entropy"] > 0.7 for log in logs)


def alternating_reward(completions, **kwargs):
    return [float(i % 2 == 0) for i in range(len(completions))]


def test_identical_greedy_completions_are_all_conflict_tokens_end_to_end(tmp_path):
    """Greedy decoding makes the group's completions identical while the rewards alternate: every token of every
    completion is a conflict token; negative completions are skipped and the run still trains on positive ones."""
    trainer = _trainer(tmp_path, "d", reward=alternating_reward, plugins=["gtpo"], top_k=1, max_steps=1,
                       plugin_config={"gtpo": {"entropy_threshold": None, "entropy_scale": 0.0}})
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert all(torch.equal(c, c[:1].expand_as(c)) for c in run.completion_ids)  # identical completions
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    for log in (log for log in run.logs if "loss" in log):
        assert log["plugins/gtpo/conflict_token_fraction"] == 1.0
        assert log["plugins/gtpo/negative_conflict_token_fraction"] == 0.5


# ------------------------------------------------------------------------------------------ official normaliser / sum
def _official_style_count(forward, terminal, mask):
    """The official n_conflict, restated: OR of the forward-run mask with the terminal-run mask left in end-aligned
    positions (index s = s-th token from the end), masked by the validity of the *original* positions."""
    lengths = mask.sum(-1)
    end_aligned = torch.zeros_like(terminal)
    for i in range(terminal.size(0)):
        n = int(lengths[i])
        end_aligned[i, :n] = terminal[i, :n].flip(0)
    return ((forward | end_aligned) & mask.bool()).sum(-1)


def test_official_conflict_count_is_the_longer_run():
    forward, terminal = conflict_runs(IDS, MASK, ADV, 3)
    assert conflict_counts(forward, terminal, "longer_run")[:3].tolist() == [2, 2, 1]  # runs of 2 and 2 -> 2
    assert conflict_counts(forward, terminal, "union")[:3].tolist() == [4, 4, 1]
    g = torch.Generator().manual_seed(0)
    for _ in range(50):  # random groups with shared prefixes and suffixes
        ids = torch.randint(0, 3, (8, 7), generator=g)
        lengths = torch.randint(1, 8, (8,), generator=g)
        mask = (torch.arange(7) < lengths.unsqueeze(1)).long()
        ids = ids * mask
        adv = torch.randn(8, generator=g).round()
        fwd, term = conflict_runs(ids, mask, adv, 4)
        assert torch.equal(conflict_counts(fwd, term, "longer_run"), _official_style_count(fwd, term, mask))


def test_advantage_stage_divides_by_the_official_count():
    stats = PolicyStats(per_token_logps=torch.zeros(6, 5), entropies=torch.zeros(6, 5), mask=MASK,
                        completion_ids=IDS, mean_entropy=ENTROPY)
    ctx = make_advantage_context(torch.zeros(6), num_generations=3, advantages=ADV, policy_stats=stats,
                                 completion_lengths=MASK.sum(-1))
    run_hook("gtpo", "trl_plugins_transform_advantages", ctx, loss_type="grpo")
    w = ctx.local_extras[WEIGHT_KEY]
    # delta / max(n_conflict, 1) with n_conflict = 2 for rows 0 and 1 (forward and terminal runs of 2), 1 for row 2
    assert w[:3].tolist() == [[1, 1, 0.5, 1, 1], [0, 0, 0.5, 0, 0], [2, 1, 1, 1, 1]]
    assert torch.all(w[3:] == 1)


def test_completion_reduction_sum_is_the_official_sum_over_the_steps_completions():
    B, T, GA = 4, 3, 2
    weights = torch.tensor([[1.0, 0.5, 2.0]] * B)
    losses = {}
    for reduction in ("sum", "mean"):
        stack = build_stack("gtpo", {"gtpo": {"completion_reduction": reduction}}, gradient_accumulation_steps=GA,
                            loss_type="grpo")
        ctx = make_loss_context(shape=(B, T), loss_type="grpo", extras={WEIGHT_KEY: weights})
        run_hook(stack, "trl_plugins_loss", ctx)
        losses[reduction] = loss_from_context(ctx)
        (grad,) = torch.autograd.grad(losses[reduction] / GA, ctx.per_token_logps)  # TRL divides by GA
        if reduction == "sum":  # official: sum over completions of -sum_t A delta r_t / n_tok, r = 1 with grad
            adv = ctx.advantages.expand(B, T)
            expected = -(adv * weights) / T
            torch.testing.assert_close(grad, expected)
    torch.testing.assert_close(losses["sum"], losses["mean"] * B * GA)


def test_configure_warns_without_the_per_completion_token_mean():
    with pytest.warns(UserWarning, match="loss_type='dapo'"):
        build_stack("gtpo", loss_type="dapo")
