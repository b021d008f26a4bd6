"""light_if: the constraint checkers and the dense score (partial credit + the all-satisfied bonus, the answer after
</think>), the TEA-RL weights and loss term on small tensors, bad input refused at construction and when the trainer
is built, and tiny-model runs (neutral setting is vanilla; an acting run fills the column and moves the loss)."""

import math

import pytest
import torch
from datasets import Dataset

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.testing import (
    assert_reduces_to_vanilla,
    make_loss_context,
    make_reward_context,
    make_tiny_trainer,
    record_run,
    tiny_dataset,
)
from trl_plugins_builtin.light_if import (
    COLUMN,
    Constraint,
    dense_score,
    entropy_weights,
    final_answer,
    parse_constraint,
    satisfied,
)


def _c(**raw):
    return parse_constraint(raw)


@pytest.mark.parametrize(
    "raw, answer, held",
    [
        ({"type": "keyword", "word": "fund"}, "Buy a fund.", True),
        ({"type": "keyword", "word": "fund"}, "Buy a Fund.", False),  # str.count: case-sensitive
        ({"type": "keyword", "word": "x", "min": 0, "max": 0}, "no such letter", True),  # forbidden word
        ({"type": "keyword", "word": "a", "min": 2, "max": 3}, "a a a a", False),
        ({"type": "word_count", "max": 3}, "one two three", True),
        ({"type": "word_count", "min": 4}, "one two three", False),
        ({"type": "capital_words", "min": 2}, "USE CAPS for A few", True),  # 'A' is too short to count
        ({"type": "highlights", "min": 2}, "*one* and _two_", True),
        ({"type": "placeholders", "min": 1}, "Dear [name],", True),
        ({"type": "bullets", "count": 2}, "* a\n* b\n- c", True),
        ({"type": "bullets", "count": 2}, "* a\n* b\n* c", False),
        ({"type": "paragraphs", "count": 2}, "p1\n\np2\n\n", True),
        ({"type": "paragraphs", "count": 2, "separator": "***"}, "p1 *** p2", True),
        ({"type": "starts_with", "text": "Sure"}, "Sure, here it is", True),
        ({"type": "ends_with", "text": "Any questions?"}, "Done. Any questions?  ", True),
    ],
)
def test_constraint_checkers(raw, answer, held):
    assert satisfied(answer, _c(**raw)) is held


def test_default_weights_follow_the_official_partial_credit():
    assert _c(type="keyword", word="a", min=1, max=2).weight == 0.1
    assert _c(type="keyword", word="a").weight == 0.05  # one-sided
    assert _c(type="word_count", min=3, max=9).weight == 0.1 and _c(type="word_count", max=9).weight == 0.05
    assert _c(type="highlights", min=1).weight == 0.05 and _c(type="placeholders", min=1).weight == 0.05
    assert _c(type="bullets", count=3).weight == 0.1 and _c(type="paragraphs", count=3).weight == 0.1
    assert _c(type="ends_with", text="x", weight=0.3).weight == 0.3
    # Arrow fills missing struct fields with None: they count as absent
    assert _c(type="word_count", min=None, max=5, word=None) == Constraint("word_count", {"max": 5}, 0.05)


def test_dense_score_is_partial_credit_plus_the_all_satisfied_bonus():
    cs = [_c(type="word_count", max=5), _c(type="keyword", word="fund", min=1, max=1), _c(type="bullets", count=1)]
    assert dense_score("* one fund", cs, 1.0) == pytest.approx(0.05 + 0.1 + 0.1 + 1.0)
    assert dense_score("one fund", cs, 1.0) == pytest.approx(0.05 + 0.1)  # bullets missing: no bonus
    assert dense_score("one fund", cs, 0.0) == pytest.approx(0.15)
    assert dense_score("anything", [], 1.0) == 0.0


