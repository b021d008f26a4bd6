"""Replay — self-imitation replay of the policy's own good rollouts (SPEAR's replay batch, RAPO's splice).

Two papers, one buffer. **RAPO** (Fathom-DeepResearch, arXiv:2509.24107) keeps a replay buffer per prompt and
injects the latest successful rollout of a prompt into a later group of that prompt in which every rollout failed,
which restores the group's reward variance (GRPO's advantages vanish in an all-fail group). **SPEAR** ("Learn the
Ropes, Then Trust the Wins", arXiv:2509.22601) is self-imitation learning: a buffer of the agent's own good
trajectories, replayed off-policy, with a staleness limit and a recalibrated advantage. Two placements:

* ``placement='batch'`` (SPEAR; the default with a SPEAR advantage): one buffer of the step's rows with a positive
  advantage (their behaviour log-probs from a no-grad forward of the policy that sampled them), trained as a separate
  **replay batch** once full, after the step's own optimizer step (below, "SPEAR's replay batch");
* ``placement='group'`` (RAPO; the default with ``advantage='group'``): per-prompt buffers of successes spliced into
  later all-fail groups of their prompt, with SPEAR's staleness limit and advantage treatments as options::

    success(row)  = verifier column of the row > success_threshold        (trl_plugins.api.success's rule)
    store         after generation: the successful rows the policy sampled itself under the prompt (no off-policy
                  token, no prompt swap, not a replay), newest last, at most buffer_size per prompt
    evict         entries older than max_age_steps optimizer steps (None: kept until pushed out)
    gate          replay_gate 'full' (the SPEAR default): replays only in a step whose buffers hold more than
                  1.5 x gate_capacity rollouts (all prompts together), and empties every buffer when it replays
                  (this step's successes are stored after: SPEAR adds its batch after reset_buffer); 'always' (the
                  RAPO default): every step, entries kept
    splice        a group with no success whose prompt has a stored entry: slot replace_index gets the entry
                  (pick='latest': the newest one), annotated ``replayed``; the group keeps exactly G rows
    provenance    replay_tokens='offpolicy' (the default without tools): every replayed token is off-policy,
                  trained through the shaped branch -A p/(p+gamma) (LUFFY; gamma = offpolicy_shaping_gamma);
                  'policy': trained like the group's own rows. Either way its sampling log-probs are NaN (not sampled
                  in this step), so TRL's vLLM importance-sampling correction leaves the row alone. 'behaviour' (the
                  default with tools): TRL's clipped ratio against the stored behaviour log-probs (below)
    advantage     'group' (RAPO): TRL's own group advantage, the replayed row counted as a group member.
                  'spear_baseline' (SPEAR's default recalibration): A_replay = max(0, r - p50(mu)) where mu are the
                  mean rewards of the last baseline_groups groups (divided by p50(sigma) + 1e-6 when scale_rewards
                  is not 'none'); the group's own rows get the advantage they would have had without the replay.
                  'spear_decay': A_replay = (advantage the row had when it was stored) * advantage_decay, the own
                  rows as in 'spear_baseline'.
    coefficient   A_replay *= replay_coef * ramp(step), ramp = (1 - cos(pi * min(step / warmup, 1))) / 2
                  (replay_coef_warmup_steps = 0: ramp = 1; default 300 with a SPEAR advantage, 0 with 'group'). The
                  loss of a row is linear in its advantage on both branches, so this scales the replayed row's loss,
                  as SPEAR's replay_loss_coef does.

Facts from SPEAR's official code (TrajectoryBufferBatch in its verl recipe): stored rows are those with a positive
advantage; rows more than trajectory_tolerate_steps (5 to 10 in the scripts, capped at 10) older than the newest are
dropped; the baseline history keeps per-group reward means and stds of the last baseline_buffer_size = 10240
groups; recalibrated advantages are ``r - p50`` (``/ (p50_std + 1e-6)`` with std normalisation) and negative ones
are dropped (here: set to 0, the row stays in its group); the decay variant multiplies the stored advantage
(weight_decay_trajectory_replay in (0, 1]); replay_loss_coef = 1 ramps up over max_replay_loss_steps steps with a
cosine schedule (200 is the yaml default, the recipe scripts pass 300: the default here with a SPEAR advantage).
The buffer is replayed only once it holds more than 1.5 x buffer_size trajectories (``is_full_capacity``, buffer_size
2048 by default), and is emptied after the replay (``reset_buffer``): ``replay_gate: full`` with ``gate_capacity``,
the default with a SPEAR advantage (``'always'`` keeps the per-step replay of RAPO). With ``placement='group'`` a
single-turn replay takes the framework's off-policy branch (no behaviour log-probs stored), a tool episode SPEAR's
ratio against its stored behaviour log-probs. The Fathom-DeepResearch repository releases no training code: the slot
that receives the replay (replace_index), 'pick' and RAPO's in-group treatment ('policy') are reconstructed.

**SPEAR's replay batch** (``placement='batch'``), in the order of its trainer (``ray_trainer_hybrid.py:744-786``:
``get_buffer`` and ``reset_buffer``, ``update_actor(batch, batch_replay)``, then ``remove_old`` and ``update_batch``)::

    replay      when the buffer is full (replay_gate 'full': more than 1.5 x gate_capacity entries count, with
                'spear_baseline' those whose reward is above the p50 of the recent group mean rewards, with
                'spear_decay' every entry; 'always': any entry): every entry's advantage recalibrated
                ('spear_baseline': (r - p50 mean) / (p50 std + 1e-6), the division only when scale_rewards is not
                'none', kept where positive; 'spear_decay': stored advantage x advantage_decay), a random subset of the
                largest power of two <= their number, at most gate_capacity (``get_buffer``: ``nearest_lower_power_of_2``,
                capped at buffer_size), times replay_coef x ramp(step); scheduled as a replay update
                (``ctx.schedule_replay_update``: after the step's own optimizer step, extra optimizer steps over the rows,
                TRL's clipped ratio against the stored behaviour log-probs, no scheduler step; SPEAR's
                ``dp_actor.py:526-608``); 'full' then empties the buffer
    store       this step's rows with a positive advantage (``update_batch``: ``advantages.mean(-1) > 0``), the policy's
                own samples under their prompt (with tools and require_tool_call: episodes that called a tool), with
                their reward, advantage and the behaviour log-probs of a no-grad forward of the policy
                (``ctx.policy_stats``; verl's recomputed ``old_log_probs``), tool-result tokens out of the trained mask;
                the group means and stds (torch's unbiased std, as ``in_group_std``) of every group join the history

Differences from the official code: the replay rows are spread over processes and micro-batches by the trainer (SPEAR
drops a replay batch smaller than its GPU count; here empty micro-batches run a zero-weight row), one replay optimizer
step covers ``P x gradient_accumulation_steps x per_device_train_batch_size`` rows (the rows one optimizer step of the
run covers; SPEAR: ``ppo_mini_batch_size``), staleness counts from the current step (SPEAR: from the newest entry).
RAPO's other parts live elsewhere: its curriculum pruning of solved prompts is ``adaptive_sampler`` (prune_solved).

SPEAR's curriculum also has an **intrinsic tool-call reward** (skill exploration early, self-imitation later), on
multi-turn tool rollouts (``tool_call_reward``, a reward column ``spear_tool_call`` filled at the reward stage)::

    r_tool(row, step) = min(tool_call_bonus * U_call, tool_call_cap) * w(step)
    U_call            = the row's assistant turns that called at least one tool (TRL's parsed tool calls)
    w(step)           = 'cosine': (cos(pi * step / tool_call_reward_steps) + 1) / 2 up to tool_call_reward_steps,
                        0 after; 'constant': 1; 'none': no column (the default, vanilla)

Facts from SPEAR's official code: ``verl/recipe/spear/reward.py:120-162`` (the posneg_decay score: +0.1 per assistant
message holding tool calls, capped at 1.0, added to the score of every rollout, right or wrong; the 'none' /
'constant' / 'cosine' ratio, 0 past max_toolcall_steps), ``verl-agent/agent_system/reward_manager/episode.py:143-159``
(the same schedule on episode lengths), ``verl-agent/verl/trainer/config/ppo_trainer.yaml:295-296`` (defaults 'none'
and 100) and ``verl/recipe/spear/run_qwen2-32b_spear.sh:79-80`` ('cosine', 200: the defaults here once it is on).
SPEAR adds the bonus to the score itself; here it is a column of its own with weight 1 (the same combined reward, the
verifier column and so the success rule untouched). The step is TRL's ``global_step`` (0 at the first step; verl
counts from 1). SPEAR's covariance-based token clipping is not in this plugin (``clip_cov``).

**Tool episodes** (runs with ``tools`` / ``environment_factory``): the buffers hold whole multi-turn episodes through
the tool-episode seam (``ctx.store_tool_episodes`` / ``ctx.replay_tool_episodes`` / ``ctx.replace_episode``): the
completion ids with the tool-result tokens, TRL's tool mask and messages, and the behaviour log-probs of the model
tokens (a teacher-forced forward of the policy in the step that sampled them). A replayed episode keeps its turn
structure, gets a fresh environment with its executed tool calls replayed (TRL's reward pass scores it), and its
model tokens train with TRL's clipped ratio ``exp(log pi_theta - log pi_behaviour)`` against the stored log-probs
(``replay_tokens='behaviour'``, the default with tools), as SPEAR's replay loss does
(``verl/verl/workers/actor/dp_actor.py:526-553``: the replay micro-batches pass their stored ``old_log_probs`` to the
policy loss, tool observations out of ``response_mask``). With ``require_tool_call`` (default) only episodes with at
least one tool call are stored, as SPEAR's buffer does (``verl/verl/trainer/ppo/ray_trainer_hybrid.py:450-469``: it
keeps rows with a positive advantage whose messages hold a tool call, the whole DataProto with ``old_log_probs``
deep-copied at 430).

Multi-process: the buffers are **global and identical on every process**. Success flags and prompt keys of all rows
are gathered (one collective), the token ids of the rows to store too (two collectives, only in steps that store
something, decided from the gathered flags; with tools the seam's padded forward and one object gather, and the
replay's two flags in steps that replay, every process with its own rows, zero included); every process then applies the same updates. A rollout of prompt p is
therefore replayable in any later group of p whichever process holds it, the checkpoint written by the main process
holds every buffer, and a run resumed on another number of processes sees the same buffers.

With ``placement='batch'`` the decisions come from the advantage stage's global data: the buffer is the same on every
process, the behaviour forward (``ctx.policy_stats``) and one object gather run in steps that store something on any
process, and the replay update spreads the same rows over the processes.

Neutral setting: ``max_age_steps=0`` (every entry expires before a later step could replay it) leaves every row and
advantage as vanilla GRPO. Metrics: ``all_fail_group_fraction``, ``replayed_group_fraction``, ``stored_rollouts``,
``buffer_prompts``, ``buffer_rollouts``, ``replay_age`` (steps since the replayed rollout was stored),
``replay_advantage`` (mean advantage of the replayed rows), ``replay_batch_rows`` (placement 'batch': rows scheduled
for the replay update, whose own metrics are ``plugins/framework/replay_update_*``); with the tool-call reward ``tool_call_turns_mean`` (assistant
turns that called a tool, per rollout) and ``tool_call_weight`` (the schedule's w(step)).

Official code checked against: ``TencentYoutuResearch/SPEAR@7e84315`` (faithful with documented options; the files and
the deviating options: ``trl-plugins show replay``, docs/faithfulness.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import (
    AdvantageContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    ReplayRow,
    RewardContext,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.collectives import gather_id_lists
from trl_plugins.api.contexts import context_device
from trl_plugins.api.success import SuccessOptions, placeholder_column
from trl_plugins.api.text import stable_key

from ._episode_replay import calls_a_tool, own_episode, splice_tool_rows, store_tool_rows
from ._rollout_buffer import RolloutBuffer

#: Annotation keys of a replayed row (they reach ``AdvantageContext.annotations`` and TRL's completions table).
REPLAYED = "replayed"
REPLAY_STEP = "replay_stored_step"
REPLAY_ADVANTAGE = "replay_stored_advantage"
#: TRL's epsilon in its group-std normalisation, and SPEAR's in its recalibration.
TRL_STD_EPS = 1e-4
SPEAR_STD_EPS = 1e-6


@dataclass
class ReplayOptions(SuccessOptions):
    buffer_size: int = option(
        1, min=1, help="placement 'group': successful rollouts kept per prompt, newest last (RAPO: the latest success, "
        "1); placement 'batch' keeps every stored row (SPEAR's buffer has no per-prompt limit)."
    )
    max_age_steps: int | None = option(
        None, min=0,
        help="Staleness limit: a stored rollout older than this many optimizer steps is evicted (SPEAR official: "
        "trajectory_tolerate_steps, 5 to 10); None = kept until newer successes push it out (RAPO states no limit); "
        "0 = never replayed (neutral setting).",
    )
    pick: Literal["latest", "random"] = option(
        "latest",
        help="Which stored rollout of the prompt is replayed: the newest (RAPO) or one drawn uniformly (seeded by the "
        "run's seed, the step and the group).",
        reconstructed=True,
    )
    replace_index: int = option(
        0, min=0, help="Slot of the all-fail group that receives the replayed rollout (every slot failed).",
        reconstructed=True,
    )
    key_column: str | None = option(
        None, help="Dataset column identifying a prompt (e.g. an id); None = the prompt itself."
    )
    replay_tokens: Literal["auto", "offpolicy", "policy", "behaviour"] = option(
        "auto",
        help="'offpolicy': replayed tokens take the shaped off-policy branch -A p/(p+gamma) (LUFFY); 'policy': they "
        "train like the group's own rows (TRL's clipped ratio, old log-probs recomputed now: RAPO's in-group "
        "treatment as we read it); 'behaviour' (tool episodes only): TRL's clipped ratio against the episode's "
        "stored behaviour log-probs (SPEAR's replay loss). 'auto': 'behaviour' with tools, 'offpolicy' without.",
        reconstructed=True,
    )
    require_tool_call: bool = option(
        True,
        help="With tools: store only episodes with at least one tool call (SPEAR's buffer keeps only those); false = "
        "every success.",
    )
    advantage: Literal["group", "spear_baseline", "spear_decay"] = option(
        "group",
        help="'group': TRL's group advantage with the replayed row as a member (RAPO); 'spear_baseline': "
        "max(0, r - p50 of recent group mean rewards), own rows as without the replay (SPEAR's default); "
        "'spear_decay': the row's stored advantage times advantage_decay (SPEAR's alternative).",
    )
    baseline_groups: int = option(
        10240, min=1, help="'spear_baseline': groups whose mean and std rewards form the p50 baseline (SPEAR 10240)."
    )
    advantage_decay: float = option(
        0.9, min=0.0, max=1.0, min_exclusive=True,
        help="'spear_decay': factor on the stored advantage (SPEAR's weight_decay_trajectory_replay, in (0, 1]).",
    )
    replay_coef: float = option(
        1.0, min=0.0, help="Multiplies the replayed rows' advantages, i.e. their loss (SPEAR's replay_loss_coef, 1)."
    )
    replay_coef_warmup_steps: int | None = option(
        None, min=0,
        help="The coefficient rises from 0 to replay_coef over this many steps, (1 - cos(pi t / T)) / 2 (SPEAR's "
        "max_replay_loss_steps: 200 is its yaml default, its recipe scripts pass 300); 0 = constant. Default (null): "
        "300 with a SPEAR advantage, 0 with 'group'.",
    )
    placement: Literal["auto", "group", "batch"] = option(
        "auto",
        help="Where a stored rollout trains again. 'batch' (SPEAR): the whole buffer, recalibrated, as a separate "
        "replay update after the step's own optimizer step (extra optimizer steps, TRL's clipped ratio against the "
        "stored behaviour log-probs); 'group' (RAPO): spliced into a later all-fail group of its prompt. 'auto': "
        "'batch' with a SPEAR advantage, 'group' with 'group'.",
    )
    replay_gate: Literal["auto", "full", "always"] = option(
        "auto",
        help="When the buffers are replayed. 'full': only in a step whose buffers hold more than 1.5 x gate_capacity "
        "rollouts (all prompts), after which every buffer is emptied (SPEAR's is_full_capacity / reset_buffer); "
        "'always': every step, entries kept (RAPO). 'auto': 'full' with a SPEAR advantage, 'always' with 'group'.",
    )
    gate_capacity: int = option(
        2048, min=1,
        help="replay_gate 'full': SPEAR's buffer_size (2048 by default); the buffers replay once they hold more than "
        "1.5 x this many rollouts.",
    )
    tool_call_reward: Literal["none", "constant", "cosine"] = option(
        "none",
        help="SPEAR's intrinsic tool-call reward (multi-turn tool rollouts), a reward column 'spear_tool_call': "
        "min(tool_call_bonus x assistant turns that called a tool, tool_call_cap) times a schedule: 'cosine' "
        "(SPEAR's recipe scripts) decays it from 1 at step 0 to 0 at tool_call_reward_steps and keeps 0 after; "
        "'constant' keeps 1; 'none' (the yaml default) adds no column.",
    )
    tool_call_reward_steps: int = option(
        200, min=1,
        help="'cosine': the steps over which the tool-call reward decays to 0 (SPEAR's max_toolcall_steps: its "
        "recipe scripts pass 200, its yaml default is 100).",
    )
    tool_call_bonus: float = option(
        0.1, min=0.0, help="Tool-call reward per assistant turn that called a tool (SPEAR: 0.1)."
    )
    tool_call_cap: float = option(
        1.0, min=0.0, help="Upper bound of the tool-call reward of a rollout (SPEAR: 1.0, i.e. ten calling turns)."
    )

    def validate(self) -> None:
        if self.placement == "batch" and self.advantage == "group":
            raise PluginConfigError(
                "Option 'placement' of plugin 'replay' got 'batch' with advantage 'group'; allowed: 'batch' with a "
                "SPEAR advantage ('spear_baseline' or 'spear_decay': a replay batch has no group), or 'group'."
            )
        batch = self.placement == "batch" or (self.placement == "auto" and self.advantage != "group")
        if batch and self.replay_tokens in ("offpolicy", "policy"):
            raise PluginConfigError(
                f"Option 'replay_tokens' of plugin 'replay' got {self.replay_tokens!r} with placement 'batch'; allowed: "
                "'auto' or 'behaviour' (a replay batch trains against its stored behaviour log-probs)."
            )
        if self.key_column is not None and not self.key_column:
            raise PluginConfigError(
                "Option 'key_column' of plugin 'replay' got ''; allowed: a dataset column name, or None for the prompt."
            )


#: SPEAR's recipe scripts' max_replay_loss_steps (the ramp of the replay loss coefficient).
SPEAR_WARMUP_STEPS = 300
#: SPEAR replays once its buffer holds more than this times buffer_size trajectories.
SPEAR_FULL_FACTOR = 1.5


#: The reward column of SPEAR's tool-call reward (added only when ``tool_call_reward`` is not 'none').
TOOL_CALL_COLUMN = "spear_tool_call"


# ============================================================================================= pure functions
def tool_call_schedule(mode: str, step: int, steps: int) -> float:
    """SPEAR's weight of the tool-call reward at ``step``: 0 ('none'), 1 ('constant'), or ``(cos(pi step / steps) +
    1) / 2`` up to ``steps`` and 0 after ('cosine')."""
    if mode == "none":
        return 0.0
    if mode == "constant":
        return 1.0
    if step > steps:
        return 0.0
    return max((math.cos(math.pi * max(step, 0) / steps) + 1.0) / 2.0, 0.0)


def tool_call_reward(calling_turns: torch.Tensor, bonus: float, cap: float, weight: float) -> torch.Tensor:
    """(N,) ``min(bonus * calling_turns, cap) * weight``: SPEAR's intrinsic reward of each rollout.

    Args:
        calling_turns: (N,) long, the assistant turns of each rollout that called at least one tool.
    """
    return (calling_turns.float() * bonus).clamp(max=cap) * weight


def cosine_ramp(step: int, warmup_steps: int) -> float:
    """``(1 - cos(pi * min(step / warmup, 1))) / 2``, rising from 0 to 1; 1 when ``warmup_steps`` is 0."""
    if warmup_steps <= 0:
        return 1.0
    t = min(max(step, 0) / warmup_steps, 1.0)
    return (1.0 - math.cos(math.pi * t)) / 2.0


def own_rows_advantages(rewards: torch.Tensor, scale: str, batch_std: float) -> torch.Tensor:
    """Advantages of a group's own rows as TRL gives them without the replayed row.

    Args:
        rewards: (G - 1,) combined rewards of the group's own rows.
        scale: the run's ``scale_rewards`` ('group', 'batch' or 'none').
        batch_std: TRL's batch std of the rewards (used when ``scale == 'batch'``).
    Returns:
        (G - 1,) ``r - mean`` divided by ``std + 1e-4`` (group) or ``batch_std + 1e-4`` (batch).
    """
    centred = rewards - rewards.mean()
    if scale == "group":
        std = rewards.std() if rewards.numel() > 1 else torch.zeros(())
        return centred / (torch.nan_to_num(std, nan=0.0) + TRL_STD_EPS)
    if scale == "batch":
        return centred / (batch_std + TRL_STD_EPS)
    return centred


def spear_baseline_advantage(reward: float, means: list[float], stds: list[float], scale_by_std: bool) -> float:
    """SPEAR's recalibrated advantage of a replayed row: ``max(0, r - p50(means))`` (``/ (p50(stds) + 1e-6)``)."""
    if not means:
        return 0.0
    p50_mean = float(torch.tensor(means, dtype=torch.float64).quantile(0.5))
    value = reward - p50_mean
    if scale_by_std:
        value /= float(torch.tensor(stds, dtype=torch.float64).quantile(0.5)) + SPEAR_STD_EPS
    return max(value, 0.0)


