"""Worker of ``test_episode_replay_multiprocess.py`` (run under ``accelerate launch``, two CPU processes, gloo).

Each rank trains two steps of the tiny tool trainer (scripted gold traces, TRL's real tool loop) on one prompt with
the ``replay`` plugin (G=4, one group straddling the ranks, two rows each): step 0 succeeds everywhere, so the newest
success (global row 3, on rank 1) is stored with its behaviour log-probs; step 1 fails everywhere, so the group's slot
0 (on rank 0) receives it and rank 1 joins the seam's collectives with zero rows. Each rank writes ``rank<k>.json``: its buffers' digest, its replayed rows, whether the loss's old
log-probs equal the stored behaviour log-probs on the replayed tokens, and the steps done.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys


def main(out_dir: str) -> None:
    import torch

    from trl_plugins import Plugin, hookimpl, register_plugin
    from trl_plugins.api.contexts import BEHAVIOUR_LOGPS_KEY
    from trl_plugins.tasks.tools import make_tool_dataset
    from trl_plugins.testing import gold_then_wrong_script, make_tool_trainer

    record: dict = {"replayed": [], "exact": []}

    class Probe(Plugin):
        name = "test_replay_probe"
        multi_turn = True

        @hookimpl
        def trl_plugins_after_generation(self, ctx):
            record["replayed"] += [ctx.global_index[i] for i in ctx.behaviour_logprobs]

        @hookimpl
        def trl_plugins_loss(self, ctx):
            behaviour = ctx.inputs.get(BEHAVIOUR_LOGPS_KEY)
            if behaviour is not None:
                finite = torch.isfinite(behaviour)
                record["exact"].append(bool(torch.equal(ctx.old_per_token_logps[finite], behaviour[finite])))

    register_plugin(Probe)
    script, bind = gold_then_wrong_script(make_tool_dataset(1), from_step=1)
    tr = make_tool_trainer(n=1, per_device_train_batch_size=2, num_generations=4, max_steps=2, script=script,
                           plugins=["replay", "test_replay_probe"], output_dir=os.path.join(out_dir, "run"),
                           loss_type="dr_grpo")
    bind(tr)
    tr.train()
    replay = next(p for p in tr.plugin_stack if p.name == "replay")
    digest = hashlib.sha256(json.dumps(replay.buffers.state(), sort_keys=True, default=str).encode()).hexdigest()
    record.update(rank=tr.accelerator.process_index, steps=tr.state.global_step, digest=digest,
                  entries=replay.buffers.total())
    with open(os.path.join(out_dir, f"rank{tr.accelerator.process_index}.json"), "w") as f:
        json.dump(record, f)
    tr.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
