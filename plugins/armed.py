"""ARMed — Adaptive Reinforcement for Medical Reasoning (arXiv:2508.12957): a semantic reward rescaled against collapse.

Open-ended answers cannot be checked by exact match, so ARMed adds a **semantic reward**: how close the response's
answer is in meaning to the reference answer, from an embedding model. The paper observes **reward collapse** with
model-based semantic rewards: responses with very different meanings get near-identical scores (embedding cosine
similarities crowd into a narrow band), so the group-relative advantage cannot tell them apart. ARMed rescales the
semantic reward adaptively so that the group's differences are spread out again.

Here, per rollout: the answer text (the first group of ``answer_pattern`` in the completion, the whole completion
when it does not match) and the reference (dataset column ``reference_column``) are embedded, ``s = cos(e_answer,
e_reference)``, and

* ``rescale="group_minmax"``: ``s' = (s - min_g s) / (max_g s - min_g s)`` over the rollouts of the group, so the
  closest answer scores 1 and the farthest 0 however narrow the band is; a group whose spread is below
  ``min_spread`` (every answer means the same) keeps ``clamp(s, 0, 1)``;
* ``rescale="none"``: ``s' = clamp(s, 0, 1)`` (the collapsing baseline).

The plugin's own reward column ``armed`` holds ``alpha * s'`` beside the textual-correctness reward (TRL's reward
functions; weights apply). ``alpha = 0`` is the neutral setting (an all-zero column, no embedding call).

The embedding model is a local Hugging Face encoder (``embedder="hf"``: mean of the last hidden state over the
tokens, L2-normalised; loaded whole on every process, no collective) or an OpenAI-compatible ``/v1/embeddings``
server (``embedder="endpoint"``, e.g. ``vllm serve --task embed``): batched, retried with backoff, a dead server is
an error naming its URL. Each process embeds its own rows; the similarities are gathered.

No official code was found and the paper's rescaling formula was not available to us (abstract and summaries only):
the group min-max rescaling, the answer extraction, mean pooling and alpha = 1 are reconstructed
(``trl-plugins show armed``, docs/faithfulness.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import (
    OfficialSource,
    Plugin,
    PluginConfigError,
    RewardContext,
    hookimpl,
    option,
)
from trl_plugins.api.engines import whole_model_loading
from trl_plugins.api.success import placeholder_column
from trl_plugins.api.text import completion_text
from trl_plugins.components.client import EndpointError, OpenAICompatibleClient, endpoint_options, local_model_loading
from ._regex import compile_option

COLUMN = "armed"
EmbedderEndpointOptions = endpoint_options("embedder", "embedding model", model="default")


@dataclass
class ArmedOptions(EmbedderEndpointOptions):
    embedder: Literal["endpoint", "hf"] = option(
        "endpoint", help="'hf': a local Hugging Face encoder (embedder_model: name or path); 'endpoint': an "
        "OpenAI-compatible /v1/embeddings server (embedder_base_url)."
    )
    reference_column: str = option("answer", help="Dataset column holding the reference answer text.")
    answer_pattern: str | None = option(
        r"<answer>(.*?)</answer>", help="Regular expression whose first group is the answer in a completion (the whole "
        "completion when it does not match; None: always the whole completion).", reconstructed=True,
    )
    alpha: float = option(1.0, min=0.0, help="Weight of the semantic reward (0: off).", reconstructed=True)
    rescale: Literal["group_minmax", "none"] = option(
        "group_minmax", help="'group_minmax': spread each group's similarities over [0, 1] (against reward collapse); "
        "'none': the raw similarity clamped to [0, 1].", reconstructed=True,
    )
    min_spread: float = option(
        1e-6, min=0.0, help="A group whose similarities span less than this keeps the raw (clamped) similarities.",
        reconstructed=True,
    )
    batch_size: int = option(32, min=1, help="Texts per forward of the local encoder.")

    def validate(self) -> None:
        if self.answer_pattern is not None:
            compile_option("armed", "answer_pattern", self.answer_pattern)
        if self.embedder == "hf" and self.embedder_model == "default":
            raise PluginConfigError(
                "Plugin 'armed' with embedder='hf' needs embedder_model (a Hugging Face encoder name or local path)."
            )
        self.require_base_url("embedder", "armed", otherwise="embedder='hf' with embedder_model")


class EndpointEmbedder:
    """Embeddings from an OpenAI-compatible ``/v1/embeddings`` server (one request per batch of texts)."""

    def __init__(self, client: OpenAICompatibleClient, batch_size: int = 32):
        self.client, self.batch_size = client, batch_size

    def embed(self, texts: list[str]) -> torch.Tensor:
        """(len(texts), d) float embeddings, in order."""
        batches = [texts[i:i + self.batch_size] for i in range(0, len(texts), self.batch_size)]

        def make(batch):
            async def call(http):
                body = await self.client.post_json(http, "embeddings", {"model": self.client.config.model,
                                                                        "input": batch})
                try:
                    rows = sorted(body["data"], key=lambda d: d["index"])
                    vectors = [row["embedding"] for row in rows]
                except (KeyError, TypeError) as exc:
                    raise EndpointError(f"{self.client.base_url}/embeddings answered without data[i].embedding: "
                                        f"{str(body)[:200]}") from exc
                if len(vectors) != len(batch):
                    raise EndpointError(f"{self.client.base_url}/embeddings answered {len(vectors)} embeddings for "
                                        f"{len(batch)} inputs.")
                return vectors

            return call

        out = [v for vectors in self.client.run([make(b) for b in batches]) for v in vectors]
        return torch.tensor(out, dtype=torch.float32) if out else torch.zeros(0, 1)

    def close(self) -> None:
        self.client.close()


class HFEmbedder:
    """A local Hugging Face encoder: the mean of the last hidden state over the tokens (no grad), loaded whole."""

    def __init__(self, model_name_or_path: str, batch_size: int = 32, model=None, tokenizer=None):
        if model is None or tokenizer is None:
            from transformers import AutoModel, AutoTokenizer

            with local_model_loading(f"embedding model {model_name_or_path!r}"):
                tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_name_or_path)
                if model is None:
                    with whole_model_loading():
                        model = AutoModel.from_pretrained(model_name_or_path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.model, self.tokenizer, self.batch_size = model.eval(), tokenizer, batch_size

    @torch.no_grad()
    def embed(self, texts: list[str]) -> torch.Tensor:
        out = []
        device = next(self.model.parameters()).device
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[i:i + self.batch_size], return_tensors="pt", padding=True, truncation=True)
            enc = {k: v.to(device) for k, v in enc.items()}
            hidden = self.model(**enc).last_hidden_state.float()  # (b, T, d)
            mask = enc["attention_mask"].unsqueeze(-1).float()
            out.append((hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0))
        return torch.cat(out).cpu() if out else torch.zeros(0, 1)

    def close(self) -> None:
        pass


def answer_text(completion: str, pattern: re.Pattern | None) -> str:
    """The answer in ``completion``: the first group of ``pattern``, else the whole text (stripped)."""
    match = pattern.search(completion) if pattern is not None else None
    return (match.group(1) if match and match.groups() else completion).strip()


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(N,) cosine similarity of the rows of (N, d) ``a`` and ``b``."""
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def rescale_similarities(s: torch.Tensor, group_size: int, mode: str, min_spread: float) -> torch.Tensor:
    """(N,) rewards in [0, 1] from (N,) similarities: per-group min-max (``group_minmax``) or clamped (``none``)."""
    clamped = s.clamp(0.0, 1.0)
    if mode == "none":
        return clamped
    g = s.view(-1, group_size)
    lo, hi = g.min(dim=1, keepdim=True).values, g.max(dim=1, keepdim=True).values
    spread = hi - lo
    stretched = (g - lo) / spread.clamp(min=1e-12)
    return torch.where(spread >= max(min_spread, 1e-12), stretched, clamped.view(-1, group_size)).view(-1)


