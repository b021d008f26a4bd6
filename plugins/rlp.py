"""RLP — Reinforcement as a Pretraining Objective (arXiv:2510.01265, NVIDIA).

RL on plain text: before predicting the next token(s) of a document, the model samples a *thought*; the thought is
rewarded by how much it raises the log-likelihood of the true continuation. Facts from the paper (the official
repository NVlabs/RLP @36b0ac0 ships only its README and the paper's PDF, no code; Algorithm 1, eq. 3-8, §2.1, §9):

1. Information-gain reward (eq. 3-5), teacher-forced, no gradient::

       r(c) = log p_theta(x | ctx, c) - log p_phi(x | ctx)

   the same network scores the true continuation ``x`` after the context and its own thought ``c`` (policy ``theta``),
   and a **no-think EMA baseline** ``phi`` scores it after the context alone. Here both terms are
   ``ctx.policy_logprobs``-style no-grad forwards of the policy (the framework's ``policy_logprobs`` service; no
   full-vocabulary logits kept): the baseline one with the EMA weights loaded into the trainable parameters for the
   call. With several continuation tokens the log-likelihoods are summed over them (the paper scores one token).
2. EMA baseline (§2.1, Algorithm 1 lines 8-9, 15): ``phi <- theta`` on the first batch (lazy), then after every
   optimizer step ``phi <- tau phi + (1 - tau) theta`` with ``tau = 0.999``. Only the **trainable** parameters are
   averaged (with LoRA / QLoRA: the adapter weights; the frozen weights are shared by both by construction). The
   average is kept in float32 (on the parameters' device, or on the CPU with ``ema_device='cpu'``) and saved in the
   plugin state of every checkpoint.
3. Group-relative advantage (eq. 7): ``A_i = G / (G - 1) * (r_i - mean_j r_j)`` over the G thoughts of one context,
   no std normalisation (``advantage='rlp'``; ``'trl'`` keeps TRL's advantages). The loss is TRL's clipped surrogate
   over the thought tokens with a per-thought ``1/|c|`` mean (eq. 8 = TRL's ``loss_type='grpo'``); the paper's recipe
   (§9-10): G = 16 thoughts, temperature 0.7, thoughts up to 2048 tokens, KL coefficient 0 -- GRPOConfig fields
   (``num_generations``, ``temperature``, ``max_completion_length``, ``beta``), not plugin options.

Data (:func:`split_documents`, the ``trl_plugins_train_dataset`` seam): each plain-text document (column
``text_column``) becomes rows of a context prompt (the document up to a word boundary, followed by ``thought_open``)
and the true continuation (the next ``continuation_words`` words, column ``continuation_column``), its other columns
copied (the document column dropped); the reward scores the first ``continuation_tokens`` tokens of the continuation
(official: the next token). A dataset without ``text_column`` must already have plain-text ``prompt`` and
``continuation_column``; rows without the continuation column (an evaluation set of another task) get no rlp reward
(None). The reasoned predictor reads ``prompt + thought + thought_close + continuation``; the baseline reads
``prompt`` without its ``thought_open`` suffix, followed by the continuation.

The thought enters the reasoned forward re-tokenised from its text (cut at its first ``thought_close``), as rlpr
does with its reasoning. Neutral setting: ``reward_weight=0`` with ``advantage='trl'`` trains as vanilla TRL (the rlp
column is computed and logged, with weight 0). Cost: two no-grad forwards of B rows per reward call, and one float32
copy of the trainable parameters (on full fine-tuning the size of the model, also in every checkpoint; with LoRA the
adapter's size).

Reconstructed (no official code): the thought delimiters (``<think>`` / ``</think>`` as in the paper's Figure 1), the
word-boundary split of documents and the number of contexts per document, the sum over several continuation
tokens, and the sampling temperature applied to both log-likelihoods (the ``policy_logprobs`` service divides the
logits by it, as TRL's log-probs do; both terms are scaled alike).

Engines: the EMA is a copy of the local trainable parameters, swapped into the model for the baseline forward; under
FSDP and ZeRO-3 the local parameters are shards, so those engines are refused at construction.
"""

from __future__ import annotations

import random
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Literal

