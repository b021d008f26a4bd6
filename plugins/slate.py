"""SLATE — truncated step-level sampling with dense process rewards (arXiv:2602.23440).

GRPO samples k complete trajectories per prompt, so the advantage of any one step is blurred by the randomness of
every other step. SLATE (Step-Level Advantage estimation for Truncated Exploration) samples k candidates for **one
step** from a **shared prefix**, scores each candidate step densely, normalises the scores within those k, and then
extends the prefix by one of them; all k candidates of every step are trained. The paper proves this lowers the
variance of the advantage estimate by up to a factor T (the number of steps) against full-trajectory sampling under
the same dense rewards. Facts from the official code (algoprog/SLATE @ cbab153, ``configs/slate.yaml`` (``CFG``),
``slate/agent_loops/slate_agent_loop.py`` (``LOOP``), ``slate/training/step_level_algos.py`` (``ALGO``),
``slate/rewards/llm_judge.py`` (``JUDGE``)):

1. Loop (LOOP:231-329, Algorithm 1): for ``t = 0 .. B-1`` generate ``k`` candidates from the current prefix
   (LOOP:243-258), judge them (LOOP:274-282), compute step advantages (LOOP:287-288), pick the winner by
   reward-weighted sampling (LOOP:293), append the winner to the prefix (LOOP:307-318); the loop ends when the winner
   is an answer (LOOP:327-329). Every step's k candidates, rewards and advantages are kept for training (LOOP:296-302).
   Defaults (CFG:18-25): ``k = 5``, ``eta = 0.7``, ``B = 4``, ``lambda = 0.1``.
2. A step (LOOP:474-639) is a reasoning segment closed by ``</think>`` then ``<search>query</search>`` (a retrieval
   follows and the loop goes on) or ``<answer>...</answer>`` (the trajectory ends).
3. Step advantage (ALGO:32-34, Eq. 5): ``A_t^j = (r_t^j - mean_j r_t) / (std_j r_t + 1e-6)``, ``std`` unbiased.
4. Winner (ALGO:54-60): sampled from ``softmax(A_t / eta)``; ``eta <= 0`` takes the argmax.
5. Step reward (JUDGE:209-220, Eqs. 3-4): an LLM judge gives ternary scores in {-1, 0, +1}; a search step earns
   ``r_think + r_query``, an answer step ``r_think + r_answer + lambda (B - t) / B`` (the early-answer bonus).
6. Objective (ALGO:98-140, Eq. 7): clipped surrogate of every candidate with its step advantage, averaged over the k
   candidates and the steps; the shared prefix is context, not trained.

Mapping onto TRL. A group of ``G = k T`` rows holds ``T = G / k`` steps of ``k`` candidates (``T`` plays ``B``):
rows ``t k .. t k + k - 1`` are the candidates of step ``t``. Every row but the first of each group is deferred at
the prompt stage (``PromptContext.defer``); TRL samples the first one, which is cut just after its first step (the
candidate 0 of step 0: sampling is autoregressive, so a sample cut where a stop string completes has the law of one
stopped there). The after-generation hook then runs ``T`` rounds, each one collective call of the branching seam
(``ctx.continue_prefixes``: HF generate, per-request ``max_new_tokens`` and the step stop strings, counted in the
rollout budget) that continues every group's current prefix by one step for each of the round's rows; the round's
step rewards are gathered across processes, normalised within each step's ``k`` candidates, and every process draws
the same winner (a generator seeded by the run seed, the step, the group and the round) which extends the group's
prefix. A row's completion is ``prefix + its step``; in the advantage stage the step's tokens get ``A_t^j`` and the
prefix tokens 0 (context only, as in Eq. 7; they still count in TRL's loss normaliser, a documented difference). A
trajectory is formed step by step from the winners (not by running each candidate to the end), as the official loop
does.

Step rewards. The judge is the project's process reward model (:mod:`trl_plugins.components.prm`: an HF PRM, an
endpoint, or a task's programmatic step verifier) scoring the candidate step after the prefix's steps; its score
``s`` in [0, 1] is put on the judge's scale as ``2 s - 1`` (reconstructed: the official judge is a generative LLM with
separate ternary reasoning and query/answer scores). A candidate that ends the trajectory (EOS, an ``answer_stops``
string, or the length limit) adds TRL's combined reward of the whole completion (the answer's outcome, where the
official judge compares the answer with the ground truth) and the early-answer bonus ``lambda (T - t) / T``.

Not here: the retrieval between steps (the branching seam samples single-turn text without running tools), the
official judge's decomposed prompts, and its forced final answer after ``B`` steps (LOOP:381-397; not trained with
step advantages there either). After a chain has ended, its remaining steps' rows branch again from the last
decision point (reconstructed: the official loop stops and has fewer steps; a fixed group of G rows needs them).

Neutral setting: ``weight=0`` defers nothing and keeps TRL's advantages (vanilla GRPO); ``weight`` (ours) mixes
``(1 - w) A_TRL + w A_SLATE`` per token, 1 being the official method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from trl_plugins.api import (
    AdvantageContext,
    IncompatiblePluginsError,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PromptContext,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.collectives import context_device, gather_id_lists
from trl_plugins.api.reasons import IMAGES_GENERATION_SERVICE, VLLM_BRANCHING, samples_outside_hf_generate
from trl_plugins.components.prm import PRMOptions, prm_from_options

#: Annotation keys of a trained row: first token of its step, completion length, step advantage, step reward, round.
START_KEY = "slate_start"
LENGTH_KEY = "slate_len"
ADV_KEY = "slate_adv"
REWARD_KEY = "slate_reward"
ROUND_KEY = "slate_round"


@dataclass
class SlateOptions(PRMOptions):
    plugin_name: ClassVar[str] = "slate"

    k: int = option(5, min=2, help="Candidates per step sharing one prefix (official slate.k: 5); divides the group.")
    eta: float = option(
        0.7, min=0.0,
        help="Temperature of the reward-weighted winner draw softmax(A / eta) (official: 0.7); 0: the best candidate.",
    )
    lambda_bonus: float = option(
        0.1, min=0.0, help="Early-answer bonus lambda (T - t) / T of an answer step (official lambda_bonus: 0.1).",
    )
    step_stops: list[str] = option(
        default_factory=lambda: ["</search>"],
        help="Stop strings that close a step and continue the trajectory (official: '</search>'; '\\n' for one step "
        "per line).",
    )
    answer_stops: list[str] = option(
        default_factory=lambda: ["</answer>"],
        help="Stop strings that close a step and end the trajectory (official: '</answer>'); EOS and the length limit "
        "also end it.",
    )
    weight: float = option(
        1.0, min=0.0, max=1.0,
        help="A = (1 - weight) A_TRL + weight A_SLATE per token (ours); 1: SLATE as published, 0: vanilla TRL.",
    )
    step_separator: str | None = option(
        None, reconstructed=True, help="PRM step separator (None: the PRM's convention; one line for 'programmatic').",
    )
    problem_column: str = option("problem", help="Dataset column read by the programmatic PRM.")

    def validate(self) -> None:
        super().validate()
        if not self.step_stops and not self.answer_stops:
            raise PluginConfigError(
                "Options 'step_stops' and 'answer_stops' of plugin 'slate' are both empty; allowed: at least one stop "
                "string (without one a step never ends before EOS and no prefix is ever shared)."
            )
        for name in ("step_stops", "answer_stops"):
            for s in getattr(self, name):
                if not isinstance(s, str) or not s:
                    raise PluginConfigError(
                        f"Option {name!r} of plugin 'slate' holds {s!r}; allowed: non-empty strings (an empty one "
                        "would match before the first token)."
                    )
        both = set(self.step_stops) & set(self.answer_stops)
        if both:
            raise PluginConfigError(
                f"Stop string(s) {sorted(both)} of plugin 'slate' are in both 'step_stops' and 'answer_stops'; "
                "allowed: each string closes either a step that continues or an answer, not both."
            )
        if self.step_separator == "":
            raise PluginConfigError("Option 'step_separator' of plugin 'slate' must not be empty.")


def step_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Official Eq. 5 per step: ``(r - mean) / (std + eps)`` over the last dimension (``std`` unbiased).

    Args:
        rewards: (..., k) step rewards of the k candidates of each step.
    Returns:
        (..., k) step advantages.
    """
    r = rewards.float()
    return (r - r.mean(dim=-1, keepdim=True)) / (r.std(dim=-1, keepdim=True) + eps)


