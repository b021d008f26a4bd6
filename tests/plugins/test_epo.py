"""EPO: a multi-turn entropy bonus, smoothed against each turn's historical entropy, with a phase-weighted penalty."""

import math

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.api.contexts import TURN_IDS_KEY
from trl_plugins.testing import (
    assert_reduces_to_vanilla, build_stack, loss_from_context, make_advantage_context, make_loss_context, run_hook,
    run_on_processes, stub_policy_stats,
)
from trl_plugins.api.turns import build_turn_structure
from trl_plugins_builtin.epo import band_penalty, historical_means, phase_weight


def epo(stack):
    return next(p for p in stack if p.name == "epo")


def stats_with(entropies, mask=None):
    base = stub_policy_stats(entropies.size(0), entropies.size(1), mask=mask)
    base.entropies = entropies
    return base


def record_history(stack, entropies, turns=None, step=0, **kw):
    """Run the advantage hook (it records the batch's per-turn mean entropy) with these (N, T) policy entropies."""
    N = entropies.size(0)
    ctx = make_advantage_context([float(i % 2) for i in range(N)], num_generations=2, step=step,
                                 policy_stats=stats_with(entropies), turns=turns, **kw)
    run_hook(stack, "transform_advantages", ctx)
    return ctx


def two_turn_rows(n):
    """n completions of 4 tokens: assistant turn 0 (tokens 0-1), tool result (2), assistant turn 1 (3)."""
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "search", "arguments": {}}}]}
    messages = [call, {"role": "tool", "content": "x"}, {"role": "assistant", "content": "a"}]
    return [build_turn_structure([1, 2, 3, 4], [1, 1, 0, 1], messages) for _ in range(n)]


def test_history_is_the_mean_entropy_per_turn_index_over_past_steps():
    stack = build_stack("epo", max_steps=10)
    turns = two_turn_rows(2)
    record_history(stack, torch.tensor([[1.0, 3.0, 9.0, 4.0], [1.0, 3.0, 9.0, 6.0]]), turns=turns)
    assert epo(stack).history == [[pytest.approx(2.0), pytest.approx(5.0)]]  # the tool-result token is left out
    record_history(stack, torch.tensor([[2.0, 2.0, 9.0, 1.0], [2.0, 2.0, 9.0, 1.0]]), turns=turns, step=1)
    assert epo(stack).reference == [pytest.approx(2.0), pytest.approx(3.0)]  # (2 + 2) / 2, (5 + 1) / 2
    window = build_stack("epo", {"epo": {"history_window": 1}}, max_steps=10)
    record_history(window, torch.full((2, 4), 1.0), turns=turns)
    record_history(window, torch.full((2, 4), 3.0), turns=turns, step=1)
    assert epo(window).reference == [pytest.approx(3.0), pytest.approx(3.0)]


def test_history_is_a_global_mean_and_identical_on_every_process():
    def work(rank, gather):
        stack = build_stack("epo", max_steps=10)
        entropies = torch.full((2, 4), 1.0 if rank == 0 else 3.0)
        record_history(stack, entropies, gather=gather)
        return epo(stack).reference

    assert run_on_processes(2, work) == [[pytest.approx(2.0)], [pytest.approx(2.0)]]


SCRIPT_BAND = {"band_low": 0.5, "band_high": 1.5}  # the official run script's default band


def epo_term(options, reference, entropies):
    """The loss EPO adds (its loss minus the surrogate's alone, dapo) on a micro-batch with these (B, T) entropies
    and historical means ``reference`` (per turn index); returns the context and the term (with grad)."""
    stack = build_stack("epo", {"epo": options}, max_steps=10)
    epo(stack).reference = reference
    ctx = make_loss_context(shape=tuple(entropies.shape), entropies=entropies, loss_type="dapo")
    run_hook(stack, "loss", ctx)
    base = loss_from_context(make_loss_context(shape=tuple(entropies.shape), loss_type="dapo"))
    return ctx, loss_from_context(ctx) - base


def test_default_band_is_the_readme_runs_zero_to_twice_the_history():
    # README runs: k_l = 0, k_r = 2.0 -- 0.1 is inside the band, 2.5 is 0.5 above it (the run script's [0.5, 1.5]
    # would have flagged both)
    entropies = torch.tensor([[0.1, 2.5]], requires_grad=True)
    ctx, term = epo_term({"entropy_coef": 1.0, "phase_weighting": False}, [1.0], entropies)
    assert float(term.detach()) == pytest.approx(-(0.1 + 2.5 - 0.1 * 0.5) / 2)
    assert ctx.metrics["plugins/epo/out_of_band_fraction"] == [0.5]