# ============================================================================================= plugin
class ReplayPlugin(Plugin):
    """Per-prompt buffers of successful rollouts; a stored success is spliced into a later all-fail group."""
    image_inputs = True
    multi_turn = True

    name = "replay"
    version = "0.5.1"
    paper = (
        "Learn the Ropes, Then Trust the Wins: Self-imitation with Progressive Exploration for Agentic Reinforcement "
        "Learning (SPEAR), arXiv:2509.22601; Fathom-DeepResearch: Unlocking Long Horizon Information Retrieval and "
        "Synthesis for SLMs (RAPO replay buffers), arXiv:2509.24107"
    )
    summary = ("Self-imitation replay: SPEAR's replay batch of past positive-advantage rows, or RAPO's splice of a "
               "prompt's stored success into a later all-fail group of it.")
    Options = ReplayOptions
    official = OfficialSource(
        "TencentYoutuResearch/SPEAR", "7e84315", verdict="faithful",
        note="The SPEAR parts (its ray_trainer_hybrid.py and dp_actor.py; the buffer of positive-advantage rows with "
        "their old_log_probs and tool calls: verl/verl/trainer/ppo/ray_trainer_hybrid.py:150-503, trained as a separate "
        "replay batch after the actor's own mini-batches: verl/verl/workers/actor/dp_actor.py:526-608 (placement "
        "'batch'); the tool-call reward: verl/recipe/spear/reward.py:120-162); RAPO "
        "(FractalAIResearchLabs/Fathom-DeepResearch@cdc2010) has no training code, its parts are reconstructed.",
        non_official_defaults={
            "tool_call_reward": "'cosine' in SPEAR's recipe scripts (its yaml default is 'none'); 'none' here keeps "
            "runs without tools free of an all-zero reward column",
        },
    )
    claim_metric = ("replayed_group_fraction", "all-fail groups given a replayed success")
    replaces = ("with placement 'group', one completion of each all-fail group whose prompt has a stored success (an "
                "off-policy replay); with placement 'batch' nothing (the replay batch trains in extra optimizer "
                "steps)",)
    reconstructed = (
        "the slot that receives the replay (replace_index) and pick='random'",
        "replay_tokens='policy' as RAPO's in-group treatment (the Fathom-DeepResearch repository releases no "
        "training code)",
        "the cosine ramp's exact form (SPEAR: 'cosine scheduler' over max_replay_loss_steps)",
        "the tool-call reward as a reward column of its own (SPEAR adds it to the score: same combined reward)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.buffers = RolloutBuffer()  # prompt key -> entries {"ids", "step", "advantage"}, newest last
        self.group_means: list[float] = []  # 'spear_baseline' history, oldest first
        self.group_stds: list[float] = []
        self._pending: dict[int, dict] = {}  # global row -> entry stored this step (its advantage comes later)
        self._scale = "group"
        self._seed = 0
        self._tools = False
        if self._placement() == "batch":  # what SPEAR's placement does, in place of the splice's group fraction
            self.claim_metric = ("replay_batch_rows", "rows trained in SPEAR's replay update per step")

    def required_columns(self) -> list[str]:
        return [self.options.key_column] if self.options.key_column else []

    # ------------------------------------------------------------------------------------------ lifecycle
    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        G = args.num_generations
        if self.options.replace_index >= G:
            raise PluginConfigError(
                f"Option 'replace_index' of plugin 'replay' got {self.options.replace_index}; allowed: a slot of the "
                f"group, 0 to {G - 1} (num_generations={G})."
            )
        scale = args.scale_rewards
        self._scale = {True: "group", False: "none"}.get(scale, scale)
        self._seed = int(args.seed)
        self._tools = bool(getattr(trainer, "tools", None))
        if self.options.replay_tokens == "behaviour" and not self._tools and self._placement() == "group":
            raise PluginConfigError(
                "Option 'replay_tokens' of plugin 'replay' got 'behaviour' with placement 'group', which needs multi-turn "
                "tool episodes (their behaviour log-probs are stored with them); allowed without tools: 'auto', "
                "'offpolicy' or 'policy', or placement 'batch'."
            )

    def _tokens(self) -> str:
        """How replayed tokens train (``replay_tokens``; 'auto': 'behaviour' with tools, 'offpolicy' without)."""
        tokens = self.options.replay_tokens
        if tokens == "auto":
            return "behaviour" if self._tools else "offpolicy"
        return tokens

    def _placement(self) -> str:
        """'group' or 'batch' (``placement``; 'auto' follows the advantage: SPEAR's replay batch with a SPEAR
        advantage)."""
        placement = self.options.placement
        if placement == "auto":
            return "group" if self.options.advantage == "group" else "batch"
        return placement

    def hook_enabled(self, hook: str) -> bool:
        if hook in ("trl_plugins_reward_functions", "trl_plugins_transform_rewards"):
            return self.options.tool_call_reward != "none"
        if hook == "trl_plugins_after_generation":  # splices and sampling-time storing: the group placement only
            return self._placement() == "group"
        return True

    # ------------------------------------------------------------------------------------------ tool-call reward
    @hookimpl
    def trl_plugins_reward_functions(self, args):
        # SPEAR adds the bonus to the score; a column of its own keeps the verifier (success) untouched and logged
        return [placeholder_column(TOOL_CALL_COLUMN)]

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        o = self.options
        local = [sum(1 for calls in t.tool_calls if calls) for t in ctx.local_turns] or [0] * len(ctx.local_rows)
        turns = torch.tensor(ctx.gather_object(local), dtype=torch.long)
        weight = tool_call_schedule(o.tool_call_reward, ctx.step, o.tool_call_reward_steps)
        values = tool_call_reward(turns, o.tool_call_bonus, o.tool_call_cap, weight)
        rewards = ctx.rewards_per_func.clone()
        rewards[:, ctx.reward_func_names.index(TOOL_CALL_COLUMN)] = values.to(rewards)
        ctx.rewards_per_func = rewards
        ctx.log_metric("tool_call_turns_mean", float(turns.float().mean()) if turns.numel() else 0.0)
        ctx.log_metric("tool_call_weight", weight)

    @hookimpl
    def trl_plugins_state_dict(self) -> dict:
        return {
            "buffers": self.buffers.state(),
            "group_means": list(self.group_means),
            "group_stds": list(self.group_stds),
        }

    @hookimpl
    def trl_plugins_load_state_dict(self, state: dict) -> None:
        self.buffers = RolloutBuffer.from_state(state["buffers"])
        self.group_means = list(state["group_means"])
        self.group_stds = list(state["group_stds"])
        self._pending = {}

    # ------------------------------------------------------------------------------------------ sampling
    def _key(self, ctx: RolloutContext, i: int) -> int:
        column = self.options.key_column
        return stable_key(ctx.rows[i].get(column) if column else ctx.prompts[i])

    def _storable(self, ctx: RolloutContext, i: int) -> bool:
        """The row holds the policy's own rollout under its prompt (not a splice, a swap or a replay); with tools, an
        episode TRL (or the tool-episode seam) sampled, with a tool call when ``require_tool_call`` (SPEAR)."""
        if self._tools and not (own_episode(ctx, i) and (calls_a_tool(ctx, i) or not self.options.require_tool_call)):
            return False
        return (bool(ctx.completion_ids[i]) and not any(ctx.offpolicy[i]) and not ctx.prompt_swapped[i]
                and not ctx.annotations[i].get(REPLAYED))

    def evict(self, step: int) -> None:
        """Drop entries older than ``max_age_steps`` at ``step`` (and prompts left without entries)."""
        self.buffers.evict(step, self.options.max_age_steps)

    def _gate(self) -> str:
        """'full' or 'always' (``replay_gate``; 'auto' follows the advantage: SPEAR's gate with a SPEAR advantage)."""
        gate = self.options.replay_gate
        if gate == "auto":
            return "always" if self.options.advantage == "group" else "full"
        return gate

    def _warmup(self) -> int:
        """Ramp length of the replay coefficient (``replay_coef_warmup_steps``; None follows the advantage)."""
        steps = self.options.replay_coef_warmup_steps
        if steps is None:
            return 0 if self.options.advantage == "group" else SPEAR_WARMUP_STEPS
        return steps

    def _pick(self, entries: list[dict], step: int, group: int) -> dict:
        if self.options.pick == "latest" or len(entries) == 1:
            return entries[-1]
        g = torch.Generator().manual_seed((self._seed * 1_000_003 + step * 7_919 + group) % (2**63 - 1))
        return entries[int(torch.randint(len(entries), (1,), generator=g))]

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        o = self.options
        G, B = ctx.num_generations, len(ctx)
        device = context_device(ctx)
        success = ctx.success(range(B), rule=o.success_rule).cpu()
        local = torch.tensor(
            [[int(success[i]), int(self._storable(ctx, i)), self._key(ctx, i)] for i in range(B)], dtype=torch.long
        ).view(B, 3)
        flags = ctx.gather(local.to(device)).cpu()  # (N, 3): success, storable, prompt key -- same on every process
        N = flags.size(0)
        n_groups = N // G
        ok, storable, keys = flags[:, 0].bool(), flags[:, 1].bool() & flags[:, 0].bool(), flags[:, 2].tolist()

        # replays come from entries of earlier steps only: evict first, decide, then store this step's successes
        self.evict(ctx.step)
        splices: dict[int, dict] = {}  # global row -> entry
        all_fail = ~ok.view(n_groups, G).any(dim=1)
        held = self.buffers.total()
        full = self._gate() == "full"
        ready = not full or held > SPEAR_FULL_FACTOR * o.gate_capacity
        for g in torch.nonzero(all_fail).flatten().tolist() if ready else []:
            target = g * G + o.replace_index
            entries = self.buffers.get(keys[target])
            if entries:
                splices[target] = self._pick(entries, ctx.step, g)
        to_store = self._rows_to_store(storable, keys, G)
        if full and ready:  # SPEAR's reset_buffer when it takes its replay batch; this step's batch is added after
            self.buffers, self._pending = RolloutBuffer(), {}
        if self._tools:  # to_store and splices are global: every process calls the seam together, or none does
            self._pending = store_tool_rows(ctx, self.buffers, to_store, keys, o.buffer_size) if to_store else {}
        else:
            self._store(ctx, to_store, keys)
        if self._tools:
            for i in splice_tool_rows(ctx, splices, self._tokens()) if splices else []:
                self._annotate(ctx, i, splices[ctx.global_index[i]])
        else:
            for i in range(B):
                entry = splices.get(ctx.global_index[i])
                if entry is not None:
                    self._splice(ctx, i, entry)

        ctx.log_metric("all_fail_group_fraction", float(all_fail.float().mean()) if n_groups else 0.0)
        ctx.log_metric("replayed_group_fraction", len(splices) / max(n_groups, 1))
        ctx.log_metric("stored_rollouts", len(to_store))
        ctx.log_metric("buffer_prompts", len(self.buffers))
        ctx.log_metric("buffer_rollouts", self.buffers.total())
        if splices:
            ctx.log_metric("replay_age", sum(ctx.step - e["step"] for e in splices.values()) / len(splices))

    def _rows_to_store(self, storable: torch.Tensor, keys: list[int], G: int) -> list[int]:
        """Global rows whose rollouts enter the buffers: per prompt, the last ``buffer_size`` storable rows."""
        by_key: dict[int, list[int]] = {}
        for n in torch.nonzero(storable).flatten().tolist():
            by_key.setdefault(keys[n], []).append(n)
        return sorted(n for rows in by_key.values() for n in rows[-self.options.buffer_size:])

    def _store(self, ctx: RolloutContext, rows: list[int], keys: list[int]) -> None:
        self._pending = {}
        if not rows:  # decided from gathered flags: every process skips the id gather together
            return
        wanted = set(rows)
        ids = gather_id_lists(ctx, [ctx.completion_ids[i] if ctx.global_index[i] in wanted else []
                                    for i in range(len(ctx))])
        for n in rows:
            entry = {"ids": ids[n], "step": int(ctx.step), "advantage": math.nan}
            self._pending[n] = self.buffers.add(keys[n], entry, self.options.buffer_size)

    def _splice(self, ctx: RolloutContext, i: int, entry: dict) -> None:
        prompt = ctx.prompts[i] if ctx.training_prompts[i] != ctx.prompts[i] else None
        # logprobs=None: NaN sampling log-probs (not sampled in this step), on 'policy' tokens too
        ctx.replace_row(i, list(entry["ids"]), offpolicy=self._tokens() == "offpolicy", logprobs=None,
                        training_prompt=prompt, prompt_swapped=False)
        self._annotate(ctx, i, entry)

    @staticmethod
    def _annotate(ctx: RolloutContext, i: int, entry: dict) -> None:
        ctx.annotations[i].update({REPLAYED: True, REPLAY_STEP: entry["step"], REPLAY_ADVANTAGE: entry["advantage"]})

    # ------------------------------------------------------------------------------------------ advantage
    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        if ctx.mode != "train":
            return
        if self._placement() == "batch":
            self._replay_batch(ctx)
            return
        o = self.options
        G = ctx.num_generations
        rewards = torch.nan_to_num(ctx.rewards.detach().float().cpu(), nan=0.0)
        before = ctx.advantages.detach().float().cpu()
        per_row = before if before.dim() == 1 else before.mean(dim=1)
        for n, entry in self._pending.items():  # the rows stored this step: their advantage, for 'spear_decay'
            if n < per_row.numel():
                entry["advantage"] = float(per_row[n])
        self._pending = {}
        replayed = [n for n, a in enumerate(ctx.annotations) if a.get(REPLAYED)]
        adv = ctx.advantages.clone()
        if o.advantage != "group":
            batch_std = float(rewards.std()) if rewards.numel() > 1 else 0.0
            for n in replayed:
                g = n // G
                own = [j for j in range(g * G, (g + 1) * G) if j != n]
                values = own_rows_advantages(rewards[own], self._scale, batch_std)
                for j, v in zip(own, values.tolist()):
                    adv[j] = v
                if o.advantage == "spear_baseline":
                    value = spear_baseline_advantage(float(rewards[n]), self.group_means, self.group_stds,
                                                     self._scale != "none")
                else:
                    stored = ctx.annotations[n].get(REPLAY_ADVANTAGE, math.nan)
                    value = (stored if not math.isnan(stored) else float(per_row[n])) * o.advantage_decay
                adv[n] = value
            if o.advantage == "spear_baseline":
                self._record_groups(rewards, set(replayed), G)
        coef = o.replay_coef * cosine_ramp(ctx.step, self._warmup())
        for n in replayed:
            adv[n] = adv[n] * coef
        ctx.advantages = adv
        if replayed:
            rows = adv[replayed] if adv.dim() == 1 else adv[replayed].mean(dim=1)
            ctx.log_metric("replay_advantage", float(rows.float().mean()))
            ctx.log_metric("replay_coef", coef)

    def _record_groups(self, rewards: torch.Tensor, replayed: set[int], G: int) -> None:
        """Append this batch's per-group mean and std of the own rows' rewards to the baseline history."""
        for g in range(rewards.numel() // G):
            own = torch.tensor([float(rewards[j]) for j in range(g * G, (g + 1) * G) if j not in replayed])
            self.group_means.append(float(own.mean()))
            self.group_stds.append(float(own.std()) if own.numel() > 1 else 0.0)  # SPEAR: torch's std, unbiased
        excess = len(self.group_means) - self.options.baseline_groups
        if excess > 0:
            del self.group_means[:excess]
            del self.group_stds[:excess]

    # ------------------------------------------------------------------------------------------ SPEAR's replay batch
    def _replay_batch(self, ctx: AdvantageContext) -> None:
        """placement 'batch': train the buffer as a replay update (entries of earlier steps), then store this step's
        rows with a positive advantage, in SPEAR's order (ray_trainer_hybrid.py: get_buffer and reset_buffer, the
        actor update, then remove_old and update_batch)."""
        o = self.options
        G = ctx.num_generations
        rewards = torch.nan_to_num(ctx.rewards.detach().float().cpu(), nan=0.0)
        before = ctx.advantages.detach().float().cpu()
        per_row = before if before.dim() == 1 else before.mean(dim=1)
        self.evict(ctx.step)
        replay: list[ReplayRow] = []
        if self._batch_ready():
            replay = self._batch_rows(ctx.step)
            if self._gate() == "full":
                self.buffers = RolloutBuffer()
        if replay:  # decided from the buffers, the same on every process
            ctx.schedule_replay_update(replay)
        stored = self._store_batch(ctx, per_row, rewards)
        self._record_groups(rewards, set(), G)
        ctx.log_metric("replay_batch_rows", len(replay))
        ctx.log_metric("stored_rollouts", stored)
        ctx.log_metric("buffer_rollouts", self.buffers.total())
        if replay:
            ctx.log_metric("replay_advantage", sum(r.advantage for r in replay) / len(replay))
            ctx.log_metric("replay_coef", o.replay_coef * cosine_ramp(ctx.step, self._warmup()))

    def _batch_ready(self) -> bool:
        """SPEAR's is_full_capacity: more than 1.5 x gate_capacity entries count ('spear_baseline': entries whose
        reward is above the p50 of the recent group mean rewards; 'spear_decay': every entry); 'always': any entry."""
        entries = [e for v in self.buffers.values() for e in v]
        if self._gate() == "always":
            return bool(entries)
        if self.options.advantage == "spear_baseline" and self.group_means:
            p50 = float(torch.tensor(self.group_means, dtype=torch.float64).quantile(0.5))
            count = sum(1 for e in entries if e["reward"] > p50)
        else:
            count = len(entries)
        return count > SPEAR_FULL_FACTOR * self.options.gate_capacity

    def _batch_rows(self, step: int) -> list[ReplayRow]:
        """SPEAR's get_buffer: every entry's recalibrated advantage ('spear_baseline': r - p50 of the group means,
        over p50 of the stds + 1e-6 unless scale_rewards is 'none', kept where positive; 'spear_decay': the stored
        advantage times advantage_decay), then a random subset of the largest power of two <= their number, at most
        gate_capacity (seeded by the run's seed and the step: the same on every process), times the coefficient."""
        o = self.options
        entries = [e for v in self.buffers.values() for e in v]
        values = []
        for e in entries:
            if o.advantage == "spear_baseline":
                value = spear_baseline_advantage(e["reward"], self.group_means, self.group_stds, self._scale != "none")
            else:
                value = e["advantage"] * o.advantage_decay
            if value > 0:
                values.append((e, value))
        n = min(lower_power_of_two(len(values)), o.gate_capacity)
        if n == 0:
            return []
        g = torch.Generator().manual_seed((self._seed * 1_000_003 + step * 7_919) % (2**63 - 1))
        chosen = sorted(torch.randperm(len(values), generator=g)[:n].tolist())
        coef = o.replay_coef * cosine_ramp(step, self._warmup())
        return [ReplayRow(_plain(values[k][0]["prompt_ids"]), _plain(values[k][0]["ids"]),
                          [int(m) for m in _plain(values[k][0]["mask"])], _plain(values[k][0]["logps"]),
                          values[k][1] * coef) for k in chosen]

    def _store_batch(self, ctx: AdvantageContext, per_row: torch.Tensor, rewards: torch.Tensor) -> int:
        """SPEAR's update_batch: this step's rows with a positive advantage (the policy's own samples under their
        prompt; with tools and require_tool_call, episodes that called a tool), with the behaviour log-probs of a no-
        grad forward of the policy that sampled them (ctx.policy_stats). Returns the number stored (rows with a trained
        token). An entry holds compact CPU tensors: ``prompt_ids`` (P,) and ``ids`` (L,) int32, ``mask`` (L,) bool,
        ``logps`` (L,) float32 with NaN where the mask is 0 (Python lists took about 8 times the memory)."""
        own = (ctx.offpolicy_fraction.detach().cpu() == 0) & ~ctx.prompt_swapped.detach().cpu().bool()
        own &= torch.tensor([not a.get(REPLAYED) for a in ctx.annotations], dtype=torch.bool)
        if self._tools and self.options.require_tool_call:
            calls = [any(bool(c) for c in t.tool_calls) for t in ctx.local_turns]
            own &= torch.tensor(ctx.gather_object(calls), dtype=torch.bool)
        rows = torch.nonzero((per_row > 0) & own).flatten().tolist()
        if not rows:  # decided from global data: every process skips the forward and the gather together
            return 0
        stats = ctx.policy_stats()
        start = ctx.process_slice.start or 0
        wanted = set(rows)
        local = []
        for i in range(stats.per_token_logps.size(0)):
            tokens = torch.nonzero(ctx.local_completion_mask[i]).flatten()
            if start + i not in wanted or tokens.numel() == 0:  # (a masked truncated completion trains nothing)
                local.append(None)
                continue
            length = int(tokens.max()) + 1  # up to and including EOS
            # copies, never views of the batch: a view would keep (and pickle) the whole batch's storage
            mask = stats.mask[i, :length].detach().cpu().bool().clone()
            local.append({"prompt_ids": torch.tensor(list(ctx.local_prompt_ids[i]), dtype=torch.int32),
                          "ids": ctx.local_completion_ids[i, :length].detach().cpu().to(torch.int32).clone(),
                          "mask": mask,
                          "logps": stats.per_token_logps[i, :length].detach().float().cpu().masked_fill(~mask, math.nan)})
        stored = 0
        for n, item in enumerate(ctx.gather_object(local)):
            if item is None or not bool(item["mask"].any()):
                continue
            self.buffers.add(0, {**item, "reward": float(rewards[n]), "advantage": float(per_row[n]),
                                 "step": int(ctx.step)})
            stored += 1
        return stored


def _plain(values) -> list:
    """A stored entry's field as a Python list (entries hold tensors; checkpoints of replay <= 0.5.0 hold lists)."""
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def lower_power_of_two(n: int) -> int:
    """SPEAR's nearest_lower_power_of_2: the largest power of two <= n, and 0 for n <= 1."""
    return 0 if n <= 1 else 1 << (n.bit_length() - 1)