def test_final_answer_after_the_think_block():
    assert final_answer("<think>plan</think>\n Answer ", "</think>") == "Answer"
    assert final_answer("a</think>b</think> c", "</think>") == "c"
    assert final_answer("no think block", "</think>") is None
    assert final_answer(" whole ", None) == "whole"


def test_entropy_weights_hand_made():
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -2.0, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    mean_a = (3 - 2) / 5
    mean_lp = (-1 - 2 - 3 - 1 - 2) / 5
    cov = torch.tensor([[(1 - mean_a) * (x - mean_lp) for x in (-1.0, -2.0, -3.0)],
                        [(-1 - mean_a) * (x - mean_lp) for x in (-1.0, -2.0)] + [float("-inf")]])
    expected = (torch.softmax(cov, dim=-1) * 10).clamp(0, 5) * mask
    got = entropy_weights(adv, lp, mask, 10.0, 5.0)
    torch.testing.assert_close(got, expected)
    assert got[1, 2] == 0 and got.max() == 5.0  # padding gets nothing; the clamp at ub bites
    unclamped = entropy_weights(adv, lp, mask, 10.0, 100.0)
    torch.testing.assert_close(unclamped.sum(-1), torch.tensor([10.0, 10.0]))  # 10 * a softmax per row
    assert entropy_weights(adv, lp, mask, 10.0, 0.5).max() == 0.5  # the clamp
    assert torch.equal(entropy_weights(adv, lp, torch.zeros_like(mask), 10.0, 5.0), torch.zeros(2, 3))


def test_loss_term_is_minus_weight_times_entropy_and_moves_only_the_entropy_gradient():
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(2, 5, generator=g) * 3).requires_grad_(True)
    ent = (torch.rand(2, 5, generator=g) * 2).requires_grad_(True)
    adv = torch.tensor([[1.5], [-0.5]])
    mask = torch.ones(2, 5)
    ctx = make_loss_context(lp, advantages=adv, mask=mask, entropies=ent, loss_type="dapo",
                            completion_ids=torch.zeros(2, 5, dtype=torch.long))
    build_plugins(["light_if"], {}).call("trl_plugins_loss", ctx)
    (term,) = ctx.token_terms
    w = entropy_weights(adv.expand(2, 5), lp.detach(), mask, 10.0, 5.0)
    torch.testing.assert_close(term, -w * ent)
    (d_ent, d_lp) = torch.autograd.grad(term.sum(), [ent, lp], allow_unused=True)
    torch.testing.assert_close(d_ent, -w)
    assert d_lp is None  # the weight is detached


def _plugin(**options):
    return build_plugins(["light_if"], {"light_if": options}).by_name["light_if"]


def test_reward_function_scores_each_row_against_its_constraints():
    (func,) = _plugin(think_end=None).trl_plugins_reward_functions(None)
    rows = [[{"type": "word_count", "max": 2}], [{"type": "keyword", "word": "fund"}], None]
    scores = func(["one fund", "two words here", "x"], constraints=rows)
    assert scores == [pytest.approx(0.05 + 1.0), 0.0, 0.0] and func.__name__ == COLUMN
    (func,) = _plugin(constraints=[{"type": "starts_with", "text": "<think>"}]).trl_plugins_reward_functions(None)
    assert func(["<think>a</think>b"], constraints=[[]]) == [0.0]  # the answer after </think> lacks the prefix
    assert func(["no tag"], constraints=[[{"type": "word_count", "max": 9}]]) == [0.0]  # official: no </think>, 0
    with pytest.raises(PluginConfigError, match="column 'constraints' holds .* in row 0 of the reward call"):
        func(["x"], constraints=[[{"type": "rhyme"}]])