import torch

from trl_plugins.api import (
    AdvantageContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginOptions,
    StageServices,
    hookimpl,
    option,
)
from trl_plugins.api.data_checks import check_column_filled
from trl_plugins.api.reasons import IMAGES_POLICY_PROBE
from trl_plugins.api.text import completion_text

COLUMN = "rlp"
SHARDED = (
    "the EMA no-think baseline is a copy of the trainable parameters swapped into the local model for its forward; "
    "under {engine} the local parameters are shards of the weights, so the copy would average shards"
)


@dataclass
class RlpOptions(PluginOptions):
    ema_decay: float = option(0.999, min=0.0, max=1.0, help="EMA decay tau of the no-think baseline: phi <- tau phi "
                              "+ (1 - tau) theta after every optimizer step (paper: 0.999; 1 = frozen initial "
                              "policy, 0 = the current policy).")
    ema_device: Literal["param", "cpu"] = option(
        "param", help="Where the float32 EMA copy lives: beside each parameter (fast) or on the CPU (saves "
        "accelerator memory on full fine-tuning).",
    )
    continuation_tokens: int | None = option(
        1, min=1, help="Tokens of the true continuation scored by the reward (paper: the next token); None = all "
        "tokens of the continuation column.",
    )
    advantage: Literal["rlp", "trl"] = option(
        "rlp", help="'rlp': A = G/(G-1) (r - group mean r), no std scaling (paper eq. 7); 'trl': keep TRL's "
        "advantages of the weighted reward.",
    )
    reward_weight: float = option(1.0, help="TRL reward weight of the rlp column.")
    thought_open: str = option(" <think>", help="Appended to each context to open the thought (the generation "
                               "prompt ends with it; the baseline drops it).", reconstructed=True)
    thought_close: str = option("</think>", help="Closes the thought before the continuation is scored; a thought "
                                "is cut at its first occurrence.", reconstructed=True)
    split: bool = option(
        True, help="Cut the documents of text_column into context/continuation rows (the prompt is replaced, the "
        "document dropped, other columns copied); a dataset without text_column (or split=false) must have "
        "plain-text prompts and continuation_column.",
    )
    text_column: str = option("text", help="Dataset column with the plain-text documents.")
    continuation_column: str = option("continuation", help="Dataset column with the true continuation text.")
    contexts_per_document: int = option(
        1, min=1, help="Rows cut from each document (distinct word positions, drawn with args.seed).",
        reconstructed=True,
    )
    min_context_words: int = option(8, min=1, help="Fewest words of document before a cut.", reconstructed=True)
    max_context_words: int | None = option(
        None, min=1, help="Keep only the last this many words of the context (None = the document from its start).",
        reconstructed=True,
    )
    continuation_words: int = option(
        1, min=1, help="Words stored as the continuation after each cut (the reward scores continuation_tokens of "
        "them).", reconstructed=True,
    )

    def validate(self) -> None:
        if not self.thought_close.strip():
            raise PluginConfigError(
                f"Option 'thought_close' of plugin 'rlp' got {self.thought_close!r}; it must be a non-blank string "
                "(the thought is cut at it and it separates the thought from the scored continuation)."
            )


# --------------------------------------------------------------------------------------------- data
def document_cuts(text: str, count: int, min_words: int, continuation_words: int, rng: random.Random
                  ) -> list[int]:
    """Word indices ``k`` at which ``text`` is cut (context = words[:k]); at most ``count``, sorted, distinct.

    Valid cuts leave at least ``min_words`` words before and ``continuation_words`` after."""
    n = len(re.findall(r"\S+", text))
    valid = list(range(min_words, n - continuation_words + 1))
    return sorted(rng.sample(valid, min(count, len(valid))))


def cut_document(text: str, k: int, continuation_words: int, max_context_words: int | None) -> tuple[str, str]:
    """(context, continuation) of ``text`` cut before word ``k``: the context ends at the end of word ``k-1`` (from
    word ``k - max_context_words`` when set); the continuation keeps its leading whitespace and runs to the end of
    word ``k + continuation_words - 1``."""
    spans = [m.span() for m in re.finditer(r"\S+", text)]
    first = 0 if max_context_words is None else max(0, k - max_context_words)
    end = spans[k - 1][1]
    return text[spans[first][0]:end], text[end:spans[k + continuation_words - 1][1]]


