"""Worker of ``test_tool_episodes_multiprocess.py``'s aepo test (``accelerate launch``, two CPU processes, gloo).

Each rank trains one step of the tiny tool trainer with ``aepo``'s rollout half on (pre-monitoring, branches through
the tool-episode seam, every boundary branching) and uneven work: rank 0's backend writes the gold traces (multi-turn
rows, so its groups branch), rank 1's answers at once (one turn: no boundary, no branch), so only rank 0 asks the seam
for episodes while both must make the same collective calls. Writes ``aepo-rank<k>.json`` with the step count and the
local rows a branch filled (an observer plugin after aepo reads their annotations).
"""

from __future__ import annotations

import json
import os
import sys


def main(out_dir: str) -> None:
    from trl_plugins import Plugin, hookimpl, register_plugin
    from trl_plugins.testing import make_tool_trainer
    from trl_plugins_builtin.aepo import BRANCH_KEY

    filled: list[list[str]] = []

    class Observer(Plugin):
        name = "test_aepo_observer"
        multi_turn = True

        @hookimpl
        def trl_plugins_after_generation(self, ctx):
            filled.append([ctx.annotations[i][BRANCH_KEY] for i in range(len(ctx)) if BRANCH_KEY in ctx.annotations[i]])

    register_plugin(Observer)
    rank = int(os.environ.get("RANK", "0"))
    script = None if rank == 0 else (lambda prompt, row: "Answer: 0")  # None: the gold traces
    tr = make_tool_trainer(n=8, per_device_train_batch_size=4, num_generations=4, max_steps=1, loss_type="dapo",
                           script=script, plugins=["aepo", "test_aepo_observer"],
                           plugin_config={"aepo": {"branching": True, "branch_probability": 0.0, "budget_scale": 0.0}},
                           output_dir=os.path.join(out_dir, "run"))
    tr.train()
    record = {"rank": tr.accelerator.process_index, "steps": tr.state.global_step, "filled": filled}
    with open(os.path.join(out_dir, f"aepo-rank{tr.accelerator.process_index}.json"), "w") as f:
        json.dump(record, f)
    tr.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
