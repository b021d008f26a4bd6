"""A tiny character-level chat model for the arithmetic task, built and warm-started offline on CPU.

Nothing here downloads anything: the tokenizer is built with the ``tokenizers`` library, the model
is a freshly initialised :class:`transformers.LlamaForCausalLM`, and the warm start is a short
supervised fine-tuning on reference solutions of :mod:`trl_plugins.tasks.arithmetic`. The result
can be saved with ``save_pretrained`` and loaded back **by path** with ``AutoTokenizer`` /
``AutoModelForCausalLM``, which is how the "load by name or path" code is exercised offline.

Chat format (one token per role marker, one token per character)::

    <|system|>{system}<|user|>{question}<|assistant|>{answer}<|end|>

``<|end|>`` is the EOS token; ``<pad>`` pads; any character outside the vocabulary becomes ``<unk>``.

Why the demo's accuracy can rise within a minute of CPU RL: a model this small learns arithmetic
facts one by one, far too slowly for a few dozen GRPO steps to teach it many new ones (with larger
learning rates plain GRPO even erodes them). So the warm start (see :class:`DemoSettings`) also
gives the model a *format habit*: on level-2 problems most of its training targets end with
``"The answer is N."`` instead of ``"Answer: N"``, which the strict verifier rejects. Greedy
decoding then answers level-1 problems in the required format and level-2 problems in prose
(held-out accuracy ~40 %); sampling at temperature 1 still produces the required format 40 % of
the time, so GRPO with the exact verifier quickly moves the model to it on level 2 and held-out
greedy accuracy rises to ~65-85 % (see :class:`DemoSettings` for the measurements).

Typical use::

    model, tokenizer = demo_model(cache_dir="~/.cache/trl_plugins")   # built + warm-started, cached
    accuracy = evaluate_accuracy(model, tokenizer, make_dataset(64, seed=1, split="test"))
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import string
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from trl_plugins.tasks.arithmetic import Problem, in_split, make_problem, verify

__all__ = [
    "CHAT_TEMPLATE",
    "DemoSettings",
    "EOS_TOKEN",
    "INFORMAL_ENDINGS",
    "PAD_TOKEN",
    "ROLE_TOKENS",
    "UNK_TOKEN",
    "build_and_save",
    "build_tiny_model",
    "build_tokenizer",
    "demo_model",
    "evaluate_accuracy",
    "generate_completions",
    "save_atomically",
    "sft_loss",
    "warm_start",
]

PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
EOS_TOKEN = "<|end|>"
ROLE_TOKENS: dict[str, str] = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|system|>{{ message['content'] }}"
    "{%- elif message['role'] == 'user' -%}<|user|>{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}<|assistant|>{{ message['content'] }}<|end|>"
    "{%- else -%}{{ raise_exception('unsupported role ' + message['role'] + '; allowed: system, user, assistant') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
"""Jinja chat template: role marker tokens, no separators; ``<|end|>`` closes assistant turns."""

_CHARACTERS: list[str] = sorted(set(string.printable) - set("\t\r\x0b\x0c"))  # printable ASCII + space + \n


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer with a chat template (vocabulary: specials + printable ASCII).

    Special tokens: ``<pad>`` (id 0, pad), ``<unk>`` (id 1), ``<|end|>`` (id 2, EOS), and the role
    markers ``<|system|>``, ``<|user|>``, ``<|assistant|>``. Padding is on the left (for batched
    generation). Decoding concatenates characters, so ``decode(encode(s)) == s`` for ASCII text.
    """
    from tokenizers import Tokenizer, decoders, models

    specials = [PAD_TOKEN, UNK_TOKEN, EOS_TOKEN, *ROLE_TOKENS.values()]
    vocab = {tok: i for i, tok in enumerate([*specials, *_CHARACTERS])}
    # A BPE model with no merges is a character-level model with an unknown token.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        eos_token=EOS_TOKEN,
        extra_special_tokens=list(ROLE_TOKENS.values()),
        padding_side="left",
        model_max_length=512,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
) -> LlamaForCausalLM:
    """A freshly initialised tiny Llama whose special-token ids match ``tokenizer``.

    ``intermediate_size`` defaults to ``4 * hidden_size``. Embeddings are tied. The generation config
    stops at ``tokenizer.eos_token_id`` and pads with ``tokenizer.pad_token_id``.
    """
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        do_sample=False,
        max_new_tokens=64,
    )
    return model