def split_documents(dataset: Any, o: RlpOptions, seed: int) -> Any:
    """The rows of ``dataset`` cut into context/continuation rows: ``contexts_per_document`` cuts of each document in
    ``o.text_column`` (drawn from ``seed`` and the document's index; documents too short for one cut are dropped),
    each a copy of its row without ``text_column``, with ``prompt = context + thought_open`` and
    ``continuation_column = continuation``.
    ``(N docs) -> (M rows)``, a ``datasets.Dataset`` (batched ``map``: the columns stay in Arrow)."""
    names = list(dataset.column_names)
    kept = [n for n in names if n not in (o.text_column, "prompt", o.continuation_column)]
    out_names = kept + ["prompt", o.continuation_column]

    def cut(batch: dict, indices: list[int]) -> dict:
        out: dict[str, list] = {n: [] for n in out_names}
        for j, i in enumerate(indices):
            text = batch[o.text_column][j]
            text = "" if text is None else str(text)
            rng = random.Random(f"{seed}:{i}")
            for k in document_cuts(text, o.contexts_per_document, o.min_context_words, o.continuation_words, rng):
                context, continuation = cut_document(text, k, o.continuation_words, o.max_context_words)
                for n in kept:
                    out[n].append(batch[n][j])
                out["prompt"].append(context + o.thought_open)
                out[o.continuation_column].append(continuation)
        return out

    rows = dataset.map(cut, batched=True, with_indices=True, remove_columns=names, load_from_cache_file=False,
                       desc="rlp: documents to context/continuation rows")
    if len(rows) == 0:
        raise PluginConfigError(
            f"rlp: no document of column {o.text_column!r} has the {o.min_context_words} + {o.continuation_words} "
            f"words one context/continuation row needs ({len(dataset)} documents); lower min_context_words or give "
            "longer documents."
        )
    return rows


# --------------------------------------------------------------------------------------------- formulas
def information_gain(pred_logps: list[torch.Tensor], ema_logps: list[torch.Tensor]) -> torch.Tensor:
    """(B,) ``sum_j log p_theta(x_j | ctx, c, x_<j) - sum_j log p_phi(x_j | ctx, x_<j)`` from per-token log-probs,
    one (L_i,) tensor per row for each term (eq. 5, summed over the continuation tokens)."""
    return torch.stack([p.float().sum() - e.float().sum().to(p.device) for p, e in zip(pred_logps, ema_logps,
                                                                                          strict=True)]).cpu()


