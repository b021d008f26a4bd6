"""R2VPO — Ratio-Variance Regularized Policy Optimization (arXiv:2601.03320; extended version arXiv:2605.26784).

PPO/GRPO keep updates in a trust region by clipping the importance ratio ``r = pi_theta / pi_old``, which zeroes
the gradient of every token past the clip range, including high-return "eureka" tokens, and makes slightly stale
samples useless. R2VPO constrains the **variance (second central moment) of the ratio** instead: a smooth,
distribution-level relaxation of the trust region, enforced by a primal-dual scheme, that keeps the gradient of
every token and down-weights stale data rather than discarding it.

What was checked against what: the abstract and introduction of arXiv:2601.03320 ("... for Efficient LLM
Fine-tuning") and the abstract of its extended version arXiv:2605.26784 (ICML), the only parts of the paper
reachable to us; no official code was found (no public repository of the authors). They state: the ratio clip is
removed (the unclipped importance-weighted objective), the constraint is on the ratio's variance (its second central
moment), it is enforced with a primal-dual (Lagrangian) formulation, and stale samples are down-weighted and reused
from a replay buffer. The method section's formulas and hyper-parameters were not reachable, so every concrete
formula and default below is **our reconstruction**, consistent with those statements (each option is marked so):

1. Per token, replacing TRL's clipped surrogate: ``l = -r A + lambda (r - 1)^2``, with ``r`` TRL's importance ratio
   at its ``importance_sampling_level``. ``(r - 1)^2`` is the ratio's squared deviation from its mean under the old
   policy (``E_old[r] = 1``), so its token-mean is the sample second central moment; it is aggregated with the
   surrogate by ``loss_type``.
2. Dual ascent once per optimizer step: ``lambda <- clip(lambda + dual_lr * (V - variance_target), 0, max_lambda)``,
   with ``V`` the global token-mean of ``(r - 1)^2`` over the step's micro-batches (all processes).
3. The replay buffer of stale rollouts (``replay_groups > 0``; off by default): after the advantage stage every fresh
   group with a non-zero advantage is stored with, per row, its training prompt, completion ids, advantage and
   **behaviour log-probs** (the policy's per-token log-probs at sampling time, ``ctx.policy_stats()``: TRL's
   ``old_per_token_logps`` of that step). A stored group stays ``replay_max_age`` optimizer steps (the newest
   ``replay_capacity`` groups). In a later step the last ``replay_groups`` group slots of the generation batch are not
   sampled (``PromptContext.defer``) but filled with stored groups (drawn uniformly without replacement, seeded by the
   run's seed and the step) through ``RolloutContext.replace_row``; their advantages are the stored ones, and in the
   loss their ratio is taken against the stored behaviour log-probs, ``r = exp(log pi_theta - log pi_behaviour)``
   (its sequence-level mean log-ratio at ``importance_sampling_level='sequence'``). Stale rows are thus re-weighted
   by ``r`` and held near the trust region by the same variance penalty, which counts their tokens, rather than
   discarded. The replayed rows' reward columns are the current slot's scores and are not used (their advantage is
   the stored one). The staleness TRL offers (``num_iterations > 1``, ``steps_per_generation >
   gradient_accumulation_steps``) is handled by 1-2 alone.

Multi-process: the buffer is global and identical on every process (prompts, ids, log-probs and advantages of the
stored rows are gathered; the replayed slots and groups are decided from shared data), every process keeps its number
of rows (deferred rows are filled in place), and the main process's checkpoint holds the whole buffer
(``trl_plugins_state_dict``). The replay needs single-turn text prompts: it is refused with tools / environments
(``replace_row`` rows lose their tool turns) and with image prompts (the stored prompt carries no image).

Identity: in a single on-policy pass (``r = 1`` in value) the penalty and its gradient vanish and the unclipped
surrogate has the clipped one's value and gradient, so R2VPO trains exactly as GRPO/DAPO there; it differs once
samples are reused. Off-policy tokens spliced by sampling plugins keep their shaped branch.

No official code was reachable and the method
section was unreachable: the dual update (initial lambda, target, learning rate, cap) and the whole replay buffer
(which groups are stored, how long, how many slots are replayed, the ratio against stored behaviour log-probs) are
reconstructed (``trl-plugins show r2vpo``, docs/faithfulness.md). Metrics: ``ratio_variance``, ``lambda``; with the
replay ``replayed_groups``, ``stored_groups``, ``buffer_groups``, and ``replay_age`` (steps since the replayed groups
were stored); the variance measured for the dual ascent counts the replayed tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from trl_plugins.api import (
    AdvantageContext,
    LossContext,
    OfficialSource,
    Plugin,
    PluginError,
    PluginOptions,
    PromptContext,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.collectives import gather_id_lists
from trl_plugins.api.reasons import EDITS_COMPLETIONS

from ._rollout_buffer import RolloutBuffer

#: Annotation of a replayed row: ``[buffer key, row of the stored group, step it was stored at]``.
REPLAY = "r2vpo_replay"
#: Extra (B, T) carrying the replayed rows' behaviour log-probs to the loss (NaN elsewhere).
BEHAVIOUR_LOGPS = "r2vpo_behaviour_logps"


@dataclass
class R2vpoOptions(PluginOptions):
    initial_lambda: float = option(
        1.0, min=0.0, help="Starting value of the dual variable lambda (the penalty's weight).", reconstructed=True
    )
    variance_target: float = option(
        0.04, min=0.0,
        help="delta: the ratio variance the constraint allows (0.04 = 0.2^2, the square of PPO's usual clip range).",
        reconstructed=True,
    )
    dual_lr: float = option(
        1.0, min=0.0,
        help="Step size of the dual ascent on lambda, once per optimizer step; 0 keeps lambda fixed.",
        reconstructed=True,
    )
    max_lambda: float = option(
        100.0, min=0.0, help="Upper bound of lambda (keeps the dual ascent bounded).", reconstructed=True
    )
    replay_groups: int = option(
        0, min=0,
        help="Replay buffer: group slots of each generation batch filled with stored stale groups instead of being "
        "sampled (trained against their behaviour log-probs); 0 = no replay buffer.",
        reconstructed=True,
    )
    replay_max_age: int = option(
        4, min=1, help="Replay buffer: optimizer steps a stored group stays replayable.", reconstructed=True
    )
    replay_capacity: int = option(
        64, min=1, help="Replay buffer: stored groups kept (the newest).", reconstructed=True
    )


def r2vpo_token_loss(coef_1: torch.Tensor, advantages: torch.Tensor, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``l = -r A + lambda (r - 1)^2`` per token (no clipping).

    Args:
        coef_1: (B, T) or (B, 1) importance ratio ``r`` with grad. advantages: (B, T) or (B, 1).
    Returns:
        ``(loss, squared_deviation)``, both broadcast to the larger of the two shapes.
    """
    sq = (coef_1 - 1.0) ** 2
    return -coef_1 * advantages + lam * sq, sq


