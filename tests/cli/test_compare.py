"""``trl-plugins compare`` and :mod:`trl_plugins.cli.equal_budget`: equal rollout budgets (extra rollouts counted),
held-out scores, the table / JSON / plots, resuming without redoing finished runs."""

import json
import math

import pytest
import yaml

from trl_plugins.cli import compare
from trl_plugins.cli import main as cli_main
from trl_plugins.cli.equal_budget import (
    EqualBudget,
    count_policy_rollouts,
    held_out_score,
    mean_std,
    merge_logs,
    rollouts_to_target,
)
from trl_plugins.tasks.arithmetic import accuracy_reward
from trl_plugins.testing import digit_fraction_reward, make_tiny_trainer, tiny_dataset


def test_stacks_are_parsed():
    assert compare.parse_stack("grpo") == []
    assert compare.parse_stack("lp_reg,canon") == ["lp_reg", "canon"] == compare.parse_stack("lp_reg+canon")
    with pytest.raises(compare.PluginConfigError, match="Empty stack"):
        compare.parse_stack(" , ")


def test_statistics():
    assert mean_std([1.0, 3.0]) == (2.0, pytest.approx(math.sqrt(2)))
    assert mean_std([float("nan"), 2.0]) == (2.0, 0.0)
    evals = [{"rollouts": 64, "score": 0.2}, {"rollouts": 128, "score": 0.6}]
    assert rollouts_to_target(evals, 0.2, 0.4, key="score") == pytest.approx(96.0)  # halfway between 64 and 128
    assert math.isnan(rollouts_to_target(evals, 0.2, 0.9, key="score"))
    assert rollouts_to_target(evals, 0.5, 0.4, key="score") == 0.0


def test_policy_rollouts_are_counted_with_the_extra_ones_and_the_budget_stops_training(tmp_path):
    """hint_scaffold re-generates all-fail groups (every group of an untrained model): those extra completions
    count, so the budget is reached in fewer optimizer steps than TRL's own rollouts alone would take."""
    trainer = make_tiny_trainer(plugins=["hint_scaffold"], max_steps=5, output_dir=str(tmp_path),
                                per_device_train_batch_size=4, num_generations=4, max_completion_length=6)
    counts = count_policy_rollouts(trainer)
    evaluations = []
    budget = EqualBudget(counts, budget=8, eval_every=4, evaluate=lambda s, r: evaluations.append((s, r)))
    trainer.add_callback(budget)
    trainer.train()
    extra = sum(log.get("plugins/framework/extra_rollouts", 0) for log in trainer.state.log_history)
    assert extra > 0
    assert counts["rollouts"] == 4 * trainer.state.global_step + extra  # TRL's 4 per step + the plugin's
    assert trainer.state.global_step < 2  # 4 of TRL's per step alone would need 2 steps for 8
    assert counts["rollouts"] >= 8 and evaluations[-1] == (trainer.state.global_step, counts["rollouts"])
    rows = merge_logs(budget.per_step, trainer.state.log_history)
    assert rows[-1]["rollouts"] == counts["rollouts"] and "reward" in rows[-1]
    assert rows[-1]["tokens"] == counts["tokens"] > 0


def test_a_budget_of_generated_tokens_counts_the_new_tokens_only(tmp_path):
    """Without plugins the tokens are TRL's completion lengths (its logged mean length x rows); the budget in tokens
    stops training at the first step that reaches it."""
    trainer = make_tiny_trainer(max_steps=6, output_dir=str(tmp_path), per_device_train_batch_size=4,
                                num_generations=4, max_completion_length=6)
    counts = count_policy_rollouts(trainer)
    budget = EqualBudget(counts, budget=30, eval_every=10, unit="tokens")
    trainer.add_callback(budget)
    trainer.train()
    logged = [log for log in trainer.state.log_history if "completions/mean_length" in log]
    assert counts["tokens"] == round(sum(4 * log["completions/mean_length"] for log in logged))
    assert counts["tokens"] >= 30 and trainer.state.global_step < 6  # at most 24 tokens a step
    assert [row["tokens"] >= 30 for row in budget.per_step] == [False] * (len(budget.per_step) - 1) + [True]
    with pytest.raises(ValueError, match="unit must be one of"):
        EqualBudget(counts, budget=30, eval_every=10, unit="steps")