def pick_winner(advantages: torch.Tensor, eta: float, generator: torch.Generator | None = None) -> int:
    """Reward-weighted draw of the candidate that extends the prefix: ``softmax(A / eta)``; ``eta <= 0``: argmax.

    Args:
        advantages: (k,) step advantages.
    """
    if eta <= 0:
        return int(advantages.argmax())
    probs = torch.softmax(advantages.float() / eta, dim=0)
    return int(torch.multinomial(probs, 1, generator=generator))


def step_reward(prm_score: float | None, ends: bool, outcome: float, steps_before: int, budget: int,
                lambda_bonus: float) -> float:
    """Reward of one candidate step: ``2 s - 1`` for a PRM score ``s`` in [0, 1] (0 when unscored), plus, for a step
    that ends the trajectory, the outcome and the early-answer bonus ``lambda (T - t) / T`` (``t`` = steps before).
    """
    r = 0.0 if prm_score is None else 2.0 * float(prm_score) - 1.0
    if ends:
        r += float(outcome) + lambda_bonus * (budget - steps_before) / budget
    return r


def first_stop(ids: list[int], stops: list[str], decode) -> tuple[int, str | None]:
    """``(n, stop)``: the shortest prefix ``ids[:n]`` whose text holds one of ``stops`` (the earliest occurrence wins),
    or ``(len(ids), None)`` when none occurs."""
    if not stops or not any(s in decode(ids) for s in stops):
        return len(ids), None
    for n in range(1, len(ids) + 1):
        text = decode(ids[:n])
        hits = [s for s in stops if s in text]
        if hits:
            return n, min(hits, key=text.index)
    return len(ids), None  # unreachable: the whole text holds a stop string


