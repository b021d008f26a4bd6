"""CLPO — the policy rewrites its medium and hard problems, and the rewrites feed the next batches (arXiv:2509.25004).

CLPO (Curriculum-guided Learning for Policy Optimization) reads each problem's difficulty from its own rollouts: a
group's **pass rate** ``a`` (the fraction of its G rollouts that succeed) classes the problem as **hard**
(``a <= hard_upper``, 0.3) or **medium** (``medium_lower < a <= medium_upper``, 0.3 < a <= 0.7); easier problems are
left alone. The **policy itself** then restructures them (Adaptive Problem Restructuring): it rewrites each hard
problem into a simpler, clearer statement and each medium problem into a differently worded equivalent one, one
rewrite per problem, told the reference answer so that the rewrite keeps it (and asked not to reveal it). The
rewritten problems are rolled out and trained on like the originals.

Here (one generation batch per step in TRL), the curriculum runs one batch behind:

1. reward stage of batch ``t`` (``trl_plugins_transform_rewards``, read-only): the pass rates of the gathered
   success matrix select the hard and medium groups of the original problems; their dataset rows (gathered) form the
   rewrite queue, hard first -- the same queue on every process;
2. sampling stage of batch ``t + 1`` (``trl_plugins_after_generation``): the current policy rewrites the queue
   through the generation service (``ctx.service.generate``, collective: item ``k`` is generated on process
   ``k % P``, every process calls once, possibly with no request; the ids are gathered and decoded everywhere). A
   rewrite is the content of the first fenced code block of the reply (the whole reply without one), kept when it is
   11 to 1999 characters long (the official bounds); the new row is the original dataset row with only the problem
   text of its prompt replaced (the last user message, or the string prompt), so the answer and every column the
   verifier reads are the original's. Valid rewrites join the pool (newest first, at most ``S`` = groups per batch);
3. refill stage of batch ``t + 1`` (``trl_plugins_reject_groups``, round 0): groups that carry no GRPO signal (pass
   rate 0 or 1 -- the official code drops them from the batch) are replaced by pooled rewrites, at most
   ``round(max_share * S)`` per batch; the trainer rolls the rewritten problems out as ordinary groups (G rollouts,
   counted in the rollout budget) and rewards them with the original answers. Rewrites left over stay in the pool
   for the following batches.

Difficulty-aware KL (``kl_hard_scale``, ``kl_nonhard_scale``): the KL coefficient of a row is TRL's ``beta`` times a
per-problem factor, 0.5 on hard problems and 1 otherwise (the official run script). A problem is hard when it is a
rewrite of a hard problem, or an original whose group pass rate is ``<= hard_upper``; rewrites of medium problems
are not hard whatever their pass rate (the official labels). The labels are read at the reward stage (training
batches) and the loss adds ``beta (m - 1) KL_t`` to each row's tokens (the shared rule of
:mod:`trl_plugins_builtin._difficulty_kl`, also ``ares``'s), so the total is ``beta m KL_t``. With ``beta = 0``
(TRL's default; CLPO's official ``kl_loss_coef`` is 0.001) there is no KL to scale.

Neutral setting: ``rewrite_mode="off"`` (or ``max_share=0``) with ``kl_hard_scale=1`` (and ``kl_nonhard_scale=1``): no
hook runs (vanilla GRPO).

Official code: csuking/CLPO@cb77b56, ``verl/trainer/ppo/ray_trainer.py`` (``RayCLPOTrainer``): the thresholds
(lines 2147-2148; defaults in ``verl/trainer/config/data/legacy_data.yaml`` lines 114-127 and
``scripts/clpo_qwen3_8b.sh`` lines 26-70), the two rewrite instructions with the answer filled in (1638-1720,
2225-2237; ours are written anew), one rewrite per problem sampled at temperature 0.7 with at most 400 new tokens
(1851-1866), the parsing and length bounds (1887-1906), the original row's non-prompt columns copied onto the rewrite
(1952-1972), the rewritten groups rolled out with ``n`` rollouts and kept only when ``0 < a < 1`` (1976-2016,
2317-2331), and the mix of informative original groups with the kept rewrites, hard rewrites first (2333-2418).

Deviations (documented, ``reconstructed``): the official trainer rewrites and rolls out within the same step and
lets the batch size vary; here the rewrites enter the next batch in the slots of zero-signal groups (a fixed-size
batch), capped by ``max_share``; rewritten groups with pass rate 0 or 1 are kept (the official drops them: stack
``dynamic_sampling`` after ``clpo`` for that). The rewrite is sampled with the run's generation settings (temperature,
``max_completion_length``), not 0.7 / 400 tokens. The difficulty-aware KL follows the official in-loss scaling
(``ray_trainer.py`` 2642-2701: labels from the rewrite source and the pass rate, ``kl_loss_coef_hard_scale`` /
``kl_loss_coef_nonhard_scale``; ``dp_actor.py`` 477-485: the per-token KL times the row's factor; defaults
``scripts/clpo_qwen3_8b.sh`` 42-43) on TRL's KL term (not clamped as verl's ``low_var_kl`` is). Not covered: the
optional dumps of the rewrites to JSON files.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trl_plugins.api import (
    AdvantageContext,
    LossContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    RefillContext,
    RewardContext,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.collectives import gather_id_lists, gather_objects_together
from trl_plugins.api.data_checks import check_column_filled
from trl_plugins.api.reasons import IMAGES_REFILL, REFILLS_GROUPS
from trl_plugins.api.success import SuccessOptions
from trl_plugins.api.text import check_template, last_user_text, stable_key, with_last_user_text

from ._difficulty_kl import scale_row_kl, token_kl

#: Extras key: (N,) factor on TRL's beta per row (advantage stage -> loss stage).
KL_KEY = "clpo_kl_scale"
#: Rewrites outside [MIN_CHARS, MAX_CHARS] characters are dropped (official: 10 < len < 2000).
MIN_CHARS, MAX_CHARS = 11, 1999

HARD_TEMPLATE = (
    "Rewrite the math problem below so that it is easier to read: shorter sentences, no redundant words, and any "
    "constraint that is only implied stated explicitly. Keep exactly the same task, quantities, conditions and "
    "required answer format, so that its correct answer is still {answer}. Do not solve it and do not hint at the "
    "answer. Reply with the rewritten problem only, inside one fenced code block (```).\n\n"
    "Problem:\n{question}"
)
MEDIUM_TEMPLATE = (
    "Restate the math problem below in different words: vary the phrasing, the sentence structure and the order of "
    "the givens, but change no number, condition or relation, and keep the required answer format, so that its "
    "correct answer is still {answer}. Do not solve it and do not hint at the answer. Reply with the rewritten "
    "problem only, inside one fenced code block (```).\n\n"
    "Problem:\n{question}"
)
_FENCE = re.compile(r"```[^\n`]*\n?(.*?)(?:```|$)", re.DOTALL)


@dataclass
class ClpoOptions(SuccessOptions):
    rewrite_mode: Literal["both", "hard_only", "medium_only", "off"] = option(
        "both",
        help="Which problems the policy rewrites (official clpo_rewrite_mode): both, hard_only, medium_only; "
        "off = no rewriting (vanilla GRPO).",
    )
    hard_upper: float = option(
        0.3, min=0.0, max=1.0, help="A problem is hard when its group's pass rate is <= this (clpo_hard_acc_upper)."
    )
    medium_lower: float = option(
        0.3, min=0.0, max=1.0, help="A problem is medium when its pass rate is > this ... (clpo_medium_acc_lower)."
    )
    medium_upper: float = option(
        0.7, min=0.0, max=1.0, help="... and <= this (clpo_medium_acc_upper); easier problems are not rewritten."
    )
    max_share: float = option(
        1.0, min=0.0, max=1.0, reconstructed=True,
        help="Largest share of a batch's groups that rewrites may replace (only groups with pass rate 0 or 1 are "
        "replaced); 0 = no rewriting (vanilla GRPO).",
    )
    kl_hard_scale: float = option(
        0.5, min=0.0,
        help="Difficulty-aware KL: factor on TRL's beta for the rows of hard problems (official "
        "kl_loss_coef_hard_scale, 0.5 in the run script); 1 with kl_nonhard_scale=1 = TRL's KL.",
    )
    kl_nonhard_scale: float = option(
        1.0, min=0.0, help="Difficulty-aware KL: factor on TRL's beta for the other rows (kl_loss_coef_nonhard_scale).",
    )
    answer_column: str | None = option(
        "answer",
        help="Dataset column with the reference answer, named in the rewrite instruction so the rewrite keeps it; "
        "None = the instruction names no answer.",
    )
    hard_template: str = option(
        HARD_TEMPLATE, help="Rewrite instruction for hard problems (simplify); fields {question} and {answer}."
    )
    medium_template: str = option(
        MEDIUM_TEMPLATE, help="Rewrite instruction for medium problems (diversify); fields {question} and {answer}."
    )

    @property
    def active(self) -> bool:
        """The policy rewrites problems."""
        return self.rewrite_mode != "off" and self.max_share > 0

    @property
    def kl_active(self) -> bool:
        """The reference KL is scaled by difficulty."""
        return self.kl_hard_scale != 1.0 or self.kl_nonhard_scale != 1.0

    def validate(self) -> None:
        super().validate()
        if self.medium_lower > self.medium_upper:
            raise PluginConfigError(
                f"Plugin 'clpo': medium_lower={self.medium_lower} is above medium_upper={self.medium_upper}; allowed: "
                "medium_lower <= medium_upper (the medium band is medium_lower < pass rate <= medium_upper)."
            )
        for name in ("hard_template", "medium_template"):
            check_template("clpo", name, getattr(self, name), ("question", "answer"), required=("question",))


def difficulty(rates: torch.Tensor, o: ClpoOptions) -> list[str | None]:
    """Per group: ``"hard"``, ``"medium"`` or None (not rewritten, or its kind is off), from (S,) pass rates (float64,
    as the official numpy means: 3/10 in float32 is above 0.3)."""
    kinds: list[str | None] = []
    for a in rates.tolist():
        if a <= o.hard_upper and o.rewrite_mode in ("both", "hard_only"):
            kinds.append("hard")
        elif o.medium_lower < a <= o.medium_upper and o.rewrite_mode in ("both", "medium_only"):
            kinds.append("medium")
        else:
            kinds.append(None)
    return kinds


def hard_rows(rates: torch.Tensor, rewrite_kinds: list[str | None], hard_upper: float, group_size: int) -> torch.Tensor:
    """(N,) bool: the rows of hard problems for the difficulty-aware KL (the official labels): a group placed as a
    rewrite is hard when it rewrites a hard problem, an original one when its pass rate is ``<= hard_upper``.

    Args: rates (S,) float64 group pass rates; rewrite_kinds (S,) the kind of each placed rewrite, None for an
    original problem.
    """
    hard = [kind == "hard" if kind is not None else a <= hard_upper for a, kind in zip(rates.tolist(), rewrite_kinds)]
    return torch.tensor(hard, dtype=torch.bool).repeat_interleave(group_size)


def kl_multipliers(hard: torch.Tensor, o: ClpoOptions) -> torch.Tensor:
    """(N,) factor on TRL's beta per row: ``kl_hard_scale`` on hard rows, ``kl_nonhard_scale`` elsewhere."""
    return torch.where(hard, torch.tensor(o.kl_hard_scale), torch.tensor(o.kl_nonhard_scale)).double()