def test_all_satisfied_fraction_is_logged():
    rows = [{"constraints": [{"type": "word_count", "max": 1}]}] * 2
    ctx = make_reward_context(torch.zeros(2, 1), num_generations=2, reward_func_names=[COLUMN], rows=rows,
                              completions=["ok", "too many words"])
    _plugin(think_end=None).trl_plugins_transform_rewards(ctx)
    assert [v for k, v in ctx.metrics.items() if k.endswith("all_satisfied_fraction")] == [[0.5]]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"entropy_alpha": -1.0}, "Option 'entropy_alpha' of plugin 'light_if' got -1.0"),
        ({"entropy_ub": 0.0}, "Option 'entropy_ub' of plugin 'light_if' got 0.0"),
        ({"all_bonus": -0.5}, "Option 'all_bonus' of plugin 'light_if' got -0.5"),
        ({"think_end": ""}, "Option 'think_end' of plugin 'light_if' got ''"),
        ({"constraints": [{"type": "rhyme"}]}, "Option 'constraints' of plugin 'light_if' .* type 'rhyme'"),
        ({"constraints": [{"type": "bullets"}]}, "lacks the fields \\['count'\\]"),
        ({"constraints": [{"type": "word_count", "max": -2}]}, "field 'max' .* integer >= 0, got -2"),
        ({"constraints": [{"type": "keyword", "word": "a", "colour": 1}]}, "unknown fields \\['colour'\\]"),
        ({"constraints": [{"type": "word_count"}]}, "needs 'min' or 'max'"),
        ({"constraints": [{"type": "ends_with", "text": "x", "weight": -1}]}, "field 'weight'"),
        ({"constraints_column": None}, "leave nothing to check"),
    ],
)
def test_bad_options_are_refused_at_construction(options, message):
    with pytest.raises(PluginConfigError, match=message):
        build_plugins(["light_if"], {"light_if": options})


def test_conflicting_entropy_plugins_are_refused():
    with pytest.raises(IncompatiblePluginsError, match="clip_cov"):
        build_plugins(["light_if", "clip_cov"], {})


def _constrained(n=8, bad_row=None):
    rows = tiny_dataset(n).to_list()
    for row in rows:
        row["constraints"] = [{"type": "word_count", "max": 3}]
    if bad_row is not None:
        rows[bad_row]["constraints"] = [{"type": "rhyme", "max": 3}]
    return Dataset.from_list(rows)


def test_bad_constraints_column_is_refused_when_the_trainer_is_built(tmp_path):
    with pytest.raises(PluginConfigError, match="column 'constraints' holds .* in row 2"):
        make_tiny_trainer(plugins=["light_if"], dataset=_constrained(4, bad_row=2), output_dir=str(tmp_path))
    with pytest.raises(PluginConfigError, match="needs the dataset column 'constraints'"):
        make_tiny_trainer(plugins=["light_if"], dataset=tiny_dataset(4), output_dir=str(tmp_path))
    with pytest.raises(IncompatiblePluginsError, match="entropy"):
        make_tiny_trainer(plugins=["light_if"], dataset=_constrained(4), entropy_coef=0.01, output_dir=str(tmp_path))


# ------------------------------------------------------------------------------------------ trainer runs
def test_neutral_setting_is_vanilla():
    assert_reduces_to_vanilla("light_if", {"reward_weight": 0.0, "entropy_alpha": 0.0}, loss_types=("grpo",), steps=1)


def test_an_acting_run_scores_the_constraints_and_adds_the_entropy_term(tmp_path):
    trainer = make_tiny_trainer(plugins=["light_if"], plugin_config={"light_if": {"think_end": None}},
                                dataset=_constrained(), num_generations=4, max_completion_length=6, max_steps=1,
                                loss_type="dapo", log_level="error", output_dir=str(tmp_path))
    assert COLUMN in trainer.reward_func_names
    run = record_run(trainer)
    log = [log for log in run.logs if "loss" in log][0]
    # 6 characters hold at most 3 words: every completion meets the constraint: 0.05 + 1
    assert log["plugins/light_if/all_satisfied_fraction"] == 1.0
    assert log[f"rewards/{COLUMN}/mean"] == pytest.approx(1.05)
    assert 0 < log["plugins/light_if/entropy_weight_mean"] <= 5.0
    assert not math.isnan(run.losses[0])
