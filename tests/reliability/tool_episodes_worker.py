"""Worker of ``test_tool_episodes_multiprocess.py`` (run under ``accelerate launch``, two CPU processes, gloo).

Each rank trains one step of the tiny tool trainer (scripted gold-trace backend, TRL's real tool loop) with a plugin
whose ``after_generation`` hook calls the tool-episode seam three times with uneven work: rank 0 continues all its rows
from turn 0 (whole episodes, with tool rounds), rank 1 none; then rank 1 alone continues its multi-turn rows from turn
1; then neither asks. It records every call of the generation backend inside each seam call (rows per call), the
episodes' lengths and the budget counts, replaces its rows by the episodes, and writes ``rank<k>.json``.
"""

from __future__ import annotations

import json
import os
import sys


def main(out_dir: str) -> None:
    from trl_plugins import Plugin, hookimpl, register_plugin
    from trl_plugins.testing import make_tool_trainer

    calls: list[int] = []
    record: dict = {}

    class Uneven(Plugin):
        name = "test_uneven_episodes"
        multi_turn = True

        @hookimpl
        def trl_plugins_after_generation(self, ctx):
            rank = ctx.global_index[0] // len(ctx.rows)
            multi = [i for i, t in enumerate(ctx.turns) if t.num_turns >= 2]
            asks = [
                (list(range(len(ctx.rows))), [0] * len(ctx.rows)) if rank == 0 else ([], []),
                (multi, [1] * len(multi)) if rank == 1 else ([], []),
                ([], []),
            ]
            phases = []
            for rows, turns in asks:
                start = len(calls)
                episodes = ctx.continue_tool_episodes(rows, turns)
                phases.append({"calls": calls[start:], "episodes": len(episodes),
                               "tool_rounds": [e.tool_mask.count(0) > 0 for e in episodes]})
                for e in episodes:
                    ctx.replace_episode(e.row, e)
            record.update(rank=rank, phases=phases, used=ctx.service.used_this_batch, total=ctx.service.total)

    register_plugin(Uneven)
    tr = make_tool_trainer(n=8, per_device_train_batch_size=2, num_generations=2, max_steps=1,
                           plugins=["test_uneven_episodes"], output_dir=os.path.join(out_dir, "run"),
                           loss_type="dr_grpo")
    train_counting_calls(tr, calls, record, out_dir)


def train_counting_calls(tr, calls: list[int], record: dict, out_dir: str) -> None:
    """Train ``tr`` with its (scripted) generation backend counting the rows of every call into ``calls``, then write
    ``record`` (with ``steps``) to ``out_dir/rank<k>.json`` (also used by ``search_r2_worker.py``)."""
    backend = tr._generate_single_turn

    def counted(prompt_ids, *args, **kwargs):
        calls.append(len(prompt_ids))
        return backend(prompt_ids, *args, **kwargs)

    tr._generate_single_turn = counted
    tr.train()
    record["steps"] = tr.state.global_step
    with open(os.path.join(out_dir, f"rank{tr.accelerator.process_index}.json"), "w") as f:
        json.dump(record, f)
    tr.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
