"""Worker of ``test_search_r2_multiprocess.py`` (run under ``accelerate launch``, two CPU processes, gloo).

Each rank trains one step of the tiny tool trainer (scripted gold-trace backend, TRL's real tool loop) with
``search_r2``, whose Meta-Refiner prompts the scripted backend answers unevenly: on rank 0 every trajectory is flawed at
step 2 (its multi-turn rows are cut and regenerated), on rank 1 every trajectory is coherent (nothing is cut). It
records every call of the generation backend (rows per call), the refined rows and the budget counts, and writes
``rank<k>.json``.
"""

from __future__ import annotations

import os
import sys


def main(out_dir: str) -> None:
    from trl_plugins import Plugin, hookimpl, register_plugin
    from trl_plugins.tasks.tools import gold_trace_script, make_tool_dataset
    from trl_plugins.testing import make_tool_trainer
    from trl_plugins_builtin.search_r2 import CUT_KEY
    from tool_episodes_worker import train_counting_calls  # this folder (the launched script's directory)

    rank = int(os.environ.get("RANK", "0"))
    calls: list[int] = []
    record: dict = {"rank": rank}

    class Record(Plugin):
        name = "test_search_r2_record"
        multi_turn = True

        @hookimpl
        def trl_plugins_after_generation(self, ctx):
            record.update(cut=[ctx.annotations[i].get(CUT_KEY) for i in range(len(ctx))],
                          episodes=sorted(ctx.episodes), used=ctx.service.used_this_batch, total=ctx.service.total)

    register_plugin(Record)
    dataset = make_tool_dataset(8, kinds=("lookup", "scaled"))
    actor = gold_trace_script(dataset)

    def script(prompt_text: str, row: int) -> str:
        if "'Verdict: coherent' or 'Verdict: flawed'" in prompt_text:
            return "Verdict: flawed" if rank == 0 else "Verdict: coherent"
        if "'Flawed step: N'" in prompt_text:
            return "Flawed step: 2"
        return actor(prompt_text, row)

    tr = make_tool_trainer(n=8, per_device_train_batch_size=2, num_generations=2, max_steps=1, script=script,
                           plugins=["search_r2", "test_search_r2_record"], output_dir=os.path.join(out_dir, "run"),
                           loss_type="dr_grpo")
    record["calls"] = calls
    train_counting_calls(tr, calls, record, out_dir)


if __name__ == "__main__":
    main(sys.argv[1])
