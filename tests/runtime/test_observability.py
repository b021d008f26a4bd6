"""Plugin metrics and annotations reach TRL's logging: every ``report_to`` backend gets ``plugins/<name>/...``
scalars (read back from tensorboard event files and from trackio's local store), and the completions table
(``completions/*.parquet`` with ``log_completions=True``) carries the per-row ``plugin_annotations`` column,
aligned with its rows also when evaluation batches (which have no sampling plugins) are logged in between."""

import collections
import glob
import json
import os
import subprocess
import sys

import pytest

from trl_plugins import Plugin, hookimpl
from trl_plugins.testing import digit_fraction_reward, make_tiny_trainer, temporary_plugin, tiny_dataset

STAGE_VALUES = {"prompt": 1.0, "rollout": 2.0, "reward": 3.0, "advantage": 4.0, "loss": 5.0}


class LogsEverywhere(Plugin):
    """Logs one constant from each of the five stage contexts."""

    name = "obs_probe"

    @hookimpl
    def trl_plugins_generation_prompts(self, ctx):
        ctx.log_metric("prompt", STAGE_VALUES["prompt"])

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        ctx.log_metric("rollout", STAGE_VALUES["rollout"])

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx):
        ctx.log_metric("reward", STAGE_VALUES["reward"])

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx):
        ctx.log_metric("advantage", STAGE_VALUES["advantage"])

    @hookimpl
    def trl_plugins_loss(self, ctx):
        ctx.log_metric("loss", STAGE_VALUES["loss"])


def _scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(logdir, size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_plugin_metrics_reach_tensorboard(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    logdir = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logdir))
    with temporary_plugin(LogsEverywhere):
        trainer = make_tiny_trainer(plugins=["obs_probe", "canon"], reward_funcs=[digit_fraction_reward],
                                    loss_type="dr_grpo", report_to=["tensorboard"], max_steps=2,
                                    output_dir=str(tmp_path / "out"), log_level="error")
        trainer.train()
    assert glob.glob(str(logdir / "events.out.tfevents.*"))
    scalars = _scalars(str(logdir))
    for stage, value in STAGE_VALUES.items():
        assert scalars[f"train/plugins/obs_probe/{stage}"] == [(1, value), (2, value)], sorted(scalars)
    for key in ("train/plugins/canon/lam", "train/plugins/framework/extra_rollouts",
                "train/plugins/framework/offpolicy_token_fraction"):
        assert [step for step, _ in scalars[key]] == [1, 2], key
    assert scalars["train/plugins/canon/lam"][0][1] == 1.0


def test_completions_table_carries_plugin_annotations(tmp_path):
    """hint_scaffold (Scaf-GRPO mode) replaces slot 0 of each all-fail group at the 25 % hint; the table row
    says so. Evaluation batches logged in between get blank annotations, so columns stay aligned with rows."""
    pd = pytest.importorskip("pandas")
    calls = collections.Counter()

    def staged(completions, trainer_state=None, **kwargs):
        """0 for the first scoring of a step (every group fails), 1 afterwards (the first hint succeeds)."""
        calls[trainer_state.global_step] += 1
        return [0.0 if calls[trainer_state.global_step] == 1 else 1.0 for _ in completions]

    eval_data = tiny_dataset(1, seed=5)
    out = tmp_path / "out"
    trainer = make_tiny_trainer(
        plugins=["hint_scaffold"], plugin_config={"hint_scaffold": {"replace": "one"}}, reward_funcs=[staged],
        output_dir=str(out), log_completions=True, max_steps=2, eval_dataset=eval_data, eval_strategy="steps",
        eval_steps=2, per_device_eval_batch_size=4, log_level="error",
    )
    trainer.train()
    first = pd.read_parquet(out / "completions" / "completions_00001.parquet")
    assert first["plugin_annotations"].tolist() == ["hint_level=0.25", "", "", ""]
    assert first["step"].tolist() == [1] * 4
    # the evaluation at step 2 rewrites step 2's table with its own rows: no sampling plugin ran on them
    second = pd.read_parquet(out / "completions" / "completions_00002.parquet")
    eval_prompt = eval_data[0]["prompt"][-1]["content"]
    assert [p[-1]["content"] for p in second["prompt"]] == [eval_prompt] * 4
    assert second["plugin_annotations"].tolist() == ["", "", "", ""]
    logs = {k: v for log in trainer.state.log_history for k, v in log.items()}
    assert logs["plugins/hint_scaffold/rescued_group_fraction"] == 1.0


_TRACKIO_RUN = """
import json, sys
from trl_plugins.testing import digit_fraction_reward, make_tiny_trainer
trainer = make_tiny_trainer(plugins=["hint_scaffold", "canon"],
                            plugin_config={"hint_scaffold": {"success_threshold": 0.9}},
                            reward_funcs=[digit_fraction_reward], output_dir=sys.argv[1], report_to=["trackio"],
                            project="trl_plugins_obs", run_name="obs", max_steps=2, log_completions=True,
                            loss_type="dr_grpo", log_level="error")
trainer.train()
from trackio.sqlite_storage import SQLiteStorage
print("TRACKIO_LOGS " + json.dumps(SQLiteStorage.get_logs("trl_plugins_obs", "obs"), default=str))
"""


@pytest.mark.slow
def test_plugin_metrics_and_completions_reach_trackio(tmp_path):
    """trackio in local mode (no Space: its store is a SQLite file under TRACKIO_DIR), in a fresh interpreter
    because trackio reads TRACKIO_DIR when imported."""
    pytest.importorskip("trackio")
    env = dict(os.environ, TRACKIO_DIR=str(tmp_path / "trackio"), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", _TRACKIO_RUN, str(tmp_path / "out")], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("TRACKIO_LOGS "))
    logs = json.loads(line[len("TRACKIO_LOGS "):])
    scalars = [entry for entry in logs if "train/loss" in entry]  # the per-step logs (not the final summary)
    assert [entry["train/global_step"] for entry in scalars] == [1, 2]
    for key in ("train/plugins/canon/lam", "train/plugins/hint_scaffold/all_fail_group_fraction",
                "train/plugins/framework/extra_rollouts"):
        assert all(key in entry for entry in scalars), key
    tables = [entry["completions"] for entry in logs if "completions" in entry]
    assert len(tables) >= 2  # one per log call (TRL logs the table again with the final training summary)
    for table in tables:
        assert len(table["_value"]) == 4 and all("plugin_annotations" in row for row in table["_value"])