class ArmedPlugin(Plugin):
    """ARMed's semantic reward from an embedding model, rescaled per group against reward collapse (reward)."""

    name = "armed"
    multi_turn = True
    image_inputs = True
    version = "0.1.0"
    paper = ("Breaking Reward Collapse: Adaptive Reinforcement for Open-ended Medical Reasoning with Enhanced Semantic "
             "Discrimination (ARMed), arXiv:2508.12957")
    summary = "Embedding similarity to the reference answer, stretched over each group so distinct answers score apart."
    Options = ArmedOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found and the rescaling formula was not available (abstract and summaries only): "
        "the group min-max rescaling, answer extraction, mean pooling and alpha are reconstructed.",
    )
    claim_metric = ("similarity_spread", "mean within-group spread of the raw similarities")
    reconstructed = (
        "rescaling: per-group min-max of the cosine similarities",
        "the answer: the first group of <answer>...</answer>, else the whole completion",
        "local encoder: mean-pooled last hidden state; alpha = 1",
    )

    def __init__(self, options=None):
        super().__init__(options)
        o = self.options
        self._pattern = re.compile(o.answer_pattern) if o.answer_pattern is not None else None
        self._embedder = None

    def required_columns(self) -> list[str]:
        return [self.options.reference_column]

    def embedder(self):
        """The embedding backend, built on first use."""
        if self._embedder is None:
            o = self.options
            if o.embedder == "endpoint":
                self._embedder = EndpointEmbedder(OpenAICompatibleClient(o.endpoint_config("embedder")), o.batch_size)
            else:
                self._embedder = HFEmbedder(o.embedder_model, o.batch_size)
        return self._embedder

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        return [placeholder_column(COLUMN)]  # the rescaling needs whole groups: the reward transform fills it in

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        o = self.options
        if o.alpha == 0:  # neutral: an all-zero column, no embedding call
            return
        answers = [answer_text(completion_text(c), self._pattern) for c in ctx.local_completions]
        references = [str(row[o.reference_column]) for row in ctx.local_rows]
        vectors = self.embedder().embed(answers + references)
        local = cosine(vectors[:len(answers)], vectors[len(answers):]).tolist() if answers else []
        s = torch.tensor(ctx.gather_object(local), dtype=torch.float64)  # collective: (N,)
        values = o.alpha * rescale_similarities(s, ctx.num_generations, o.rescale, o.min_spread)
        rewards = ctx.rewards_per_func.clone()
        rewards[:, ctx.reward_func_names.index(COLUMN)] = values.to(rewards)
        ctx.rewards_per_func = rewards
        spread = s.view(-1, ctx.num_generations)
        ctx.log_metric("similarity_mean", float(s.mean()))
        ctx.log_metric("similarity_spread", float((spread.max(1).values - spread.min(1).values).mean()))
        ctx.log_metric("semantic_reward", float(values.mean()))