def test_the_later_turns_of_a_tool_episode_are_not_counted_as_rollouts(tmp_path):
    """With tools, TRL's tool loop generates again after each tool result; those turns continue a counted rollout."""
    from trl_plugins.testing import make_tool_trainer

    # the gold-trace backend: every second row answers at once, the others make two calls (scaled questions)
    trainer = make_tool_trainer(kinds=["scaled"], max_steps=1, per_device_train_batch_size=4, num_generations=4,
                                output_dir=str(tmp_path))
    counts = count_policy_rollouts(trainer)
    rounds, trl_round = [], trainer._trl_generation_round

    def recording_round(prompts):
        rounds.append(trl_round(prompts))
        return rounds[-1]

    trainer._trl_generation_round = recording_round
    trainer.train()
    assert trainer.state.log_history[0]["tools/call_frequency"] == 1.0  # two turns after tool results, every other row
    assert counts["rollouts"] == 4
    # generated tokens: the policy's turns (tool mask 1), not the tool responses between them
    (_, completion_ids, tool_mask, *_), = rounds
    sampled, total = sum(sum(m) for m in tool_mask), sum(len(c) for c in completion_ids)
    assert counts["tokens"] == sampled < total


def test_held_out_score_is_the_reward_of_greedy_completions():
    from trl_plugins.tasks.tiny import evaluate_accuracy

    trainer = make_tiny_trainer(reward_funcs=[digit_fraction_reward])
    held = tiny_dataset(6, seed=3)
    score = held_out_score(trainer.model, trainer.processing_class, held, accuracy_reward, max_new_tokens=8)
    assert score == evaluate_accuracy(trainer.model, trainer.processing_class, held, max_new_tokens=8)
    dense = held_out_score(trainer.model, trainer.processing_class, held, digit_fraction_reward, max_new_tokens=8)
    assert 0.0 <= dense <= 1.0


def _fake_run(calls):
    def run_one(config_path, budget, eval_every, args, base_path):
        config = yaml.safe_load(config_path.read_text())
        calls.append((tuple(config["plugins"]), config["seed"]))
        if not base_path.exists():
            base_path.write_text(json.dumps({"score": 0.2, "metric": "accuracy", "held_out": "a test split"}))
        gain = 0.1 * len(config["plugins"]) + 0.01 * config["seed"]
        evals = [{"step": 1, "rollouts": budget // 2, "score": 0.2 + gain / 2},
                 {"step": 2, "rollouts": budget, "score": 0.2 + gain}]
        per_step = [{"step": 1, "rollouts": budget // 2, "entropy": 1.0, "plugins/lp_reg/regularised_token_fraction": 0.1},
                    {"step": 2, "rollouts": budget, "entropy": 0.9, "plugins/lp_reg/regularised_token_fraction": 0.3}]
        claims = {"lp_reg": ["regularised_token_fraction", "tokens regularised"]} if "lp_reg" in config["plugins"] else {}
        return {"plugins": config["plugins"], "seed": config["seed"], "budget": budget, "rollouts": budget, "steps": 2,
                "seconds": 1.0, "evals": evals, "per_step": per_step, "claim_metrics": claims}

    return run_one


def test_compare_writes_table_json_plots_and_resumes(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(compare, "run_one", _fake_run(calls))
    config = tmp_path / "config.yaml"
    config.write_text("model_name_or_path: builtin:tiny\nper_device_train_batch_size: 8\nplugins: [lp_reg]\n"
                      "plugin_config:\n  lp_reg: {kappa: 0.05}\n  canon: {alpha: 0.5}\n")
    out = tmp_path / "cmp"
    argv = [str(config), "--stacks", "grpo", "lp_reg", "--seeds", "2", "--rollouts", "64", "--output-dir", str(out)]
    assert compare.main(argv) == 0
    assert sorted(calls) == [((), 0), ((), 1), (("lp_reg",), 0), (("lp_reg",), 1)]
    run_config = yaml.safe_load(next((out / "runs").glob("lp_reg__s0*/config.yaml")).read_text())
    assert run_config["plugin_config"] == {"lp_reg": {"kappa": 0.05}}  # the stack's own options, not canon's
    assert run_config["save_strategy"] == "no" and run_config["max_steps"] >= 64 // 8
    result = json.loads((out / "compare.json").read_text())
    rows = {r["stack"]: r for r in result["summary"]}
    assert rows["lp_reg"]["score"][0] == pytest.approx(0.305) and rows["grpo"]["score"][0] == pytest.approx(0.205)
    assert rows["lp_reg"]["reached"] == "2/2" and rows["grpo"]["reached"] == "0/2"  # target 0.25
    assert rows["lp_reg"]["claims"]["lp_reg: tokens regularised"][0] == pytest.approx(0.2)
    table = (out / "compare.md").read_text()
    assert "| lp_reg | 2 | 0.305 ± 0.007 | +0.100 |" in table and "lp_reg: tokens regularised 0.200" in table
    assert (out / "score.png").stat().st_size > 0 and (out / "entropy.png").stat().st_size > 0
    assert "Table:" in capsys.readouterr().out
    # run again: every finished run is reused, none redone; --fresh redoes them
    calls.clear()
    assert compare.main(argv) == 0 and calls == []
    assert compare.main(argv + ["--fresh"]) == 0 and len(calls) == 4


def test_compare_refuses_a_bad_stack_before_any_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(compare, "run_one", lambda *a: pytest.fail("no run may start"))
    config = tmp_path / "config.yaml"
    config.write_text("model_name_or_path: builtin:tiny\n")
    assert cli_main(["compare", str(config), "--stacks", "grpo", "lp_rge", "--output-dir", str(tmp_path)]) == 2
    assert "Unknown plugin 'lp_rge'. Did you mean 'lp_reg'" in capsys.readouterr().err
    assert cli_main(["compare", str(config), "--stacks", "canon,riskpo", "--output-dir", str(tmp_path)]) == 2
    assert "each recompute the advantages" in capsys.readouterr().err


@pytest.mark.slow
def test_compare_trains_each_stack_at_the_same_budget(tmp_path):
    """A real comparison on a tiny untrained model: every run stops at the budget, extra rollouts included."""
    from trl_plugins.tasks.tiny import build_and_save

    tiny = build_and_save(tmp_path / "tiny")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "model_name_or_path": str(tiny), "dataset_name": "builtin:arithmetic", "reward_funcs": ["accuracy"],
        "task_size": 16, "task_levels": [1], "per_device_train_batch_size": 4, "num_generations": 4,
        "max_completion_length": 8, "logging_steps": 1, "use_cpu": True, "bf16": False, "report_to": "none",
        "output_dir": str(tmp_path / "unused"),
    }))
    out = tmp_path / "cmp"
    assert cli_main(["compare", str(config), "--stacks", "grpo", "hint_scaffold", "--seeds", "1", "--rollouts", "8",
                     "--eval-size", "4", "--output-dir", str(out)]) == 0
    result = json.loads((out / "compare.json").read_text())
    for stack, (run,) in result["runs"].items():
        extra = sum(row.get("plugins/framework/extra_rollouts", 0) for row in run["per_step"])
        assert run["rollouts"] == 4 * run["steps"] + extra >= 8, stack
        assert run["evals"] and run["evals"][-1]["rollouts"] == run["rollouts"]
    assert result["runs"]["hint_scaffold"][0]["steps"] <= result["runs"]["grpo"][0]["steps"]
    assert (out / "score.png").is_file() and "| hint_scaffold | 1 |" in (out / "compare.md").read_text()


