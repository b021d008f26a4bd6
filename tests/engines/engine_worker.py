"""Worker of the engine tests (``test_engines.py``); not collected by pytest.

Launched by ``accelerate launch --config_file docs/accelerate/<engine>.yaml --num_processes 2 --mixed_precision no``
on CPU (see ``cpu_engines.py``); every rank runs ``main()``. Each *phase* (see :data:`PHASES`) builds a tiny trainer
with a stack of plugins, trains ``max_steps`` steps with real HF generation from the same seed, and writes
``PHASE-rank{R}.json`` (what ran, the engine seen, the error if any) and, on rank 0, ``PHASE-params.pt`` (the full
final parameters, gathered by the engine's own ``get_state_dict``). The test compares those parameters with the DDP
launch of the same phase.

A phase that raises records its error on every rank and the launch goes on to the next phase, so one launch reports
every phase; a phase left inside a collective would hang the launch instead (the test's timeout reports it).

Usage: ``python engine_worker.py OUT_DIR ENGINE PHASE [PHASE ...]`` (ENGINE: one of ``cpu_engines.ENGINES``)
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import cpu_engines  # noqa: E402

cpu_engines.install()

import torch  # noqa: E402

#: one rank's rows: 2 whole groups of G=2 (4 groups globally), so per-rank work (a guided group, a refill) is real
PER_DEVICE = 4
G = 2
SOFTCAP = 2.0
LOGIT_SCALE = 10.0

#: phase -> (plugins, plugin_config, options); options: "softcap" (a head with logit_scale and a softcap), "steps",
#: "refused" (engines that must refuse the stack at construction, with a word the error must contain), "engines"
#: (run only under these engines and DDP; default: every engine), "args" (PluginGRPOConfig fields), "tools" (the
#: bundled tool environment with gold traces; "tool_prompts" its size, "fail_from_step" the optimizer step from which
#: every rollout answers wrong)
ZERO3_FSDP2 = {"steps": 1, "engines": ["fsdp2", "zero3"]}
PHASES: dict[str, tuple[list[str], dict, dict]] = {
    "vanilla": ([], {}, {}),
    # no-grad head statistics (lp_reg's proxy at the advantage stage, its loss-stage head log-probs), softcapped head
    "head_stats": (["canon", "lp_reg"], {"lp_reg": {"kappa": 0.1, "rho": 0.5}}, {"softcap": True}),
    # a head statistic WITH gradient through the head (a large coefficient: at the default one the head's share of the
    # update is below ZeRO-3's tolerance, so losing it would go unseen; the anchored term acts from the second step)
    "siren": (["siren"], {"siren": {"coef": 0.5}}, {"softcap": True, "refused": {"fsdp1": "siren"}}),
    # uneven per-rank policy forwards: log-probs and entropies on rank 0 only; hidden features (repexp)
    "uneven_probes": (["test_uneven_probes", "repexp"], {"repexp": {"features": "policy"}}, {}),
    # ampo's guided groups on rank 0 only (rank 1's rows succeed): its policy scoring of the solutions on one rank
    "uneven_guidance": (["ampo"], {"ampo": {"solutions_column": "solution", "success_column": "solved_on_rank1"}},
                        {"rank_reward": True}),
    # recommended stacks (scripts/gpu_smoke.py's STACKS): sampling + advantage + loss plugins together
    "adaptive_sampler+laser+clip_cov": (["adaptive_sampler", "laser", "clip_cov"], {}, {"steps": 1}),
    "scope+lp_reg": (["scope", "lp_reg"], {"scope": {"mode": "reference_suffix", "prm": "programmatic",
                                                     "min_prefix_steps": 0}, "lp_reg": {"kappa": 0.1, "rho": 0.5}},
                     {"softcap": True, "steps": 1}),
    "ruscarl+kl_cov": (["ruscarl", "kl_cov"], {"ruscarl": {"judge": "rule"}}, {"steps": 1}),
    # every other built-in (not tool-agent ones) in stacks that compose, one step each
    # (dler's cap above the completion length: the tiny model never ends, and zeroed rewards would train nothing)
    "stack1": (["critique_grpo", "dagrpo", "dars", "dcpo", "decs", "dler"],
               {"dler": {"cap": 64, "zero_unfinished": False}}, ZERO3_FSDP2),
    "stack2": (["dynamic_sampling", "empo", "fbos_rl", "gtpo", "hapo", "hicra", "hint_scaffold"],
               {"hint_scaffold": {"success_threshold": 0.9}}, ZERO3_FSDP2),
    # (beta > 0: prl needs the reference policy, which a sharded engine only has as TRL's reference model; with
    # beta = 0 it is refused at construction, naming the fix)
    "stack3": (["llds", "mrt", "pear", "posterior_grpo", "prl", "r2vpo", "r3l"],
               {"posterior_grpo": {"prm": "programmatic"}}, {**ZERO3_FSDP2, "args": {"beta": 0.04},
                                                                "policy_on_disk": True}),
    "stack4": (["rec", "remax", "replay"], {}, ZERO3_FSDP2),
    # (rlpr's std filter zeroes advantages here: its refill, the default, is refused under FSDP / ZeRO-3 with several
    # processes at construction -- tests/plugins/test_rlpr.py -- because its reward runs a policy forward per process)
    "stack5": (["riskpo", "rl_plus", "rlpr"], {"rlpr": {"filter_drop": "zero_advantage"}}, ZERO3_FSDP2),
    # the hidden-state service (ctx.hidden_states): verl_erank's per-row effective ranks, thr's two passes with the
    # LM head on a vocabulary subset (success on the partial-credit column: the random tiny model is never right)
    "hidden_states": (["verl_erank", "thr"], {"verl_erank": {"stride": 2}, "thr": {
        "success_column": "digit_fraction_reward", "success_threshold": 0.05}}, ZERO3_FSDP2),
    # (seed_grpo's exponential form: the linear one scales every advantage by 0 when all answers differ; hbpo's
    # budget sub-groups have one row each at G=2)
    "stack6": (["rover", "seed_grpo", "steer", "hbpo"], {"seed_grpo": {"function": "exponential"},
                                                         "hbpo": {"budgets": [8, 16]}}, ZERO3_FSDP2),
    # (the tool-agent plugins: multi-turn rollouts of TRL's tool loop on the bundled environment, the backend scripted
    # with the gold traces; igpo and matchtir both replace the advantages, hence two phases)
    "tools1": (["igpo", "otc_po", "aspo", "e_grpo", "funrl", "epo"], {"igpo": {"mode": "a2tgpo"}},
               {**ZERO3_FSDP2, "tools": True, "args": {"loss_type": "grpo"}}),
    "tools2": (["matchtir", "ikea", "salt"], {}, {**ZERO3_FSDP2, "tools": True, "args": {"loss_type": "grpo"}}),
    # oreal's own surrogate with its token reward model (success on the partial-credit column: the random tiny model
    # is never right), cure's branch regeneration, seele's hinted rounds (both collective generation calls)
    "stack7": (["oreal", "cure", "seele"],
               {"oreal": {"success_column": "digit_fraction_reward", "success_threshold": 0.05, "token_rm": True},
                "cure": {"branches_per_response": 1}, "seele": {"rounds": 2}},
               {**ZERO3_FSDP2, "args": {"loss_type": "dapo"}}),
    # scripted answers (right in even rows, wrong in odd ones, each closed with EOS): siri zeroes only responses cut
    # off at its cap, which every response of the random tiny model is; disco trains on groups holding a success
    "scripted": (["disco", "siri"], {}, {**ZERO3_FSDP2, "script": True,
                                        "args": {"loss_type": "grpo", "max_completion_length": 16}}),
    # refill on one rank only: rank 0's groups score flat at each step's first scoring (dynamic_sampling rejects
    # them and only rank 0 regenerates, one round), rank 1's never; the generation calls stay collective
    "uneven_refill": (["dynamic_sampling"], {"dynamic_sampling": {"criterion": "reward_std"}},
                      {"reward": "flat_on_rank0_first_round", "steps": 2, "args": {"max_refill_rounds": 1}}),
    # kepo's local HF teacher called on one rank only: hints for rank 0's failing groups, teacher log-probs for
    # rank 1's successful rows
    "uneven_teacher": (["kepo"], {"kepo": {"teacher_model": "@teacher", "success_column": "solved_on_rank1",
                                           "success_threshold": 0.5}}, {"rank_reward": True, "steps": 1}),
    # a local HF teacher (loaded from disk while transformers' ZeRO-3 flag is on) writing demonstrations
    "teacher": (["luffy"], {"luffy": {"source": "teacher", "teacher_model": "@teacher", "teacher_max_tokens": 6}},
                {"steps": 1}),
    # the branching seam (ctx.continue_prefixes): spo's Monte-Carlo continuations from its cut points, a collective
    # HF generate with padded requests (every token of the random tiny model is below the probability threshold)
    "branching": (["spo"], {"spo": {"cutpoint_interval": 2, "mc_samples": 2, "max_cutpoints": 2}}, ZERO3_FSDP2),
    # the generative reward model's local HF backend (the tiny teacher writes unparsable verdicts: allowed here)
    "genrm": (["deepseek_grm"], {"deepseek_grm": {"genrm": "hf", "genrm_model": "@teacher", "k": 2,
                                                 "genrm_max_tokens": 6, "genrm_max_unparsable": 1.0}}, ZERO3_FSDP2),
    # local teacher models scoring rows: listener's confidence in the reference answer, rapo_retention's KL drift
    "teachers": (["listener", "rapo_retention"], {"listener": {"teacher_model": "@teacher"},
                                                  "rapo_retention": {"teacher_model": "@teacher"}}, ZERO3_FSDP2),
    # reward and loss transforms added later, and the pairwise / regression losses over whole groups
    # (fleming_r1 and observe_r1 both replace the training sampler: one per phase)
    # (scripted answers: with the random tiny model's rewards these plugins leave every group flat, nothing trains)
    "stack8": (["aepo", "sweet_spot", "rlsp", "observe_r1"], {}, {**ZERO3_FSDP2, "script": True,
                                                                   "args": {"max_completion_length": 16}}),
    "pairs": (["fleming_r1", "p3o"], {}, ZERO3_FSDP2),
    "regression": (["reg_grpo"], {}, ZERO3_FSDP2),
    "dno": (["dno"], {}, ZERO3_FSDP2),
    # fork_prefixes (forced distinct next tokens at a fork, a padded probe forward then a collective generate): ettrl's
    # entropy-forked trees of one root and one branch
    "forks": (["ettrl"], {"ettrl": {"fork_points": 1, "branches": 1, "fork_tokens": "distinct"}}, ZERO3_FSDP2),
    # the policy judging its own groups: G=4, each group 2 answers and 2 verdict rows (deferred slots filled through
    # the generation service, trained under the judge prompt in the same step, one group a process). The tiny
    # policy's verdicts are unparsable: allowed here, the answers then get their group's mean (their dense reward
    # columns still differ) and the verdicts 0
    "self_judge": (["urpo"], {"urpo": {"default_kind": "open", "judge_weight": 0.0, "max_unparsable": 1.0}},
                   {**ZERO3_FSDP2, "args": {"num_generations": 4, "max_completion_length": 16}}),
    # ares's entropy reward, per-difficulty KL (beta > 0: TRL's reference model from the policy on disk) and HWE
    # branching (one deferred row per group) with polychromic's set advantage and its scored vines (continuations
    # through the branching seam; trained vines also defer rows, refused with ares's branching)
    "stack9": (["ares", "polychromic"], {"ares": {"kl_update_interval": 1, "branch_rollouts": 1},
                                         "polychromic": {"set_size": 1, "num_sets": 2, "rollout_states": 1,
                                                         "vines": 2, "vine_rows": "scored"}},
               {**ZERO3_FSDP2, "args": {"beta": 0.04}, "policy_on_disk": True}),
    # latr's trees: probes, forks with lookahead, pruning and completions through the seam, the tree state gathered
    "latr": (["latr"], {"latr": {"prob_abs_threshold": None, "prob_rel_threshold": None, "pruning_steps": [2, 3]}},
             ZERO3_FSDP2),
    # deepsearch's trees: one seam call per search iteration on every process (zero requests where a process's trees
    # are done), the fill call, the rows and credit gathered
    "deepsearch": (["deepsearch"], {"deepsearch": {"expansion_width": 2, "max_depth": 3, "node_budget": 4}},
                   ZERO3_FSDP2),
    "rex_rag": (["rex_rag"], {"rex_rag": {"probe_prob": 1.0, "answer_pattern": "[0-9]", "probe_prefix": "",
                                          "probes": ["ab", "b"]}}, ZERO3_FSDP2),
    # CAPO's curvature masks from the (gathered) softcapped head and its Adam model's moment update, whose touched
    # head rows are all-gathered once per loss call (a small step size: the tiny model's hidden states are large)
    "capo": (["capo"], {"capo": {"learning_rate": 1e-5}}, {**ZERO3_FSDP2, "softcap": True,
                                                            "args": {"loss_type": "dr_grpo"}}),
    # arpo's branches from tool-call boundaries through the tool-episode seam (TRL's tool loop in lockstep); igpo's
    # turn rewards vary within a group (the scripted backend answers every question right: the outcome is flat)
    "tool_episodes": (["arpo", "igpo"], {"arpo": {"branch_probability": 1.0}},
                      {**ZERO3_FSDP2, "tools": True, "args": {"loss_type": "grpo"}}),
    "slate": (["slate"], {"slate": {"prm": "programmatic", "k": 2, "step_stops": ["\n"], "answer_stops": []}},
              ZERO3_FSDP2),
    # libra_rm's binary verdicts from a local HF judge (loaded whole on every process, like a teacher)
    "libra_rm": (["libra_rm"], {"libra_rm": {"genrm": "hf", "genrm_model": "@teacher", "genrm_max_tokens": 6,
                                             "genrm_max_unparsable": 1.0}}, ZERO3_FSDP2),
    # aepo's branches after tool calls (one global-rollout slot left per group) and search_r2's refiner calls and
    # cut-and-regenerate, both through the tool-episode seam; replay's stored tool episodes (a padded no-grad forward
    # for their behaviour log-probs) replayed into later groups
    "aepo_branching": (["aepo"], {"aepo": {"branching": True, "branch_probability": 0.0, "budget_scale": 0.0}},
                       {**ZERO3_FSDP2, "tools": True, "args": {"loss_type": "grpo", "num_generations": 4}}),
    "search_r2": (["search_r2"], {}, {**ZERO3_FSDP2, "tools": True, "args": {"loss_type": "grpo"}}),
    # 4 prompts, each in every step: step 1 stores every (gold) episode with its behaviour log-probs, step 2 fails
    # everywhere, so each all-fail group receives its prompt's stored episode (replayed against those log-probs)
    "tool_replay": (["replay"], {}, {**ZERO3_FSDP2, "steps": 2, "tools": True, "tool_prompts": 4, "fail_from_step": 1,
                                     "args": {"loss_type": "grpo"}}),
    # the replay update (extra optimizer steps after the step's own): 5 scheduled rows over 2 ranks x 2 micro-batches
    # of 2 leave a micro-batch with no row (a zero-weight forward); DeepSpeed steps its engine at the replay boundary
    "replay_update": (["test_replay_rows"], {}, {"steps": 2, "engines": ["fsdp1", "fsdp2", "zero3", "zero2"],
                                                 "args": {"gradient_accumulation_steps": 2}}),
    # SPEAR's replay batch (replay's placement 'batch'): stored rows with their behaviour log-probs replayed once two
    # are held
    "replay_batch": (["replay"], {"replay": {"advantage": "spear_decay", "gate_capacity": 1,
                                             "replay_coef_warmup_steps": 0}},
                     {"steps": 2, "engines": ["fsdp2", "zero3"]}),
}
#: rows test_replay_rows schedules at step 0 (5 over 2 ranks x 2 micro-batches of 2: one micro-batch has none)
REPLAY_ROWS = 5
UNEVEN_ROWS = 3  # rows rank 0 scores with ctx.policy_logprobs / policy_entropies; rank 1 scores none


def _register_test_plugins() -> None:
    from trl_plugins import Plugin, hookimpl, register_plugin
    from trl_plugins.runtime.manager import available_plugins

    if "test_uneven_probes" in available_plugins():
        return

    class UnevenProbes(Plugin):
        """Rank 0 asks the collective policy services for rows, rank 1 for none (the same number of calls)."""

        name = "test_uneven_probes"
        seen: list = []

        @hookimpl
        def trl_plugins_after_generation(self, ctx):
            rows = list(range(UNEVEN_ROWS)) if ctx.global_index[0] == 0 else []
            logps = ctx.policy_logprobs([ctx.prompt_ids[i] for i in rows],
                                        [list(ctx.completion_ids[i]) or [0] for i in rows])
            entropies = ctx.policy_entropies(rows)
            UnevenProbes.seen.append({"logprobs": [len(x) for x in logps], "entropies": [len(x) for x in entropies],
                                      "finite": all(bool(torch.isfinite(x).all()) for x in logps)})

    register_plugin(UnevenProbes)

    class ReplayRows(Plugin):
        """Schedules REPLAY_ROWS rows (this step's first completions, fixed old log-probs) for a replay update."""

        name = "test_replay_rows"

        @hookimpl
        def trl_plugins_transform_advantages(self, ctx):
            from trl_plugins.api import ReplayRow

            if ctx.mode != "train" or ctx.step != 0:
                return
            rows = [ReplayRow([5 + k, 6], [7 + k, 8, 9], [1, 1, 1], [-1.0, -2.0, -0.5], 0.5 - 0.25 * k)
                    for k in range(REPLAY_ROWS)]
            ctx.schedule_replay_update(rows)

    register_plugin(ReplayRows)


def solved_on_rank1(completions, **kwargs) -> list[float]:
    """1.0 on process 1's rows, 0.0 on process 0's: a verifier under which only rank 0 has failing groups."""
    return [float(os.environ.get("RANK", "0") == "1")] * len(completions)


#: (step, rows) of every call of flat_on_rank0_first_round on this process
scored_calls: list = []


def flat_on_rank0_first_round(completions, trainer_state=None, **kwargs) -> list[float]:
    """On process 0, 0.0 for every row at the first scoring of each step (zero-variance groups: dynamic_sampling
    rejects them); everywhere else the fraction of digits plus 0.5 in odd rows, which differ within every group of
    G=2 (each process's rows are whole groups). So exactly one rank refills, once per step, deterministically."""
    from trl_plugins.testing import digit_fraction_reward

    step = trainer_state.global_step if trainer_state is not None else -1
    first = all(s != step for s, _n in scored_calls)
    scored_calls.append((step, len(completions)))
    if os.environ.get("RANK", "0") == "0" and first:
        return [0.0] * len(completions)
    return [v + 0.5 * (i % 2) for i, v in enumerate(digit_fraction_reward(completions, **kwargs))]


#: phase option "reward" -> the only reward function of the phase
phase_rewards = {"flat_on_rank0_first_round": flat_on_rank0_first_round}


def arithmetic_script(dataset):
    """A scripted backend (trl_plugins.testing.script_generation) for the arithmetic rows: ``Answer: N``, right in
    even request rows, one off in odd ones (each group of G=2 holds one of each)."""
    answers = {row["prompt"][-1]["content"]: int(row["answer"]) for row in dataset}

    def script(prompt_text: str, row: int) -> str:
        answer = next((a for q, a in answers.items() if q in prompt_text), 0)
        return f"Answer: {answer + row % 2}"

    return script


def _model(softcap: bool):
    from trl_plugins.testing import tiny_model, tiny_tokenizer

    model = tiny_model(tiny_tokenizer(), seed=0)
    if softcap:  # TRL's fused head and trl_plugins' head statistics read both from the config (Gemma-2 / Cohere)
        model.config.final_logit_softcapping = SOFTCAP
        model.config.logit_scale = LOGIT_SCALE  # sharpens the tiny model's near-uniform logits: the cap then bites
    return model


def build_trainer(engine: str, phase: str, out_dir: str):
    from trl_plugins.tasks.arithmetic import accuracy_reward
    from trl_plugins.testing import digit_fraction_reward, make_tiny_trainer, tiny_dataset

    plugins, plugin_config, options = PHASES[phase]
    plugin_config = json.loads(json.dumps(plugin_config))
    for settings in plugin_config.values():
        for key, value in settings.items():
            if value == "@teacher":  # the tiny teacher main() saved
                settings[key] = teacher_path(out_dir)
    model = _model(options.get("softcap", False))
    if options.get("policy_on_disk"):  # TRL builds its reference model from the policy's _name_or_path
        model.config._name_or_path = policy_path(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    if int(os.environ.get("RANK", "0")) == 0:  # the test checks that training moved the parameters
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                   os.path.join(out_dir, f"{phase}-initial.pt"))
    args = {"loss_type": "dr_grpo", "max_steps": options.get("steps", 2), "max_completion_length": 8,
            "num_generations": G, **options.get("args", {})}
    common = dict(
        model=model,
        plugins=plugins,
        plugin_config=plugin_config,
        output_dir=os.path.join(out_dir, phase),
        per_device_train_batch_size=PER_DEVICE,
        **args,
        # the engines need it off (cpu_engines pins the device to the CPU); the DDP reference is accelerate's CPU path
        use_cpu=engine == "ddp",
        log_level="error",
    )
    if options.get("tools"):  # the bundled tool environment, the backend writing the gold traces
        from trl_plugins.tasks.tools import make_tool_dataset
        from trl_plugins.testing import gold_then_wrong_script, make_tool_trainer

        n, kinds, bind = options.get("tool_prompts", 8), ("lookup", "scaled"), None
        script = None
        if options.get("fail_from_step") is not None:  # gold traces, then "Answer: -1" from that optimizer step on
            script, bind = gold_then_wrong_script(make_tool_dataset(n, kinds=kinds), from_step=options["fail_from_step"])
        trainer = make_tool_trainer(n=n, kinds=kinds, script=script, **{**common, "max_completion_length": 300})
        if bind is not None:
            bind(trainer)
        return trainer
    if "reward" in options:
        reward_funcs = [phase_rewards[options["reward"]]]
    else:  # a dense reward: the random tiny model never answers right, and zero advantages would train nothing
        reward_funcs = [accuracy_reward, digit_fraction_reward] + ([solved_on_rank1] if options.get("rank_reward")
                                                                   else [])
    dataset = tiny_dataset(16)
    trainer = make_tiny_trainer(dataset=dataset, reward_funcs=reward_funcs, **common)
    if options.get("script"):
        from trl_plugins.testing import script_generation

        script_generation(trainer, arithmetic_script(dataset))
    return trainer


def full_parameters(trainer, engine: str) -> dict[str, torch.Tensor]:
    """The full final parameters (on rank 0), named as in the unwrapped model. Collective.

    accelerate's ``get_state_dict`` for every engine but FSDP1, whose FULL_STATE_DICT path (offload to CPU) crashes
    on a CPU-only machine: there ``summon_full_params`` gathers them."""
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(trainer.model_wrapped, writeback=False):
            return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                    for n, p in trainer.model_wrapped.named_parameters()}
    return trainer.accelerator.get_state_dict(trainer.model_wrapped)