def rewrite_instruction(row: dict, kind: str, o: ClpoOptions) -> Any:
    """The rewrite request for ``row``'s problem, in the prompt's own format (a user message, or a string)."""
    answer = row.get(o.answer_column) if o.answer_column else None
    template = o.hard_template if kind == "hard" else o.medium_template
    text = template.format(question=last_user_text(row["prompt"]),
                           answer="the same as before" if answer is None else answer)
    return text if isinstance(row["prompt"], str) else [{"role": "user", "content": text}]


def parse_rewrite(reply: str) -> str | None:
    """The rewritten problem in ``reply``: its first fenced code block, else the whole reply (stripped); None when
    it is not MIN_CHARS to MAX_CHARS characters long."""
    match = _FENCE.search(reply)
    text = (match.group(1) if match else reply).strip()
    return text if MIN_CHARS <= len(text) <= MAX_CHARS else None


def rewritten_row(row: dict, question: str) -> dict:
    """``row`` with the problem text of its prompt replaced (every other column, the answer included, kept)."""
    return {**row, "prompt": with_last_user_text(row["prompt"], question)}


def replacement_slots(rates: torch.Tensor, open_slots: torch.Tensor, available: int, cap: int) -> list[int]:
    """Group slots a rewrite replaces: the first ``min(available, cap)`` open slots whose (S,) pass rate is 0 or 1."""
    idle = ((rates == 0) | (rates == 1)) & open_slots
    return idle.nonzero().flatten().tolist()[: max(min(available, cap), 0)]


