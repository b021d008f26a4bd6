"""Readable console output (``trl_plugins.cli.console``): a progress bar with the headline metrics and a closing summary
instead of TRL's per-step metrics dict; every metric still reaches the log file and ``trainer.state.log_history``."""

import json

from trl_plugins.cli.console import headline_metrics, install, table
from trl_plugins.tasks.arithmetic import accuracy_reward
from trl_plugins.testing import build_stack, digit_fraction_reward, make_tiny_trainer


def test_headlines_are_reward_accuracy_and_each_plugins_claim_metric():
    stack = build_stack(["hint_scaffold", "lp_reg"])
    heads = headline_metrics(list(stack), ["accuracy_reward", "format_reward"])
    assert heads == [("reward", "reward"), ("accuracy", "rewards/accuracy_reward/mean"),
                     ("hint_scaffold:rescued_group_fraction", "plugins/hint_scaffold/rescued_group_fraction"),
                     ("lp_reg:regularised_token_fraction", "plugins/lp_reg/regularised_token_fraction")]
    assert headline_metrics([], ["digit_fraction_reward"]) == [("reward", "reward")]  # no accuracy column: none


def _trainer(tmp_path, **kwargs):
    return make_tiny_trainer(plugins=["canon"], reward_funcs=[accuracy_reward, digit_fraction_reward],
                             loss_type="dr_grpo", max_steps=2, output_dir=str(tmp_path), verbose=True, **kwargs)


def test_a_run_shows_headlines_and_a_summary_and_logs_everything(tmp_path, capsys):
    trainer = _trainer(tmp_path)  # verbose=True in the kit: TRL's printer is installed, and install removes it
    console = install(trainer)
    trainer.train()
    out = capsys.readouterr()
    assert "'loss'" not in out.out  # no per-step metrics dict
    assert "Summary: 2 steps" in out.out
    summary = out.out[out.out.index("Summary:"):]
    for label in ("reward", "accuracy", "canon:high_minus_low_reward"):
        assert f"\n{label} " in summary, summary
    assert "training" in out.err and "2/2" in out.err  # the progress bar, on stderr
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) >= 2 and all("step" in line for line in lines)
    assert any("plugins/canon/lam" in line and "entropy" in line for line in lines)  # every metric, not headlines
    assert console.values["plugins/canon/high_minus_low_reward"]  # what the summary was made from


def test_verbose_prints_every_metric_too(tmp_path, capsys):
    trainer = _trainer(tmp_path)
    install(trainer, verbose=True, log_file=tmp_path / "elsewhere.jsonl")
    trainer.train()
    out = capsys.readouterr().out
    assert "'plugins/canon/lam'" in out and "Summary: 2 steps" in out
    assert (tmp_path / "elsewhere.jsonl").is_file()


def test_table_aligns_columns():
    assert table([("a", "bb"), ("ccc", "d")]) == ["a    bb", "---  --", "ccc  d"]