def test_an_edited_config_is_trained_again_and_a_damaged_record_is_redone(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(compare, "run_one", _fake_run(calls))
    config = tmp_path / "config.yaml"
    config.write_text("model_name_or_path: builtin:tiny\nper_device_train_batch_size: 8\nlearning_rate: 1.0e-5\n")
    out = tmp_path / "cmp"
    argv = [str(config), "--stacks", "grpo", "--seeds", "1", "--rollouts", "64", "--output-dir", str(out)]
    assert compare.main(argv) == 0 and len(calls) == 1
    assert compare.main(argv) == 0 and len(calls) == 1  # reused
    config.write_text("model_name_or_path: builtin:tiny\nper_device_train_batch_size: 8\nlearning_rate: 3.0e-5\n")
    assert compare.main(argv) == 0 and len(calls) == 2  # the edited config is not answered by the old run
    records = sorted((out / "runs").glob("grpo__*.json"))
    assert len(records) == 2 and all("__c" in r.name for r in records)
    newest = max(records, key=lambda r: r.stat().st_mtime)
    newest.write_text('{"plugins": [], "evals": [{"st')  # cut off mid-write (by an older release)
    with pytest.warns(UserWarning, match="cannot be read .* the run is done again"):
        assert compare.main(argv) == 0
    assert len(calls) == 3 and json.loads(newest.read_text())["evals"]
    assert not list(out.rglob("*.tmp"))  # records are written through a temporary file and a rename


@pytest.mark.parametrize("flags, expected", [
    (["--seeds", "0"], "--seeds must be an integer >= 1 (leave it out for the default); got 0."),
    (["--rollouts", "0"], "--rollouts must be an integer >= 1"),
    (["--rollouts", "-64"], "got -64"),
    (["--eval-every", "0"], "--eval-every must be an integer >= 1"),
    (["--eval-size", "0"], "--eval-size must be an integer >= 1"),
    (["--target", "nan"], "--target must be a finite number; got nan."),
])
def test_zero_and_negative_counts_are_refused(flags, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(compare, "run_one", lambda *a: pytest.fail("no run may start"))
    config = tmp_path / "config.yaml"
    config.write_text("model_name_or_path: builtin:tiny\n")
    assert cli_main(["compare", str(config), *flags, "--output-dir", str(tmp_path / "o")]) == 2
    assert expected in capsys.readouterr().err


def _tool_config(tmp_path, **extra):
    config = tmp_path / "tools.yaml"
    config.write_text(yaml.safe_dump({
        "model_name_or_path": "builtin:tiny", "dataset_name": "builtin:tools", "reward_funcs": ["tool_answer"],
        "environment_factory": "trl_plugins.tasks.tools.ToolEnvironment", "task_size": 16,
        "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 24, "logging_steps": 1,
        "use_cpu": True, "bf16": False, "report_to": "none", "output_dir": str(tmp_path / "unused"), **extra,
    }))
    return config


def test_compare_builds_a_tool_run_exactly_as_train_does(tmp_path):
    from trl_plugins.cli.train import TrainScriptArguments, build_trainer, parse_config

    config = _tool_config(tmp_path)
    trainer, script_args, _ = compare.build_run(config)
    from trl import ModelConfig, TrlParser

    from trl_plugins import PluginGRPOConfig

    parser = TrlParser((TrainScriptArguments, PluginGRPOConfig, ModelConfig))
    reference = build_trainer(*parse_config(parser, ["--config", str(config)]))
    assert compare.uses_tools(trainer) and compare.uses_tools(reference)
    assert list(trainer.environment_factories) == list(reference.environment_factories) == [None]
    assert [t.__name__ for t in trainer.tools] == [t.__name__ for t in reference.tools] == ["calculator", "search"]
    # the tool-calling chat template the built-in model gets from train, and the held-out questions: none trained on
    assert trainer.processing_class.chat_template == reference.processing_class.chat_template
    train, held, source = compare.split_held_out(script_args, trainer.train_dataset, "test", 6)
    assert len(held) == 6 and not {str(p) for p in held["prompt"]} & {str(p) for p in train["prompt"]}
    assert "another draw" in source


def test_the_tool_held_out_score_is_the_runs_own_reward_over_tool_rollouts(tmp_path):
    from trl_plugins.tasks.tools import search, tool_answer_reward
    from trl_plugins.testing import make_tool_trainer

    trainer = make_tool_trainer(n=8, output_dir=str(tmp_path), per_device_eval_batch_size=3)
    held = trainer.train_dataset.select(range(4))
    calls = []
    original = trainer._tool_call_loop
    trainer._tool_call_loop = lambda *a, **k: calls.append(1) or original(*a, **k)
    score = compare.tool_held_out_score(trainer, held, tool_answer_reward)
    # the scripted backend answers through the tool loop (gold traces) on part of the rows: a score above 0 needs the tools
    assert 0.0 < score <= 1.0 and calls
    assert trainer.args.per_device_eval_batch_size == 3  # restored
    with pytest.raises(compare.PluginConfigError, match=r"--eval-metric 'search': with tools .* choose one of "
                                                        r"\['tool_answer_reward'\]"):
        compare.tool_held_out_score(trainer, held, search)


@pytest.mark.slow
def test_compare_runs_a_tool_config(tmp_path):
    """builtin:tools with environment_factory: trained and evaluated with the tools (it used to be refused)."""
    config = _tool_config(tmp_path)
    out = tmp_path / "cmp"
    assert cli_main(["compare", str(config), "--stacks", "grpo", "--seeds", "1", "--rollouts", "8", "--eval-size", "4",
                     "--output-dir", str(out)]) == 0
    result = json.loads((out / "compare.json").read_text())
    (run,) = result["runs"]["grpo"]
    assert run["rollouts"] >= 8 and run["evals"]
    assert "rollouts with the run's tools" in result["held_out"]
    assert any("tools/call_frequency" in row for row in run["per_step"]), run["per_step"]


def test_pending_values_join_their_steps_row_and_a_passed_deadline_evaluates_and_truncates():
    from types import SimpleNamespace

    counts = {"rollouts": 0, "tokens": 0}
    pending: dict = {}
    evaluations = []
    budget = EqualBudget(counts, budget=100, eval_every=50, evaluate=lambda s, r: evaluations.append((s, r)),
                         pending=pending, deadline=float("inf"))
    control = SimpleNamespace(should_training_stop=False)
    counts["rollouts"], pending["train_reward"] = 10, 0.5
    budget.on_step_end(None, SimpleNamespace(global_step=1), control)
    assert budget.per_step == [{"step": 1, "rollouts": 10, "tokens": 0, "train_reward": 0.5}] and pending == {}
    assert not control.should_training_stop and evaluations == []
    budget.deadline = 0.0  # past: the next step evaluates and stops the run short of its budget
    counts["rollouts"] = 20
    budget.on_step_end(None, SimpleNamespace(global_step=2), control)
    assert control.should_training_stop and budget.truncated and evaluations == [(2, 20)]
    assert budget.per_step[-1] == {"step": 2, "rollouts": 20, "tokens": 0}