class ClpoPlugin(Plugin):
    """The policy rewrites its hard (simplify) and medium (diversify) problems; the rewrites fill later batches."""

    name = "clpo"
    image_inputs = IMAGES_REFILL
    multi_turn = REFILLS_GROUPS
    version = "0.2.0"
    paper = "CLPO: Curriculum Learning meets Policy Optimization for LLM Reasoning, arXiv:2509.25004"
    summary = ("The policy rewrites its hard and medium problems (by group pass rate) into later batches; hard "
               "problems get a smaller KL coefficient.")
    Options = ClpoOptions
    official = OfficialSource(
        "csuking/CLPO", "cb77b56", verdict="faithful",
        files=("verl/trainer/ppo/ray_trainer.py", "verl/trainer/config/data/legacy_data.yaml",
               "scripts/clpo_qwen3_8b.sh"),
        note="Thresholds, rewrite modes, one rewrite per problem with the answer named, parsing and length bounds as "
        "official; the rewrites enter the next batch in the slots of zero-signal groups (official: the same step, a "
        "batch of varying size); sampled with the run's settings (official 0.7 / 400 tokens); the difficulty-aware "
        "KL scales TRL's reference KL per row as the official in-loss factors do.",
    )
    claim_metric = ("rewritten_fraction", "batch share of rewritten problems")
    reconstructed = (
        "the rewrites enter the next generation batch, replacing groups with pass rate 0 or 1 (max_share caps them); "
        "the official trainer adds them to the same step",
        "rewritten groups with pass rate 0 or 1 are kept (the official drops them)",
        "the rewrite instructions are ours (same intent: simplify hard, diversify medium, keep the named answer)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.queue: list[dict] = []  # {"kind", "row"}: problems to rewrite at the next sampling stage
        self.pool: list[dict] = []  # {"kind", "row"}: rewritten rows waiting for a slot
        self.supplied: dict[int, str] = {}  # stable key -> kind of the rewritten prompts placed in the current batch
        self.bias_correction = False
        self._hard: torch.Tensor | None = None  # (N,) hard rows of the batch (reward stage -> advantage stage)

    def hook_enabled(self, hook: str) -> bool:
        o = self.options
        if hook in ("trl_plugins_transform_advantages", "trl_plugins_loss"):
            return o.kl_active
        if hook in ("trl_plugins_transform_rewards", "trl_plugins_configure", "trl_plugins_state_dict",
                    "trl_plugins_load_state_dict"):
            return o.active or o.kl_active
        return o.active

    def required_columns(self) -> list[str]:
        return [self.options.answer_column] if self.options.answer_column else []

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self.bias_correction = bool(getattr(args, "use_bias_correction_kl", False))
        if not self.options.active:
            return
        if getattr(args, "max_refill_rounds", 1) < 1:
            raise PluginConfigError(
                f"clpo: max_refill_rounds={args.max_refill_rounds}; allowed: >= 1 (the rewritten problems enter the "
                "batch through one refill round)."
            )
        if self.options.answer_column:
            check_column_filled(self.name, getattr(trainer, "train_dataset", None), self.options.answer_column,
                                "the rewrite instruction names the answer the rewrite must keep")

    @hookimpl
    def trl_plugins_state_dict(self) -> dict:
        return {"queue": list(self.queue), "pool": list(self.pool),
                "supplied": [[key, kind] for key, kind in self.supplied.items()]}

    @hookimpl
    def trl_plugins_load_state_dict(self, state: dict) -> None:
        self.queue, self.pool = list(state["queue"]), list(state["pool"])
        # version 0.1 kept the keys only (their kind unknown: not hard)
        self.supplied = {int(k[0]): k[1] for k in state["supplied"]} if state["supplied"] and isinstance(
            state["supplied"][0], (list, tuple)) else {int(k): None for k in state["supplied"]}

    # ------------------------------------------------------------------------------------------ rewriting
    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        """Rewrite the queued problems with the current policy (collective), into the pool."""
        if ctx.mode != "train" or not self.queue:  # the queue is the same on every process
            return
        B, P = len(ctx), max(int(ctx.run.num_processes), 1)
        p = ctx.global_index[0] // B if B else 0
        mine = [k for k in range(len(self.queue)) if k % P == p]
        requests = [rewrite_instruction(self.queue[k]["row"], self.queue[k]["kind"], self.options) for k in mine]
        completions = ctx.service.generate(prompts=requests)  # collective: every process calls, maybe with none
        local = [[] for _ in range(B)]
        for j, completion in enumerate(completions):
            local[j] = list(completion.completion_ids)
        gathered = gather_id_lists(ctx, local)  # (N,) lists; process q's requests sit at q * B + j
        fresh = []
        for k, item in enumerate(self.queue):
            reply = ctx.tokenizer.decode(gathered[(k % P) * B + k // P], skip_special_tokens=True)
            question = parse_rewrite(reply)
            if question is not None:
                fresh.append({"kind": item["kind"], "row": rewritten_row(item["row"], question)})
        groups = max((B * P) // ctx.num_generations, 1)
        ctx.log_metric("rewrite_requests", float(len(self.queue)))
        ctx.log_metric("rewrite_valid_fraction", len(fresh) / len(self.queue))
        self.pool = (fresh + self.pool)[:groups]
        self.queue = []

    @hookimpl
    def trl_plugins_reject_groups(self, ctx: RefillContext):
        """Round 0: replace zero-signal groups with pooled rewrites (hard ones first)."""
        if ctx.round != 0:
            return
        self.supplied = {}
        S = ctx.num_groups
        rates = ctx.group_success(self.options.success_rule).float().mean(dim=1).cpu()
        cap = int(math.floor(self.options.max_share * S + 0.5))
        pool = sorted(self.pool, key=lambda item: item["kind"] != "hard")  # stable: hard first, newest first
        slots = replacement_slots(rates, ctx.fresh.cpu() & ~ctx.rejected.cpu(), len(pool), cap)
        ctx.reject(slots)
        for item in pool[: len(slots)]:
            ctx.supply(item["row"])
            self.supplied[stable_key(item["row"]["prompt"])] = item["kind"]
        self.pool = pool[len(slots):]
        ctx.log_metric("rewritten_fraction", len(slots) / max(S, 1))
        ctx.log_metric("pool_size", float(len(self.pool)))

    # ------------------------------------------------------------------------------------------ difficulty
    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        """Read (never change) the gathered rewards: queue this batch's hard and medium original problems, and label
        its hard rows for the difficulty-aware KL."""
        self._hard = None
        if ctx.mode != "train":
            return
        G = ctx.num_generations
        rates = ctx.success(self.options.success_rule).double().view(-1, G).mean(dim=1).cpu()  # (S,) float64
        kinds = difficulty(rates, self.options)
        supplied = self.supplied
        first = ctx.index_in_group[ctx.process_slice].tolist()
        groups = ctx.group_ids[ctx.process_slice].tolist()

        def local_rows() -> list:
            return [
                (supplied.get(stable_key(row["prompt"]), False), row if kinds[g] is not None else None) if i == 0
                else None
                for row, i, g in zip(ctx.local_rows, first, groups)
            ]

        heads = [v for v in gather_objects_together(ctx, self.name, local_rows) if v is not None]  # (S,) in order
        rewritten = torch.tensor([flag is not False for flag, _ in heads], dtype=torch.bool)
        if self.options.kl_active:
            self._hard = hard_rows(rates, [None if flag is False else flag for flag, _ in heads],
                                   self.options.hard_upper, G)
        if not self.options.active:
            return
        queue = [{"kind": kinds[g], "row": row} for g, (flag, row) in enumerate(heads)
                 if row is not None and flag is False]
        self.queue = sorted(queue, key=lambda item: item["kind"] != "hard")
        S = max(len(heads), 1)
        ctx.log_metric("hard_fraction", sum(k == "hard" for k in kinds) / S)
        ctx.log_metric("medium_fraction", sum(k == "medium" for k in kinds) / S)
        if rewritten.any():
            r = rates[rewritten]
            ctx.log_metric("rewritten_pass_rate", float(r.mean()))
            ctx.log_metric("rewritten_informative_fraction", float(((r > 0) & (r < 1)).float().mean()))

    # ------------------------------------------------------------------------------------------ difficulty-aware KL
    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        """Send each row's KL factor (hard / not hard, labelled at the reward stage) to the loss stage."""
        hard, self._hard = self._hard, None
        if ctx.mode != "train" or hard is None or hard.numel() != ctx.rewards.numel():
            return
        ctx.extras[KL_KEY] = kl_multipliers(hard, self.options).to(ctx.rewards.device)
        ctx.log_metric("kl_hard_fraction", float(hard.float().mean()))

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        kl = token_kl(ctx, self.bias_correction)
        if kl is None or KL_KEY not in ctx.extras:
            return
        scale_row_kl(ctx, kl, ctx.extras[KL_KEY].reshape(-1))
