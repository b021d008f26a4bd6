"""Worker of the two-process refill test (``test_refill_multiprocess.py``); not collected by pytest.

Run under ``accelerate launch`` with 2 CPU processes (gloo). Global batch: 6 rows = 3 groups of G=2, 3 rows per rank,
so group 0 lives on rank 0, group 2 on rank 1 and group 1 straddles both. A test plugin rejects, per round:
round 0 group 0 (only rank 0 regenerates rows), round 1 group 2 replaced by group 1's prompt again (only rank 1
regenerates; the repeat needs the rows of both ranks), round 2 group 1 (one row on each rank), round 3 nothing.
Each rank writes what it saw to ``refill-rank{R}.json``.

Usage: ``python refill_worker.py OUT_DIR``.
"""

from __future__ import annotations

import json
import os
import sys

GLOBAL_ROWS = 6
G = 2
PLAN = {0: ([0], None), 1: ([2], 1), 2: ([1], None)}  # round -> (rejected groups, group repeated into the slots)


def main(out_dir: str) -> None:
    import warnings

    warnings.simplefilter("ignore")
    from accelerate.utils import gather_object

    from trl_plugins import Plugin, hookimpl, register_plugin
    from trl_plugins.testing import digit_fraction_reward, make_tiny_trainer, tiny_dataset

    seen = []

    class Scripted(Plugin):
        name = "test_scripted_rejects"

        @hookimpl
        def trl_plugins_reject_groups(self, ctx):
            seen.append({"round": ctx.round, "rewards": ctx.rewards.tolist(), "keys": ctx.prompt_keys.tolist()})
            groups, repeat = PLAN.get(ctx.round, ([], None))
            ctx.reject(groups)
            if repeat is not None:
                ctx.repeat(repeat)

    register_plugin(Scripted)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = make_tiny_trainer(
        plugins=["test_scripted_rejects"], reward_funcs=[digit_fraction_reward], dataset=tiny_dataset(12),
        output_dir=os.path.join(out_dir, "run"), per_device_train_batch_size=GLOBAL_ROWS // world, num_generations=G,
        max_steps=2, max_completion_length=8, log_level="error",
    )
    acc = trainer.accelerator
    final_prompts = []
    original = trainer._calculate_rewards

    def spy(inputs, prompts, completions, ids):
        texts = [p[-1]["content"] if isinstance(p, list) else p for p in prompts]
        final_prompts.append(gather_object(texts))
        return original(inputs, prompts, completions, ids)

    trainer._calculate_rewards = spy
    trainer.train()
    metrics = {}
    for log in trainer.state.log_history:
        metrics.update({k: v for k, v in log.items() if k.startswith("plugins/framework/")})
    record = {
        "rank": acc.process_index, "num_processes": acc.num_processes, "steps": trainer.state.global_step,
        "seen": seen, "final_prompts": final_prompts, "metrics": metrics,
        "stream": trainer.refill_stage.stream.state_dict(), "rollouts": trainer.generation_service.total,
    }
    with open(os.path.join(out_dir, f"refill-rank{acc.process_index}.json"), "w") as f:
        json.dump(record, f)
    acc.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