def test_the_entropy_term_is_an_entropy_bonus_inside_the_band():
    entropies = torch.tensor([[1.0, 1.2], [0.8, 1.4]], requires_grad=True)
    ctx, term = epo_term({"entropy_coef": 0.5, **SCRIPT_BAND}, [1.0], entropies)  # band [0.5, 1.5]
    assert float(term.detach()) == pytest.approx(-0.5 * entropies.mean().item())
    term.backward()
    assert torch.allclose(entropies.grad, torch.full((2, 2), -0.5 / 4))
    assert ctx.metrics["plugins/epo/out_of_band_fraction"] == [0.0]


def test_out_of_band_entropy_is_pulled_back_toward_the_band():
    # one token far below the band, one far above; hinge penalty alpha * distance, weight c * w_k = 1
    entropies = torch.tensor([[0.1, 3.0]], requires_grad=True)
    ctx, term = epo_term({"entropy_coef": 1.0, "penalty": 0.5, "phase_weighting": False, **SCRIPT_BAND}, [1.0],
                         entropies)
    penalties = [0.5 * (0.5 - 0.1), 0.5 * (3.0 - 1.5)]
    assert float(term.detach()) == pytest.approx(-(0.1 + 3.0 - sum(penalties)) / 2)
    term.backward()
    # below the band: bonus 1 plus the penalty's pull 0.5 (loss falls faster as entropy rises); above: 1 - 0.5
    assert entropies.grad.tolist() == [[pytest.approx(-1.5 / 2), pytest.approx(-0.5 / 2)]]
    assert ctx.metrics["plugins/epo/out_of_band_fraction"] == [1.0]


def test_indicator_penalty_is_the_official_constant_without_gradient():
    entropies = torch.tensor([[0.1, 1.0]], requires_grad=True)
    options = {"entropy_coef": 1.0, "penalty": 0.5, "phase_weighting": False, "penalty_form": "indicator",
               **SCRIPT_BAND}
    _, term = epo_term(options, [1.0], entropies)
    assert float(term.detach()) == pytest.approx(-(0.1 + 1.0 - 0.5) / 2)
    term.backward()
    assert torch.allclose(entropies.grad, torch.full((1, 2), -0.5))  # the plain bonus only


def test_penalty_uses_each_tokens_turn_and_skips_early_turns_and_tool_results():
    reference = torch.tensor([[1.0, 1.0, math.nan, 2.0]])
    entropy = torch.tensor([[0.2, 1.0, 5.0, 0.2]])
    p = band_penalty(entropy, reference, 0.5, 1.5, 1.0, "hinge")
    assert p.tolist() == [[pytest.approx(0.3), 0.0, 0.0, pytest.approx(0.8)]]
    stack = build_stack("epo", {"epo": {"smooth_from_turn": 1}}, max_steps=10)
    epo(stack).reference = [1.0, 2.0]
    per_token = epo(stack).reference_per_token(torch.tensor([[0, 0, -1, 1]]))
    assert torch.isnan(per_token[0, :3]).all() and per_token[0, 3] == 2.0


def test_loss_reads_the_turns_of_the_micro_batch():
    stack = build_stack("epo", {"epo": {"entropy_coef": 1.0, "phase_weighting": False, **SCRIPT_BAND}}, max_steps=10)
    epo(stack).reference = [1.0, 10.0]  # turn 1's band is [5, 15]
    ctx = make_loss_context(shape=(1, 4), entropies=torch.tensor([[1.0, 1.0, 1.0, 1.0]]), loss_type="dapo",
                            mask=torch.tensor([[1.0, 1.0, 0.0, 1.0]]))
    ctx.inputs[TURN_IDS_KEY] = torch.tensor([[0, 0, -1, 1]])
    run_hook(stack, "loss", ctx)
    assert ctx.metrics["plugins/epo/out_of_band_fraction"] == [pytest.approx(1 / 3)]  # only the turn-1 token