def behaviour_ratio(per_token_logps: torch.Tensor, behaviour_logps: torch.Tensor, mask: torch.Tensor,
                    sequence: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance ratio of replayed rows against their stored behaviour log-probs.

    Args:
        per_token_logps: (B, T) log pi_theta with grad. behaviour_logps: (B, T), NaN on rows that are not replayed
            (and past a row's stored tokens). mask: (B, T) loss mask.
        sequence: the ratio of a row is ``exp`` of its masked mean log-ratio (TRL's sequence level), (B, 1).
    Returns:
        ``(ratio, replayed)``: ratio (B, T) or (B, 1), 1 in value on rows that are not replayed (finite gradients
        everywhere); replayed (B,) bool.
    """
    valid = torch.isfinite(behaviour_logps) & mask.bool()
    replayed = valid.any(dim=1)
    behaviour = torch.where(valid, behaviour_logps.to(per_token_logps.dtype), per_token_logps.detach())
    log_ratio = per_token_logps - behaviour
    if sequence:
        m = valid.to(log_ratio.dtype)
        log_ratio = ((log_ratio * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)).unsqueeze(1)
    return torch.exp(log_ratio), replayed


def replay_slots(num_groups: int, replay_groups: int, available: int) -> list[int]:
    """The group slots given to stored groups: the last ``min(replay_groups, available, num_groups - 1)`` ones (one
    slot at least is always sampled)."""
    k = max(min(replay_groups, available, num_groups - 1), 0)
    return list(range(num_groups - k, num_groups))


def dual_update(lam: float, variance: float, target: float, lr: float, max_lambda: float) -> float:
    """One projected dual-ascent step: ``clip(lam + lr * (variance - target), 0, max_lambda)``."""
    return min(max(lam + lr * (variance - target), 0.0), max_lambda)


class R2vpoPlugin(Plugin):
    """Unclipped importance-weighted surrogate with a ratio-variance penalty whose weight follows a dual ascent."""
    claim_metric = ('ratio_variance', 'variance of the importance ratio')
    image_inputs = True
    multi_turn = True

    name = "r2vpo"
    version = "0.2.0"
    paper = (
        "Ratio-Variance Regularized Policy Optimization for Efficient LLM Fine-tuning (R2VPO), arXiv:2601.03320 "
        "(extended: arXiv:2605.26784)"
    )
    summary = "Replaces ratio clipping by a penalty on the ratio's variance, weighted by a dual-ascent multiplier."
    Options = R2vpoOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found and the method section was unreachable: the dual update (initial lambda, "
        "target, learning rate, cap) and the replay buffer (what is stored, for how long, where it is replayed) are "
        "reconstructed.",
    )
    replaces_surrogate = True
    replaces = ("the clipped surrogate on every on-policy token (unclipped r A minus the ratio-variance penalty)",)
    loss_types = ("grpo", "bnpo", "dr_grpo", "dapo")
    loss_types_reason = (
        "R2VPO replaces PPO's clipped surrogate; cispo, sapo, vespo and luspo are other replacements of the same "
        "clipping"
    )
    reconstructed = (
        "the per-token form -r A + lambda (r - 1)^2, the projected dual ascent on lambda and every default (no "
        "official code; checked against the abstracts and introduction of arXiv:2601.03320 / 2605.26784, which state "
        "the unclipped objective, the ratio-variance constraint and the primal-dual scheme, not the formulas)",
        "the replay buffer: which groups are stored (fresh groups with a non-zero advantage), replay_max_age, "
        "replay_capacity, the replayed slots (the batch's last replay_groups, drawn uniformly from the buffer), the "
        "stored advantages (a row's token mean when they are token-level) and the ratio against the stored behaviour "
        "log-probs",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.lam = float(self.options.initial_lambda)
        self._measurements: list[float] = []
        self.buffer = RolloutBuffer()  # group key -> its G rows {"step", "prompt", "ids", "logps", "advantage"}
        self._next_key = 0
        self._seed = 0
        self._plan: dict[int, tuple[int, int]] = {}  # global row -> (buffer key, row of the stored group)

    # ------------------------------------------------------------------------------------------ capabilities
    def hook_enabled(self, hook: str) -> bool:
        if hook in ("trl_plugins_generation_prompts", "trl_plugins_after_generation",
                    "trl_plugins_transform_advantages"):
            return self.options.replay_groups > 0
        return True

    def multi_turn_refusal(self) -> str | None:
        """Tool rollouts: refused with the replay buffer (``replay_groups > 0``: replayed rows are spliced as single-turn
        token ids); the ratio-variance loss alone (the default) runs on them."""
        return EDITS_COMPLETIONS if self.options.replay_groups > 0 else None

    def image_inputs_refusal(self) -> str | None:
        """Image prompts: refused with the replay buffer (``replay_groups > 0``: a stored prompt keeps no image); the
        ratio-variance loss alone (the default) runs on them."""
        if self.options.replay_groups > 0:
            return "its replay buffer stores the prompts' text and replays rows through replace_row (no image)."
        return None

    # ------------------------------------------------------------------------------------------ replay buffer
    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self._seed = int(args.seed)

    @hookimpl
    def trl_plugins_generation_prompts(self, ctx: PromptContext):
        """Defer the rows of the last ``replay_groups`` group slots; they are filled with stored groups."""
        self._plan = {}
        if ctx.mode != "train":
            return
        G = ctx.num_generations
        self.buffer.evict(ctx.step, self.options.replay_max_age)
        keys = sorted(k for k, rows in self.buffer.items() if rows[0]["step"] < ctx.step)
        num_groups = len(ctx.rows) * ctx.run.num_processes // G
        slots = replay_slots(num_groups, self.options.replay_groups, len(keys))
        if not slots:
            return
        g = torch.Generator().manual_seed((self._seed * 1_000_003 + ctx.step * 7_919) % (2**63 - 1))
        picked = [keys[int(j)] for j in torch.randperm(len(keys), generator=g)[: len(slots)]]
        by_slot = dict(zip(slots, picked))
        for i in range(len(ctx.rows)):
            key = by_slot.get(ctx.group_ids[i])
            if key is not None:
                self._plan[ctx.global_index[i]] = (key, ctx.index_in_group[i])
                ctx.defer(i)

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        for i in range(len(ctx)):
            planned = self._plan.get(ctx.global_index[i])
            if planned is None:
                continue
            key, j = planned
            entry = self.buffer[key][j]
            ctx.replace_row(i, list(entry["ids"]), offpolicy=False, logprobs=None, training_prompt=entry["prompt"],
                            prompt_swapped=False)
            ctx.annotations[i][REPLAY] = [key, j, entry["step"]]
        self._plan = {}  # (metrics at the advantage stage, where the whole batch is seen)

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        if ctx.mode != "train":
            return
        G = ctx.num_generations
        N = ctx.advantages.size(0)
        replays = {n: a[REPLAY] for n, a in enumerate(ctx.annotations) if a.get(REPLAY)}
        adv = ctx.advantages.clone()
        for n, (key, j, _) in replays.items():  # stored advantages (the buffer is identical on every process)
            adv[n] = self.buffer[key][j]["advantage"]
        ctx.advantages = adv
        self._attach_behaviour_logps(ctx, replays)
        self._store(ctx, set(replays), G, N)
        ages = [ctx.step - step for _, _, step in replays.values()]
        ctx.log_metric("replayed_groups", len(replays) / G)
        ctx.log_metric("buffer_groups", float(len(self.buffer)))
        if ages:
            ctx.log_metric("replay_age", sum(ages) / len(ages))

    def _attach_behaviour_logps(self, ctx: AdvantageContext, replays: dict) -> None:
        """(B, T) stored behaviour log-probs of this process's replayed rows, NaN elsewhere, to the loss."""
        ids = ctx.local_completion_ids
        if ids is None:
            raise PluginError("r2vpo: the replay buffer needs AdvantageContext.local_completion_ids.")
        out = torch.full(ids.shape, float("nan"), dtype=torch.float32, device=ids.device)
        start = ctx.process_slice.start or 0
        for n, (key, j, _) in replays.items():
            i = n - start
            if 0 <= i < ids.size(0):
                logps = self.buffer[key][j]["logps"][: ids.size(1)]
                out[i, : len(logps)] = torch.tensor(logps, dtype=torch.float32)
        ctx.set_local_extra(BEHAVIOUR_LOGPS, out)

    def _store(self, ctx: AdvantageContext, replayed: set[int], G: int, N: int) -> None:
        """Store the fresh groups with a non-zero advantage (decided from shared data, gathered on every process)."""
        adv = ctx.advantages.detach().float().cpu()
        if adv.dim() == 2:  # token-level advantages (another plugin's) are stored as their row's token mean
            mask = ctx.completion_mask().float().cpu()
            per_row = (adv * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        else:
            per_row = adv
        clean = (ctx.offpolicy_fraction.cpu() == 0) & ~ctx.prompt_swapped.cpu().bool()
        groups = [g for g in range(N // G)
                  if not replayed & set(range(g * G, (g + 1) * G)) and bool(clean[g * G:(g + 1) * G].all())
                  and bool((per_row[g * G:(g + 1) * G] != 0).any())]
        ctx.log_metric("stored_groups", float(len(groups)))
        if not groups:  # decided from shared data: every process skips the gathers together
            return
        if ctx.local_completion_ids is None or len(ctx.local_rows) != ctx.local_completion_ids.size(0):
            raise PluginError("r2vpo: the replay buffer needs AdvantageContext.local_rows and local_completion_ids.")
        stats = ctx.policy_stats()  # the sampling-time policy: this step has not updated it yet
        mask = ctx.local_completion_mask if ctx.local_completion_mask is not None else stats.mask
        lengths = [int(x) for x in mask.sum(dim=1).tolist()]
        local_ids = [ctx.local_completion_ids[i, :n].tolist() for i, n in enumerate(lengths)]
        all_ids = gather_id_lists(ctx, local_ids)
        logps = ctx.gather_padded(stats.per_token_logps.detach().float(), dim=1, pad_value=float("nan")).cpu()
        prompts = [list(json.dumps(row["prompt"]).encode()) for row in ctx.local_rows]
        all_prompts = [json.loads(bytes(p).decode()) for p in gather_id_lists(ctx, prompts)]
        for g in groups:
            key = self._next_key
            self._next_key += 1
            for n in range(g * G, (g + 1) * G):
                self.buffer.add(key, {"step": int(ctx.step), "prompt": all_prompts[n], "ids": all_ids[n],
                                      "logps": logps[n, : len(all_ids[n])].tolist(), "advantage": float(per_row[n])})
        for key in sorted(self.buffer)[: max(len(self.buffer) - self.options.replay_capacity, 0)]:
            del self.buffer[key]

    # ------------------------------------------------------------------------------------------ loss
    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        coef = ctx.coef_1
        behaviour = ctx.extras.get(BEHAVIOUR_LOGPS)
        if behaviour is not None:
            ratio, replayed = behaviour_ratio(ctx.per_token_logps, behaviour, ctx.mask, coef.size(1) == 1)
            coef = torch.where(replayed.view(-1, 1), ratio, coef)
        values, sq = r2vpo_token_loss(coef, ctx.advantages, self.lam)
        values = values.expand_as(ctx.per_token_logps) if values.shape != ctx.per_token_logps.shape else values
        ctx.replace_tokens(ctx.mask.bool() & ~ctx.offpolicy_mask, values)
        variance = ctx.global_masked_mean(sq.detach().expand_as(ctx.mask))
        if ctx.mode == "train":
            self._measurements.append(variance)
        ctx.log_metric("ratio_variance", variance)
        ctx.log_metric("lambda", self.lam)

    @hookimpl
    def trl_plugins_on_step_end(self, trainer, step):
        if not self._measurements:
            return
        o = self.options
        variance = sum(self._measurements) / len(self._measurements)
        self._measurements = []
        self.lam = dual_update(self.lam, variance, o.variance_target, o.dual_lr, o.max_lambda)

    @hookimpl
    def trl_plugins_state_dict(self):
        return {"lambda": self.lam, "buffer": self.buffer.state(), "next_key": self._next_key}

    @hookimpl
    def trl_plugins_load_state_dict(self, state):
        self.lam = float(state.get("lambda", self.options.initial_lambda))
        self.buffer = RolloutBuffer.from_state(state.get("buffer", {}))
        self._next_key = int(state.get("next_key", 0))
        self._plan = {}