def slate_token_advantages(starts: list[int], lengths: list[int], advantages: list[float], width: int) -> torch.Tensor:
    """(N, width) per-token SLATE advantages: row ``n``'s step tokens ``[starts[n], lengths[n])`` get
    ``advantages[n]``, its prefix tokens (and padding) 0."""
    out = torch.zeros(len(starts), width)
    for n, (s, length, a) in enumerate(zip(starts, lengths, advantages)):
        out[n, s:min(length, width)] = a
    return out


@dataclass
class _Chain:
    """One group's trajectory so far: the winners' tokens, their step texts, whether an answer ended it."""

    ids: list[int] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    ended: bool = False


class SlatePlugin(Plugin):
    """Truncated step-level sampling: k candidate next steps from a shared prefix, step-normalised dense rewards."""

    name = "slate"
    version = "0.1.0"
    paper = "Truncated Step-Level Sampling with Process Rewards for Retrieval-Augmented Reasoning (SLATE), " \
        "arXiv:2602.23440"
    summary = "k candidate next steps from a shared prefix, judged per step; reward-weighted winner extends the prefix."
    Options = SlateOptions
    image_inputs = IMAGES_GENERATION_SERVICE
    multi_turn = (
        "its candidate steps run through the branching seam, which samples single-turn text without running tools, so "
        "the retrieval between steps (the paper's search calls) cannot run."
    )
    official = OfficialSource(
        "algoprog/SLATE", "cbab153", verdict="faithful",
        files=(
            "slate/agent_loops/slate_agent_loop.py",
            "slate/training/step_level_algos.py",
            "slate/rewards/llm_judge.py",
            "configs/slate.yaml",
        ),
        note="Step loop, Eq. 5 advantages, reward-weighted winner, early-answer bonus and defaults as official; no "
        "retrieval between steps (single-turn text), the judge is the project's PRM (2 s - 1) plus TRL's reward of an "
        "answer step instead of the official decomposed ternary LLM judge; G = k T rows with the first candidate "
        "cut from TRL's own sample; steps after an answer branch again from the last decision point.",
        variants=("weight",),
    )
    claim_metric = ("step_reward_std", "within-step std of the k candidates' rewards (what Eq. 5 normalises)")
    reconstructed = (
        "step reward: the project's PRM score s mapped to 2 s - 1, plus TRL's combined reward of an answer step",
        "candidate 0 of step 0 is TRL's own sample cut after its first step",
        "the rows of steps after an answer branch again from the last decision point",
        "weight (mix with TRL's advantages) is our option",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.prm = None
        self._seed = 0
        self._pending = False

    def hook_enabled(self, hook: str) -> bool:
        return self.options.weight > 0

    def required_columns(self) -> list[str]:
        return [self.options.problem_column] if self.options.prm == "programmatic" and self.options.weight > 0 else []

    # ------------------------------------------------------------------------------------------ lifecycle
    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        if samples_outside_hf_generate(args):
            raise IncompatiblePluginsError(
                f"slate cannot run with use_vllm=True or continuous batching: {VLLM_BRANCHING} Or set weight=0.")
        G = int(args.num_generations)
        if G % o.k:
            raise PluginConfigError(
                f"Options of plugin 'slate': k={o.k} candidates per step does not divide num_generations={G}; "
                f"allowed: num_generations a multiple of k (the official k=5 and B=4 steps: 20), or another k.")
        self._seed = int(getattr(args, "seed", 0) or 0)
        tokenizer = getattr(trainer, "text_tokenizer", None)
        if tokenizer is not None:
            for s in o.step_stops + o.answer_stops:
                text = tokenizer.decode(tokenizer.encode(s, add_special_tokens=False), skip_special_tokens=True)
                if s not in text:
                    raise PluginConfigError(
                        f"Stop string {s!r} of plugin 'slate' can never match: the tokenizer writes it as {text!r} "
                        "once decoded (special tokens are skipped when stop strings are matched); allowed: strings the "
                        "policy's decoded text can contain.")
        if self.prm is None:
            self.prm = prm_from_options(o)

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def trl_plugins_generation_prompts(self, ctx: PromptContext):
        """Defer every row but the first of each group: TRL samples candidate 0 of step 0."""
        ctx.defer_slots(lambda k: k != 0)
        self._pending = True  # on every process: the next hook's collectives run everywhere

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        """``T`` rounds of one step each (collective: one branching call and three gathers per round)."""
        if not self._pending:  # e.g. a refill round: its rows were sampled independently
            return
        self._pending = False
        o, G, B = self.options, ctx.num_generations, len(ctx)
        k, rounds = o.k, ctx.num_generations // o.k
        limit = ctx.run.max_completion_length
        tok = ctx.tokenizer
        decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731  (as the seam matches stops)
        stops = o.step_stops + o.answer_stops
        chains: dict[int, _Chain] = {}
        local_groups = sorted(set(ctx.group_ids))
        for g in local_groups:
            chains[g] = _Chain()
        extra, ended_candidates, all_rewards = 0, 0, []
        for t in range(rounds):
            mine = [i for i in range(B) if ctx.index_in_group[i] // k == t]
            starts, ends, step_ids = {}, {}, {}
            requests = [i for i in mine if not (t == 0 and ctx.index_in_group[i] == 0)]
            for i in mine:
                if t == 0 and ctx.index_in_group[i] == 0:  # TRL's sample, cut just after its first step
                    ids = list(ctx.completion_ids[i])
                    n, stop = first_stop(ids, stops, decode)
                    lps = None if ctx.sampling_logprobs is None else list(ctx.sampling_logprobs[i][:n])
                    if n < len(ids):
                        ctx.replace_row(i, ids[:n], logprobs=lps)
                    starts[i], step_ids[i] = 0, ids[:n]
                    ends[i] = stop is None or stop in o.answer_stops or n >= limit
            prefixes = [chains[ctx.group_ids[i]].ids for i in requests]
            continuations = ctx.continue_prefixes(  # collective, even with no request
                [list(ctx.prompt_ids[i]) for i in requests], [list(p) for p in prefixes],
                [limit - len(p) for p in prefixes], stop=stops)
            for i, p, c in zip(requests, prefixes, continuations):
                lps = None if ctx.sampling_logprobs is None else [float("nan")] * len(p) + list(c.logprobs)
                ctx.replace_row(i, c.completion_ids, logprobs=lps)
                starts[i], step_ids[i] = len(p), list(c.new_ids)
                ends[i] = c.stop is None or c.stop in o.answer_stops or len(c.completion_ids) >= limit
            extra += len(requests)
            rewards = self._rewards(ctx, mine, chains, starts, ends, step_ids, rounds)
            ended_candidates += sum(ends[i] for i in mine)
            # every process: the step's k rewards (a group may straddle processes), then the same winner everywhere
            local = torch.zeros(B, 3)
            for i in mine:
                local[i] = torch.tensor([rewards[i], float(ends[i]), 1.0])
            table = ctx.gather(local.to(context_device(ctx))).cpu()  # (N, 3): reward, ends, in this round
            new_steps = gather_id_lists(ctx, [step_ids.get(i, []) for i in range(B)])
            for g in local_groups:
                rows = [g * G + t * k + j for j in range(k)]
                r = table[rows, 0]
                adv = step_advantages(r)
                all_rewards.append(r)
                for i in mine:
                    if ctx.group_ids[i] == g:
                        j = ctx.index_in_group[i] - t * k
                        ctx.annotations[i].update({START_KEY: starts[i], LENGTH_KEY: len(ctx.completion_ids[i]),
                                                   ADV_KEY: float(adv[j]), REWARD_KEY: float(r[j]), ROUND_KEY: t})
                chain = chains[g]
                if chain.ended:
                    continue  # its later steps branch again from the last decision point
                gen = torch.Generator().manual_seed(hash((self._seed, ctx.step, g, t)) % (2**63))
                w = pick_winner(adv, o.eta, gen)
                if bool(table[rows[w], 1]):  # an answer (or the length limit): the trajectory is complete
                    chain.ended = True
                    continue
                chain.ids = chain.ids + new_steps[rows[w]]
                chain.steps.append(decode(new_steps[rows[w]]).strip())
        stacked = torch.stack(all_rewards) if all_rewards else torch.zeros(0, k)
        ctx.log_metric("extra_rollouts", float(extra))
        ctx.log_metric("step_reward_mean", float(stacked.mean()) if stacked.numel() else 0.0)
        ctx.log_metric("step_reward_std", float(stacked.std(dim=-1).mean()) if stacked.numel() else 0.0)
        ctx.log_metric("answer_step_fraction", ended_candidates / max(B, 1))
        ctx.log_metric("chain_steps", sum(len(c.steps) for c in chains.values()) / max(len(chains), 1))

    def _rewards(self, ctx: RolloutContext, mine: list[int], chains: dict, starts: dict, ends: dict,
                 step_ids: dict, rounds: int) -> dict[int, float]:
        """Step reward of each local row of the round (PRM over the prefix's steps and this one; outcome if it ends)."""
        o = self.options
        decode = lambda ids: ctx.tokenizer.decode(ids, skip_special_tokens=True).strip()  # noqa: E731
        scores = self.prm.score_step_lists(
            [ctx.rows[i] for i in mine],
            [chains[ctx.group_ids[i]].steps + [decode(step_ids[i])] for i in mine],
        ) if mine else []
        ending = [i for i in mine if ends[i]]
        outcomes = ctx.score(ending, [ctx.completions[i] for i in ending]).float().tolist() if ending else []
        outcome = dict(zip(ending, outcomes))
        out = {}
        for i, s in zip(mine, scores):
            before = len(chains[ctx.group_ids[i]].steps)
            out[i] = step_reward(s[-1] if s else None, ends[i], outcome.get(i, 0.0), before, rounds, o.lambda_bonus)
        return out

    # ------------------------------------------------------------------------------------------ advantages
    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if ctx.mode != "train":
            return
        mask = ctx.completion_mask()
        N, width = mask.shape
        has = torch.zeros(N, dtype=torch.bool)
        starts, lengths, advs = [0] * N, [0] * N, [0.0] * N
        for n, note in enumerate(ctx.annotations):
            if ADV_KEY not in note or note[LENGTH_KEY] > width:
                continue  # e.g. a row of a refill round: it keeps TRL's advantage
            starts[n], lengths[n], advs[n] = int(note[START_KEY]), int(note[LENGTH_KEY]), float(note[ADV_KEY])
            has[n] = True
        slate = slate_token_advantages(starts, lengths, advs, width)
        adv = ctx.advantages.float().cpu()
        base = adv[:, :width] if adv.dim() == 2 else adv.unsqueeze(1).expand(-1, width)
        # (1 - w) A_TRL + w A_SLATE on the rows SLATE sampled, TRL's advantage elsewhere
        ctx.add_token_advantages(torch.where(has.unsqueeze(1), slate - base, torch.zeros_like(base)), o.weight)
        trained = has.unsqueeze(1) & mask.bool().cpu()
        prefix = torch.zeros_like(trained)
        for n in range(N):
            prefix[n, : starts[n]] = True
        ctx.log_metric("prefix_token_fraction", float((trained & prefix).sum()) / max(float(trained.sum()), 1.0))
        ctx.log_metric("step_advantage_abs_mean", float(slate[trained & ~prefix].abs().mean())
                       if (trained & ~prefix).any() else 0.0)