def build_and_save(path: str | Path, seed: int = 0, **model_kwargs: Any) -> Path:
    """Build the tokenizer and an untrained tiny model, save both under ``path``; return ``path``.

    ``AutoTokenizer.from_pretrained(path)`` and ``AutoModelForCausalLM.from_pretrained(path)`` load
    them back. ``model_kwargs`` go to :func:`build_tiny_model`.
    """
    path = Path(path)
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed, **model_kwargs)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------------- supervised warm start


def _prompt_ids(tokenizer: PreTrainedTokenizerFast, question: str) -> list[int]:
    out = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(out["input_ids"])


def _sft_batch(
    tokenizer: PreTrainedTokenizerFast, problems: Sequence[Problem], targets: Sequence[str] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask, labels)``, each ``(B, T)``; labels are -100 off the answer.

    ``targets`` are the assistant texts (default: the reference solutions).
    """
    seqs, labs = [], []
    targets = [p.solution for p in problems] if targets is None else targets
    for p, target in zip(problems, targets, strict=True):
        prompt = _prompt_ids(tokenizer, p.question)
        completion = tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(prompt + completion)
        labs.append([-100] * len(prompt) + completion)
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, lab) in enumerate(zip(seqs, labs)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        labels[i, : len(s)] = torch.tensor(lab)
    return ids, mask, labels


INFORMAL_ENDINGS: tuple[str, ...] = ("The answer is {}.", "The result is {}.")
"""Last lines of the informal targets of :func:`warm_start` (rejected by the strict verifier)."""


def _informal(problem: Problem, rng: random.Random) -> str:
    ending = rng.choice(INFORMAL_ENDINGS).format(problem.answer)
    return "\n".join([*problem.step_lines, ending])


def _draw_problems(rng: random.Random, levels: Sequence[int], n: int, split: str | None = "train") -> list[Problem]:
    out: list[Problem] = []
    while len(out) < n:
        p = make_problem(rng, rng.choice(list(levels)))
        if in_split(p, split):
            out.append(p)
    return out


@torch.no_grad()
def sft_loss(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, problems: Sequence[Problem]
) -> float:
    """Mean cross-entropy (nats per token) of the reference solutions given the questions."""
    was_training = model.training
    model.eval()
    ids, mask, labels = _sft_batch(tokenizer, problems)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
    model.train(was_training)
    return loss


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    levels: Iterable[int] = (1, 2),
    steps: int = 300,
    seed: int = 0,
    lr: float = 3e-3,
    batch_size: int = 32,
    warmup_steps: int = 20,
    informal_fraction: float | Mapping[int, float] = 0.0,
    log_every: int = 0,
    progress: bool = False,
) -> PreTrainedModel:
    """Supervised fine-tuning on freshly drawn reference solutions (train split), in place.

    AdamW, linear warm-up over ``warmup_steps`` then cosine decay to 10 % of ``lr``; the loss covers
    only the assistant tokens (solution and ``<|end|>``). Deterministic given ``seed``. Returns
    ``model`` (in eval mode). ``log_every > 0`` prints the loss every that many steps; ``progress`` shows a
    progress bar (steps, loss, time left) on stderr.

    ``informal_fraction`` of the targets (a number, or a number per level) end with an informal
    last line, ``"The answer is N."`` or ``"The result is N."`` (correct ``N``), instead of
    ``"Answer: N"``, as in pre-training data that ignores the required format. The strict verifier
    rejects those, so where the fraction is above one half greedy decoding drifts into prose and
    scores 0 although the steps may be right. Whether the format is followed is decided at one
    token (the start of the last line), so RL with an outcome reward corrects it within a few dozen
    steps and the correction transfers to held-out prompts: this is what makes the demo's accuracy
    rise fast. The arithmetic itself improves far more slowly under RL.
    """
    levels = tuple(levels)
    if isinstance(informal_fraction, Mapping):
        fractions = dict(informal_fraction)
    else:
        fractions = dict.fromkeys(levels, informal_fraction)
    for level in levels:
        if not 0.0 <= fractions.get(level, 0.0) <= 1.0:
            raise ValueError(f"informal_fraction must be in [0, 1], got {fractions[level]!r} for level {level}")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < warmup_steps:
            return lr * (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, steps - warmup_steps)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc="warm-starting builtin:tiny", unit="step", dynamic_ncols=True)
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        problems = _draw_problems(rng, levels, batch_size)
        targets = [_informal(p, rng) if rng.random() < fractions.get(p.level, 0.0) else p.solution for p in problems]
        ids, mask, labels = _sft_batch(tokenizer, problems, targets)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"warm_start step {step:4d} loss {loss.item():.4f}", flush=True)
        if bar is not None:
            bar.update(1)
            if step % 10 == 0 or step == steps - 1:
                bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    if bar is not None:
        bar.close()
    model.eval()
    return model


# ------------------------------------------------------------------------------------------------ evaluation


def _question_of(row: dict[str, Any]) -> str:
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return prompt
    return next(m["content"] for m in reversed(prompt) if m["role"] == "user")


@torch.no_grad()
def generate_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    questions: Sequence[str],
    max_new_tokens: int = 64,
    batch_size: int = 64,
    temperature: float = 0.0,
    num_samples: int = 1,
    seed: int = 0,
) -> list[str]:
    """Completions (decoded, special tokens skipped) for each question, ``num_samples`` per question.

    ``temperature == 0`` is greedy decoding (``num_samples`` must then be 1); otherwise plain
    sampling at ``temperature`` (no top-k / top-p), seeded with ``seed``. The result is flat and
    grouped by question: ``len(questions) * num_samples`` strings.
    """
    greedy = temperature <= 0.0
    if greedy and num_samples != 1:
        raise ValueError(f"greedy decoding gives one completion per question, got num_samples={num_samples}")
    was_training = model.training
    model.eval()
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    sampling: dict[str, Any] = (
        {"do_sample": False} if greedy else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    )
    texts: list[str] = []
    for start in range(0, len(questions), batch_size):
        conversations = [[{"role": "user", "content": q}] for q in questions[start : start + batch_size]]
        enc = tokenizer.apply_chat_template(
            conversations,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            padding=True,
            return_tensors="pt",
        )
        out = model.generate(
            input_ids=enc["input_ids"].to(device),
            attention_mask=enc["attention_mask"].to(device),
            max_new_tokens=max_new_tokens,
            num_return_sequences=num_samples,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **sampling,
        )
        texts.extend(tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True))
    model.train(was_training)
    return texts


def evaluate_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    dataset: Any,
    max_new_tokens: int | None = None,
    batch_size: int = 64,
    temperature: float = 0.0,
    num_samples: int = 1,
    seed: int = 0,
) -> float:
    """Fraction of correct completions (by :func:`~trl_plugins.tasks.arithmetic.verify`) on ``dataset``.

    ``temperature == 0`` is greedy decoding (``num_samples`` is then 1); otherwise ``num_samples``
    completions per prompt are sampled at ``temperature`` (seeded with ``seed``) and the fraction
    over all of them is returned. ``dataset`` rows need ``prompt`` (conversational or a string
    question) and ``answer``. ``max_new_tokens`` defaults to the longest reference solution + 8.
    """
    rows = list(dataset)
    if not rows:
        raise ValueError("dataset is empty")
    if max_new_tokens is None:
        max_new_tokens = (max(len(r["solution"]) for r in rows) if "solution" in rows[0] else 88) + 8
    num_samples = 1 if temperature <= 0.0 else num_samples
    texts = generate_completions(
        model, tokenizer, [_question_of(r) for r in rows], max_new_tokens, batch_size, temperature, num_samples, seed
    )
    correct = sum(verify(text, rows[i // num_samples]["answer"]) for i, text in enumerate(texts))
    return correct / len(texts)


# ---------------------------------------------------------------------------------------------- demo settings


@dataclass(frozen=True)
class DemoSettings:
    """Tuned defaults of the offline demo: tiny model, warm start, and the GRPO run on top of it.

    Tuned with ``scripts/check_task_learnability.py`` (plain ``trl.GRPOTrainer``, ``accuracy_reward``,
    ``beta=0``, 1 torch thread). Measured on 128 held-out level-1/2 problems, greedy decoding:

    ==========  ==================  ===================  ========================
    seed        after warm start    after 60 GRPO steps  sampled (T=1) before/after
    ==========  ==================  ===================  ========================
    0           44.5 %              86.7 %               43 % / 60 %
    1           37.5 %              67.2 %               36 % / 47 %
    ==========  ==================  ===================  ========================

    CPU time on one core: warm start ~75-150 s, GRPO ~35 s (wall time on a busy machine is larger).

    Why these values:

    * ``warm_start_steps=900``: with 600 steps the model solves too few problems when sampling
      (~15 %) and plain GRPO, dominated by negative samples, erodes its arithmetic; at 900 steps
      sampling solves ~40 % and GRPO improves it cleanly.
    * ``warm_start_informal_fraction``: the format habit that GRPO fixes fast (see the module
      docstring); level 2 above one half so greedy decoding starts in prose there.
    * ``grpo_learning_rate=5e-5`` with 64 completions (8 prompts x 8) per step: 1e-4 and above
      (or 16-32 completions per step) make the run noisy enough to erode the arithmetic; 2e-3
      destroys the model within a few steps (Adam moves every weight by ~lr per step).
    """

    seed: int = 0
    levels: tuple[int, ...] = (1, 2)
    # model
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    # warm start (supervised, reference solutions)
    warm_start_steps: int = 900
    warm_start_lr: float = 3e-3
    warm_start_batch_size: int = 32
    warm_start_informal_fraction: dict[int, float] = dataclasses.field(default_factory=lambda: {1: 0.1, 2: 0.6})
    # GRPO on top of it
    grpo_steps: int = 60
    grpo_learning_rate: float = 5e-5
    num_generations: int = 8
    per_device_train_batch_size: int = 64
    max_completion_length: int = 40
    temperature: float = 1.0
    train_size: int = 1024
    eval_size: int = 128
    # runtime: one intra-op thread is as fast as two for tensors this small, and avoids OpenMP
    # spin-waiting collapse when the other core is busy (e.g. the generation loop of another process)
    torch_threads: int = 1

    def grpo_config_fields(self, output_dir: str, seed: int) -> dict:
        """GRPOConfig fields of the GRPO run on the warm-started model (CPU, no checkpoints, no reporting)."""
        from trl_plugins.runtime.config import checkpointing_off

        return dict(
            output_dir=output_dir,
            max_steps=self.grpo_steps,
            learning_rate=self.grpo_learning_rate,
            num_generations=self.num_generations,
            per_device_train_batch_size=self.per_device_train_batch_size,
            max_completion_length=self.max_completion_length,
            temperature=self.temperature,
            beta=0.0,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            bf16=False,
            **checkpointing_off(),
            seed=seed,
            lr_scheduler_type="constant",
        )

    def cache_key(self) -> str:
        """A short hash of the fields that determine the warm-started model."""
        fields = {
            k: getattr(self, k)
            for k in (
                "seed", "levels", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                "warm_start_steps", "warm_start_lr", "warm_start_batch_size", "warm_start_informal_fraction",
            )
        }
        blob = json.dumps({"v": _CACHE_VERSION, **fields}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


_CACHE_VERSION = 1  # bump when the tokenizer, model or warm start changes meaning


def demo_model(
    cache_dir: str | Path | None = None, settings: DemoSettings | None = None, verbose: bool = False,
    progress: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The warm-started tiny model and its tokenizer, cached on disk under ``cache_dir``.

    The cache entry is ``cache_dir/tiny-<settings.cache_key()>`` (written atomically, under a file lock so that
    processes started together warm it up once); a later call with the same settings loads it by path instead of
    training. ``builtin:tiny`` (the demo, ``trl-plugins train``, ``compare``, the trainer) uses the per-user cache
    folder (:func:`trl_plugins.runtime.models.cache_root`), so it is warm-started once per machine. ``cache_dir=None``
    disables caching. ``progress`` announces a first-use warm-up and shows a progress bar on stderr; ``verbose``
    prints the loss every 50 steps instead.
    """
    settings = settings or DemoSettings()
    target = Path(cache_dir).expanduser() / f"tiny-{settings.cache_key()}" if cache_dir is not None else None
    if target is not None and not (target / "config.json").exists():
        from trl_plugins.runtime.locks import exclusive_file_lock

        with exclusive_file_lock(target.parent / f".{target.name}.lock"):
            return _build_or_load(target, settings, verbose, progress)
    return _build_or_load(target, settings, verbose, progress)


