"""DaGRPO — Distinctiveness-aware Group Relative Policy Optimization (arXiv:2512.06337). LOW CONFIDENCE.

Only the paper's abstract and public summaries were readable, no code: the method masks sample **pairs** of low
distinctiveness, judged by a fine-grained score (LLM-based, per a public summary), so that near-identical rollouts
stop producing conflicting gradients ("sequence-level gradient rectification"), and adds high-quality off-policy
**anchors** (external expert data) to hard queries without a valid positive ("off-policy data augmentation").
Everything below is our reconstruction; every guessed detail is an option marked reconstructed.

Pair masking (advantage stage). GRPO's centred advantage in pairwise form is
``A_i = (1/G) sum_j (R_i - R_j) / sigma``; with the incoming advantages ``a`` (TRL's ``(R - mean)/sigma`` unless
an earlier plugin changed them) ``(R_i - R_j)/sigma = a_i - a_j``. With a distinctiveness ``d_ij`` per pair
(``d_ii = 0``) and the surviving set ``S_i = {j : d_ij >= delta}`` (``i`` itself survives only when
``delta = 0``)::

    A_i = m + (1/|S_i|) sum_{j in S_i} (a_i - a_j)      (pair_normalizer="surviving", the default)
    A_i = m + (1/G)     sum_{j in S_i} (a_i - a_j)      (pair_normalizer="group")
    A_i = 0 when S_i is empty,

where ``m`` is the group mean of the incoming advantages: 0 for TRL's own (centred per group); for an earlier
plugin's uncentred advantages the group offset is kept and only the pairwise part is masked. ``delta = 0`` keeps
every pair and returns the incoming advantages exactly: mean-centred GRPO, bit for bit TRL's run. All-equal scores
with ``delta > 0`` give all zeros. With a symmetric mask the "group" normaliser gives ``sum_i A_i = G m`` (0 for
centred advantages) in every group; the "surviving" one only when every row keeps the same number of pairs.

Distinctiveness, from a pluggable fine-grained scorer (``scorer``):

* ``"judge"``: an LLM judge (the paper's kind of scorer), through the project's rubric judge
  (:mod:`trl_plugins.components.judge`: an OpenAI-compatible endpoint with retries, or a local HF model). Each
  completion is graded against every criterion of ``judge_criteria`` (one judge call each, verdicts cached);
  ``s_i`` = the fraction of criteria met, ``d_ij = |s_i - s_j|``. The criteria are ours (reasoning validity,
  completeness, no redundancy, a clear final answer): the paper's scoring prompt is not public.
* ``"similarity"`` (default): ``d_ij = 1 - sim(i, j)``, a token-level similarity between the two completions
  (Jaccard of token n-grams, or ``1 - normalised edit distance``) on their generated token ids (or, when the
  framework does not provide them, on the completion text re-tokenized by the trainer's tokenizer). Any dataset, no
  model: it masks exactly the near-identical rollouts whose conflicting gradients the paper targets.
* ``"prm"``: ``s_i`` = mean step score of a programmatic step verifier (``prm_verifier``, named in
  :data:`~trl_plugins.components.prm.STEP_VERIFIERS`; default ``"arithmetic"``, the bundled tasks' exact step
  check on the row's ``problem`` JSON column; 0 for an empty completion), ``d_ij = |s_i - s_j|``. With the default
  verifier it **works only on the bundled arithmetic tasks** (their ``problem`` column).
* ``"reward"``: ``s_i = R_i`` (the combined reward), ``d_ij = |R_i - R_j|``.

``include_reward_gap`` adds ``|R_i - R_j|`` to ``d_ij``. Scores are read at the reward stage, from the final
completions (after every sampling plugin), and carried to the advantage stage of the same batch.

Off-policy anchors (sampling stage). A group with fewer than ``min_positives`` successful rollouts (verifier column
above ``success_threshold``; the first reward function that is not a placeholder unless ``success_column`` names
another) gets the dataset's reference solution (``solution`` column), tokenized plus EOS, as an
anchor. Its tokens are marked off-policy, so the loss trains them through the framework's shaped branch
``-A p/(p+gamma)`` (LUFFY, gamma = ``offpolicy_shaping_gamma``) with no importance ratio and no vLLM IS
correction; its reward comes from the ordinary reward functions (a correct reference solution scores as a success
under a verifier). **The paper adds anchors to the group** (augmentation); TRL's groups have a fixed size G, so
``anchor_placement`` chooses how [reconstructed]:

* ``"replace"`` (default): all G rows are sampled; in an anchored group one failed rollout (slot ``anchor_index``,
  or the next failed slot) is replaced by the anchor. The sampled rollout is discarded.
* ``"reserve"``: the paper's augmentation inside a fixed G. Slot ``anchor_index`` of every group is reserved (not
  sampled with the others); an anchored group gets the anchor there, **added** to its G - 1 rollouts, and every other
  group fills the slot with one more rollout through the generation service (a second round; still G rollouts at
  most per group, counted in the generation budget). With ``num_generations = G + 1`` an anchored group holds the
  paper's G rollouts plus its anchor.

Because an anchored group has no (or too few) successes, both placements give it the same make-up (failures plus
one anchor); they differ in whether a sampled rollout is thrown away and in how many rollouts decide that a group
needs an anchor (G or G - 1). ``anchors=false`` switches anchors off. Success is judged on the rows as the earlier
sampling plugins left them, so listed after e.g. ``hint_scaffold`` DaGRPO anchors only the groups that plugin did
not rescue.

Defaults, all reconstructed: scorer ``similarity`` (works on any dataset, no model server; ``judge`` is the paper's
kind of scorer, ``prm`` the bundled tasks' step verifier), delta = 0.1, pair_normalizer ``surviving``, similarity
``jaccard`` on token bigrams, anchors on for groups with no success (they need reference solutions in
``solution_column``; ``anchors=false`` on a dataset without them), placement ``replace``, slot 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from trl_plugins.api import (
    AdvantageContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginError,
    PromptContext,
    RewardContext,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.collectives import gather_objects_together
from trl_plugins.api.contexts import context_device
from trl_plugins.api.reasons import EDITS_COMPLETIONS
from trl_plugins.api.success import SuccessOptions
from trl_plugins.api.text import completion_text
from trl_plugins.api.reasons import IMAGES_DEFERRED_ROWS
from trl_plugins.components.judge import EndpointJudge, HFJudge, JudgeEndpointOptions, JudgeRequest, RubricJudge
from trl_plugins.components.prm import STEP_VERIFIERS
from trl_plugins.components.steps import split_steps

ANCHOR_ANNOTATION = "dagrpo_anchor"
RESERVED_ANNOTATION = "dagrpo_reserved"
DEFAULT_CRITERIA = (
    "Every step of the reasoning is correct: it contains no calculation error and no logical error.",
    "The reasoning is complete: no step needed to reach the final answer is skipped or merely asserted.",
    "The solution contains no redundant, repeated or irrelevant steps.",
    "The final answer is stated clearly and explicitly at the end.",
)


@dataclass
class DaGRPOOptions(JudgeEndpointOptions, SuccessOptions):
    scorer: Literal["prm", "judge", "similarity", "reward"] = option(
        "similarity",
        help="Fine-grained scorer: a programmatic step verifier (prm_verifier; the default one reads the bundled "
        "tasks' 'problem' column), an LLM judge grading judge_criteria (the paper's scorer is LLM-based), token "
        "similarity between completions (default: any dataset, no model), or the reward itself.",
        reconstructed=True,
    )
    judge: Literal["endpoint", "hf"] = option(
        "endpoint", help="scorer='judge': an OpenAI-compatible endpoint (e.g. vllm serve) or a local HF model."
    )
    judge_max_concurrency: int = option(64, min=1, help="Judge requests in flight at once.")
    judge_temperature: float = option(0.0, min=0.0, help="Judge sampling temperature (0: greedy).")
    judge_max_tokens: int = option(512, min=1, help="Maximum judge answer tokens.")
    judge_parse_retries: int = option(3, min=0, help="Re-asks of a judge answer that holds no parsable verdict.")
    judge_criteria: list[str] = option(
        default_factory=lambda: list(DEFAULT_CRITERIA), reconstructed=True,
        help="scorer='judge': the criteria each completion is graded on (one judge call each); the score is the "
        "fraction met. Ours: the paper's scoring prompt is not public.",
    )
    delta: float = option(
        0.1, min=0.0, help="Pairs with distinctiveness d_ij < delta are masked; 0 keeps all (mean-centred GRPO).",
        reconstructed=True,
    )
    pair_normalizer: Literal["surviving", "group"] = option(
        "surviving",
        help="Divide the sum over surviving pairs by their number (default) or by the group size G.",
        reconstructed=True,
    )
    include_reward_gap: bool = option(
        False, help="Add |R_i - R_j| to the distinctiveness of each pair.", reconstructed=True
    )
    similarity: Literal["jaccard", "edit"] = option(
        "jaccard",
        help="scorer='similarity': Jaccard of token n-grams, or 1 - normalised edit distance (quadratic in the "
        "length, pure Python: slow for long completions).",
        reconstructed=True,
    )
    ngram: int = option(2, min=1, help="n of the token n-grams of the Jaccard similarity.", reconstructed=True)
    prm_verifier: str = option(
        "arithmetic",
        help="scorer='prm': the step verifier by name (components.prm.STEP_VERIFIERS; 'arithmetic' = the bundled "
        "tasks') or 'package.module:function' (fn(problem, steps) -> scores).",
    )
    problem_column: str = option("problem", help="scorer='prm': dataset column the step verifier reads.")
    anchors: bool = option(True, help="Give groups without a success the reference solution as an off-policy anchor.")
    anchor_placement: Literal["replace", "reserve"] = option(
        "replace", reconstructed=True,
        help="The paper adds anchors to the group; with TRL's fixed G: replace a failed rollout by the anchor, or "
        "reserve one slot per group (the anchor is added to G - 1 rollouts; groups without an anchor fill the slot "
        "with one more rollout from the generation service).",
    )
    solution_column: str = option("solution", help="Dataset column holding the reference solution text (anchors).")
    min_positives: int = option(
        1, min=1, help="Anchor groups with fewer successful rollouts than this (1 = groups with none).",
        reconstructed=True,
    )
    anchor_index: int = option(
        0, min=0, reconstructed=True,
        help="Slot of the anchor: replace: the slot replaced (the next failed slot if that one succeeded); reserve: "
        "the reserved slot (capped at G - 1).",
    )

    def validate(self) -> None:
        if self.scorer == "prm" and not self.problem_column:
            raise PluginConfigError("Option 'problem_column' of plugin 'dagrpo' must name a column with scorer='prm'.")
        if self.scorer == "prm":
            STEP_VERIFIERS.check(self.prm_verifier, "Option 'prm_verifier' of plugin 'dagrpo': ")
        if self.scorer == "judge":
            self.require_base_url("judge", "dagrpo", when="scorer='judge'", otherwise="judge='hf'")
            if not self.judge_criteria or not all(isinstance(c, str) and c.strip() for c in self.judge_criteria):
                raise PluginConfigError(
                    f"Option 'judge_criteria' of plugin 'dagrpo' must be a non-empty list of non-empty strings; got "
                    f"{self.judge_criteria!r}."
                )


# ------------------------------------------------------------------------------------------ pure functions
def pairwise_advantages(advantages: torch.Tensor, keep: torch.Tensor, normalizer: str) -> torch.Tensor:
    """Pair-masked centred advantages.

    Args:
        advantages: (N,) or (N, T) incoming advantages ``a`` (groups of G contiguous rows).
        keep: (num_groups, G, G) bool, ``keep[g, i, j]`` = pair (i, j) survives (row i's set S_i).
        normalizer: "surviving" (divide by |S_i|) or "group" (divide by G).
    Returns:
        same shape as ``advantages``: ``mean_G(a) + sum_{j in S_i} (a_i - a_j) / norm``; 0 where S_i is empty;
        exactly ``a_i`` where S_i is the whole group (the formula's value, without rounding).
    """
    n_groups, G, _ = keep.shape
    a = advantages.reshape(n_groups, G, -1).double()  # (n, G, T')
    k = keep.double()
    count = k.sum(-1, keepdim=True)  # (n, G, 1)
    others = torch.einsum("gij,gjt->git", k, a)  # sum_j keep_ij a_j
    if normalizer == "surviving":
        pair = a - others / count.clamp(min=1.0)
    else:
        pair = (count * a - others) / G
    out = a.mean(dim=1, keepdim=True) + pair
    out = torch.where(count == 0, torch.zeros_like(out), out)
    out = torch.where(count == G, a, out)
    return out.reshape(advantages.shape).to(advantages.dtype)


def score_distinctiveness(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """``d_ij = |s_i - s_j|`` within each group. scores: (N,) -> (num_groups, G, G)."""
    s = scores.view(-1, group_size).double()
    return (s.unsqueeze(2) - s.unsqueeze(1)).abs()


def ngram_jaccard(x: list, y: list, n: int) -> float:
    """Jaccard similarity of the n-gram sets of two token sequences (a sequence shorter than n is one gram).

    Two empty sequences are identical (1.0).
    """
    def grams(seq):
        if not seq:
            return set()
        if len(seq) < n:
            return {tuple(seq)}
        return {tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)}

    a, b = grams(x), grams(y)
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def edit_similarity(x: list, y: list) -> float:
    """``1 - levenshtein(x, y) / max(len)`` of two token sequences (1.0 for two empty ones)."""
    if not x and not y:
        return 1.0
    prev = list(range(len(y) + 1))
    for i, xi in enumerate(x, start=1):
        cur = [i] + [0] * len(y)
        for j, yj in enumerate(y, start=1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (xi != yj))
        prev = cur
    return 1.0 - prev[-1] / max(len(x), len(y))


def similarity_distinctiveness(tokens: list[list], group_size: int, kind: str, n: int) -> torch.Tensor:
    """``d_ij = 1 - sim(i, j)`` within each group.

    Args:
        tokens: N token sequences, groups of ``group_size`` contiguous.
        kind: "jaccard" (n-grams) or "edit".
    Returns:
        (num_groups, G, G) float64, symmetric, zero diagonal.
    """
    G = group_size
    n_groups = len(tokens) // G
    d = torch.zeros(n_groups, G, G, dtype=torch.float64)
    for g in range(n_groups):
        for i in range(G):
            for j in range(i + 1, G):
                x, y = tokens[g * G + i], tokens[g * G + j]
                sim = ngram_jaccard(x, y, n) if kind == "jaccard" else edit_similarity(x, y)
                d[g, i, j] = d[g, j, i] = 1.0 - sim
    return d


def prm_score(problem: Any, text: str, verifier: str = "arithmetic") -> float:
    """Mean step score of ``text`` (one step per non-empty line) under the programmatic step verifier ``verifier``
    (:data:`~trl_plugins.components.prm.STEP_VERIFIERS`; default the bundled arithmetic tasks', ``problem`` their
    JSON); 0.0 for a text without steps."""
    steps = [span.text for span in split_steps(text, "\n")]
    scores = list(STEP_VERIFIERS.get(verifier)(problem, steps)) if steps else []
    return sum(scores) / len(scores) if scores else 0.0


def judge_conversation(prompt: Any) -> list[dict]:
    """The conversation a judge sees: the prompt's messages (a string prompt as one user message)."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def criteria_scores(verdicts: list[bool], num_criteria: int) -> list[float]:
    """Fraction of criteria met per completion: ``verdicts`` holds ``num_criteria`` verdicts per completion, in
    order (N * K,) -> (N,)."""
    K = num_criteria
    return [sum(verdicts[n * K:(n + 1) * K]) / K for n in range(len(verdicts) // K)]


def anchor_slots(success: torch.Tensor, min_positives: int, anchor_index: int) -> list[int]:
    """Slot (index in group) to replace per group, or -1 when the group is not anchored.

    Args:
        success: (num_groups, G) bool.
    Returns:
        num_groups ints: a group with fewer than ``min_positives`` successes (and at least one failure) gets the
        first failed slot at or after ``min(anchor_index, G-1)``, cyclically.
    """
    n_groups, G = success.shape
    start = min(anchor_index, G - 1)
    slots = []
    for g in range(n_groups):
        row = success[g].tolist()
        if sum(row) >= min_positives or all(row):
            slots.append(-1)
            continue
        slots.append(next((start + k) % G for k in range(G) if not row[(start + k) % G]))
    return slots


def _encode(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer(text=text, add_special_tokens=False)["input_ids"]
    if ids and isinstance(ids[0], list):  # processors return a batch
        ids = ids[0]
    return list(ids)


# ------------------------------------------------------------------------------------------ plugin
class DaGRPOPlugin(Plugin):
    """Distinctiveness-aware pair masking of advantages plus off-policy reference anchors."""

    name = "dagrpo"
    image_inputs = IMAGES_DEFERRED_ROWS
    multi_turn = EDITS_COMPLETIONS
    version = "0.1.0"
    paper = (
        "DaGRPO: Rectifying Gradient Conflict in Reasoning via Distinctiveness-Aware Group Relative Policy "
        "Optimization, arXiv:2512.06337"
    )
    summary = "Masks low-distinctiveness rollout pairs in the centred advantage; anchors all-fail groups."
    Options = DaGRPOOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found (abstract only): the distinctiveness scorer, the pair normaliser and the "
        "anchors with their placement are reconstructed.",
    )
    claim_metric = ("anchored_group_fraction", "groups anchored with the reference")
    replaces = (
        "the advantages (pair-masked)",
        "one failed completion of an all-fail group, or the group's reserved slot (a reference-solution anchor)",
    )
    reconstructed = (
        "the whole method is reconstructed from the abstract and public summaries (no code, no method section)",
        "fine-grained scorer: default token similarity between completions (any dataset, no model); the LLM judge "
        "(scorer='judge', the paper's kind) grades our criteria, the paper's prompt is not public",
        "delta = 0.1; pair normaliser |S_i| with a 1/G alternative",
        "the incoming advantages' group mean (0 for TRL's) is kept; only their pairwise part is masked",
        "the paper adds anchors to the group; here (fixed G) an anchor replaces a failed rollout by default "
        "(anchor_placement='replace') or fills a reserved slot ('reserve')",
        "anchors are trained through the shaped off-policy branch f(p) = p/(p+gamma) (LUFFY), their reward computed "
        "by the reward functions",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self._pending: dict[str, torch.Tensor] | None = None
        self.judge: RubricJudge | None = None

    def build_judge(self) -> RubricJudge:
        """The LLM judge of ``scorer='judge'`` (built on first use)."""
        o = self.options
        if o.judge == "hf":
            return HFJudge(o.judge_model, max_new_tokens=o.judge_max_tokens, temperature=o.judge_temperature,
                           parse_retries=o.judge_parse_retries)
        endpoint = o.endpoint_config("judge", max_concurrency=o.judge_max_concurrency)
        sampling = {"temperature": o.judge_temperature, "max_tokens": o.judge_max_tokens}
        return EndpointJudge(endpoint, sampling, parse_retries=o.judge_parse_retries)

    def judge_scores(self, prompts: list, completions: list, rows: list[dict]) -> list[float]:
        """Fraction of ``judge_criteria`` the judge finds met, per completion (one batched grading call)."""
        if self.judge is None:
            self.judge = self.build_judge()
        items = [{"criterion": c, "points": 1.0} for c in self.options.judge_criteria]
        requests = [
            JudgeRequest(judge_conversation(prompt), completion_text(completion), item, row)
            for prompt, completion, row in zip(prompts, completions, rows)
            for item in items
        ]
        verdicts = self.judge.grade(requests) if requests else []
        return criteria_scores(verdicts, len(items))

    def reserves(self, G: int) -> bool:
        """Whether a slot per group is reserved for anchors (anchor_placement='reserve', G >= 2)."""
        o = self.options
        return o.anchors and o.anchor_placement == "reserve" and G >= 2

    def required_columns(self) -> list[str]:
        o = self.options
        columns = [o.problem_column] if o.scorer == "prm" else []
        if o.anchors:
            columns.append(o.solution_column)
        return columns

    # ---------------------------------------------------------------- sampling: anchors
    @hookimpl
    def trl_plugins_generation_prompts(self, ctx: PromptContext):
        """anchor_placement='reserve': the anchor slot of every group is left out of the first round."""
        G = ctx.num_generations
        if not self.reserves(G):
            return
        slot = min(self.options.anchor_index, G - 1)
        for i in ctx.defer_slots(lambda k: k == slot):
            ctx.annotations[i][RESERVED_ANNOTATION] = True

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        o = self.options
        if not o.anchors:
            return
        G = ctx.num_generations
        reserve = self.reserves(G)
        reserved = [reserve and bool(ctx.annotations[i].get(RESERVED_ANNOTATION)) for i in range(len(ctx))]
        sampled = [i for i in range(len(ctx)) if not reserved[i]]
        local = torch.full((len(ctx),), float("nan"))
        if sampled:
            local[sampled] = ctx.success(sampled, rule=o.success_rule).float().cpu()  # verifier column only
        scores = ctx.gather(local.to(context_device(ctx))).cpu()  # (N,) collective; NaN on reserved slots
        success = (scores == 1.0).view(-1, G)  # NaN (reserved slot) counts as no success
        if reserve:
            anchored = (success.sum(1) < o.min_positives).tolist()
            rows = [i for i in range(len(ctx)) if reserved[i] and anchored[ctx.group_ids[i]]]
            refill = [i for i in range(len(ctx)) if reserved[i] and not anchored[ctx.group_ids[i]]]
        else:
            slots = anchor_slots(success, o.min_positives, o.anchor_index)
            anchored = [s >= 0 for s in slots]
            rows = [i for i in range(len(ctx)) if slots[ctx.group_ids[i]] == ctx.index_in_group[i]]
            refill = []
        self._check_solutions(ctx, rows)
        tokenizer = ctx.tokenizer
        for i in rows:
            ids = _encode(tokenizer, ctx.rows[i][o.solution_column]) + [tokenizer.eos_token_id]
            ctx.replace_row(i, ids, offpolicy=True, training_prompt=None)
            ctx.annotations[i][ANCHOR_ANNOTATION] = True
        if reserve:  # collective: groups without an anchor get their reserved rollout now
            for i, c in zip(refill, ctx.service.generate(prompts=[ctx.prompts[i] for i in refill])):
                ctx.replace_row(i, c.completion_ids or [tokenizer.eos_token_id], logprobs=c.logprobs if c.completion_ids else None)
        n_groups = success.size(0)
        ctx.log_metric("no_positive_group_fraction", float((success.sum(1) == 0).float().mean()))
        ctx.log_metric("anchored_group_fraction", sum(anchored) / max(n_groups, 1))

    def _check_solutions(self, ctx: RolloutContext, rows: list[int]) -> None:
        """Every process raises together when a row to anchor has no reference solution."""
        col = self.options.solution_column
        bad = [i for i in rows if not (isinstance(ctx.rows[i].get(col), str) and ctx.rows[i].get(col))]
        flags = ctx.gather(torch.tensor([ctx.global_index[bad[0]] if bad else -1]))
        offenders = [int(x) for x in flags.tolist() if x >= 0]
        if offenders:
            raise PluginConfigError(
                f"dagrpo: row {offenders[0]} needs an anchor but has no reference solution in column {col!r} "
                "(a non-empty string is needed); fill the column or set anchors=false."
            )

    # ---------------------------------------------------------------- reward: fine-grained scores
    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        o = self.options
        self._pending = None
        if o.scorer == "prm":
            local = []
            for row, completion in zip(ctx.local_rows, ctx.local_completions):
                problem = row.get(o.problem_column)
                if not isinstance(problem, str) or not problem:
                    raise PluginConfigError(
                        f"dagrpo: scorer='prm' needs the problem JSON in column {o.problem_column!r}; got {problem!r}."
                    )
                local.append(prm_score(problem, completion_text(completion), o.prm_verifier))
            scores = torch.tensor(ctx.gather_object(local), dtype=torch.float64)
            self._pending = {"scores": scores}
        elif o.scorer == "judge":
            # (N,) collective; a judge failing on one process stops every process together
            scores = gather_objects_together(ctx, self.name, self.judge_scores, ctx.local_prompts,
                                             ctx.local_completions, ctx.local_rows)
            self._pending = {"scores": torch.tensor(scores, dtype=torch.float64)}
        elif o.scorer == "similarity":
            local_ids = getattr(ctx, "local_completion_ids", None)
            if local_ids is not None:  # the generated token ids
                tokens = ctx.gather_object([list(ids) for ids in local_ids])
            else:  # the completion text, re-tokenized
                texts = ctx.gather_object([completion_text(c) for c in ctx.local_completions])
                tokens = [_encode(ctx.tokenizer, t) for t in texts]
            self._pending = {"distinctiveness": similarity_distinctiveness(tokens, ctx.num_generations,
                                                                           o.similarity, o.ngram)}

    # ---------------------------------------------------------------- advantage: pair masking
    def distinctiveness(self, ctx: AdvantageContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(num_groups, G, G) d_ij of the batch, and the per-row scores s (N,) when the scorer has them."""
        o = self.options
        G = ctx.num_generations
        rewards = torch.nan_to_num(ctx.rewards.double(), nan=0.0)
        scores = None
        if o.scorer == "reward":
            scores = rewards
            d = score_distinctiveness(scores, G)
        else:
            pending, self._pending = self._pending, None
            if pending is None:
                raise PluginError(
                    "dagrpo: no fine-grained scores for this batch (the reward-stage hook did not run before the "
                    "advantage stage)."
                )
            if o.scorer in ("prm", "judge"):
                scores = pending["scores"]
                d = score_distinctiveness(scores, G)
            else:
                d = pending["distinctiveness"]
        if o.include_reward_gap:
            d = d + score_distinctiveness(rewards, G)
        return d, scores

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        G = ctx.num_generations
        d, scores = self.distinctiveness(ctx)
        keep = d >= o.delta
        a = ctx.advantages
        ctx.advantages = pairwise_advantages(a, keep.to(a.device), o.pair_normalizer)
        off_diagonal = ~torch.eye(G, dtype=torch.bool).expand_as(keep)
        if G > 1:
            ctx.log_metric("masked_pair_fraction", float((~keep & off_diagonal).sum() / off_diagonal.sum()))
        ctx.log_metric("zero_advantage_row_fraction", float((keep.sum(-1) == 0).double().mean()))
        if scores is not None:
            ctx.log_metric("mean_score", float(scores.mean()))
        if o.scorer == "similarity" and G > 1:
            ctx.log_metric("mean_pair_distinctiveness", float(d[off_diagonal].mean()))