def test_phase_weight_follows_the_official_schedule():
    assert phase_weight(0, 100) == 1.0
    assert phase_weight(50, 100) == pytest.approx(1 - 0.2 * (1 - math.exp(-2)))
    assert phase_weight(51, 100) == pytest.approx(0.8 * math.exp(-3 / 50))
    assert phase_weight(100, 100) == pytest.approx(0.8 * math.exp(-3))
    stack = build_stack("epo", {"epo": {"phase_steps": 100}}, max_steps=10)
    record_history(stack, torch.ones(2, 4), step=50)
    assert epo(stack).weight() == pytest.approx(phase_weight(50, 100))


def test_history_survives_a_checkpoint():
    stack = build_stack("epo", max_steps=10)
    record_history(stack, torch.full((2, 4), 2.0), step=3)
    state = epo(stack).trl_plugins_state_dict()
    resumed = build_stack("epo", max_steps=10)
    epo(resumed).trl_plugins_load_state_dict(state)
    assert epo(resumed).reference == [pytest.approx(2.0)] and epo(resumed).step == 3
    assert historical_means([[1.0, None], [3.0, 4.0]]) == [2.0, 4.0]


def test_history_is_saved_in_checkpoints_and_a_resumed_run_continues_it(tmp_path):
    import os

    from trl_plugins.testing import make_tiny_trainer

    kw = dict(plugins=["epo"], output_dir=str(tmp_path), save_strategy="steps", save_steps=1)
    make_tiny_trainer(max_steps=1, **kw).train()
    saved = torch.load(os.path.join(tmp_path, "checkpoint-1", "trl_plugins_state.pt"), weights_only=True)["epo"]
    assert len(saved["history"]) == 1 and saved["history"][0][0] > 0
    resumed = make_tiny_trainer(max_steps=2, **kw)
    resumed.train(resume_from_checkpoint=os.path.join(tmp_path, "checkpoint-1"))
    history = epo(resumed.plugin_stack).history
    assert len(history) == 2 and history[0] == saved["history"][0]  # step 1 averaged with the restored step 0


def test_eval_batches_and_entropy_coef_zero_leave_everything_alone():
    stack = build_stack("epo", max_steps=10)
    record_history(stack, torch.ones(2, 4), mode="eval")
    assert epo(stack).history == []
    off = build_stack("epo", {"epo": {"entropy_coef": 0.0}}, max_steps=10)
    ctx = make_loss_context(shape=(2, 2), entropies=torch.ones(2, 2))
    run_hook(off, "loss", ctx)
    assert ctx.token_terms == []


def test_trls_entropy_bonus_and_other_entropy_remedies_are_refused():
    with pytest.raises(IncompatiblePluginsError, match="entropy_coef"):
        build_stack("epo", entropy_coef=0.01)
    with pytest.raises(IncompatiblePluginsError, match="lp_reg"):
        build_plugins(["epo", "lp_reg"])


@pytest.mark.parametrize("options, match", [
    ({"band_low": 2.0, "band_high": 1.0}, "band_low"), ({"penalty_form": "quadratic"}, "penalty_form"),
    ({"entropy_coef": -1.0}, "entropy_coef"), ({"phase_steps": 0}, "phase_steps"),
])
def test_bad_options_are_refused_at_construction(options, match):
    with pytest.raises(PluginConfigError, match=match):
        build_plugins(["epo"], {"epo": options})


def test_neutral_setting_reduces_to_vanilla():
    assert_reduces_to_vanilla("epo", {"entropy_coef": 0.0}, loss_types=("dapo",), steps=1)


def test_neutral_setting_reduces_to_vanilla_on_tool_rollouts():
    from trl import GRPOTrainer

    from trl_plugins.testing import assert_runs_equal, make_tool_trainer, record_run

    vanilla = record_run(make_tool_trainer(GRPOTrainer, max_steps=1))
    ours = record_run(make_tool_trainer(plugins=["epo"], plugin_config={"epo": {"entropy_coef": 0.0}}, max_steps=1))
    assert_runs_equal(vanilla, ours)


def test_epo_trains_on_real_tool_rollouts():
    from trl_plugins.testing import make_tool_trainer, record_run

    trainer = make_tool_trainer(plugins=["epo"], plugin_config={"epo": {"entropy_coef": 0.01}}, max_steps=2)
    record = record_run(trainer)
    assert len(epo(trainer.plugin_stack).reference) > 1  # one historical mean per turn index of the tool episodes
    logs = {k: v for log in record.logs for k, v in log.items()}
    assert logs["plugins/epo/batch_entropy"] > 0 and "plugins/epo/out_of_band_fraction" in logs
    assert 0 < logs["plugins/epo/phase_weight"] <= 1