#: Folder of the warm-started weights shipped in the package, one ``tiny-<DemoSettings.cache_key()>.safetensors`` per
#: shipped setting: the default ``DemoSettings()`` (``builtin:tiny``, the demo) and the benchmarks' pinned settings
#: (``scripts/bench_common.py``), plus ``tiny-tools-<key>.safetensors`` for the benchmarks' tool-use warm start
#: (:func:`trl_plugins.tasks.tiny_tools.tool_demo_model`): byte-identical on every machine, where a warm start on the
#: machine itself would round differently. ``python -m trl_plugins.tasks.tiny --write-shipped`` remakes the demo's
#: file with the recipe, ``python scripts/write_shipped_weights.py`` the benchmarks' two.
SHIPPED_WEIGHTS = Path(__file__).resolve().parent / "weights"


def shipped_weights(settings: DemoSettings) -> Path | None:
    """The shipped weights file of ``settings``, or None when these settings are not shipped (they are warm-started)."""
    path = SHIPPED_WEIGHTS / f"tiny-{settings.cache_key()}.safetensors"
    return path if path.is_file() else None


def _tiny_skeleton(settings: DemoSettings) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    tokenizer = build_tokenizer()
    model = build_tiny_model(
        tokenizer,
        seed=settings.seed,
        hidden_size=settings.hidden_size,
        num_layers=settings.num_layers,
        num_heads=settings.num_heads,
        intermediate_size=settings.intermediate_size,
    )
    return model, tokenizer


