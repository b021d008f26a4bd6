"""Worker of ``test_branching_multiprocess.py`` (run under ``accelerate launch``, two CPU processes, gloo).

Each rank builds the tiny trainer and calls the branching seam three times with uneven requests: rank 0 asks for three
continuations (different lengths, a stop string, probes), rank 1 for none; then rank 1 alone asks for one; then
neither asks; then rank 0 alone forks one prefix into two (``fork_prefixes``). It records every call of the generation backend (rows, ``max_new_tokens``) and of the teacher-forced
forward (rows), and writes ``rank<k>.json`` under the output folder.
"""

from __future__ import annotations

import json
import os
import sys


def main(out_dir: str) -> None:
    from trl_plugins.testing import digit_fraction_reward, make_tiny_trainer

    tr = make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=1, max_completion_length=10,
                           per_device_train_batch_size=2, output_dir=os.path.join(out_dir, "run"), log_level="error")
    rank = tr.accelerator.process_index
    generate_calls, forward_calls = [], []
    sample, forward = tr.sample_completions, tr.per_token_logps_and_entropies

    def counted_sample(prompt_ids, num_generations=1):
        generate_calls.append([len(prompt_ids), int(tr.generation_config.max_new_tokens)])
        return sample(prompt_ids, num_generations=num_generations)

    def counted_forward(model, input_ids, *args, **kwargs):
        forward_calls.append(int(input_ids.size(0)))
        return forward(model, input_ids, *args, **kwargs)

    tr.sample_completions, tr.per_token_logps_and_entropies = counted_sample, counted_forward
    svc = tr.generation_service
    svc.begin_batch([1, 2, 3])
    prompt = svc.tokenize(["Compute 1+2 step by step"])[0]
    lengths = []
    first = ([prompt] * 3, [[], [5], [5, 6]], [2, 6, 3]) if rank == 0 else ([], [], [])
    out = svc.continue_prefixes(*first, stop=["zz"], probe_positions=[[0], [1], [2]][: len(first[0])], top_k=2)
    lengths.append([len(c.new_ids) for c in out])
    second = ([prompt], [[7]], 4) if rank == 1 else ([], [], 4)
    lengths.append([len(c.new_ids) for c in svc.continue_prefixes(*second)])
    lengths.append([len(c.new_ids) for c in svc.continue_prefixes([], [], 1)])
    record = {"generate": list(generate_calls), "forward": list(forward_calls), "lengths": lengths,
              "total": svc.total, "used": svc.used_this_batch}
    # the fork (forced distinct top tokens): rank 0 forks one prefix into two, rank 1 asks for nothing
    fork = ([prompt] * 2, [[5], [5]], [0, 1], 4) if rank == 0 else ([], [], [], 4)
    forked = svc.fork_prefixes(*fork, exclude=[6, 6][: len(fork[0])])
    record["fork"] = {"generate": generate_calls[len(record["generate"]):],
                      "forward": forward_calls[len(record["forward"]):],
                      "first": [c.new_ids[0] for c in forked], "lengths": [len(c.new_ids) for c in forked]}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    tr.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