def run_phase(engine: str, phase: str, out_dir: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    record = {"phase": phase, "rank": rank, "plugins": PHASES[phase][0]}
    start = time.monotonic()
    trainer = None
    try:
        _register_test_plugins()
        trainer = build_trainer(engine, phase, out_dir)
        acc = trainer.accelerator
        record["engine"] = cpu_engines.engine_name(acc)
        trainer.train()
        state = full_parameters(trainer, record["engine"])  # collective
        if acc.is_main_process:
            params = {k: v.detach().float().cpu().clone() for k, v in state.items()}
            torch.save(params, os.path.join(out_dir, f"{phase}-params.pt"))
        record["steps"] = trainer.state.global_step
        from trl_plugins.runtime.manager import available_plugins

        record["probes"] = available_plugins()["test_uneven_probes"].seen if phase == "uneven_probes" else []
        record["scored"] = scored_calls if phase == "uneven_refill" else []
        record["logs"] = {k: v for log in trainer.state.log_history for k, v in log.items()
                          if isinstance(v, (int, float))}
        acc.wait_for_everyone()
    except Exception as exc:  # recorded; the next phase runs
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()[-3000:]
        print(f"[rank {rank}] phase {phase} raised {record['error'][:500]}", file=sys.stderr, flush=True)
    record["seconds"] = time.monotonic() - start
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{phase}-rank{rank}.json"), "w") as f:
        json.dump(record, f)
    del trainer


def policy_path(out_dir: str) -> str:
    return os.path.join(out_dir, f"policy-rank{os.environ.get('RANK', '0')}")


def teacher_path(out_dir: str) -> str:
    return os.path.join(out_dir, f"teacher-rank{os.environ.get('RANK', '0')}")


def main(argv: list[str]) -> None:
    out_dir, engine, phases = argv[0], argv[1], argv[2:]
    if any(str(PHASES[p][1]).find("@teacher") >= 0 for p in phases):
        # a tiny local teacher on disk, one copy per rank, saved before any trainer exists: once accelerate's state
        # is up, transformers' save_pretrained writes nothing on a non-main process
        from trl_plugins.tasks.tiny import build_and_save

        build_and_save(teacher_path(out_dir), hidden_size=16, num_layers=1, num_heads=2)
    if any(PHASES[p][2].get("policy_on_disk") for p in phases):  # the initial policy, saved the same way
        _model(False).save_pretrained(policy_path(out_dir))
    for phase in phases:
        run_phase(engine, phase, out_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