def load_shipped(path: Path, settings: DemoSettings) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The tiny model of ``settings``'s shape with the weights of the shipped file ``path`` (strict: every tensor)."""
    from safetensors.torch import load_file

    model, tokenizer = _tiny_skeleton(settings)
    model.load_state_dict(load_file(str(path)), strict=True)
    model.eval()
    return model, tokenizer


def _build_or_load(
    target: Path | None, settings: DemoSettings, verbose: bool, progress: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    if target is not None and (target / "config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(target)
        model = AutoModelForCausalLM.from_pretrained(target)
        model.eval()
        return model, tokenizer
    shipped = shipped_weights(settings)
    if shipped is not None:  # no warm start: the same weights on every machine
        model, tokenizer = load_shipped(shipped, settings)
        if target is not None:
            save_atomically(model, tokenizer, target)
        return model, tokenizer
    return warm_started_model(target, settings, verbose, progress)


def warm_started_model(
    target: Path | None, settings: DemoSettings, verbose: bool = False, progress: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The recipe: a fresh tiny model warm-started with ``settings`` on this machine (saved under ``target`` when
    given). It made the shipped weights; elsewhere its rounding, and so its weights, differ from machine to machine."""
    if progress:
        where = f"into {target} (once per machine; later runs load it)" if target is not None else "(not cached)"
        print(f"[builtin:tiny] first use: warm-starting the tiny model {where}; a few minutes on a CPU.",
              file=sys.stderr, flush=True)

    model, tokenizer = _tiny_skeleton(settings)
    start = time.perf_counter()
    warm_start(
        model,
        tokenizer,
        levels=settings.levels,
        steps=settings.warm_start_steps,
        seed=settings.seed,
        lr=settings.warm_start_lr,
        batch_size=settings.warm_start_batch_size,
        informal_fraction=settings.warm_start_informal_fraction,
        log_every=50 if verbose else 0,
        progress=progress and not verbose,
    )
    if verbose:
        print(f"warm start took {time.perf_counter() - start:.1f}s", flush=True)
    if target is not None:
        save_atomically(model, tokenizer, target)
    return model, tokenizer


def save_atomically(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, target: Path) -> None:
    """Save ``model`` and ``tokenizer`` into a temporary sibling folder, then rename it to ``target``; a concurrent
    writer that got there first wins (its folder is kept)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-tiny-", dir=target.parent))
    try:
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").exists():
            raise


def write_shipped_weights(settings: DemoSettings | None = None) -> Path:
    """Warm-start the tiny model with ``settings`` (default: the demo's) on this machine and write its weights as the
    shipped file (:data:`SHIPPED_WEIGHTS`); returns the path. Run by maintainers when the recipe changes."""
    from safetensors.torch import save_file

    settings = settings or DemoSettings()
    model, _ = warm_started_model(None, settings, progress=True)
    SHIPPED_WEIGHTS.mkdir(parents=True, exist_ok=True)
    path = SHIPPED_WEIGHTS / f"tiny-{settings.cache_key()}.safetensors"
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(path),
              metadata={"settings": json.dumps(dataclasses.asdict(settings), default=str)})
    return path


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-shipped"]:
        raise SystemExit("usage: python -m trl_plugins.tasks.tiny --write-shipped")
    print(write_shipped_weights())
