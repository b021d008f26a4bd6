"""Worker of the multi-process reliability test (``test_multiprocess.py``); not collected by pytest.

Run by the test twice: in the pytest process (one process, ``run_phase("deterministic", ...)``) and under
``accelerate launch --multi_gpu --num_processes 2`` on CPU (gloo), where every rank executes ``main()``. Both runs use
the same *global* generation batch (6 rows = 3 groups of G=2), so with 2 processes group 1 (global rows 2 and 3)
straddles the ranks.

Phases:

``deterministic``
    Stack ``hint_scaffold + canon + lp_reg`` (a sampling plugin that calls the generation service, an advantage and a
    loss plugin). Generation is replaced by a deterministic backend (a function of the prompt and of the row's index in
    its group, so it does not depend on how rows are split across ranks): first-round completions are wrong, so every
    group fails and hint_scaffold re-generates it within the step from hinted prompts, where the first row of each
    group answers correctly. Rewards, advantages, completions, losses and final parameters are written out and must
    match between 1 and 2 processes.
``asymmetric``
    Real HF generation, and a test plugin that makes the ranks ask for different things within the step: rank 0 defers
    a row to a second generation round and fills it from the generation service, asks for policy entropies, and asks
    the service for one extra completion; rank 1 asks for nothing. Plus hint_scaffold in ``replace="one"`` mode (one
    request per failing group: 2 on rank 0, 1 on rank 1). It must finish (no deadlock) with exactly G rows per group.
``nan_scored_on_one_rank`` (expected to fail on both ranks; the launch goes on)
    hint_scaffold scores the first-round completions with ``ctx.score`` in the sampling stage, and a reward function
    returns NaN there on rank 1 only. The error is held until the next framework collective; then rank 1 raises the
    guard's error and rank 0 a ``PluginError`` naming process 1. Both ranks record what they raised and go on to the
    next phase together -- which only works if neither was left inside a collective.
``tools``
    A multi-turn tool run (the bundled environment, TRL's tool loop, a scripted backend writing the gold tool calls)
    with ``igpo`` (A2TGPO mode: per-turn clip factors ride with their rows to each rank's loss stage) and ``otc_po``:
    groups straddle the ranks, the turn structures are gathered (information gains, tool-call counts) and it must
    finish with whole groups.
``tool_fails_on_one_rank`` (expected to fail on both ranks; the launch goes on)
    The environment's search tool raises on rank 1 only. The tool guard retries, then holds the error until the end
    of TRL's tool loop, where one gathered flag makes rank 1 raise the ``ToolError`` (naming the tool and the row) and
    rank 0 a ``PluginError`` naming process 1.
``nan_on_one_rank`` (last: it ends the launch)
    A reward function returns NaN on rank 1 only. The reward guard holds the error until TRL's reward gather has
    completed on both ranks; then rank 1 raises the guard's error (naming the function, row and value) and rank 0 a
    ``PluginError`` naming process 1 -- the launch fails, it does not hang.

Usage: ``python mp_worker.py OUT_DIR [PHASE ...]`` (one JSON file per phase and rank: ``PHASE-rank{R}.json``; rank 0
also saves ``PHASE-params.pt``).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import torch

GLOBAL_ROWS = 6
G = 2
PHASES = ("deterministic", "asymmetric", "nan_scored_on_one_rank", "tools", "tool_fails_on_one_rank",
          "nan_on_one_rank")
# each rank records its error and the launch continues
EXPECTED_TO_FAIL = ("nan_scored_on_one_rank", "tool_fails_on_one_rank")


def nan_on_rank1(completions, **kwargs):
    """0.5 everywhere, except NaN for the second row on rank 1."""
    rank = int(os.environ.get("RANK", "0"))
    return [float("nan") if rank == 1 and i == 1 else 0.5 for i in range(len(completions))]


class SearchDownOnRank1:
    """The bundled tool environment, with a search backend that is down on rank 1."""

    def __init__(self):
        from trl_plugins.tasks.tools import ToolEnvironment

        self._env = ToolEnvironment()

    def reset(self, **row):
        return self._env.reset(**row)

    def search(self, query: str) -> str:
        """Search the encyclopedia of towns.

        Args:
            query: words to look for.
        """
        if int(os.environ.get("RANK", "0")) == 1:
            raise ConnectionError("search backend unreachable")
        return self._env.search(query)


def _answer_text(expression: str) -> str:
    from trl_plugins.tasks.arithmetic import Problem

    tokens = re.findall(r"\d+|[+\-*]", expression)
    return Problem.from_expression([int(t) for t in tokens[0::2]], tokens[1::2]).solution


def deterministic_backend(trainer):
    """Stands in for ``_generate_single_turn``: completion = f(prompt, index of the row in its group).

    The index in the group is computed from the row's global slot (process index * local count + position), which is
    the global row index for the first-round call and for the (equally padded) generation-service calls of this test.
    Hinted prompts (hint_scaffold) get the right answer at index 0 of a group; everything else is a wrong answer whose
    digits depend on the index (so the groups have reward variance through the digit-fraction reward).
    """
    tok = trainer.processing_class
    eos = tok.eos_token_id
    limit = trainer.max_completion_length

    def single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        rank, n = trainer.accelerator.process_index, len(prompt_ids)
        completions = []
        for j, ids in enumerate(prompt_ids):
            k = (rank * n + j) % G
            text = tok.decode(list(ids), skip_special_tokens=True)
            match = re.search(r"Compute ([0-9+\-*]+) step by step", text)
            if match and "beginning of the answer" in text and k == 0:
                completion = _answer_text(match.group(1)).split("\n")[-1]  # "Answer: N"
            else:
                completion = f"x{k}{len(ids) % 7}" + "z" * k
            completions.append(tok(completion, add_special_tokens=False)["input_ids"][: limit - 1] + [eos])
        return completions, None

    return single_turn


def _register_test_plugins():
    from trl_plugins import Plugin, hookimpl, register_plugin

    class LayoutProbe(Plugin):
        """Records what each rank sees at the sampling stage (global layout of its rows)."""

        name = "test_layout_probe"
        seen: list = []

        @hookimpl
        def trl_plugins_after_generation(self, ctx):
            LayoutProbe.seen.append(
                {
                    "global_index": list(ctx.global_index),
                    "group_ids": list(ctx.group_ids),
                    "index_in_group": list(ctx.index_in_group),
                }
            )

    class Asymmetric(Plugin):
        """Rank 0 defers a row, asks for entropies and an extra completion; rank 1 asks for nothing."""

        name = "test_asymmetric"
        served: list = []

        @hookimpl
        def trl_plugins_generation_prompts(self, ctx):
            if ctx.global_index[0] == 0:  # process 0 holds the first global rows
                ctx.defer(0)

        @hookimpl
        def trl_plugins_after_generation(self, ctx):
            rows = [i for i, d in enumerate(ctx.deferred) if d]
            filled = ctx.service.generate(prompts=[ctx.prompts[i] for i in rows])  # rank 1: zero prompts
            for i, completion in zip(rows, filled):
                ctx.replace_row(i, completion.completion_ids, logprobs=completion.logprobs)
            entropies = ctx.policy_entropies(rows)  # collective forward, padded on rank 1
            extra = ctx.service.generate(prompts=ctx.prompts[:1] if rows else [])
            Asymmetric.served.append(
                {"deferred": rows, "filled": len(filled), "entropies": [len(e) for e in entropies], "extra": len(extra)}
            )

    for cls in (LayoutProbe, Asymmetric):
        register_plugin(cls)
    return LayoutProbe, Asymmetric


def build_trainer(phase: str, out_dir: str, num_processes: int):
    from trl_plugins.tasks.arithmetic import accuracy_reward
    from trl_plugins.testing import digit_fraction_reward, make_tiny_trainer, tiny_dataset

    per_device = GLOBAL_ROWS // num_processes
    common = dict(
        reward_funcs=[accuracy_reward, digit_fraction_reward],
        dataset=tiny_dataset(12),
        output_dir=os.path.join(out_dir, phase),
        per_device_train_batch_size=per_device,
        num_generations=G,
        log_level="error",
        loss_type="dr_grpo",
        max_completion_length=10,
    )
    if phase == "deterministic":
        trainer = make_tiny_trainer(
            plugins=["test_layout_probe", "hint_scaffold", "canon", "lp_reg"],
            plugin_config={
                "hint_scaffold": {"success_threshold": 0.9},
                "lp_reg": {"kappa": 0.45, "rho": 0.5, "selection_scope": "generation_batch"},
            },
            max_steps=2,
            **common,
        )
        trainer._generate_single_turn = deterministic_backend(trainer)
        return trainer
    if phase == "asymmetric":
        return make_tiny_trainer(
            plugins=["test_asymmetric", "test_layout_probe", "hint_scaffold", "lp_reg"],
            plugin_config={
                "hint_scaffold": {"success_threshold": 0.9, "replace": "one", "hint_fractions": [0.5]},
                "lp_reg": {"kappa": 0.45, "rho": 0.5},
            },
            max_steps=1,
            **common,
        )
    if phase == "nan_scored_on_one_rank":
        return make_tiny_trainer(
            plugins=["hint_scaffold"], plugin_config={"hint_scaffold": {"success_threshold": 0.9}}, max_steps=1,
            **{**common, "reward_funcs": [accuracy_reward, nan_on_rank1]},
        )
    if phase in ("tools", "tool_fails_on_one_rank"):
        from trl_plugins.testing import make_tool_trainer

        trainer = make_tool_trainer(
            n=12, per_device_train_batch_size=per_device, num_generations=G, max_steps=1,
            output_dir=os.path.join(out_dir, phase), loss_type="dr_grpo", tool_retries=1, tool_retry_backoff=0.0,
            **({"plugins": ["igpo", "otc_po"], "plugin_config": {"igpo": {"mode": "a2tgpo"}}} if phase == "tools"
               else {}),
        )
        if phase == "tool_fails_on_one_rank":
            trainer.environment_factories = {None: SearchDownOnRank1}
            trainer._environment_pool = {None: []}
        return trainer
    if phase == "nan_on_one_rank":
        return make_tiny_trainer(
            plugins=["canon"], max_steps=1, **{**common, "reward_funcs": [accuracy_reward, nan_on_rank1]}
        )
    raise ValueError(f"unknown phase {phase!r}")


def run_phase(phase: str, out_dir: str) -> dict:
    """Train one phase on the current process layout; returns (and writes) this rank's record."""
    from accelerate.utils import gather_object

    from trl_plugins.testing import assert_group_sizes

    probe, asym = _register_test_plugins()
    probe.seen, asym.served = [], []
    trainer = build_trainer(phase, out_dir, int(os.environ.get("WORLD_SIZE", "1")))
    acc = trainer.accelerator
    record = {"phase": phase, "rank": acc.process_index, "num_processes": acc.num_processes, "batches": [],
              "losses": []}
    original_gen, original_rewards, original_loss = (
        trainer._generate_and_score_completions, trainer._calculate_rewards, trainer.compute_loss,
    )
    pending = {}

    def rewards(*args, **kwargs):
        value = original_rewards(*args, **kwargs)  # (N, K): already gathered over processes
        pending["rewards"] = value.detach().cpu().tolist()
        return value

    def gen(inputs):
        out = original_gen(inputs)
        assert_group_sizes(out)  # per-row tensors agree locally (a local batch may hold part of a group)
        mask = out["completion_mask"].bool()
        ids = [row[m].tolist() for row, m in zip(out["completion_ids"], mask)]
        record["batches"].append(
            {
                "rewards": pending.pop("rewards"),
                # token-level advantages (igpo) differ in width across ranks: padded before the gather
                "advantages": acc.gather(acc.pad_across_processes(out["advantages"], dim=1)
                                         if out["advantages"].dim() == 2 else out["advantages"]).cpu().tolist(),
                "completion_ids": gather_object(ids) if acc.num_processes > 1 else ids,
            }
        )
        assert len(record["batches"][-1]["completion_ids"]) % G == 0, "the global batch is not whole groups"
        return out

    def loss(*args, **kwargs):
        value = original_loss(*args, **kwargs)
        record["losses"].append(float(value.detach()))
        return value

    trainer._generate_and_score_completions, trainer._calculate_rewards, trainer.compute_loss = gen, rewards, loss
    start = time.monotonic()
    trainer.train()
    record["seconds"] = time.monotonic() - start
    record["layout"] = probe.seen
    record["asymmetric"] = asym.served
    record["extra_rollouts_total"] = trainer.generation_service.total
    merged = {}
    for log in trainer.state.log_history:
        merged.update({k: v for k, v in log.items() if isinstance(v, (int, float))})
    record["logs"] = merged
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{phase}-rank{acc.process_index}.json"), "w") as f:
        json.dump(record, f)
    if acc.is_main_process:
        model = trainer.accelerator.unwrap_model(trainer.model)
        params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        torch.save(params, os.path.join(out_dir, f"{phase}-params.pt"))
    acc.wait_for_everyone()
    return record


def main(argv: list[str]) -> None:
    out_dir = argv[0]
    for phase in argv[1:] or PHASES:
        try:
            run_phase(phase, out_dir)
        except Exception as exc:
            if phase in EXPECTED_TO_FAIL:
                rank = int(os.environ.get("RANK", "0"))
                with open(os.path.join(out_dir, f"{phase}-rank{rank}.json"), "w") as f:
                    json.dump({"error": type(exc).__name__, "message": str(exc)}, f)
                continue
            # each rank reports at once, then lingers: the launcher stops the other rank as soon as one exits, and the
            # test reads what *both* raised by themselves (a rank stuck in a collective would print nothing here)
            print(f"rank {os.environ.get('RANK', '0')} raised {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            time.sleep(3)
            raise


if __name__ == "__main__":
    main(sys.argv[1:])
