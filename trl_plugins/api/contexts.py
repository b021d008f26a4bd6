"""Stage context objects: what each hook sees and may change (tensor shapes in every docstring).

Shapes: ``N`` rows in the global generation batch, ``B`` rows on this process (a generation batch at the
sampling/advantage stages, a shuffled micro-batch at the loss stage), ``T`` completion positions, ``K``
reward functions, ``G`` group size. Global row ``g`` is in group ``g // G`` at index ``g % G``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from trl_plugins.api.collectives import context_device  # noqa: F401 -- re-exported: plugins import it from here
from trl_plugins.api.collectives import run_together
from trl_plugins.api.errors import PluginError
from trl_plugins.api.services import RunInfo, StageServices, gather_padded
from trl_plugins.api.success import (
    DEFAULT_RULE,
    RewardColumns,
    SuccessRule,
    success_mask,
    verifier_column,
)

#: Prefix of the generation-batch keys that carry per-row plugin extras to the loss stage.
EXTRA_PREFIX = "plugin_extra::"
#: Generation-batch key of the (B, T) off-policy token mask.
OFFPOLICY_KEY = "offpolicy_mask"
#: Generation-batch key of the (B, T) behaviour log-probs of replayed tool episodes (``RolloutContext.
#: behaviour_logprobs``; NaN elsewhere): the loss takes them as the old log-probs where finite.
BEHAVIOUR_LOGPS_KEY = "plugin_behaviour_logps"
#: Generation-batch key of the (B, T) assistant-turn index of each completion token (multi-turn tool rollouts; -1 on
#: tool-result tokens and padding), see :mod:`trl_plugins.api.turns`.
TURN_IDS_KEY = "plugin_turn_ids"
#: Name of the per-row extra carrying teacher log-probs to the loss stage (``LossContext.teacher_logps``).
TEACHER_LOGPS_EXTRA = "teacher_logps"


#: The services of a context built without any (every member raises a ``PluginError`` naming itself).
NO_SERVICES = StageServices()


def masked_sampling_logprobs(logprobs: Sequence[float], offpolicy: Sequence[bool], prompt_swapped: bool) -> list[float]:
    """The sampling log-probs a row trains with: NaN on off-policy tokens, NaN on every token of a prompt-swapped row.

    NaN tells TRL's vLLM importance-sampling correction (and its off-policy masks) to leave the token alone: an
    off-policy token was not sampled from the policy, and a swapped row's tokens were sampled under another prompt
    than the one the loss conditions on. ``logprobs`` and ``offpolicy`` have one entry per completion token.
    """
    if prompt_swapped:
        return [float("nan")] * len(logprobs)
    return [float("nan") if off else lp for lp, off in zip(logprobs, offpolicy)]


class _StageContext:
    """What every stage context shares: its services (a constructor argument), metrics, the active plugin.

    Members read from ``self.services`` (a :class:`~trl_plugins.api.services.StageServices`); a member the services
    lack raises a ``PluginError`` naming the member and the context.
    """

    _active_plugin: str | None = None

    def set_active_plugin(self, name: str | None) -> None:
        """Name the plugin whose hook runs now (None: the framework); the plugin manager calls this."""
        self._active_plugin = name

    @property
    def active_plugin(self) -> str | None:
        """Name of the plugin whose hook runs now (None outside a hook)."""
        return self._active_plugin

    def _service(self, member: str) -> Any:
        return self.services.require(member, type(self).__name__)

    def log_metric(self, name: str, value: float) -> None:
        """Log a scalar under ``plugins/<plugin>/<name>`` (averaged per logging step, like TRL's metrics)."""
        sink = self.services.metric_sink
        if sink is None:
            return
        plugin = self._active_plugin or "framework"
        sink(f"plugins/{plugin}/{name}", float(value))

    @property
    def run(self) -> RunInfo:
        """Read-only settings of the run (:class:`~trl_plugins.api.services.RunInfo`: max_completion_length, ...)."""
        return self.services.run()

    @property
    def device(self) -> torch.device:
        """The device of the run's collectives (the accelerator's): put tensors given to :meth:`gather` there."""
        return torch.device(self.run.device)

    @property
    def tokenizer(self) -> Any:
        """The run's text tokenizer (TRL's ``processing_class``, or its ``.tokenizer`` for a multimodal processor)."""
        return self._service("tokenizer")

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """All-gather a (B, ...) tensor into (N, ...) in global row order (collective: call on every process)."""
        return self._service("gather")(tensor)

    def gather_object(self, values: list) -> list:
        """Gather a per-row Python list (B,) from every process into (N,) (collective)."""
        return self._service("gather_object")(values)

    def gather_padded(self, tensor: torch.Tensor, dim: int = 1, pad_value: float = 0) -> torch.Tensor:
        """Pad ``tensor`` along ``dim`` to the largest size on any process, then all-gather along dim 0.

        (B, T_local) -> (N, T_max) with ``dim=1``; a variable-length (n_local,) -> (P * n_max,) with ``dim=0``
        (drop the padding by its ``pad_value``). Collective: call on every process.
        """
        return gather_padded(self._service("gather"), tensor, dim, pad_value)

    def policy_logprobs(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """No-grad per-token log-probs of ``completion_ids[i]`` after ``prompt_ids[i]`` under the current policy.

        Temperature applied as in TRL's log-probs; one (len(completion_ids[i]),) tensor per row (forward chunks of
        ``per_device_train_batch_size`` rows; prompts left-padded, completions right-padded, TRL's layout).

        Collective: every process must call it the same number of times (with no rows where it has none: pass
        ``[]``, never skip the call); the rows are padded to the largest count across processes, because a forward
        of a sharded model (FSDP, ZeRO-3) is itself a collective. Batch this process's rows into one call.
        """
        return self._service("policy_logprobs")(
            [list(p) for p in prompt_ids], [list(c) for c in completion_ids]
        )


def group_layout(process_index: int, local_rows: int, num_generations: int) -> tuple[list[int], list[int], list[int]]:
    """Global index, group id and index-in-group of each local row (from its global position, never local).

    >>> group_layout(1, 3, 2)  # process 1 of a batch of 6 rows, G=2
    ([3, 4, 5], [1, 2, 2], [1, 0, 1])
    """
    global_index = [process_index * local_rows + j for j in range(local_rows)]
    return global_index, [g // num_generations for g in global_index], [g % num_generations for g in global_index]


# =============================================================================================== sampling
@dataclass
class PromptContext(_StageContext):
    """Sampling stage, before generation: per-row generation and training prompts (local rows).

    Attributes:
        rows: the B dataset rows of this process (each prompt repeated G times), with every column.
        prompts: the original prompts (length B, conversational message lists or strings); read-only.
        generation_prompts: what each row is sampled from (length B); edit freely.
        training_prompts: what the loss conditions on for each row (length B); default = ``prompts``.
        global_index, group_ids, index_in_group: (B,) integer lists from the global position.
        num_generations: G.
        step: ``trainer.state.global_step``.
        annotations: per-row dicts; keys become columns of TRL's completions table (e.g. ``hint_level``).
        deferred: (B,) rows left out of the first generation round (see :meth:`defer`); empty = none.
        mode: "train" or "eval" (the sampling-stage hooks run on training batches only).
        services: the :class:`~trl_plugins.api.services.StageServices` behind the methods (a constructor argument).
    """

    rows: list[dict]
    prompts: list
    generation_prompts: list
    training_prompts: list
    global_index: list[int]
    group_ids: list[int]
    index_in_group: list[int]
    num_generations: int
    step: int
    annotations: list[dict]
    deferred: list[bool] = field(default_factory=list)
    mode: str = "train"
    services: StageServices = field(default=NO_SERVICES, repr=False, compare=False)

    def defer(self, i: int) -> None:
        """Leave local row ``i`` out of the first generation round; a later hook of the step fills it.

        For methods that spend part of the group's budget in a second round (e.g. feedback-conditioned re-sampling):
        the trainer samples only the other rows, so the step still costs exactly G rollouts per group. Until an
        ``after_generation`` hook fills the row with :meth:`RolloutContext.replace_row` (typically from
        ``ctx.service.generate``), it holds an empty completion (``RolloutContext.deferred[i]`` is True); a
        deferred row left unfilled is an error. Not available with ``rollout_func`` or tools.
        """
        if not self.deferred:
            self.deferred = [False] * len(self.rows)
        self.deferred[i] = True

    def defer_slots(self, slot: Callable[[int], bool]) -> list[int]:
        """:meth:`defer` every local row whose index in its group ``k`` (0 .. G-1) satisfies ``slot(k)``, e.g. the
        branch rows of trees rooted at every ``L``-th slot: ``ctx.defer_slots(lambda k: k % L != 0)``. Returns the
        deferred local row indices, in order."""
        rows = [i for i in range(len(self.rows)) if slot(self.index_in_group[i])]
        for i in rows:
            self.defer(i)
        return rows


@dataclass
class Completion:
    """One completion returned by the generation service.

    Attributes:
        completion_ids: generated token ids (for a continuation: the prefix ids followed by the new ids).
        logprobs: sampling log-probs per token (None with HF generation), NaN on prefix tokens.
        text: decoded text of ``completion_ids``.
    """

    completion_ids: list[int]
    logprobs: list[float] | None
    text: str


@dataclass
class TokenProbe:
    """The policy's next-token distribution at one completion position (the branching seam's probes).

    Attributes:
        position: completion index ``t``: the distribution of token ``t`` given the prompt and ``completion[:t]``.
        top_ids: the ``k`` most likely next tokens, most likely first (``k`` = the call's ``top_k``).
        top_logprobs: their log-probs (temperature applied as in TRL's log-probs), same order.
        entropy: entropy of the whole next-token distribution there (nats, temperature applied).
    """

    position: int
    top_ids: list[int]
    top_logprobs: list[float]
    entropy: float


@dataclass
class Continuation:
    """One continuation of a given prefix (``GenerationService.continue_prefixes``, ``ctx.continue_prefixes``).

    Attributes:
        completion_ids: the prefix ids followed by the new ids (the whole completion so far).
        new_ids: the generated ids alone (at least one), cut at the request's ``max_new_tokens`` and just after its
            first stop string.
        logprobs: (len(new_ids),) per-token sampling log-probs of ``new_ids`` under the policy that sampled them
            (temperature applied, from a teacher-forced no-grad forward of the same weights).
        finished: True when the continuation ended by EOS or a stop string, False when a length limit cut it.
        stop: the stop string that ended it, or None.
        probes: one :class:`TokenProbe` per requested position, in the order asked (empty when none asked).
    """

    completion_ids: list[int]
    new_ids: list[int]
    logprobs: list[float]
    finished: bool
    stop: str | None = None
    probes: list[TokenProbe] = field(default_factory=list)


@dataclass
class ToolEpisode:
    """One tool episode continued from a turn boundary (``ctx.continue_tool_episodes``); put it into its row with
    :meth:`RolloutContext.replace_episode`.

    Attributes:
        row: the local row it continues.
        turn: the boundary: assistant turns ``0 .. turn-1`` and their tool results are the row's, kept token-exact.
        start: completion index of the first new token (the kept prefix's length).
        completion_ids: (L,) the kept prefix followed by the new assistant turns and tool results (TRL's layout).
        tool_mask: (L,) TRL's tool mask (1 model token, 0 tool-result token), the kept prefix's included.
        messages: TRL's completion messages (assistant and tool messages), the kept ones first.
        logprobs: (L,) per-token sampling log-probs of the new model tokens under the policy that sampled them
            (temperature applied, teacher-forced no-grad forward of the same weights); NaN on the kept prefix and on
            tool-result tokens.
        turns: the :class:`~trl_plugins.api.turns.TurnStructure` of the whole completion (per-call rewards of its
            environment included).
        environment: the continuation's own environment instance (a fresh one, reset with the row and with the kept
            turns' calls replayed), or None without ``environment_factory``.
    """

    row: int
    turn: int
    start: int
    completion_ids: list[int]
    tool_mask: list[int]
    messages: list
    logprobs: list[float]
    turns: Any
    environment: Any = field(default=None, repr=False)
    behaviour: bool = False

    @property
    def new_ids(self) -> list[int]:
        """The tokens after the boundary (new assistant turns and their tool results)."""
        return self.completion_ids[self.start:]


class _TokenTerms(NamedTuple):
    """How a stored row's validation names its per-token mask and log-probs (:func:`_checked_row_tokens`)."""

    mask: str  # the mask field, e.g. "tool_mask"
    mask_values: str  # its plural in a count, e.g. "tool-mask values"
    zero: str  # what 0 means, e.g. "tool-result token"
    one: str  # what 1 means, e.g. "model token"
    token: str  # a masked-in token, e.g. "model token"
    logp: str  # the log-prob's name, e.g. "behaviour log-prob"
    logp_meaning: str  # what it is, e.g. "the log-prob of the sampled token under the policy that sampled it"


def _checked_row_tokens(where: str, terms: _TokenTerms, prompt_ids: Sequence[int], completion_ids: Sequence[int],
                        mask: Sequence[int], logprobs: Sequence[float | None]) -> tuple[list, list, list, list]:
    """The validated ``(prompt_ids, completion_ids, mask, logprobs)`` of a stored row (:class:`StoredEpisode`,
    :class:`ReplayRow`): ids as ints, a 0/1 mask with at least one 1, one log-prob per token that is finite and <= 0
    where the mask is 1 (NaN elsewhere); anything else raises a ``PluginError`` naming the value and what is allowed."""
    prompt_ids, completion_ids, mask = [int(t) for t in prompt_ids], [int(t) for t in completion_ids], list(mask)
    L = len(completion_ids)
    if not prompt_ids:
        raise PluginError(f"{where}: prompt_ids is empty; allowed: the prompt's token ids (at least one).")
    if L == 0:
        raise PluginError(f"{where}: completion_ids is empty; allowed: at least one token.")
    if len(mask) != L or len(logprobs) != L:
        raise PluginError(f"{where}: {len(mask)} {terms.mask_values} and {len(logprobs)} log-probs for {L} completion "
                          "tokens; allowed: one of each per token.")
    bad = [m for m in mask if isinstance(m, bool) or m not in (0, 1)]
    if bad or 1 not in mask:
        raise PluginError(f"{where}: {terms.mask} value {bad[0] if bad else 'all 0'!r}; allowed: 0 ({terms.zero}) or 1 "
                          f"({terms.one}), with at least one {terms.token}.")
    logps = []
    for t, (m, v) in enumerate(zip(mask, logprobs)):
        value = math.nan if v is None else float(v)
        if m == 1 and not (math.isfinite(value) and value <= 0.0):
            raise PluginError(f"{where}: {terms.logp} {v!r} at {terms.token} {t}; allowed: a finite value <= 0 "
                              f"({terms.logp_meaning}).")
        logps.append(value if m == 1 else math.nan)
    return prompt_ids, completion_ids, mask, logps


_EPISODE_TERMS = _TokenTerms("tool_mask", "tool-mask values", "tool-result token", "model token", "model token",
                             "behaviour log-prob", "the log-prob of the sampled token under the policy that sampled it")
_REPLAY_TERMS = _TokenTerms("loss_mask", "loss-mask values", "not trained", "trained", "trained token", "old log-prob",
                            "the log-prob of the token under the policy that sampled it")


@dataclass
class StoredEpisode:
    """A past tool episode kept for replay (``ctx.store_tool_episodes``), spliced back into a row of a later batch by
    ``ctx.replay_tool_episodes`` + :meth:`RolloutContext.replace_episode`.

    A replayed episode is off-policy: its model tokens train with TRL's clipped ratio against ``logprobs``, the
    behaviour log-probs of the policy that sampled it, so the importance ratio ``exp(log pi_theta - log pi_behaviour)``
    stays exact (SPEAR's replay batch keeps its stored ``old_log_probs``).

    Attributes:
        prompt_ids: the prompt's token ids (the episode replays into rows with the same prompt ids only).
        completion_ids: (L,) the whole completion, tool-result tokens included (TRL's layout).
        tool_mask: (L,) TRL's tool mask (1 model token, 0 tool-result token); at least one model token.
        messages: TRL's completion messages (assistant and tool messages), at least one assistant message.
        logprobs: (L,) behaviour log-probs: finite and <= 0 on model tokens, NaN on tool-result tokens (forced).
        step: the optimizer step at which it was stored.
        global_row: the global row it was stored from (-1: unknown).

    Refused at construction (a ``PluginError`` naming the value and what is allowed): lengths that differ, an empty
    completion, a mask value other than 0/1 or no model token, a model-token log-prob that is not a finite value <= 0,
    no assistant message, empty prompt ids. :meth:`state` / :meth:`from_state` give a checkpointable dict.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    tool_mask: list[int]
    messages: list
    logprobs: list[float]
    step: int = 0
    global_row: int = -1

    def __post_init__(self) -> None:
        where = "StoredEpisode"
        self.messages = list(self.messages)
        self.prompt_ids, self.completion_ids, self.tool_mask, self.logprobs = _checked_row_tokens(
            where, _EPISODE_TERMS, self.prompt_ids, self.completion_ids, self.tool_mask, self.logprobs)
        if not any(isinstance(x, dict) and x.get("role") == "assistant" for x in self.messages):
            raise PluginError(f"{where}: messages hold no assistant message; allowed: TRL's completion messages of the "
                              "episode (assistant and tool messages).")

    @property
    def num_turns(self) -> int:
        """Assistant turns of the episode (maximal runs of model tokens)."""
        return sum(1 for t, m in enumerate(self.tool_mask) if m == 1 and (t == 0 or self.tool_mask[t - 1] != 1))

    def state(self) -> dict:
        """A checkpointable copy (plain lists, dicts, ints and floats)."""
        return {"prompt_ids": list(self.prompt_ids), "completion_ids": list(self.completion_ids),
                "tool_mask": list(self.tool_mask), "messages": copy.deepcopy(self.messages),
                "logprobs": list(self.logprobs), "step": int(self.step), "global_row": int(self.global_row)}

    @classmethod
    def from_state(cls, state: dict) -> StoredEpisode:
        """The episode saved by :meth:`state` (validated again)."""
        return cls(**{k: copy.deepcopy(v) for k, v in state.items()})


@dataclass
class ReplayRow:
    """A row kept from an earlier batch and trained again in a **replay update** (SPEAR's replay batch): extra
    optimizer steps after a generation batch's own update, scheduled by :meth:`AdvantageContext.schedule_replay_update`.

    Its loss is TRL's surrogate of the run's ``loss_type`` with the importance ratio ``exp(log pi_theta - old)``
    against ``old_logprobs`` (the behaviour log-probs of the policy that sampled it), its ``advantage`` on every token
    of ``loss_mask``. See :mod:`trl_plugins.runtime.replay_update`.

    Attributes:
        prompt_ids: the prompt's token ids (at least one).
        completion_ids: (L,) the completion (with tool-result tokens, TRL's layout, when it is a tool episode).
        loss_mask: (L,) 1 on tokens the loss trains (model tokens), 0 elsewhere (tool results); at least one 1.
        old_logprobs: (L,) behaviour log-probs: finite and <= 0 where ``loss_mask`` is 1 (stored as NaN elsewhere).
        advantage: the row's advantage (finite), the same on every trained token.

    Refused at construction (a ``PluginError`` naming the value and what is allowed): lengths that differ, an empty
    prompt or completion, a mask value other than 0/1 or no trained token, a trained token's log-prob that is not a
    finite value <= 0, an advantage that is not finite. :meth:`state` / :meth:`from_state` give a checkpointable dict.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float]
    advantage: float

    def __post_init__(self) -> None:
        where = "ReplayRow"
        self.prompt_ids, self.completion_ids, self.loss_mask, self.old_logprobs = _checked_row_tokens(
            where, _REPLAY_TERMS, self.prompt_ids, self.completion_ids, self.loss_mask, self.old_logprobs)
        advantage = float(self.advantage)
        if not math.isfinite(advantage):
            raise PluginError(f"{where}: advantage {self.advantage!r}; allowed: a finite number.")
        self.advantage = advantage

    def state(self) -> dict:
        """A checkpointable copy (plain lists, ints and floats)."""
        return {"prompt_ids": list(self.prompt_ids), "completion_ids": list(self.completion_ids),
                "loss_mask": list(self.loss_mask), "old_logprobs": list(self.old_logprobs),
                "advantage": float(self.advantage)}

    @classmethod
    def from_state(cls, state: dict) -> ReplayRow:
        """The row saved by :meth:`state` (validated again)."""
        return cls(**{k: copy.deepcopy(v) for k, v in state.items()})


@dataclass
class RolloutContext(_StageContext):
    """Sampling stage, after generation: the generated local batch, editable row by row.

    Attributes:
        rows: the B dataset rows of this process.
        prompts: original prompts (B,).
        training_prompts: the prompt each row is trained under (B,); see :meth:`replace_row`.
        prompt_ids: token ids of each row's training prompt (B lists).
        completion_ids: token ids of each row's completion (B lists, unpadded).
        completions: decoded completions (B,), TRL's format (string or assistant message list).
        sampling_logprobs: per-token sampling log-probs (B lists) or None (HF generation). Rows with
            ``prompt_swapped`` still hold the log-probs under their *generation* prompt here; the trainer sets
            them to NaN after the last ``after_generation`` hook (they are not log-probs of the training prompt).
        offpolicy: per-token provenance (B lists of bool; True = off-policy token, trained through the shaped
            branch ``-A f(p)`` with ``f(p) = p/(p+gamma)``, NaN sampling log-prob).
        prompt_swapped: (B,) True where the generation prompt differs from the training prompt.
        global_index, group_ids, index_in_group, num_generations, step, annotations: as in PromptContext.
        service: the :class:`~trl_plugins.runtime.generation.GenerationService` (in-step generation).
        deferred: (B,) True for rows left out of the first generation round (``PromptContext.defer``): they hold an
            empty completion until a hook fills them with :meth:`replace_row`; empty list = no deferred row.
        mode: "train" or "eval" (the sampling-stage hooks run on training batches only).
        services: the :class:`~trl_plugins.api.services.StageServices` behind the methods (a constructor argument).
        turns: (B,) :class:`~trl_plugins.api.turns.TurnStructure` of each completion (assistant-turn, tool-call and
            tool-result spans, TRL's tool mask, the environment's per-turn rewards) when the run has ``tools`` or an
            ``environment_factory``; empty list otherwise. A row changed by :meth:`replace_row` becomes one turn; a row
            changed by :meth:`replace_episode` keeps the continued episode's turns.
        episodes: local row -> the :class:`ToolEpisode` that replaced it (:meth:`replace_episode`).
        behaviour_logprobs: local row -> (L,) behaviour log-probs of a replayed episode (a :class:`ToolEpisode` with
            ``behaviour=True``, from :meth:`replay_tool_episodes`); the loss takes them as the row's old log-probs, so
            its importance ratio is ``exp(log pi_theta - log pi_behaviour)`` (NaN tokens keep TRL's old log-probs).
    """

    rows: list[dict]
    prompts: list
    training_prompts: list
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    completions: list
    sampling_logprobs: list[list[float]] | None
    offpolicy: list[list[bool]]
    prompt_swapped: list[bool]
    global_index: list[int]
    group_ids: list[int]
    index_in_group: list[int]
    num_generations: int
    step: int
    annotations: list[dict]
    service: Any = None
    changed: set = field(default_factory=set)
    deferred: list[bool] = field(default_factory=list)
    mode: str = "train"
    services: StageServices = field(default=NO_SERVICES, repr=False, compare=False)
    turns: list = field(default_factory=list)
    episodes: dict = field(default_factory=dict)
    behaviour_logprobs: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)

    def reward_columns(self, indices: Sequence[int], completions: Sequence[Any] | None = None) -> RewardColumns:
        """Every reward function's value for local rows ``indices`` and the given completions (default: their current
        ones): a :class:`~trl_plugins.api.success.RewardColumns` with the (len(indices), K) matrix (NaN where a function
        returned None and in placeholder columns), the column names and TRL's weights.

        Runs the trainer's reward functions locally (no gather, no reward transforms). With several processes a
        reward function's error here is held (its rows score 0.0) and raised on every process together at the next
        framework collective (generation service, policy entropies, end of stage), so a failure on one process never
        leaves the others waiting in your ``gather``.
        """
        comps = [self.completions[i] for i in indices] if completions is None else list(completions)
        score = self._service("score")
        return RewardColumns.of(score([self.rows[i] for i in indices], [self.prompts[i] for i in indices], comps))

    def score(self, indices: Sequence[int], completions: Sequence[Any] | None = None) -> torch.Tensor:
        """Weighted reward (len(indices),) of local rows ``indices``, as TRL combines the columns (weighted nansum of
        :meth:`reward_columns`). To decide whether an answer is *correct*, use :meth:`success` instead: a weighted
        sum mixes partial-credit and placeholder columns into the verdict."""
        return self.reward_columns(indices, completions).weighted_sum()

    def success(
        self, indices: Sequence[int], completions: Sequence[Any] | None = None, rule: SuccessRule = DEFAULT_RULE
    ) -> torch.Tensor:
        """(len(indices),) bool: which completions succeed under ``rule`` -- decided on the verifier column only
        (default: the first reward function that is not a placeholder, above 0.0); see
        :mod:`trl_plugins.api.success`."""
        return self.reward_columns(indices, completions).success(rule)

    def tokenize_prompts(self, prompts: list) -> list[list[int]]:
        """Token ids of prompts exactly as TRL tokenizes them for generation (chat template applied)."""
        return self._service("tokenize_prompts")(prompts)

    def policy_entropies(self, indices: Sequence[int]) -> list[torch.Tensor]:
        """Per-token entropies of the current policy's next-token distribution over the completions of local rows
        ``indices`` (no grad; temperature applied as in the loss), one (len(completion_ids[i]),) tensor per row.

        Costs a forward pass over those rows. Collective: every process must call it (possibly with no rows); the
        forwards are padded to the same size on every process.
        """
        entropies = self._service("policy_entropies")
        return entropies([self.prompt_ids[i] for i in indices], [self.completion_ids[i] for i in indices])

    def continue_prefixes(
        self,
        prompt_ids: Sequence[Sequence[int]],
        prefix_ids: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        *,
        stop: Sequence[str] | Sequence[Sequence[str]] | None = None,
        probe_positions: Sequence[Sequence[int]] | None = None,
        top_k: int = 0,
    ) -> list[Continuation]:
        """Continue ``prompt_ids[j] + prefix_ids[j]`` for each request ``j``: the branching seam (one
        :class:`Continuation` per request, in order). See
        :meth:`~trl_plugins.runtime.generation.GenerationService.continue_prefixes` for the arguments.

        Collective: call it on every process the same number of times, with zero requests where a process has none;
        counted in the rollout budget like ``service.generate``. TRL's HF-generate backend only (refused under vLLM).
        """
        if self.service is None:
            raise PluginError("RolloutContext.continue_prefixes: this context has no generation service.")
        return self.service.continue_prefixes(
            prompt_ids, prefix_ids, max_new_tokens, stop=stop, probe_positions=probe_positions, top_k=top_k
        )

    def fork_prefixes(
        self,
        prompt_ids: Sequence[Sequence[int]],
        prefix_ids: Sequence[Sequence[int]],
        ranks: Sequence[int],
        max_new_tokens: int | Sequence[int],
        *,
        exclude: Sequence[int | None] | None = None,
        stop: Sequence[str] | Sequence[Sequence[str]] | None = None,
    ) -> list[Continuation]:
        """Fork ``prompt_ids[j] + prefix_ids[j]``: its first new token is forced to the ``ranks[j]``-th most likely
        next token of the policy there (``exclude[j]`` left out), then it continues like :meth:`continue_prefixes`.
        Requests sharing a prefix with ranks ``0 .. k-1`` give ``k`` continuations with distinct next tokens; each
        result's ``probes`` holds the distribution at the fork (top ids, log-probs, entropy). See
        :meth:`~trl_plugins.runtime.generation.GenerationService.fork_prefixes`.

        Collective (call it on every process the same number of times, with zero requests where a process has none);
        counted in the rollout budget; TRL's HF-generate backend only (refused under vLLM).
        """
        if self.service is None:
            raise PluginError("RolloutContext.fork_prefixes: this context has no generation service.")
        return self.service.fork_prefixes(
            [list(p) for p in prompt_ids], [list(p) for p in prefix_ids], list(ranks), max_new_tokens,
            exclude=None if exclude is None else list(exclude), stop=stop,
        )

    def continue_tool_episodes(self, rows: Sequence[int], turns: Sequence[int]) -> list[ToolEpisode]:
        """Continue the tool rollouts of local rows ``rows`` from a turn boundary through TRL's own tool loop: row
        ``rows[j]`` keeps its assistant turns ``0 .. turns[j]-1`` with their tool results (token-exact) and samples turn
        ``turns[j]`` and the rest again (HF generate, TRL's tool execution and length rules), with a fresh instance of
        the row's environment brought to the boundary. One :class:`ToolEpisode` per request, in order; a row may be
        asked several times (several branches from one boundary). Put one into its row with :meth:`replace_episode`.

        ``turns[j]`` is in ``[0, turns[rows[j]].num_turns)``; 0 samples the whole episode again. Rows replaced by
        :meth:`replace_row` in this stage and prompt-swapped rows are refused (their turns are no longer TRL's).

        Collective: call it on every process the same number of times, with zero rows where a process has none. Each
        request counts as one completion in the rollout budget; every generation call inside (the first new turn, each
        tool round) is padded across processes with dummy requests. Runs with tools only, on TRL's HF-generate backend
        (refused under vLLM: :data:`~trl_plugins.api.reasons.VLLM_TOOL_EPISODES`). See
        :mod:`trl_plugins.runtime.tool_episodes`.
        """
        if self.service is None:
            raise PluginError("RolloutContext.continue_tool_episodes: this context has no generation service.")
        return self.service.continue_tool_episodes(self.service.episode_requests(self, list(rows), list(turns)))

    def replace_episode(self, i: int, episode: ToolEpisode, *, offpolicy: bool = False) -> None:
        """Replace local row ``i`` by a continued tool episode (from :meth:`continue_tool_episodes`) or a replayed one
        (from :meth:`replay_tool_episodes`), keeping its turn structure: its ids, sampling log-probs, TRL's messages,
        tool mask and turns, and, for TRL's reward pass, its environment. Usually ``i == episode.row``; another row of
        the same group and prompt is allowed (the same prompt ids are required).

        A replayed episode (``episode.behaviour``) keeps its behaviour log-probs (:attr:`behaviour_logprobs`): the loss
        takes them as the row's old log-probs. ``offpolicy=True`` marks the episode's model tokens off-policy instead
        (the shaped branch ``-A p/(p+gamma)``, no ratio; behaviour log-probs unused)."""
        if not self.turns:
            raise PluginError("replace_episode: the run has no tools; use replace_row.")
        if episode.row != i and list(self.prompt_ids[episode.row]) != list(self.prompt_ids[i]):
            raise PluginError(f"replace_episode({i}): the episode continues row {episode.row}, whose prompt differs from "
                              f"row {i}'s; allowed: row {episode.row} or a row with the same prompt ids.")
        flags = [bool(offpolicy) and m == 1 for m in episode.tool_mask]
        self.replace_row(i, list(episode.completion_ids), offpolicy=flags, logprobs=episode.logprobs)
        self.completions[i] = list(episode.messages)
        self.turns[i] = episode.turns
        self.episodes[i] = episode
        if episode.behaviour and not offpolicy:  # a replayed episode: its stored behaviour log-probs become the row's old log-probs
            self.behaviour_logprobs[i] = list(episode.logprobs)

    def store_tool_episodes(self, rows: Sequence[int]) -> list[StoredEpisode]:
        """Keep the tool episodes of local rows ``rows`` for a later replay: each becomes a :class:`StoredEpisode` (its
        ids with the tool-result tokens, tool mask, messages, and the behaviour log-probs of its model tokens from one
        teacher-forced no-grad forward of the policy that sampled it: call this in the step that generated the rows).

        Collective: call it on every process the same number of times, with zero rows where a process has none (the
        forward is padded across processes). Returns every process's stored episodes, in global row order (the same
        list on every process, so per-prompt buffers built from it stay identical). Rows changed by
        :meth:`replace_row`, prompt-swapped rows and replayed rows are refused (their tokens are not this policy's
        sample under the row's prompt). See :mod:`trl_plugins.runtime.episode_replay`.
        """
        if self.service is None:
            raise PluginError("RolloutContext.store_tool_episodes: this context has no generation service.")
        return self.service.store_tool_episodes(self, [int(i) if not isinstance(i, bool) else i for i in rows])

    def replay_tool_episodes(self, rows: Sequence[int], episodes: Sequence[StoredEpisode]) -> list[ToolEpisode]:
        """Stored episodes made ready to replace local rows ``rows``: one :class:`ToolEpisode` per request with
        ``behaviour=True`` (its ``logprobs`` are the stored behaviour log-probs), the stored turn structure, and a fresh
        instance of the row's environment, reset with the row and with every stored tool call replayed (for TRL's
        reward pass). Put one into its row with :meth:`replace_episode`. ``episodes[j].prompt_ids`` must equal row
        ``rows[j]``'s prompt ids.

        Collective (environment reset errors are raised on every process together): call it on every process the same
        number of times, with zero rows where a process has none. Samples nothing (no rollout budget used).
        """
        if self.service is None:
            raise PluginError("RolloutContext.replay_tool_episodes: this context has no generation service.")
        return self.service.replay_tool_episodes(self, list(rows), list(episodes))

    def decode(self, completion_ids: list[int], row: int) -> Any:
        """Decode ids into TRL's completion format (string, or an assistant message list) for local row ``row``."""
        return self._service("decode")(completion_ids, self.prompts[row])

    def replace_row(
        self,
        i: int,
        completion_ids: list[int],
        *,
        offpolicy: bool | Sequence[bool] = False,
        logprobs: Sequence[float] | None = None,
        training_prompt: Any = None,
        prompt_swapped: bool | None = None,
    ) -> None:
        """Replace local row ``i``'s completion in place (the group keeps exactly G rows).

        Args:
            completion_ids: the new completion's token ids (at least one; ``[eos_token_id]`` for an empty answer).
            offpolicy: per-token provenance (a bool for all tokens, or one bool per token).
            logprobs: sampling log-probs of the new tokens (NaN is forced on off-policy tokens); None = unknown.
            training_prompt: train this row under another prompt (prompt swap); None keeps the current one.
            prompt_swapped: whether the tokens were sampled under a different prompt than the training one
                (their sampling log-probs are then set to NaN). Defaults to the row's current flag.
        """
        n = len(completion_ids)
        if n == 0:  # TRL cannot pad or score a row without completion tokens (it fails later, far from the cause)
            raise PluginError(
                f"replace_row({i}): the new completion has no tokens; a row needs at least one (use [eos_token_id] "
                "for an empty answer)."
            )
        flags = [bool(offpolicy)] * n if isinstance(offpolicy, bool) else [bool(x) for x in offpolicy]
        if len(flags) != n:
            raise PluginError(f"replace_row({i}): {len(flags)} provenance flags for {n} tokens.")
        lps = None
        if self.sampling_logprobs is not None:  # validate before touching the row (a failed call changes nothing)
            # None = unknown (vLLM reports a NaN log-prob as None): NaN, as TRL maps it
            if logprobs is None:
                lps = [float("nan")] * n
            else:
                lps = [float("nan") if x is None else float(x) for x in logprobs]
            if len(lps) != n:
                raise PluginError(f"replace_row({i}): {len(lps)} log-probs for {n} tokens.")
            swapped = self.prompt_swapped[i] if prompt_swapped is None else prompt_swapped
            lps = masked_sampling_logprobs(lps, flags, swapped)
        self.completion_ids[i] = list(completion_ids)
        self.offpolicy[i] = flags
        if training_prompt is not None:
            self.training_prompts[i] = training_prompt
            self.prompt_ids[i] = self.tokenize_prompts([training_prompt])[0]
        if prompt_swapped is not None:
            self.prompt_swapped[i] = prompt_swapped
        if lps is not None:
            self.sampling_logprobs[i] = lps
        self.completions[i] = self.decode(self.completion_ids[i], i)
        self.changed.add(i)
        self.episodes.pop(i, None)  # a plain replacement is one turn again (replace_episode sets it after)
        self.behaviour_logprobs.pop(i, None)

    def splice(self, i: int, start: int, new_ids: Sequence[int], *, offpolicy: bool = True) -> None:
        """Keep row ``i``'s first ``start`` completion tokens (token-exact) and append ``new_ids``.

        The kept prefix keeps its provenance and sampling log-probs; the new tokens are marked ``offpolicy``.
        ``start`` must lie in ``[0, len(completion_ids[i])]``.
        """
        if not 0 <= start <= len(self.completion_ids[i]):
            raise PluginError(
                f"splice({i}, start={start}): start must be in [0, {len(self.completion_ids[i])}] "
                f"(row {i} has {len(self.completion_ids[i])} completion tokens)."
            )
        keep_ids = self.completion_ids[i][:start]
        keep_flags = self.offpolicy[i][:start]
        lps = None
        if self.sampling_logprobs is not None:
            lps = list(self.sampling_logprobs[i][:start]) + [float("nan")] * len(new_ids)
        self.replace_row(i, keep_ids + list(new_ids), offpolicy=keep_flags + [offpolicy] * len(new_ids), logprobs=lps)


# =============================================================================================== reward
class _VerdictMixin:
    """``success`` / ``verifier`` for the stages that hold the gathered (N, K) ``rewards_per_func`` (reward, advantage):
    the success rule of :mod:`trl_plugins.api.success`, one implementation for both."""

    def _reward_names(self) -> list[str]:
        """K column names (TRL's reward function names; ``reward_k`` where the run does not say)."""
        names = list(self.run.reward_func_names)
        K = self.rewards_per_func.shape[1]
        return names if len(names) == K else [f"reward_{k}" for k in range(K)]

    def _placeholders(self) -> list[bool]:
        flags = self.run.placeholder_columns
        return list(flags) if len(flags) == self.rewards_per_func.shape[1] else []

    def success(self, rule: SuccessRule = DEFAULT_RULE) -> torch.Tensor:
        """(N,) bool: which rows succeed under ``rule``, decided on the verifier column of ``rewards_per_func`` only
        (default: the first reward function that is not a placeholder, above 0.0); see
        :mod:`trl_plugins.api.success`."""
        return success_mask(self.rewards_per_func, self._reward_names(), rule, self._placeholders())

    def verifier(self, rule: SuccessRule = DEFAULT_RULE) -> torch.Tensor:
        """(N,) the verifier column of ``rewards_per_func`` (``rule.column``, default: the first reward function that
        is not a placeholder)."""
        return self.rewards_per_func[:, verifier_column(self._reward_names(), self._placeholders(), rule.column)]


@dataclass
class RewardContext(_VerdictMixin, _StageContext):
    """Reward stage: the gathered reward matrix, with the groups in view (same on every process).

    Attributes:
        rewards_per_func: (N, K) float tensor, one column per reward function (NaN = not applicable);
            transform it in place or assign a new (N, K) tensor.
        reward_func_names: K names (TRL's column names).
        reward_weights: (K,) TRL's weights.
        group_ids, index_in_group: (N,) long tensors.
        num_generations: G.
        local_rows, local_prompts, local_completions: this process's B rows, prompts and completions.
        process_slice: the slice of global rows held by this process.
        step: ``trainer.state.global_step``.
        local_completion_ids: this process's B completions as token id lists (unpadded; None if unknown).
        shared: results the plugins of this reward stage share, by key (e.g. the batch's answer clusters, computed
            once by :func:`~trl_plugins.api.answers.batch_clusters` for every plugin that needs them).
        mode: "train" or "eval".
        services: the :class:`~trl_plugins.api.services.StageServices` behind the methods (a constructor argument).
        local_turns: (B,) :class:`~trl_plugins.api.turns.TurnStructure` of this process's completions (multi-turn tool
            rollouts; empty list without tools). A plugin may set ``local_turns[i].turn_rewards`` (one float per
            assistant turn): the advantage stage's ``AdvantageContext.turn_rewards`` is gathered from them.
        local_annotations: (B,) this process's per-row dicts written by the sampling stage
            (``RolloutContext.annotations``, e.g. a check run with the generation service there), for reward
            transforms that need it; read-only here, empty when the sampling stage did not run (rows of a refill round
            carry only ``{"refill_round": n}``). Local: no collective.
    """

    rewards_per_func: torch.Tensor
    reward_func_names: list[str]
    reward_weights: torch.Tensor
    group_ids: torch.Tensor
    index_in_group: torch.Tensor
    num_generations: int
    local_rows: list[dict]
    local_prompts: list
    local_completions: list
    process_slice: slice
    step: int
    local_completion_ids: list[list[int]] | None = None
    mode: str = "train"
    shared: dict[str, Any] = field(default_factory=dict)
    services: StageServices = field(default=NO_SERVICES, repr=False, compare=False)
    local_turns: list = field(default_factory=list)
    local_annotations: list = field(default_factory=list)

    def policy_entropies(self) -> list[torch.Tensor]:
        """Per-token entropies of the current policy's next-token distribution over this process's completions (no
        grad; temperature applied as in the loss), one (len(local_completion_ids[i]),) tensor per local row.

        The forward conditions on ``local_prompts`` tokenized as TRL tokenizes prompts for generation (for a
        prompt-swapped row: its original prompt). Costs a forward pass; collective: call it on every process.
        """
        if self.local_completion_ids is None:
            raise PluginError("RewardContext.policy_entropies: the completions' token ids are not available here.")
        prompt_ids = self._service("tokenize_prompts")(list(self.local_prompts))
        return self._service("policy_entropies")(prompt_ids, [list(c) for c in self.local_completion_ids])

    def policy_features(self) -> torch.Tensor:
        """(B, d) no-grad representation of each local completion: the mean of the policy's last hidden state (the
        backbone's output, before the LM head) over the completion's token positions, conditioned on
        ``local_prompts`` as TRL tokenizes them. One backbone forward (no logits); collective: call it on every
        process."""
        if self.local_completion_ids is None:
            raise PluginError("RewardContext.policy_features: the completions' token ids are not available here.")
        prompt_ids = self._service("tokenize_prompts")(list(self.local_prompts))
        return self._service("policy_features")(prompt_ids, [list(c) for c in self.local_completion_ids])

    def reference_features(self) -> torch.Tensor:
        """(B, d) as :meth:`policy_features`, under the **reference policy** (TRL's reference model, the PEFT model
        with its adapter off, or the trainer's frozen copy of the initial policy). Only for plugins declaring
        ``needs_reference_model = True``; collective."""
        if self.local_completion_ids is None:
            raise PluginError("RewardContext.reference_features: the completions' token ids are not available here.")
        prompt_ids = self._service("tokenize_prompts")(list(self.local_prompts))
        return self._service("reference_features")(prompt_ids, [list(c) for c in self.local_completion_ids])

    def _reward_names(self) -> list[str]:
        return list(self.reward_func_names)


# =============================================================================================== advantage
@dataclass
class AdvantageContext(_VerdictMixin, _StageContext):
    """Advantage stage over the **global** batch (identical on every process).

    Attributes:
        rewards_per_func: (N, K) gathered rewards (after reward transforms).
        rewards: (N,) combined reward: weighted nansum of ``rewards_per_func`` (NaN where every column is NaN).
        advantages: (N,) TRL's advantages to start with; replace with (N,) or (N, T_max) values.
        group_ids, index_in_group: (N,) long tensors; ``num_generations`` = G.
        completion_lengths: (N,) number of loss tokens per row.
        offpolicy_fraction: (N,) fraction of each row's completion tokens that are off-policy.
        prompt_swapped: (N,) bool, rows trained under another prompt than they were sampled from.
        annotations: (N,) per-row dicts from the sampling stage (e.g. ``{"hinted": True}``).
        extras: name -> (N, ...) tensors; they ride with their rows to ``LossContext.extras``.
        process_slice: slice of the global rows held by this process.
        local_completion_ids: (B, T) completion token ids of this process's rows (right-padded, the labels the
            loss sees), for per-token extras set with :meth:`set_local_extra`; None when not provided.
        local_prompt_ids: B lists, the training-prompt token ids of this process's rows (unpadded); None when not
            provided.
        local_completion_mask: (B, T) completion mask of this process's rows (1 up to and including EOS); None when
            not provided.
        mode: "train" or "eval".
        prompt_keys: (N // G,) long, one key per group slot: groups with the same key were generated from the same
            prompt draw (refill plugins' ``RefillContext.repeat``); None = every group its own (see :meth:`pool_ids`).
        services: the :class:`~trl_plugins.api.services.StageServices` behind the methods (a constructor argument).
        turn_ids: (N, T_max) long, the assistant turn of each completion token (-1 on tool-result tokens and
            padding), gathered over processes; None without tools / environments. Expand per-turn values with
            :meth:`expand_turns`.
        turn_rewards: (N, U_max) float, per-turn rewards (the environment's, NaN where none); plugins may write
            their own here (e.g. information-gain rewards) for later advantage plugins. None without tools.
        local_turns: (B,) :class:`~trl_plugins.api.turns.TurnStructure` of this process's rows (empty without tools).
        local_rows: this process's B dataset rows (every column), e.g. a ground-truth answer per row; empty when
            not provided.
    """

    rewards_per_func: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    group_ids: torch.Tensor
    index_in_group: torch.Tensor
    num_generations: int
    completion_lengths: torch.Tensor
    offpolicy_fraction: torch.Tensor
    prompt_swapped: torch.Tensor
    annotations: list[dict]
    process_slice: slice
    step: int
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    local_extras: dict[str, torch.Tensor] = field(default_factory=dict)
    local_completion_ids: torch.Tensor | None = None
    local_prompt_ids: list[list[int]] | None = None
    local_completion_mask: torch.Tensor | None = None
    mode: str = "train"
    prompt_keys: torch.Tensor | None = None
    services: StageServices = field(default=NO_SERVICES, repr=False, compare=False)
    turn_ids: torch.Tensor | None = None
    turn_rewards: torch.Tensor | None = None
    local_turns: list = field(default_factory=list)
    local_rows: list[dict] = field(default_factory=list)

    def expand_turns(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Per-turn values (N, U) -> per-token (N, T_max) over :attr:`turn_ids` (``fill`` on tool results and padding).

        Turn-level advantages: ``ctx.advantages = ctx.expand_turns(turn_advantages)``."""
        if self.turn_ids is None:
            raise PluginError("expand_turns needs turn_ids, which only multi-turn tool rollouts have.")
        from trl_plugins.api.turns import expand_turn_values

        return expand_turn_values(values, self.turn_ids, fill)

    def attach_teacher_logps(self, teacher: Any, rows: Sequence[int] | None = None) -> torch.Tensor:
        """Score this process's completions with ``teacher`` and send the log-probs to the loss stage.

        ``teacher.logprobs(prompt_ids, completion_ids)`` (e.g. a :class:`~trl_plugins.components.teacher.HFTeacher`
        or :class:`~trl_plugins.components.teacher.EndpointTeacher`) scores local rows ``rows`` (default: all B)
        under their training prompts. Returns the (B, T) float32 tensor, NaN where absent (rows not scored,
        positions past a row's completion); it rides with its rows to ``LossContext.teacher_logps``. Calling it again
        (another plugin) overwrites the rows it scores and keeps the others.

        Collective: call on every process (possibly with no rows). A teacher failing on one process (an endpoint
        down after its retries, whose error names the URL) stops every process together, as does a value that is not
        a finite log-prob (NaN, -inf, > 0) or a row of the wrong length, named with the plugin, token and row.
        """
        if self.local_completion_ids is None or self.local_prompt_ids is None or self.local_completion_mask is None:
            raise PluginError("AdvantageContext.attach_teacher_logps needs local_prompt_ids, local_completion_ids and "
                              "local_completion_mask (give them to the context's builder).")
        B, T = self.local_completion_ids.shape
        rows = list(range(B)) if rows is None else [int(i) for i in rows]
        lengths = self.local_completion_mask.sum(-1).long().tolist()
        completions = [self.local_completion_ids[i, : lengths[i]].tolist() for i in rows]
        prompts = [self.local_prompt_ids[i] for i in rows]
        plugin = self.active_plugin or "teacher log-probs"
        scored = run_together(self, plugin, checked_teacher_logprobs,  # finite values <= 0, or refused here
                              teacher, prompts, completions, rows, plugin, self.process_slice.start or 0)
        previous = self.local_extras.get(TEACHER_LOGPS_EXTRA)
        device = self.local_completion_ids.device
        out = torch.full((B, T), float("nan"), device=device) if previous is None else previous.clone()
        for i, values in zip(rows, scored):
            out[i] = float("nan")
            out[i, : values.numel()] = values.to(device=device, dtype=torch.float32)
        self.set_local_extra(TEACHER_LOGPS_EXTRA, out)
        return out
    def pool_ids(self) -> torch.Tensor:
        """(N,) long: rows with the same id were generated from the same prompt draw -- the group id, except for
        groups a refill plugin added with ``RefillContext.repeat`` (they share the repeated group's key)."""
        if self.prompt_keys is None:
            return self.group_ids
        return self.prompt_keys.to(self.group_ids.device).repeat_interleave(self.num_generations)

    def policy_stats(self, head_stats: bool = False) -> PolicyStats:
        """Per-token statistics of the current policy on this process's generation batch (no grad, cached).

        Costs one extra forward pass the first time (like TRL's ``old_per_token_logps``). Collective: gathers
        ``mean_entropy`` across processes, so call it on every process (contexts are identical, so a plugin
        deciding from context data does).
        """
        return self._service("policy_stats")(head_stats)

    def hidden_states(self, reduce: Any, layer: int = -1, head: bool = False) -> Any:
        """Per-token hidden states of one layer of the current policy on this process's generation batch, reduced
        chunk by chunk by ``reduce`` (no grad; one extra forward per call).

        ``reduce(chunk: HiddenChunk)`` gets ``per_device_train_batch_size`` rows at a time (:class:`HiddenChunk`:
        ``hidden`` (n, C, d), ``mask``, ``completion_ids``, ``rows``, and ``head_logprobs`` when ``head``) and returns
        a tensor of n rows, a dict of such tensors, or None; the results are concatenated along rows ((B, ...)). The
        chunk's hidden states are dropped after the call, so no (B, T, d) tensor of the whole batch is held.
        ``layer``: transformers' ``hidden_states`` numbering (0 the embeddings, ``i`` decoder block ``i``, -1 the
        final output after the last norm); pass the plugin's ``hidden_states_layer``. ``head=True`` also gathers the
        LM head once for :meth:`HiddenChunk.head_logprobs` (last layer only).

        Only for plugins declaring ``needs_hidden_states = True``. Collective: every process makes the same forward
        calls, so call it on every process (contexts are identical, so a plugin deciding from context data does),
        and call no collective inside ``reduce``. Not available with image prompts (text-only forwards).
        """
        if self.services.hidden_states is None:
            raise PluginError(
                f"Plugin {self._active_plugin!r} called ctx.hidden_states() without declaring needs_hidden_states = True."
            )
        if head and layer not in (-1,):
            raise PluginError(f"ctx.hidden_states(head=True) projects the final hidden states through the LM head; "
                              f"got layer={layer!r}, allowed: -1.")
        return self.services.hidden_states(reduce, layer, head)

    def completion_mask(self) -> torch.Tensor:
        """(N, T_max) loss mask of all rows, padded across processes (collective)."""
        return self._service("completion_mask")()

    def add_token_advantages(self, dense: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        """Add ``weight * dense`` ((N, T_max) per-token values, e.g. process rewards on their steps' tokens) to the
        advantages, masked by :meth:`completion_mask` (collective); (N,) advantages become (N, T_max). Returns the
        masked ``dense`` (for metrics)."""
        mask = self.completion_mask().float()
        dense = dense.to(mask.device) * mask
        base = self.advantages if self.advantages.dim() == 2 else self.advantages.unsqueeze(1).expand_as(mask)
        self.advantages = (base.to(mask) + weight * dense).to(self.advantages.dtype)
        return dense

    def reference_logprobs(self) -> torch.Tensor:
        """(B, T) no-grad log-probs of this process's completion tokens under the **reference policy** (cached).

        Only for plugins declaring ``needs_reference_model = True``. The trainer takes them from TRL's reference
        forward when ``beta != 0`` (no extra cost); otherwise it runs one forward: the PEFT model with its adapter
        switched off (TRL's own rule: the ``"ref"`` adapter when the model has one), or a frozen copy of the initial
        policy that the trainer keeps for full fine-tuning. Temperature applied as in TRL's log-probs.
        """
        return self._service("reference_logprobs")()

    def set_local_extra(self, name: str, tensor: torch.Tensor) -> None:
        """Attach a (B, ...) tensor for this process's rows only (e.g. per-token proxy log-probs (B, T))."""
        self.local_extras[name] = tensor

    def schedule_replay_update(self, rows: Sequence[ReplayRow]) -> None:
        """Train ``rows`` (:class:`ReplayRow`, kept from earlier batches) in a **replay update**: after the last
        optimizer step that trains this generation batch, ``ceil(R / (P * gradient_accumulation_steps *
        per_device_train_batch_size))`` extra optimizer steps, each over ``gradient_accumulation_steps`` micro-batches
        per process (the R rows spread over processes and micro-batches as evenly as they go; a micro-batch with no
        row runs one zero-weight row, so every process makes the same forwards). No learning-rate scheduler step and
        no ``global_step`` count: SPEAR's replay mini-batches (its ``dp_actor.py``) step the optimizer only.

        Loss: TRL's surrogate of the run's ``loss_type``, clip range and importance-sampling level, ratio against each
        row's ``old_logprobs``; no KL term (SPEAR's replay loss has it commented out), no entropy bonus or entropy mask,
        no vLLM importance-sampling correction, no loss-stage plugin hooks (they act on the batch's own rows). Metrics:
        ``plugins/framework/replay_update_*``.

        Training only (refused in eval). Collective: call it on every process with the same rows (the advantage
        stage's data is the same everywhere), or on none; rows that differ between processes are refused on every
        process (one gather of each process's row count and a digest of its rows). A second call in the same batch adds
        to the first.
        """
        if self.mode != "train":
            raise PluginError("AdvantageContext.schedule_replay_update: only in training (mode 'train'), "
                              f"got mode {self.mode!r}.")
        bad = [r for r in rows if not isinstance(r, ReplayRow)]
        if bad:
            raise PluginError(f"AdvantageContext.schedule_replay_update: got {type(bad[0]).__name__}; allowed: "
                              "ReplayRow objects.")
        self._service("replay_update")(list(rows))


@dataclass
class PolicyStats:
    """No-grad policy statistics of the local generation batch.

    Attributes:
        per_token_logps: (B, T) log-probs of the completion tokens under the current policy.
        entropies: (B, T) entropy of the next-token distribution.
        mask: (B, T) loss mask.
        completion_ids: (B, T) completion token ids (the labels of ``per_token_logps``).
        mean_entropy: (N,) per-row token-mean entropy, gathered over processes.
        head_stats: a :class:`~trl_plugins.runtime.head_stats.HeadStats` of this forward when requested, else None.
    """

    per_token_logps: torch.Tensor
    entropies: torch.Tensor
    mask: torch.Tensor
    completion_ids: torch.Tensor
    mean_entropy: torch.Tensor
    head_stats: Any = None


@dataclass
class HiddenChunk:
    """One chunk of the hidden-state service (:meth:`AdvantageContext.hidden_states`), no grad.

    Attributes:
        rows: the chunk's rows of the local generation batch (a slice of ``range(B)``).
        hidden: (n, C, d) hidden states of the requested layer in the model's dtype; position ``t`` is the state that
            predicts completion token ``t`` (sequence position ``P - 1 + t``); padded positions hold whatever the
            forward produced (mask them).
        mask: (n, C) loss mask of the completion tokens.
        completion_ids: (n, C) completion token ids.
    """

    rows: slice
    hidden: torch.Tensor
    mask: torch.Tensor
    completion_ids: torch.Tensor
    _head: Any = None

    def head_logprobs(self, vocab_ids: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """(..., K) float32 log-probs of the tokens ``vocab_ids`` (K,) under the policy at ``hidden`` (default: the
        chunk's (n, C, d)), the run's temperature applied, normalised over the full vocabulary (computed in blocks of
        ``head_stats_chunk_size`` positions: no (n, C, V) logits). Only with ``ctx.hidden_states(..., head=True)``."""
        if self._head is None:
            raise PluginError("HiddenChunk.head_logprobs needs ctx.hidden_states(..., head=True).")
        return self._head(self.hidden if hidden is None else hidden, vocab_ids)


# =============================================================================================== loss
@dataclass
class LossContext(_StageContext):
    """Loss stage of one micro-batch (a shuffled slice: it holds whole groups only for ``needs_whole_groups`` stacks).

    Attributes (B rows, T positions):
        inputs: the micro-batch dict TRL built (prompt/completion ids and masks, ...).
        per_token_logps: (B, T) log pi_theta of the completion tokens, **with grad** (temperature-scaled).
        old_per_token_logps: (B, T) log pi_old (``per_token_logps.detach()`` when TRL skips it).
        ref_per_token_logps: (B, T) or None (only when ``beta != 0``).
        sampling_per_token_logps: (B, T) or None (vLLM only; NaN on off-policy tokens).
        entropies: (B, T) full-vocabulary entropies, with grad.
        advantages: token advantages: (B, T) when the advantage stage gave token-level ones or a
            ``loss_advantages`` hook is present (it always sees (B, T)); otherwise (B, 1), broadcasting over T.
            (Advantages the ``loss_advantages`` hooks leave constant along each row build the surrogate per row.)
        mask: (B, T) loss mask (completion mask times tool mask).
        offpolicy_mask: (B, T) bool, tokens trained through the shaped off-policy branch.
        log_ratio: (B, T) or (B, 1) ``log pi_theta - log pi_old`` at TRL's importance-sampling level.
        coef_1: ``exp(log_ratio)``, the importance ratio.
        per_token_loss: the base surrogate (TRL's, by ``loss_type``: :mod:`trl_plugins.runtime.loss_rules`; off-policy
            tokens already shaped): (B, T), or (B, 1) at sequence-level importance sampling with per-row advantages.
        extras: per-row tensors attached at the advantage stage (first dim B).
        teacher_logps: (B, T) teacher log-probs of the completion tokens, NaN where absent, or None when no plugin
            attached any (``AdvantageContext.attach_teacher_logps``); a property reading ``extras``.
        loss_type, epsilon_low, epsilon_high, beta: the run's settings.
        clip_scale: (B, T) per-token factors of the clip range, ``clip(r, 1 - c eps_low, 1 + c eps_high)``, set
            through :meth:`scale_clip_range` by ``trl_plugins_loss_advantages`` hooks; None: TRL's scalar range.
        surrogate_built: True once :attr:`per_token_loss` exists (the framework sets it after those hooks).
        num_items_in_batch: loss tokens in the whole generation batch (all processes), TRL's dapo normaliser.
        iteration: index of the current pass over this generation batch (0 .. num_iterations-1).
        mode: "train" or "eval".
        gradient_accumulation_steps: TRL's normaliser of this micro-batch's loss (its current gradient-accumulation
            steps in train mode, 1 in eval); divide a scalar term given to :meth:`add_loss` by it, as TRL does.
        num_generations: G when a plugin of the stack declares ``needs_whole_groups``: the micro-batch then holds whole
            groups, rows ``k*G .. k*G+G-1`` being group k in index-in-group order (:meth:`group_rows`); None otherwise
            (the rows are a shuffled slice of the generation batch).
        services: the :class:`~trl_plugins.api.services.StageServices` behind the methods (a constructor argument).
    """

    inputs: dict
    per_token_logps: torch.Tensor
    old_per_token_logps: torch.Tensor
    ref_per_token_logps: torch.Tensor | None
    sampling_per_token_logps: torch.Tensor | None
    entropies: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    offpolicy_mask: torch.Tensor
    extras: dict[str, torch.Tensor]
    loss_type: str
    epsilon_low: float
    epsilon_high: float
    beta: float
    num_items_in_batch: torch.Tensor
    iteration: int
    mode: str
    gradient_accumulation_steps: int = 1
    num_generations: int | None = None
    log_ratio: torch.Tensor | None = None
    coef_1: torch.Tensor | None = None
    per_token_loss: torch.Tensor | None = None
    token_weights: list[torch.Tensor] = field(default_factory=list)
    token_terms: list[torch.Tensor] = field(default_factory=list)
    scalar_terms: list[torch.Tensor] = field(default_factory=list)
    replacement: tuple[torch.Tensor, torch.Tensor] | None = None
    _replacer: str | None = None
    services: StageServices = field(default=NO_SERVICES, repr=False, compare=False)
    clip_scale: torch.Tensor | None = None
    surrogate_built: bool = False

    @property
    def completion_ids(self) -> torch.Tensor:
        """(B, T) completion token ids."""
        return self.inputs["completion_ids"]

    @property
    def turn_ids(self) -> torch.Tensor | None:
        """(B, T) long assistant-turn index of each token (-1 on tool results and padding) in multi-turn tool
        rollouts; None otherwise. The tool mask itself is folded into :attr:`mask` (and in ``inputs["tool_mask"]``)."""
        return self.inputs.get(TURN_IDS_KEY)

    @property
    def teacher_logps(self) -> torch.Tensor | None:
        """(B, T) float32 teacher log-probs of the completion tokens (no grad), NaN where absent (rows no plugin scored,
        padding); None when no plugin attached any (``AdvantageContext.attach_teacher_logps``)."""
        return self.extras.get(TEACHER_LOGPS_EXTRA)

    def group_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (B, ...) viewed per group: (B / G, G, ...). Only for plugins declaring ``needs_whole_groups``."""
        if self.num_generations is None:
            raise PluginError(
                f"Plugin {self._active_plugin!r} called ctx.group_rows() without declaring needs_whole_groups = True."
            )
        return x.view(-1, self.num_generations, *x.shape[1:])

    def head_stats(self):
        """Chunked LM-head statistics of this forward (:class:`~trl_plugins.runtime.head_stats.HeadStats`).

        Available only to plugins declaring ``needs_head_stats = True``. Every statistic, the gradient path of
        ``top_p_entropy_with_grad`` included, works on blocks of at most ``chunk_size`` rows of V logits, so no
        (B, T, V) logits are built for any ``k_max`` or nucleus width (``nucleus_ids`` alone returns an
        ``(N, min(k_max, V))`` id tensor, by design).
        """
        if self.services.head_stats is None:
            raise PluginError(
                f"Plugin {self._active_plugin!r} called ctx.head_stats() without declaring needs_head_stats = True."
            )
        return self.services.head_stats()

    def scale_clip_range(self, scale: torch.Tensor) -> None:
        """Widen (> 1) or narrow (< 1) the PPO clip range per token: ``clip(r, 1 - c eps_low, 1 + c eps_high)``.

        ``scale`` (B, T) (or broadcastable), positive; the factors of several plugins multiply. Call it from a
        ``trl_plugins_loss_advantages`` hook: the surrogate is built right after those hooks (a call from
        ``trl_plugins_loss`` comes too late and raises). Clipped loss types only (``loss_rules.CLIPPED_LOSS_TYPES``).
        """
        if self.surrogate_built:
            raise PluginError(
                f"Plugin {self._active_plugin!r} called ctx.scale_clip_range() after the surrogate was built; call it "
                "from a trl_plugins_loss_advantages hook."
            )
        scale = torch.as_tensor(scale, dtype=self.per_token_logps.dtype, device=self.per_token_logps.device)
        if not bool((scale > 0).all()):
            raise PluginError(f"Plugin {self._active_plugin!r}: scale_clip_range needs positive factors.")
        scale = scale.expand_as(self.per_token_logps)
        self.clip_scale = scale if self.clip_scale is None else self.clip_scale * scale

    def scale_tokens(self, weights: torch.Tensor) -> None:
        """Multiply the surrogate per token by ``weights`` ((B, T) or broadcastable); weights of plugins multiply."""
        self.token_weights.append(weights)

    def add_token_loss(self, term: torch.Tensor) -> None:
        """Add a (B, T) per-token term; it is masked and aggregated exactly like the surrogate (``loss_type``)."""
        self.token_terms.append(term)

    def add_loss(self, term: torch.Tensor) -> None:
        """Add a scalar term to the micro-batch loss (divide by :attr:`gradient_accumulation_steps` as TRL does)."""
        self.scalar_terms.append(term)

    def replace_tokens(self, token_mask: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the surrogate by ``values`` (B, T) where ``token_mask`` (B, T, bool) is True.

        Only for plugins declaring ``replaces_surrogate = True`` (at most one per stack, checked at construction).
        """
        if self._replacer is not None and self._replacer != self._active_plugin:
            raise PluginError(f"Plugins {self._replacer!r} and {self._active_plugin!r} both replace the surrogate.")
        self._replacer = self._active_plugin
        self.replacement = (token_mask.bool(), values)

    def global_masked_mean(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> float:
        """Token-mean of ``x`` (B, T) over ``mask`` (default: the loss mask) across all processes; for metrics."""
        return self._service("masked_mean")(x, self.mask if mask is None else mask)


# =============================================================================================== refill
@dataclass
class RefillContext(_VerdictMixin, _StageContext):
    """Sampling stage, once the batch's rewards are known: reject whole groups; the trainer refills their slots.

    Identical on every process (built from the gathered reward matrix), so a plugin deciding from it decides the same
    everywhere. Called once per round: round 0 after the first generation, round ``r`` after the ``r``-th refill.
    Rejections are whole groups (``S = N // G`` group slots); a rejected slot is refilled with a new group of G rows,
    so G and N never change. See ``trl_plugins_reject_groups`` in :mod:`trl_plugins.api.hookspecs`.

    Attributes:
        rewards_per_func: (N, K) the reward functions' values of the current batch, gathered (before the reward-stage
            transforms, which run once on the final batch; NaN in placeholder columns).
        rewards: (N,) combined reward: weighted nansum of ``rewards_per_func`` (TRL's weights).
        group_ids, index_in_group: (N,) long tensors; ``num_generations`` = G.
        round: 0 for the first generation; ``r`` after the ``r``-th refill round.
        max_refill_rounds: the run's limit (``PluginGRPOConfig.max_refill_rounds``); groups rejected in the round
            ``round == max_refill_rounds`` are not refilled (``refill_at_limit`` decides what becomes of them).
        fresh: (S,) bool, groups generated in this round (all of them in round 0): a plugin judging each group once
            looks at these.
        prompt_keys: (S,) long, one key per prompt draw: groups made by :meth:`repeat` share the key of the group whose
            prompt they repeat (the advantage stage gets them as ``AdvantageContext.prompt_keys``).
        rejected: (S,) bool, groups rejected so far in this round (by this plugin or earlier ones in the chain);
            change it through :meth:`reject`.
        step: ``trainer.state.global_step``.
        mode: "train" (refill runs on training batches only).
        services: the :class:`~trl_plugins.api.services.StageServices` behind the methods (a constructor argument).
    """

    rewards_per_func: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    index_in_group: torch.Tensor
    num_generations: int
    round: int
    max_refill_rounds: int
    fresh: torch.Tensor
    prompt_keys: torch.Tensor
    rejected: torch.Tensor
    step: int = 0
    mode: str = "train"
    #: replacement sources asked for by plugins, in order: ("repeat", group) or ("row", dataset row dict)
    replacements: list[tuple[str, Any]] = field(default_factory=list)
    #: per rejected group slot: the plugin that rejected it first (for the metrics)
    rejected_by: dict[int, str] = field(default_factory=dict)
    services: StageServices = field(default=NO_SERVICES, repr=False, compare=False)

    @property
    def num_groups(self) -> int:
        """S, the number of group slots of the batch (``N // G``)."""
        return int(self.fresh.numel())

    def group_rewards(self) -> torch.Tensor:
        """(S, G) combined rewards, one row per group slot."""
        return self.rewards.view(-1, self.num_generations)

    def group_success(self, rule: SuccessRule = DEFAULT_RULE) -> torch.Tensor:
        """(S, G) bool: which rollouts succeed under ``rule`` (the verifier column; see
        :mod:`trl_plugins.api.success`)."""
        return self.success(rule).view(-1, self.num_generations)

    def reject(self, groups: Sequence[int] | torch.Tensor) -> None:
        """Reject group slots ``groups`` (ints in ``[0, S)``, or an (S,) bool mask): their G rows leave the batch and the
        trainer refills the slots (next round), unless the round limit is reached."""
        if isinstance(groups, torch.Tensor) and groups.dtype == torch.bool:
            if groups.shape != self.rejected.shape:
                raise PluginError(f"reject: a bool mask must have shape {tuple(self.rejected.shape)} (one per group).")
            groups = groups.nonzero().flatten().tolist()
        for g in [int(x) for x in groups]:
            if not 0 <= g < self.num_groups:
                raise PluginError(f"reject: group {g} is out of range [0, {self.num_groups}).")
            if not bool(self.rejected[g]):
                self.rejected[g] = True
                self.rejected_by[g] = self._active_plugin or "framework"

    def repeat(self, group: int, times: int = 1) -> None:
        """Ask for ``times`` replacement groups generated from the prompt (dataset row) of group slot ``group``.

        Replacements fill this round's rejected slots in the order they were asked for (before the trainer's refill
        stream); those beyond the rejected slots are dropped (metric ``plugins/framework/unplaced_replacements``). The
        new groups share ``prompt_keys[group]``. A repeated group may itself be rejected (its prompt is kept)."""
        if not 0 <= int(group) < self.num_groups:
            raise PluginError(f"repeat: group {group} is out of range [0, {self.num_groups}).")
        self.replacements.extend([("repeat", int(group))] * int(times))

    def supply(self, row: dict) -> None:
        """Ask for one replacement group generated from ``row`` (a dataset row: ``prompt`` plus the columns the reward
        functions read), e.g. from a plugin's buffer. It must be the same row on every process (decide from gathered
        data). Placed like :meth:`repeat`."""
        if not isinstance(row, dict) or "prompt" not in row:
            raise PluginError("supply: a replacement must be a dataset row (a dict with a 'prompt' key).")
        self.replacements.append(("row", dict(row)))


def checked_teacher_logprobs(teacher: Any, prompt_ids: Sequence[Sequence[int]],
                             completion_ids: Sequence[Sequence[int]], rows: Sequence[int], plugin: str,
                             first_row: int = 0) -> list[torch.Tensor]:
    """``teacher.logprobs(prompt_ids, completion_ids)``, refused at the first row whose values cannot enter the loss.

    Every value must be a finite number <= 0, one per completion token: a single ``-inf`` (a token the teacher
    gives probability 0, a server's overflow) makes KEPO's advantage and KL term infinite, the loss ~1e36 and every
    parameter NaN after one step, without any other error. The :class:`~trl_plugins.api.errors.PluginError` names the
    plugin, the value, the token and the global row (``first_row + rows[k]``).
    """
    scored = list(teacher.logprobs(prompt_ids, completion_ids))
    where = f"{plugin}: teacher log-probs (ctx.teacher_logps)"
    if len(scored) != len(completion_ids):
        raise PluginError(f"{where}: the teacher returned {len(scored)} rows for {len(completion_ids)} completions.")
    out = []
    for row, values, completion in zip(rows, scored, completion_ids):
        values = torch.as_tensor(values, dtype=torch.float32).reshape(-1)
        if values.numel() != len(completion):
            raise PluginError(f"{where}: {values.numel()} values for the {len(completion)} completion tokens of row "
                              f"{first_row + row}; allowed: one log-prob per completion token.")
        bad = (~torch.isfinite(values)) | (values > 1e-6)
        if bool(bad.any()):
            t = int(bad.nonzero()[0, 0])
            raise PluginError(
                f"{where}: {values[t].item()!r} for completion token {t} of row {first_row + row}; allowed: a finite "
                "number <= 0 (a log-probability). A -inf or NaN would make the loss non-finite; check the teacher "
                "(its endpoint or model)."
            )
        out.append(values)
    return out

