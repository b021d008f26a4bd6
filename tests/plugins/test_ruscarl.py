"""ruscarl: CPU faithfulness checks plus end-to-end runs.

Pure checks (schedule, k = round(N rho), scaffold, reward arithmetic, the judge never sees the scaffold) drive the
plugin's functions and hooks directly; the runs use the tiny model: the neutral setting (scaffold off) reproduces
trl.GRPOTrainer, and ruscarl stacked with lp_reg trains against a real OpenAI-compatible HTTP judge on loopback
that answers from the rule-based judge, with the prompt swap checked on the training batch."""

import math
import random

import pytest
import torch
from datasets import Dataset
from trl import GRPOTrainer

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.components import serve_openai_compatible
from trl_plugins.components.judge import rule_judge_handler
from trl_plugins.tasks.arithmetic import Problem, make_rubrics, rubric_score, rubric_verdict
from trl_plugins.testing import (
    assert_runs_equal,
    digit_fraction_reward,
    make_prompt_context,
    make_tiny_trainer,
    record_run,
    tiny_dataset,
)
from trl_plugins_builtin.ruscarl import (
    BASE_SYSTEM,
    INCLUDE_HEADER,
    WARNING,
    group_ratio,
    rubric_reward_value,
    scaffold_text,
    select_items,
    step_decay,
    with_system,
)

ITEMS = [
    {"criterion": "Mentions A", "points": 5.0, "tags": []},
    {"criterion": "Mentions B", "points": 3.0, "tags": []},
    {"criterion": "Claims C", "points": -6.0, "tags": []},
]


# ------------------------------------------------------------------------------------------ schedule
def test_group_ratio_linear_and_binary():
    assert [group_ratio(i, 8) for i in range(8)] == [(7 - i) / 7 for i in range(8)]
    assert group_ratio(0, 8) == 1.0 and group_ratio(7, 8) == 0.0
    assert group_ratio(0, 1) == 1.0  # G = 1
    assert [group_ratio(i, 4, "binary", k_full=1) for i in range(4)] == [1.0, 0.0, 0.0, 0.0]
    assert [group_ratio(i, 4, "binary", k_full=2) for i in range(4)] == [1.0, 1.0, 0.0, 0.0]