def rlp_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) -> (N,) ``G/(G-1) * (r - group mean r)`` (eq. 7); NaN rewards are left out of the mean and get 0."""
    r = rewards.view(-1, group_size).float()
    valid = ~torch.isnan(r)
    n = valid.sum(1, keepdim=True)
    mean = torch.where(valid, r, 0).sum(1, keepdim=True) / n.clamp(min=1)
    scale = group_size / (group_size - 1)
    return torch.where(valid, scale * (r - mean), torch.zeros_like(r)).view(-1).to(rewards.dtype)


def ema_update_(ema: list[torch.Tensor], params: list[torch.Tensor], decay: float) -> None:
    """In place: ``ema_i <- decay * ema_i + (1 - decay) * params_i`` (float32 accumulation)."""
    with torch.no_grad():
        for e, p in zip(ema, params, strict=True):
            e.mul_(decay).add_(p.detach().to(e.device, torch.float32), alpha=1.0 - decay)


class ParameterEMA:
    """A float32 moving average of a model's trainable parameters, swappable into the model for no-grad forwards."""

    def __init__(self, model: Any, decay: float, device: str = "param"):
        self.model, self.decay, self.device = model, decay, device
        self.names: list[str] = []
        self.values: list[torch.Tensor] = []

    def _params(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    @property
    def initialised(self) -> bool:
        return bool(self.values)

    def init_from_model(self) -> None:
        """``phi <- theta`` (Algorithm 1, line 9)."""
        named = self._params()
        self.names = [n for n, _ in named]
        self.values = [p.detach().to("cpu" if self.device == "cpu" else p.device, torch.float32, copy=True)
                       for _, p in named]

    def update(self) -> None:
        """``phi <- tau phi + (1 - tau) theta`` (line 15); no-op before initialisation."""
        if self.initialised:
            ema_update_(self.values, [p for _, p in self._params()], self.decay)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Within the block the trainable parameters hold the EMA values (in their own dtype); restored on exit."""
        params = [p for _, p in self._params()]
        if len(params) != len(self.values):
            raise PluginConfigError(f"rlp: the model has {len(params)} trainable parameters, the EMA baseline "
                                    f"{len(self.values)} (the set of trainable parameters changed during training).")
        backup = []
        with torch.no_grad():
            for p, e in zip(params, self.values):
                backup.append(p.detach().clone())
                p.copy_(e.to(p.device, p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(params, backup):
                    p.copy_(b)

    def state_dict(self) -> dict:
        return {"names": list(self.names), "values": [v.detach().cpu() for v in self.values]}

    def load_state_dict(self, state: dict) -> None:
        names, values = list(state.get("names", [])), list(state.get("values", []))
        if not values:
            return
        current = [n for n, _ in self._params()]
        if names != current:
            raise PluginConfigError(f"rlp: the checkpoint's EMA baseline holds {len(names)} parameters that do not "
                                    f"match the model's {len(current)} trainable parameters (names differ).")
        self.names = names
        self.values = [v.to("cpu" if self.device == "cpu" else p.device, torch.float32)
                       for v, (_, p) in zip(values, self._params())]


# --------------------------------------------------------------------------------------------- plugin
class RlpPlugin(Plugin):
    """Information-gain reward of a thought on plain text against an EMA no-think baseline (reward, advantage)."""

    name = "rlp"
    image_inputs = IMAGES_POLICY_PROBE
    multi_turn = "the thought is one generated span before a teacher-forced continuation of plain text."
    version = "0.1.0"
    paper = "RLP: Reinforcement as a Pretraining Objective, arXiv:2510.01265"
    summary = "Rewards a thought sampled before the next token of plain text by the log-likelihood it adds over an " \
              "EMA no-think baseline."
    Options = RlpOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="NVlabs/RLP @36b0ac0 publishes only the README and the paper's PDF, no code: the formulas and defaults "
        "follow the paper (Algorithm 1, eq. 3-8, tau = 0.999 in §2.1, recipe in §9-10); thought delimiters, the "
        "document split and multi-token continuations are reconstructed.",
        variants=("advantage", "continuation_tokens"),
    )
    claim_metric = ("information_gain", "information gain (nats)")
    replaces = ("the correctness reward (information gain of the thought on the true continuation)",)
    unsupported_engines = {e: SHARDED.format(engine=n) for e, n in
                           (("fsdp1", "FSDP"), ("fsdp2", "FSDP2"), ("zero3", "ZeRO-3"))}
    reconstructed = (
        "thought delimiters thought_open / thought_close (the paper's Figure 1 shows <think> ... </think>)",
        "documents cut at word boundaries, contexts_per_document rows each",
        "several continuation tokens: their log-likelihoods are summed (the paper scores one token)",
        "both log-likelihoods are taken at the sampling temperature (the policy_logprobs service)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.services: StageServices | None = None
        self.ema: ParameterEMA | None = None
        self._pending_state: dict | None = None

    def required_columns(self) -> list[str]:
        return [self.options.continuation_column]

    @hookimpl
    def trl_plugins_train_dataset(self, dataset, args):
        o = self.options
        columns = getattr(dataset, "column_names", None) or []
        if o.split and o.text_column in columns:
            return split_documents(dataset, o, int(args.seed))
        if "prompt" not in columns:
            raise PluginConfigError(
                f"rlp: the training dataset has neither a 'prompt' column nor the document column "
                f"{o.text_column!r} (columns: {columns}); set text_column to the column holding the documents."
            )
        return None

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self.services = trainer.plugin_services
        model = getattr(trainer, "model", None)  # None: a stub trainer (testing kit) without a policy
        self.ema = None if model is None else ParameterEMA(model, self.options.ema_decay, self.options.ema_device)
        if self.ema is not None and self._pending_state is not None:
            self.ema.load_state_dict(self._pending_state)
            self._pending_state = None
        dataset = getattr(trainer, "train_dataset", None)
        columns = getattr(dataset, "column_names", None)
        if columns is not None:
            if self.options.continuation_column not in columns:
                raise PluginConfigError(
                    f"rlp: the training dataset has no continuation column {self.options.continuation_column!r} "
                    f"(columns: {columns}); give plain-text documents in {self.options.text_column!r} (split=true) "
                    "or name the column holding the true continuations."
                )
            check_column_filled(self.name, dataset, self.options.continuation_column,
                                "the reward is the log-likelihood the thought adds to the true continuation")
            first = dataset[0]["prompt"] if len(dataset) else ""
            if not isinstance(first, str):
                raise PluginConfigError(
                    "rlp: prompts must be plain text (a string context), not conversations: the baseline drops "
                    f"thought_open from the prompt's end and scores the continuation after it (got {type(first)})."
                )

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        plugin = self

        def rlp(prompts, completions, **kwargs):
            return plugin.rewards(prompts, completions, kwargs)

        rlp.reward_weight = self.options.reward_weight
        return [rlp]

    def _encode(self, text: str) -> list[int]:
        return list(self.services.tokenizer(text=text, add_special_tokens=False)["input_ids"])

    def rewards(self, prompts: list, completions: list, columns: dict) -> list[float | None]:
        """The rlp column: information gain of each completion (thought) on its row's true continuation."""
        o = self.options
        if self.services is None or self.ema is None:
            raise PluginConfigError("rlp: the plugin was not configured with a trainer.")
        refs = columns.get(o.continuation_column)
        if refs is None:  # rows without continuations (an eval set of another task): not applicable
            return [None] * len(completions)
        targets = []
        for i, ref in enumerate(refs):
            ids = self._encode("" if ref is None else str(ref))
            ids = ids if o.continuation_tokens is None else ids[: o.continuation_tokens]
            if not ids:
                raise PluginConfigError(f"rlp: row {i} has an empty continuation ({ref!r}); nothing to predict.")
            targets.append(ids)
        prompt_ids = self.services.tokenize_prompts(list(prompts))
        thoughts = [completion_text(c).split(o.thought_close, 1)[0] + o.thought_close for c in completions]
        reasoned = [p + self._encode(t) for p, t in zip(prompt_ids, thoughts, strict=True)]
        contexts = [p[: len(p) - len(o.thought_open)] if o.thought_open and p.endswith(o.thought_open) else p
                    for p in map(str, prompts)]
        baseline = self.services.tokenize_prompts(contexts)
        pred = self.services.policy_logprobs(reasoned, targets)
        if not self.ema.initialised:
            self.ema.init_from_model()
        with self.ema.swapped_in():
            base = self.services.policy_logprobs(baseline, targets)
        gain = information_gain(pred, base)
        log_metric = columns.get("log_metric")
        if callable(log_metric):
            log_metric("plugins/rlp/information_gain", float(gain.mean()))
            log_metric("plugins/rlp/reasoned_logprob", float(torch.stack([p.float().sum() for p in pred]).mean()))
            log_metric("plugins/rlp/baseline_logprob", float(torch.stack([b.float().sum() for b in base]).mean()))
        return gain.tolist()

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        if self.options.advantage != "rlp":
            return
        ctx.advantages = rlp_advantages(ctx.rewards, ctx.num_generations).to(ctx.advantages.device,
                                                                             ctx.advantages.dtype)

    @hookimpl
    def trl_plugins_on_step_end(self, trainer, step):
        if self.ema is not None:
            self.ema.update()

    @hookimpl
    def trl_plugins_state_dict(self):
        return {"ema": self.ema.state_dict() if self.ema is not None else {}}

    @hookimpl
    def trl_plugins_load_state_dict(self, state):
        ema_state = (state or {}).get("ema", {})
        if self.ema is None:
            self._pending_state = ema_state
        else:
            self.ema.load_state_dict(ema_state)
