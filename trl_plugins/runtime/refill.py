"""The refill stage: plugins reject whole groups once their rewards are known, the trainer fills the batch back.

Where it sits in TRL 1.16's ``_generate_and_score_completions``: at the end of ``_generate`` -- after the sampling
stage's ``after_generation`` hooks, before TRL pads the batch, runs the old/reference log-prob forwards and computes
rewards and advantages. Why there: the rows that finally leave ``_generate`` are the only ones TRL ever pads, runs
forwards on and normalises, so a rejected group costs its generation and its reward functions and nothing else; and
TRL's own code after ``_generate`` (padding, ``mask_truncated_completions``, importance sampling, advantages, logs)
runs unchanged on the final batch. This is verl's DAPO order too (generate, score, filter, refill; log-probs on the
kept batch only).

One round (every process runs the same collectives; every decision is taken on gathered data):

1. score: round 0 runs TRL's own ``_calculate_rewards`` on the whole batch (its gather included) and the result is
   handed to TRL's later call, so with nothing rejected the stage adds no reward evaluation (with several processes,
   one small collective: the decision check of step 2);
   later rounds score the replaced rows locally and all-gather the (B, K) block (two collectives);
2. the ``trl_plugins_reject_groups`` hooks mark group slots rejected (:class:`~trl_plugins.api.contexts.RefillContext`);
   with several processes the rejected slots and replacements of every process are compared (one collective): a
   decision taken on some processes only is a ``PluginError`` on every process (``RefillStage._decide``);
3. nothing rejected: done. Round limit reached: ``refill_at_limit`` (keep / zero advantage / error);
4. each rejected slot gets a replacement: first those plugins named (``ctx.repeat`` / ``ctx.supply``), then the
   :class:`RefillStream`; each process replaces the rows of those slots it holds (dataset row, prompt, completion),
   generating them through the generation service (one call per round; padded to the same count on every process,
   counted in the rollout budget); back to 1.

The refill stream is a permutation of the training set of its own (the training sampler's rule: a seeded
``randperm`` per epoch, or the dataset order when ``shuffle_dataset=False``), seeded from ``args.seed``, identical on
every process; its position is saved in every checkpoint (``plugin_state.json``). It is not the dataloader's own
iterator (the Trainer's loop owns that and draws ahead of training), so refill draws do not shorten the epoch; verl's
DAPO instead pulls its next generation batch from the training dataloader.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from trl_plugins.api.data_checks import has_image_prompts
from trl_plugins.api.contexts import RefillContext
from trl_plugins.api.errors import PluginConfigError, PluginError
from trl_plugins.api.success import combined_reward

REJECT_HOOK = "trl_plugins_reject_groups"
#: Offset that separates the refill stream's seeds from the training sampler's.
STREAM_SEED_OFFSET = 7_919


class RefillStream:
    """Dataset indices for refill groups: epoch ``e`` is a permutation of ``range(n)`` from a generator seeded with
    ``seed + 7919 * (e + 1)`` (the dataset order when ``shuffle`` is False). Deterministic; resumes from
    :meth:`state_dict`."""

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True):
        if num_rows < 1:
            raise PluginConfigError("The refill stream needs a training dataset with at least one row.")
        self.num_rows, self.seed, self.shuffle = int(num_rows), int(seed), bool(shuffle)
        self.epoch, self.position = 0, 0
        self._order: list[int] | None = None

    def _permutation(self) -> list[int]:
        if self._order is None:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + STREAM_SEED_OFFSET * (self.epoch + 1))
                self._order = torch.randperm(self.num_rows, generator=generator).tolist()
            else:
                self._order = list(range(self.num_rows))
        return self._order

    def draw(self, k: int) -> list[int]:
        """The next ``k`` dataset indices (crossing into the next epoch's permutation when one ends)."""
        out = []
        for _ in range(int(k)):
            if self.position >= self.num_rows:
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
            out.append(self._permutation()[self.position])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self._order = int(state.get("epoch", 0)), int(state.get("position", 0)), None


@dataclass
class RefillOutcome:
    """What the refill stage leaves for the later stages of the batch.

    Attributes:
        rewards_per_func: (N, K) gathered reward-function values of the final batch (TRL's ``_calculate_rewards``
            returns it instead of scoring again).
        prompt_keys: (S,) long, see ``RefillContext.prompt_keys``; None when nothing was refilled.
        zero_advantage_groups: group slots whose advantage is set to 0 (``refill_at_limit="zero_advantage"``).
    """

    rewards_per_func: torch.Tensor
    prompt_keys: torch.Tensor | None = None
    zero_advantage_groups: list[int] = field(default_factory=list)


def check_refill_supported(trainer: Any) -> None:
    """At construction: refuse the TRL features the refill stage does not handle (named, with the way out)."""
    reasons = []
    if getattr(trainer, "rollout_func", None) is not None:
        reasons.append("rollout_func")
    if getattr(trainer, "tools", None):
        reasons.append("tools")
    if getattr(trainer, "environment_factories", None) is not None:
        reasons.append("environment_factory")
    dataset = trainer.train_dataset
    iterable = isinstance(dataset, torch.utils.data.IterableDataset) or type(dataset).__name__ == "IterableDataset"
    if dataset is not None and (iterable or not hasattr(dataset, "__getitem__")):
        reasons.append("an iterable training dataset (the refill stream draws rows by index)")
    if has_image_prompts(dataset):
        reasons.append("image prompts (the refill rounds generate from the prompt's token ids alone, without the image)")
    if reasons:
        names = [p.name for p in trainer.plugin_stack.implementers(REJECT_HOOK)]
        raise PluginConfigError(
            f"Plugins {names} reject and refill whole groups (trl_plugins_reject_groups), which is not supported with "
            f"{', '.join(reasons)}. Remove those plugins or that setting."
        )


class RefillStage:
    """Runs the refill rounds of one training generation batch for a :class:`~trl_plugins.PluginGRPOTrainer`."""

    def __init__(self, trainer: Any):
        check_refill_supported(trainer)
        self.trainer = trainer
        args = trainer.args
        self.max_rounds = int(getattr(args, "max_refill_rounds", 9))
        self.at_limit = getattr(args, "refill_at_limit", "keep")
        self.stream = RefillStream(len(trainer.train_dataset), args.seed, getattr(trainer, "shuffle_dataset", True))

    # ------------------------------------------------------------------------------------------ one batch
    def run(self, state: Any, prompts: list, generated: tuple) -> tuple[tuple, RefillOutcome]:
        """The rounds on TRL's 8-tuple of local rows ``generated``; ``state.inputs`` and ``prompts`` (TRL's own lists)
        are edited in place for replaced rows. Returns the final tuple and the :class:`RefillOutcome`."""
        tr = self.trainer
        prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images = generated
        if images is not None or extra_fields:
            raise PluginError("Refilling rejected groups supports text-only prompts (this batch has images).")
        prompt_ids, completion_ids, completions = list(prompt_ids), list(completion_ids), list(completions)
        logprobs = None if logprobs is None else list(logprobs)
        acc, G, B = tr.accelerator, tr.num_generations, len(prompts)
        start = acc.process_index * B
        if not tr.uses_sampling_stage:  # else the sampling stage began the service's batch (its count goes on)
            tr.generation_service.begin_batch(prompt_ids[0])
        rewards = tr.gathered_rewards(state.inputs, prompts, completions, completion_ids)
        N = rewards.size(0)
        S = N // G
        keys = torch.arange(S)
        fresh = torch.ones(S, dtype=torch.bool)
        next_key, rounds, rejected_total, refill_rows, unplaced = S, 0, 0, 0, 0
        outcome = RefillOutcome(rewards)
        replaced_any = False
        while True:
            ctx = self._context(rewards, rounds, fresh, keys)
            self._decide(ctx, rounds)
            rejected = ctx.rejected.nonzero().flatten().tolist()
            if not rejected:
                break
            rejected_total += len(rejected)
            if rounds >= self.max_rounds:
                self._at_limit(rejected, ctx, outcome)
                break
            sources = ctx.replacements[: len(rejected)]
            unplaced += max(0, len(ctx.replacements) - len(rejected))
            rows = self._replacement_rows(state, rejected, sources)
            new_keys = keys.clone()
            for slot, source in zip(rejected, sources + [None] * (len(rejected) - len(sources))):
                if source is not None and source[0] == "repeat":
                    new_keys[slot] = keys[source[1]]
                else:
                    new_keys[slot], next_key = next_key, next_key + 1
            keys = new_keys
            local = [i for i in range(B) if (start + i) // G in rows]
            for i in local:
                row = dict(rows[(start + i) // G])
                state.inputs[i], prompts[i] = row, row["prompt"]
            ids = tr.generation_service.tokenize([prompts[i] for i in local])
            generated_rows = tr.generation_service.generate(prompt_ids=ids)
            for i, p_ids, completion in zip(local, ids, generated_rows):
                prompt_ids[i], completion_ids[i] = p_ids, list(completion.completion_ids)
                completions[i] = tr.decode_completion(completion_ids[i], prompts[i])
                if logprobs is not None:
                    logprobs[i] = list(completion.logprobs or [float("nan")] * len(completion_ids[i]))
                self._reset_row_provenance(state, i, len(completion_ids[i]), rounds + 1)
            self._forget_stale_extras(state, local, B)
            rewards = self._rescore(state, prompts, completions, completion_ids, rewards, local, start)
            fresh = torch.zeros(S, dtype=torch.bool)
            fresh[rejected] = True
            rounds, refill_rows, replaced_any = rounds + 1, refill_rows + len(rejected) * G, True
        outcome.rewards_per_func = rewards
        outcome.prompt_keys = keys if replaced_any else None
        self._log(rounds, rejected_total, refill_rows, len(outcome.zero_advantage_groups), unplaced)
        return (prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images), outcome

    def _decide(self, ctx: RefillContext, rounds: int) -> None:
        """The ``trl_plugins_reject_groups`` hooks, and with several processes a check that every process took the
        same decision (one collective): each process refills the slots it holds, so a rejection taken on one process
        only would leave the others generating a different number of rows (a collective size mismatch) -- it is
        named instead, on every process together, as is a hook raising on one process only."""
        tr = self.trainer
        acc = tr.accelerator
        try:
            tr.plugin_stack.call(REJECT_HOOK, ctx)
            error = None
        except Exception as exc:  # raised below, on every process together
            error = exc
        if acc.num_processes <= 1:
            if error is not None:
                raise error
            return
        from trl_plugins.api.collectives import gather_ints_together

        S = ctx.rejected.numel()
        codes = [value if kind == "repeat" else -1 for kind, value in ctx.replacements[:S]]
        values = [int(r) for r in ctx.rejected.tolist()] + [len(ctx.replacements)] + codes + [-2] * (S - len(codes))
        names = [p.name for p in tr.plugin_stack.implementers(REJECT_HOOK)]
        gathered = gather_ints_together(acc.gather, values, acc.device, f"refill plugins {names} (reject_groups)", error)
        if any(not torch.equal(row, gathered[0]) for row in gathered[1:]):
            per_process = "; ".join(
                f"process {p}: rejected groups {row[:S].nonzero().flatten().tolist()}, {int(row[S])} replacements"
                for p, row in enumerate(gathered)
            )
            raise PluginError(
                f"Refill round {rounds}: the plugins {names} rejected different groups on different processes "
                f"({per_process}). Every process refills the slots it holds, so the decision must be the same "
                "everywhere: a trl_plugins_reject_groups hook must decide from its context only (ctx.rewards, "
                "ctx.rewards_per_func, ctx.prompt_keys, ctx.fresh are the gathered batch, identical on every process), "
                "never from process-local state, rows or unseeded randomness."
            )

    def _context(self, rewards: torch.Tensor, rounds: int, fresh: torch.Tensor, keys: torch.Tensor) -> RefillContext:
        tr = self.trainer
        N, G = rewards.size(0), tr.num_generations
        combined = combined_reward(rewards, tr.reward_weights.to(rewards.device))
        rows = torch.arange(N, device=rewards.device)
        return RefillContext(
            rewards_per_func=rewards,
            rewards=combined,
            group_ids=rows // G,
            index_in_group=rows % G,
            num_generations=G,
            round=rounds,
            max_refill_rounds=self.max_rounds,
            fresh=fresh.clone(),
            prompt_keys=keys.clone(),
            rejected=torch.zeros(N // G, dtype=torch.bool),
            step=tr.state.global_step,
            mode="train",
            services=tr.plugin_services,
        )

    def _at_limit(self, rejected: list[int], ctx: RefillContext, outcome: RefillOutcome) -> None:
        if self.at_limit == "error":
            by = sorted(set(ctx.rejected_by.values()))
            raise PluginError(
                f"{len(rejected)} groups are still rejected (by {by}) after max_refill_rounds={self.max_rounds} refill "
                "rounds (refill_at_limit='error'). Raise max_refill_rounds, or set refill_at_limit to 'keep' or "
                "'zero_advantage'."
            )
        if self.at_limit == "zero_advantage":
            outcome.zero_advantage_groups = list(rejected)
        else:
            outcome.zero_advantage_groups = []
        self._kept_at_limit = len(rejected)

    def _replacement_rows(self, state: Any, rejected: list[int], sources: list) -> dict[int, dict]:
        """Group slot -> the dataset row of its replacement (the same on every process)."""
        tr = self.trainer
        G = tr.num_generations
        batch_rows = None
        if any(kind == "repeat" for kind, _ in sources):  # the same decision on every process: one gather or none
            from accelerate.utils import gather_object

            batch_rows = gather_object(list(state.inputs)) if tr.accelerator.num_processes > 1 else list(state.inputs)
        columns = set(state.inputs[0])
        for kind, value in sources:
            if kind == "row" and not columns <= set(value):
                raise PluginError(
                    f"A replacement row supplied by a plugin (RefillContext.supply) lacks the columns "
                    f"{sorted(columns - set(value))} that the batch's rows have (reward functions read them)."
                )
        drawn = iter(self.stream.draw(len(rejected) - len(sources)))
        rows = {}
        for j, slot in enumerate(rejected):
            if j < len(sources):
                kind, value = sources[j]
                rows[slot] = dict(batch_rows[value * G]) if kind == "repeat" else dict(value)
            else:
                rows[slot] = dict(tr.train_dataset[int(next(drawn))])
        return rows

    def _reset_row_provenance(self, state: Any, i: int, length: int, round_: int) -> None:
        """A refilled row is on-policy, sampled from its own training prompt; annotated with its refill round."""
        if state.offpolicy is not None:
            state.offpolicy[i] = [False] * length
        if state.prompt_swapped is not None:
            state.prompt_swapped[i] = False
        if state.annotations is not None:
            state.annotations[i] = {"refill_round": round_}

    def _forget_stale_extras(self, state: Any, local: list[int], B: int) -> None:
        """Completion-table columns logged for the rows now replaced (reward functions' ``log_extra``, the sampling
        stage's annotations) describe rollouts that left the batch: they become None / the refill annotation."""
        for column, values in self.trainer.pending_completion_extras.items():
            if len(values) < B:
                continue
            for i in local:
                if column == "plugin_annotations" and state.annotations is not None:
                    values[len(values) - B + i] = f"refill_round={state.annotations[i]['refill_round']}"
                else:
                    values[len(values) - B + i] = None

    def _rescore(self, state, prompts, completions, completion_ids, rewards, local, start) -> torch.Tensor:
        """Score the replaced local rows (this process only), then all-gather the (B, K) blocks into (N, K).

        A reward-function error on one process is held and raised on every process together (one flag collective)."""
        tr = self.trainer
        acc = tr.accelerator
        B = len(prompts)
        held = tr.held_reward_errors
        with held.holding_while(acc.num_processes > 1):
            scored = tr.score_locally(
                [state.inputs[i] for i in local], [prompts[i] for i in local], [completions[i] for i in local],
                completion_ids=[completion_ids[i] for i in local],
            )
        from trl_plugins.runtime.generation import SCORING_FAILED

        if acc.num_processes > 1:
            held.gather_with_flag(acc.gather, [], acc.device, SCORING_FAILED)
        block = rewards[start : start + B].clone()
        if local:
            block[local] = scored.values.to(block)
        return acc.gather(block)

    def _log(self, rounds: int, rejected: int, refill_rows: int, zeroed: int, unplaced: int) -> None:
        kept = getattr(self, "_kept_at_limit", 0)
        self._kept_at_limit = 0
        values = {"refill_rounds": rounds, "rejected_groups": rejected, "refill_rollouts": refill_rows,
                  "kept_at_limit": kept, "zero_advantage_groups": zeroed, "unplaced_replacements": unplaced}
        for name, value in values.items():
            self.trainer.record_metric("train", f"plugins/framework/{name}", float(value))

    # ------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state.get("stream", {}))


def zero_group_advantages(advantages: torch.Tensor, groups: list[int], G: int, process_slice: slice) -> torch.Tensor:
    """Local advantages ((B,) or (B, T)) with the rows of global group slots ``groups`` set to 0."""
    if not groups:
        return advantages
    N_local = advantages.size(0)
    global_rows = torch.arange(process_slice.start, process_slice.start + N_local)
    hit = torch.isin(global_rows // G, torch.tensor(groups)).to(advantages.device)
    shape = (-1,) + (1,) * (advantages.dim() - 1)
    return advantages * (~hit).view(shape).to(advantages.dtype)