def test_step_sigmoid_values():
    T = 101  # x = (t - 1) / 100
    assert step_decay(1, T) > 0.999
    assert step_decay(21, T) == pytest.approx(0.5)  # x = x0 = 0.2
    assert step_decay(26, T) == pytest.approx(1 / (1 + math.exp(125 * 0.05)))  # ~0.002 at 25 %
    assert step_decay(26, T) < 0.002
    assert step_decay(16, T) > 0.99  # ~1 until ~15 %
    values = [step_decay(t, T) for t in range(1, T + 1)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # non-increasing in t
    assert step_decay(101, T) == pytest.approx(1 / (1 + math.exp(125 * 0.8)))
    # config-default shape and the other rules of the code
    assert step_decay(1, 11, x0=0.3, steepness=10) == pytest.approx(1 / (1 + math.exp(-3)))
    assert step_decay(4, 11, "step_linear") == pytest.approx(7 / 10)
    assert step_decay(6, 11, "step_power", power=2.0) == pytest.approx(0.25)
    assert step_decay(50, 100, "constant") == 1.0
    assert step_decay(1, 1) == pytest.approx(1 / (1 + math.exp(-25)))  # T = 1: x = 0


def test_ratio_non_increasing_in_row_and_step():
    plugin = build_plugins(["ruscarl"], {"ruscarl": {"judge": "rule"}}).plugins[0]
    G, T = 8, 50
    grid = [[plugin.row_ratio(i, G, s, T)[0] for s in range(T)] for i in range(G)]
    for i in range(G):
        assert all(a >= b for a, b in zip(grid[i], grid[i][1:]))
    for s in range(T):
        column = [grid[i][s] for i in range(G)]
        assert all(a >= b for a, b in zip(column, column[1:]))
    assert grid[0][0] == pytest.approx(step_decay(1, T))  # the hook's 0-based step is RuscaRL's t = 1


# ------------------------------------------------------------------------------------------ selection
def test_k_is_python_round_of_n_rho():
    items = [{"criterion": f"c{j}", "points": 1.0} for j in range(5)]
    rng = random.Random(0)
    assert len(select_items(items, 0.5, "random", rng)) == 2  # round(2.5) = 2 (half to even)
    assert len(select_items(items, 0.3, "random", rng)) == 2  # round(1.5) = 2
    assert len(select_items(items, 0.1, "random", rng)) == 0  # round(0.5) = 0
    assert len(select_items(items, 0.7, "random", rng)) == 4  # round(3.5) = 4
    assert len(select_items(items[:3], 0.5, "random", rng)) == 2  # round(1.5) = 2
    assert select_items(items, 1.0, "random", rng) == items  # rho = 1: all, in order
    chosen = select_items(items, 0.6, "random", random.Random("s"))
    assert chosen == select_items(items, 0.6, "random", random.Random("s"))  # seeded
    assert len(chosen) == 3 and len({c["criterion"] for c in chosen}) == 3  # without replacement


def test_math_linear_rule():
    items = make_rubrics(Problem.from_expression([3, 4, 2, 5], ["+", "*", "-"]))  # N = 7
    fmt, final = items[-2], items[-1]
    assert select_items(items, 1.0, "math_linear", random.Random(0)) == items
    assert select_items(items, 0.0, "math_linear", random.Random(0)) == [fmt]  # format item always
    assert select_items(items, 0.5, "math_linear", random.Random(0)) == items[:2] + [fmt]  # round(2.5) = 2
    assert final not in select_items(items, 0.99, "math_linear", random.Random(0))


def test_scaffold_text_and_injection():
    text = scaffold_text(ITEMS)
    assert INCLUDE_HEADER in text and "Points to avoid" in text
    assert "Criterion 1: Mentions A (worth 5 points)" in text
    assert "Criterion 2: Mentions B (worth 3 points)" in text
    assert "Criterion 3: Claims C (penalty: 6 points)" in text
    assert text.endswith(WARNING)
    assert WARNING not in scaffold_text(ITEMS, warning=False)
    prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert with_system(prompt, "X") == [{"role": "system", "content": "X"}, *prompt]
    assert with_system(prompt, "X", "merge_system") == [{"role": "system", "content": "X\n\nS"}, prompt[1]]
    assert with_system([{"role": "user", "content": "Q"}], "X", "merge_system")[0] == {"role": "system", "content": "X"}
    assert with_system("Q", "X") == "X\n\nQ"
    assert prompt[0]["content"] == "S"  # not mutated


# ------------------------------------------------------------------------------------------ prompt hook
def _prompt_ctx(G=4, groups=1, step=0, process_index=0, run=None):
    problem = Problem.from_expression([3, 4, 2], ["+", "*"])
    B = G * groups
    prompts = [[{"role": "user", "content": problem.question}] for _ in range(B)]
    rows = [{"prompt": p, "rubrics": make_rubrics(problem), "problem": problem.to_json()} for p in prompts]
    return make_prompt_context(rows, num_generations=G, step=step, process_index=process_index, run=run)


def _run_prompts(ctx, **options):
    stack = build_plugins(["ruscarl"], {"ruscarl": {"judge": "rule", **options}})
    stack.plugins[0]._total_steps = 100
    stack.call("trl_plugins_generation_prompts", ctx)
    return ctx


def test_prompt_swap_first_row_sees_all_items_last_row_none():
    ctx = _run_prompts(_prompt_ctx(G=4))
    items = ctx.rows[0]["rubrics"]
    first = ctx.generation_prompts[0]
    assert first[0]["role"] == "system" and first[1:] == ctx.prompts[0]
    # rho = sigma(t=1) = 1 - 1e-11 < 1: round(6 rho) = 6 items, drawn (so in random order)
    assert all(it["criterion"] in first[0]["content"] for it in items)
    assert first[0]["content"].endswith(WARNING)
    assert ctx.generation_prompts[3] == ctx.prompts[3]  # rho = 0, add_base_when_zero=False: untouched
    assert ctx.training_prompts == ctx.prompts  # every row is trained under the original prompt
    # N = 6 items; rows 1 and 2: rho = 2/3 and 1/3 -> round(4.0) = 4, round(2.0) = 2
    assert len(items) == 6
    assert [a["rubric_items"] for a in ctx.annotations] == [6, 4, 2, 0]
    assert ctx.metrics["plugins/ruscarl/mean_ratio"] == [pytest.approx(0.5)]


def test_participate_training_and_base_when_zero():
    ctx = _run_prompts(_prompt_ctx(G=4), participate_training=True, add_base_when_zero=True)
    assert ctx.training_prompts == ctx.generation_prompts
    assert ctx.generation_prompts[3][0] == {"role": "system", "content": BASE_SYSTEM}


def test_scaffold_off_and_late_steps_leave_prompts_untouched():
    ctx = _run_prompts(_prompt_ctx(G=4), scaffold=False)
    assert ctx.generation_prompts == ctx.prompts and not ctx.metrics
    ctx = _run_prompts(_prompt_ctx(G=4, step=50))  # x ~ 0.5: sigma ~ 0, k = 0 everywhere
    assert ctx.generation_prompts == ctx.prompts


def test_subsets_depend_on_global_row_not_on_process():
    a = _run_prompts(_prompt_ctx(G=4, groups=2))
    b = _run_prompts(_prompt_ctx(G=4, groups=1, process_index=1))  # the second group, held by process 1
    assert b.generation_prompts == a.generation_prompts[4:]


# ------------------------------------------------------------------------------------------ reward
def test_reward_arithmetic():
    assert rubric_reward_value(ITEMS, [True, False, True]) == pytest.approx(-0.125)  # (5 - 6) / 8
    assert rubric_reward_value(ITEMS, [True, True, False]) == 1.0
    assert rubric_reward_value([{"criterion": "x", "points": -2.0}], [True]) == 0.0  # no positive item


class RecordingJudge:
    location = "recording"

    def __init__(self, verdicts):
        self.verdicts, self.requests = verdicts, []

    def grade(self, requests):
        self.requests.extend(requests)
        return [self.verdicts[r.item["criterion"]] for r in requests]


def test_reward_function_one_call_per_item_and_the_judge_never_sees_the_scaffold():
    stack = build_plugins(["ruscarl"], {"ruscarl": {"judge": "rule"}})
    plugin = stack.plugins[0]
    judge = RecordingJudge({"Mentions A": True, "Mentions B": False, "Claims C": True})
    plugin.judge = judge
    (func,) = plugin.trl_plugins_reward_functions(args=None)
    prompts = [[{"role": "system", "content": "keep"}, {"role": "user", "content": "Q"}], "plain"]
    logged = {}
    scores = func(prompts=prompts, completions=[[{"role": "assistant", "content": "R1"}], "R2"],
                  completion_ids=[[1], [2]], rubrics=[ITEMS, ITEMS[:2]], trainer_state=None,
                  log_metric=lambda k, v: logged.setdefault(k, v))
    assert scores == [pytest.approx(-0.125), pytest.approx(5 / 8)]
    assert len(judge.requests) == 5
    assert judge.requests[0].conversation == [{"role": "user", "content": "Q"}]  # system messages removed
    assert judge.requests[3].conversation == [{"role": "user", "content": "plain"}]
    assert [r.completion for r in judge.requests] == ["R1"] * 3 + ["R2"] * 2
    assert logged["plugins/ruscarl/judge_requests"] == 5.0


def test_empty_rubric_list_is_refused_or_left_out_of_the_reward():
    """An empty rubric list is a data error by default (not a silent 0.0); with empty_rubrics='skip' the row's
    rubric reward is None (TRL leaves it out of the weighted sum) and the score metric ignores it."""
    kwargs = dict(prompts=["Q1", "Q2"], completions=["R1", "R2"], completion_ids=[[1], [2]], trainer_state=None)
    strict = build_plugins(["ruscarl"], {"ruscarl": {"judge": "rule"}}).plugins[0]
    strict.judge = RecordingJudge({"Mentions A": True, "Mentions B": True, "Claims C": False})
    (func,) = strict.trl_plugins_reward_functions(args=None)
    with pytest.raises(PluginConfigError, match="row 1 .*no rubric items.*empty_rubrics"):
        func(rubrics=[ITEMS, []], **kwargs)
    with pytest.raises(PluginConfigError, match="1 of 3 rows have no rubric items .*first: row 2"):
        strict.check_dataset(Dataset.from_dict({"rubrics": [ITEMS, ITEMS[:1], []]}))
    strict.check_dataset(Dataset.from_dict({"rubrics": [ITEMS, ITEMS[:1]]}))  # complete data passes

    lenient = build_plugins(["ruscarl"], {"ruscarl": {"judge": "rule", "empty_rubrics": "skip"}}).plugins[0]
    lenient.judge = strict.judge
    lenient.check_dataset(Dataset.from_dict({"rubrics": [ITEMS, []]}))
    (func,) = lenient.trl_plugins_reward_functions(args=None)
    logged = {}
    scores = func(rubrics=[ITEMS, None], log_metric=lambda k, v: logged.setdefault(k, v), **kwargs)
    assert scores == [1.0, None]
    assert logged["plugins/ruscarl/rubric_score_clipped"] == 1.0
    assert logged["plugins/ruscarl/judge_requests"] == 3.0


def test_options_refused():
    with pytest.raises(PluginConfigError, match="judge_base_url"):
        build_plugins(["ruscarl"], {"ruscarl": {}})
    with pytest.raises(PluginConfigError, match="step_rule"):
        build_plugins(["ruscarl"], {"ruscarl": {"judge": "rule", "step_rule": "cosine"}})


# ------------------------------------------------------------------------------------------ runs
def rule_rubric(prompts, completions, rubrics, problem, **kwargs):
    """The rubric reward computed directly with the rule-based judge (the vanilla side of the neutral check)."""
    out = []
    for c, items, raw in zip(completions, rubrics, problem):
        p = Problem.from_json(raw)
        text = c if isinstance(c, str) else c[-1]["content"]
        out.append(rubric_score(items, [rubric_verdict(it, p, text) for it in items]))
    return out


RUN = dict(max_steps=2, log_level="error")


def test_neutral_setting_scaffold_off_is_vanilla_grpo(tmp_path):
    vanilla = record_run(make_tiny_trainer(GRPOTrainer, reward_funcs=[digit_fraction_reward, rule_rubric],
                                           output_dir=str(tmp_path / "v"), **RUN))
    ours = record_run(make_tiny_trainer(plugins=["ruscarl"],
                                        plugin_config={"ruscarl": {"judge": "rule", "scaffold": False}},
                                        reward_funcs=[digit_fraction_reward], output_dir=str(tmp_path / "p"), **RUN))
    assert any(a.abs().sum() > 0 for a in vanilla.advantages)
    assert_runs_equal(vanilla, ours)


def test_end_to_end_http_judge_stacked_with_lp_reg(tmp_path):
    """ruscarl (endpoint judge on loopback, answering with the rule-based judge) + lp_reg, two steps."""
    seen = []
    with serve_openai_compatible(rule_judge_handler(seen)) as url:
        trainer = make_tiny_trainer(
            plugins=["ruscarl", "lp_reg"],
            plugin_config={"ruscarl": {"judge_base_url": url, "judge_max_retries": 1}},
            reward_funcs=[digit_fraction_reward], dataset=tiny_dataset(8), output_dir=str(tmp_path), **RUN,
        )
        generated, batches = [], []
        original_single, original_gen = trainer._generate_single_turn, trainer._generate_and_score_completions

        def single_turn(prompt_ids, *args, **kwargs):
            generated.append([list(p) for p in prompt_ids])
            return original_single(prompt_ids, *args, **kwargs)

        def gen(inputs):
            out = original_gen(inputs)
            batches.append((inputs, out))
            return out

        trainer._generate_single_turn, trainer._generate_and_score_completions = single_turn, gen
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        run = record_run(trainer)

    tok = trainer.processing_class
    G = trainer.num_generations
    assert len(batches) == 2
    inputs, out = batches[0]
    for i, row in enumerate(inputs):
        original = tok(tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False)["input_ids"]
        trained = out["prompt_ids"][i][out["prompt_mask"][i].bool()].tolist()
        assert trained == original  # training prompt ids = the original prompt, for every row
        if i % G == 0:
            assert generated[0][i] != original  # row 0 of each group was sampled under the scaffold
            assert "Points to include" in tok.decode(generated[0][i])
        if i % G == G - 1:
            assert generated[0][i] == original  # the last row of a group saw no scaffold
    # one judge request per rubric item and row, and the judge never saw the scaffold
    n_items = sum(len(row["rubrics"]) for inputs, _ in batches for row in inputs)
    assert len(seen) == n_items
    assert not any("Points to include" in p or "evaluation criteria" in p or "system:" in p for p in seen)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        assert "rewards/ruscarl_rubric/mean" in log
        assert "plugins/ruscarl/mean_ratio" in log and "plugins/ruscarl/judge_requests" in log
        assert "plugins/lp_reg/selected_token_fraction" in log
