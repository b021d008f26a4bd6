"""Worker of the two-process whole-groups test (``test_whole_groups_multiprocess.py``); not collected by pytest.

Run under ``accelerate launch`` with 2 CPU processes (gloo). Each rank holds 4 rows per micro-batch, 2 micro-batches
per generation batch (steps_per_generation=2): 8 rows = 4 groups of G=2 per rank. p3o (``needs_whole_groups``) trains
with a probe plugin that records, per loss micro-batch, the prompt of each row. Each rank writes what it saw to
``groups-rank{R}.json``.

Usage: ``python whole_groups_worker.py OUT_DIR``.
"""

from __future__ import annotations

import json
import os
import sys


def main(out_dir: str) -> None:
    import warnings

    warnings.simplefilter("ignore")
    from trl_plugins import Plugin, hookimpl, register_plugin
    from trl_plugins.testing import digit_fraction_reward, make_tiny_trainer, tiny_dataset

    seen = []

    def record(self, ctx):
        ids, masks = ctx.inputs["prompt_ids"], ctx.inputs["prompt_mask"]
        seen.append({"G": ctx.num_generations, "prompts": [row[m.bool()].tolist() for row, m in zip(ids, masks)]})

    probe = type("Probe", (Plugin,), {"name": "test_group_probe_mp", "multi_turn": True, "needs_whole_groups": True,
                                      "trl_plugins_loss": hookimpl(record)})
    register_plugin(probe)
    trainer = make_tiny_trainer(
        plugins=["test_group_probe_mp", "p3o"], reward_funcs=[digit_fraction_reward], dataset=tiny_dataset(16),
        output_dir=os.path.join(out_dir, "run"), per_device_train_batch_size=4, num_generations=2,
        gradient_accumulation_steps=2, max_steps=2, max_completion_length=8, scale_rewards="none", log_level="error",
    )
    trainer.train()
    acc = trainer.accelerator
    record = {"rank": acc.process_index, "num_processes": acc.num_processes, "steps": trainer.state.global_step,
              "whole_groups": trainer.whole_groups, "seen": seen}
    with open(os.path.join(out_dir, f"groups-rank{acc.process_index}.json"), "w") as f:
        json.dump(record, f)
    acc.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
