"""The tiny character-level model as a tool agent on the bundled offline tool environment (CPU, offline).

The demo model (:func:`trl_plugins.tasks.tiny.demo_model`) only ever saw arithmetic, so it never writes a tool call.
:func:`tool_demo_model` gives it a second, supervised warm start on tool-use traces rendered with the tiny tool chat
template (:func:`trl_plugins.tasks.tools.enable_tool_calling`), token for token what TRL's tool loop builds during
GRPO (the assistant turn, ``<|end|>``, the tool result as a ``<tool_response>`` user turn, the next assistant turn):

* gold traces: ``<tool_call>{"name": "search", ...}</tool_call>``, the real tool result, (for ``scaled`` questions)
  ``<tool_call>{"name": "calculator", ...}</tool_call>``, its result, then ``Answer: N``;
* shortcut traces (a fraction per question kind, :attr:`ToolWarmStartSettings.shortcut_fraction`): ``Answer: N``
  at once, without tools, with a wrong number -- a model that answers "from memory". The verifier rejects them;
* optional variation among the gold traces, so that correct episodes differ in tool use (off by default): a fraction
  repeats the first search once before going on (:attr:`ToolWarmStartSettings.redundant_search_fraction`: a correct
  answer with one call more than needed), and a fraction writes a short sentence from :data:`PREAMBLES` before the
  first call (:attr:`ToolWarmStartSettings.preamble_fraction`: a correct answer whose first call starts later).
  A trace takes at most one of the two. These are the behaviours tool-efficiency and tool-timing methods act on
  (``otc_po``: calls per correct answer; ``aspo``: the position of the first call); the variation is drawn from a
  random stream of its own, so the batches and shortcut draws are those of the same settings without it.

As with the arithmetic demo's format habit, whether the model calls a tool is decided at the first token of its
answer, so GRPO with the exact verifier can move it to the tools within a few dozen steps; where the shortcut
fraction is above one half (``scaled`` questions by default) greedy decoding starts with the shortcut.

Held-out split: the questions about a (place, fact) pair are either all train or all test
(:func:`tool_question_split`), so test answers never appear in training and must be read from the search results.
Only the ``lookup`` and ``scaled`` kinds are used: a ``combined`` (three-call) episode is longer than the tiny model's
512 positions. Prompts have no system message (it would cost 57 positions and the tiny model ignores it).

:func:`run_tool_episodes` plays episodes greedily (or sampled) with the tools of
:class:`~trl_plugins.tasks.tools.ToolEnvironment`, parsing each turn with TRL's ``parse_response``;
:func:`evaluate_tool_accuracy` scores them with :func:`~trl_plugins.tasks.tools.tool_answer_reward`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trl_plugins.tasks.tool_corpus import FACTS, PLACES
from trl_plugins.tasks.tools import ToolEnvironment, enable_tool_calling, make_tool_dataset, tool_answer_reward

__all__ = [
    "PREAMBLES",
    "TOOL_TASK_KINDS",
    "ToolWarmStartSettings",
    "evaluate_tool_accuracy",
    "make_tool_split",
    "run_tool_episodes",
    "tool_demo_model",
    "tool_question_split",
    "trace_messages",
    "warm_start_tools",
]

TOOL_TASK_KINDS: tuple[str, ...] = ("lookup", "scaled")
#: Sentences a gold trace may write before its first tool call (:attr:`ToolWarmStartSettings.preamble_fraction`).
PREAMBLES: tuple[str, ...] = ("Search first.", "Let me search.", "I will look it up.")
_PLACE_INDEX = {p.name: i for i, p in enumerate(PLACES)}
_FACT_ORDER = sorted(FACTS, key=lambda f: -len(FACTS[f]))  # "elevation in metres" before shorter labels


def _fact_of(question: str) -> str:
    return next(f for f in _FACT_ORDER if f" {FACTS[f]} of " in question)


def tool_question_split(row: dict[str, Any]) -> str:
    """``"test"`` for one (place, fact) pair in four (by corpus index), else ``"train"``."""
    question = row["prompt"][-1]["content"]
    place = _PLACE_INDEX[row["entities"][0]]
    fact = sorted(FACTS).index(_fact_of(question))
    return "test" if (place * len(FACTS) + fact) % 4 == 0 else "train"


def make_tool_split(n: int, split: str, seed: int = 0, kinds: Sequence[str] = TOOL_TASK_KINDS) -> Any:
    """``n`` questions of ``split`` ("train" or "test"), no system message; columns of
    :func:`~trl_plugins.tasks.tools.make_tool_dataset`. Deterministic given the arguments."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    pool = make_tool_dataset(8 * n + 64, kinds=kinds, seed=seed, system_prompt=False)
    keep = [i for i, row in enumerate(pool) if tool_question_split(row) == split][:n]
    if len(keep) < n:  # pragma: no cover - the pool is 8x larger than needed
        raise ValueError(f"could not draw {n} {split} questions")
    return pool.select(keep)


def trace_messages(row: dict[str, Any], shortcut: bool, rng: random.Random, redundant_search: bool = False,
                   preamble: str = "") -> list[dict]:
    """The assistant and tool messages of one training trace for ``row``: its gold trace, executed with the real
    tools, ending in ``Answer: N``; or (``shortcut``) one ``Answer: M`` with a wrong ``M`` of the same length.

    Gold traces only: ``redundant_search`` repeats the first call (the search) once, same query and same result,
    before the rest of the trace (one call more than needed, still correct); ``preamble`` is written as the text of
    the first assistant turn, before its tool call."""
    answer = int(row["answer"])
    if shortcut:
        digits = len(str(answer))
        wrong = answer
        while wrong == answer:
            wrong = rng.randint(10 ** (digits - 1), 10**digits - 1)
        return [{"role": "assistant", "content": f"Answer: {wrong}"}]
    env = ToolEnvironment()
    env.reset(**row)
    messages: list[dict] = []
    calls = json.loads(row["gold_calls"])
    if redundant_search:
        calls = [calls[0], *calls]
    for i, call in enumerate(calls):
        result = getattr(env, call["name"])(**call["arguments"])
        messages.append({"role": "assistant", "content": preamble if i == 0 else "",
                         "tool_calls": [{"type": "function", "function": call}]})
        messages.append({"role": "tool", "name": call["name"], "content": result})
    messages.append({"role": "assistant", "content": f"Answer: {answer}"})
    return messages


def _assistant_labels(ids: list[int], assistant_id: int, end_id: int) -> list[int]:
    """Labels of one rendered conversation: the tokens of each assistant turn (after ``<|assistant|>``, up to and
    including ``<|end|>``) keep their id, every other token is -100."""
    labels, inside = [], False
    for tok in ids:
        labels.append(tok if inside else -100)
        if inside and tok == end_id:
            inside = False
        elif tok == assistant_id:
            inside = True
    return labels


def _sft_batch(tokenizer: Any, conversations: Sequence[list[dict]]) -> tuple[torch.Tensor, ...]:
    """Right-padded ``(input_ids, attention_mask, labels)``, each ``(B, T)``; labels -100 off the assistant turns."""
    assistant_id = tokenizer.convert_tokens_to_ids("<|assistant|>")
    rows = [list(tokenizer.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"]) for c in conversations]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
        labels[i, : len(row)] = torch.tensor(_assistant_labels(row, assistant_id, tokenizer.eos_token_id))
    return ids, mask, labels


@dataclass(frozen=True)
class ToolWarmStartSettings:
    """The supervised tool-use warm start of :func:`tool_demo_model` (on top of the arithmetic demo model)."""

    seed: int = 0
    steps: int = 500
    lr: float = 3e-3
    batch_size: int = 16
    warmup_steps: int = 20
    train_size: int = 512
    #: per question kind, the fraction of traces that answer at once without tools (wrong); see the module docstring
    shortcut_fraction: dict[str, float] = dataclasses.field(default_factory=lambda: {"lookup": 0.3, "scaled": 0.7})
    #: per question kind, the fraction of gold traces that repeat their first search once before going on (correct
    #: answers with a needless extra call); none by default. A ``scaled`` trace with an extra search is longer than the
    #: benchmark's 360-token completion budget, so the benchmark sets it for ``lookup`` only
    redundant_search_fraction: dict[str, float] = dataclasses.field(default_factory=dict)
    #: per question kind, the fraction of gold traces that write one of :data:`PREAMBLES` before their first call
    #: (correct answers whose first call starts later); none by default. A trace takes at most one variation (both
    #: together overflow the 360-token budget on some ``lookup`` questions), so the two fractions sum to at most 1
    preamble_fraction: dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for field in ("shortcut_fraction", "redundant_search_fraction", "preamble_fraction"):
            for kind, frac in getattr(self, field).items():
                if kind not in TOOL_TASK_KINDS or not 0.0 <= frac <= 1.0:
                    raise ValueError(f"{field}: kinds {list(TOOL_TASK_KINDS)} with fractions in [0, 1]; "
                                     f"got {kind!r}: {frac!r}")
        for kind in TOOL_TASK_KINDS:
            both = self.redundant_search_fraction.get(kind, 0.0) + self.preamble_fraction.get(kind, 0.0)
            if both > 1.0:
                raise ValueError(f"redundant_search_fraction + preamble_fraction must be at most 1 per kind (a trace "
                                 f"takes at most one variation); {kind!r} has {both!r}")

    def cache_key(self, base_key: str) -> str:
        """Key of the warm-started model. Variation fields that are empty are left out, so a model built before they
        existed keeps its key (their neutral value trains exactly the same model)."""
        fields = {k: v for k, v in dataclasses.asdict(self).items()
                  if v or k not in ("redundant_search_fraction", "preamble_fraction")}
        blob = json.dumps({"v": 1, "base": base_key, **fields}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _training_trace(row: dict[str, Any], settings: ToolWarmStartSettings, rng: random.Random,
                    variation_rng: random.Random) -> list[dict]:
    """One warm-start trace for ``row``: shortcut or gold from ``rng`` (as without variation), then the gold trace's
    variation from ``variation_rng``: a redundant search, a preamble, or neither (never both)."""
    kind = row["kind"]
    shortcut = rng.random() < settings.shortcut_fraction.get(kind, 0.0)
    if shortcut:
        return trace_messages(row, True, rng)
    u, redundant = variation_rng.random(), settings.redundant_search_fraction.get(kind, 0.0)
    preamble = redundant <= u < redundant + settings.preamble_fraction.get(kind, 0.0)
    return trace_messages(row, False, rng, redundant_search=u < redundant,
                          preamble=variation_rng.choice(PREAMBLES) if preamble else "")


def warm_start_tools(model: Any, tokenizer: Any, settings: ToolWarmStartSettings, log_every: int = 0) -> Any:
    """Supervised fine-tuning on tool-use traces of training questions, in place (``tokenizer`` must have the tool
    template). AdamW, linear warm-up then cosine decay to 10 % of ``lr``; the loss covers the assistant turns only.
    Deterministic given ``settings.seed``; returns ``model`` in eval mode."""
    rows = list(make_tool_split(settings.train_size, "train", seed=settings.seed))
    rng = random.Random(settings.seed)
    variation_rng = random.Random(f"{settings.seed}:variation")  # its own stream: batches and shortcuts unchanged
    torch.manual_seed(settings.seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0, betas=(0.9, 0.98))
    for step in range(settings.steps):
        warm = (step + 1) / settings.warmup_steps
        progress = max(0.0, (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps))
        scale = warm if step < settings.warmup_steps else 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * scale
        batch = rng.sample(rows, settings.batch_size)
        conversations = [row["prompt"] + _training_trace(row, settings, rng, variation_rng) for row in batch]
        ids, mask, labels = _sft_batch(tokenizer, conversations)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if log_every and (step % log_every == 0 or step == settings.steps - 1):
            print(f"tool warm start step {step:4d} loss {loss.item():.4f}", flush=True)
    model.eval()
    return model


def tool_demo_model(cache_dir: str | Path | None, demo_settings: Any = None,
                    settings: ToolWarmStartSettings | None = None, verbose: bool = False) -> tuple[Any, Any]:
    """``(model, tokenizer)``: the arithmetic demo model (``demo_settings``, see
    :func:`~trl_plugins.tasks.tiny.demo_model`) warm-started on tool-use traces, its tokenizer with the tool
    template. Cached under ``cache_dir/tiny-tools-<key>`` (built once under a file lock; ``None``: not cached)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_plugins.tasks.tiny import DemoSettings, demo_model, load_shipped, save_atomically

    demo_settings = demo_settings or DemoSettings()
    settings = settings or ToolWarmStartSettings()
    target = None
    if cache_dir is not None:
        target = Path(cache_dir).expanduser() / f"tiny-tools-{settings.cache_key(demo_settings.cache_key())}"

    def load():
        tokenizer = enable_tool_calling(AutoTokenizer.from_pretrained(target))
        return AutoModelForCausalLM.from_pretrained(target).eval(), tokenizer

    if target is not None and (target / "config.json").exists():
        return load()

    def build():
        shipped = shipped_tool_weights(settings.cache_key(demo_settings.cache_key()))
        if shipped is not None:  # no warm start: the same weights on every machine
            model, tokenizer = load_shipped(shipped, demo_settings)
            enable_tool_calling(tokenizer)
        else:
            model, tokenizer = demo_model(cache_dir, demo_settings)
            enable_tool_calling(tokenizer)
            warm_start_tools(model, tokenizer, settings, log_every=50 if verbose else 0)
        if target is not None:
            save_atomically(model, tokenizer, target)
        return model, tokenizer

    if target is None:
        return build()
    from trl_plugins.runtime.locks import exclusive_file_lock

    with exclusive_file_lock(target.parent / f".{target.name}.lock"):
        if (target / "config.json").exists():
            return load()
        build()
    return load()


def shipped_tool_weights(key: str) -> Path | None:
    """The shipped weights file of the tool-warm-started model with cache key ``key``
    (:meth:`ToolWarmStartSettings.cache_key`), or None when that model is not shipped (it is warm-started)."""
    from trl_plugins.tasks.tiny import SHIPPED_WEIGHTS

    path = SHIPPED_WEIGHTS / f"tiny-tools-{key}.safetensors"
    return path if path.is_file() else None


def write_shipped_tool_weights(demo_settings: Any, settings: ToolWarmStartSettings) -> Path:
    """Warm-start the tool model (``settings``) on top of the arithmetic model of ``demo_settings`` (its shipped weights
    when those are shipped) on this machine and write its weights as a shipped file; returns the path. Run by
    maintainers when the recipe changes."""
    from safetensors.torch import save_file

    from trl_plugins.tasks.tiny import SHIPPED_WEIGHTS

    key = settings.cache_key(demo_settings.cache_key())
    path = SHIPPED_WEIGHTS / f"tiny-tools-{key}.safetensors"
    if path.exists():
        path.unlink()  # warm-start from the arithmetic model, not from the file being replaced
    model, _ = tool_demo_model(None, demo_settings, settings)
    SHIPPED_WEIGHTS.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(path),
              metadata={"tool_settings": json.dumps(dataclasses.asdict(settings), default=str),
                        "base_key": demo_settings.cache_key()})
    return path


# ------------------------------------------------------------------------------------------------ evaluation


def _tool_result_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids the chat template appends after an assistant turn for these tool messages, ending with the next
    assistant header (the tiny tool template renders each message independently of the others)."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def _call_tools(env: ToolEnvironment, tool_calls: list[dict]) -> list[dict]:
    """Run one turn's tool calls on ``env``; a failing call's result is ``{"error": ...}`` as in TRL's tool loop."""
    messages = []
    for call in tool_calls:
        function = call.get("function") or {}
        name = function.get("name", "unknown")
        try:
            if name not in ("search", "calculator"):
                raise ValueError(f"Tool {name} not found.")
            result: Any = getattr(env, name)(**(function.get("arguments") or {}))
        except Exception as exc:  # noqa: BLE001 - the model's call is bad, the episode goes on
            result = {"error": str(exc)}
        messages.append({"role": "tool", "name": name, "content": str(result)})
    return messages


@torch.no_grad()
def run_tool_episodes(model: Any, tokenizer: Any, rows: Sequence[dict], max_completion_length: int = 200,
                      max_tool_turns: int = 3, temperature: float = 0.0, seed: int = 0,
                      batch_size: int = 64) -> list[dict]:
    """Play one episode per row with the bundled tools; ``[{"completion": messages, "tool_calls": n}]``.

    Each turn is generated (greedy when ``temperature`` is 0, else sampled), parsed with TRL's ``parse_response``,
    and its tool calls run on a fresh :class:`~trl_plugins.tasks.tools.ToolEnvironment`; the results are appended as
    the template renders them and the next turn is generated. As in TRL's tool loop, ``max_completion_length``
    bounds everything after the prompt (tool results included) and an episode ends at a turn without tool calls or
    after ``max_tool_turns`` turns with calls.
    """
    from trl.chat_template_utils import parse_response

    was_training = model.training
    model.eval()
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    envs = [ToolEnvironment() for _ in rows]
    for env, row in zip(envs, rows):
        env.reset(**row)
    prompts = [list(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"]) for row in rows]
    seqs = [list(p) for p in prompts]
    episodes = [{"completion": [], "tool_calls": 0} for _ in rows]
    active = list(range(len(rows)))
    sampling = {"do_sample": False} if temperature <= 0 else {"do_sample": True, "temperature": temperature,
                                                               "top_k": 0, "top_p": 1.0}
    for turn in range(max_tool_turns + 1):
        active = [i for i in active if len(seqs[i]) - len(prompts[i]) < max_completion_length]
        next_active = []
        for start in range(0, len(active), batch_size):
            chunk = active[start : start + batch_size]
            width = max(len(seqs[i]) for i in chunk)
            ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, i in enumerate(chunk):  # left padding
                ids[j, width - len(seqs[i]) :] = torch.tensor(seqs[i])
                mask[j, width - len(seqs[i]) :] = 1
            room = max(max_completion_length - (len(seqs[i]) - len(prompts[i])) for i in chunk)
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=room,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **sampling)
            for j, i in enumerate(chunk):
                new = out[j, width:].tolist()
                if tokenizer.eos_token_id in new:
                    new = new[: new.index(tokenizer.eos_token_id) + 1]
                new = [t for t in new if t != tokenizer.pad_token_id]
                new = new[: max_completion_length - (len(seqs[i]) - len(prompts[i]))]
                message = parse_response(tokenizer, new, prefix=seqs[i]) if new else {}
                seqs[i] += new
                if message:
                    episodes[i]["completion"].append(message)
                calls = message.get("tool_calls") if message else None
                if not calls or turn == max_tool_turns:
                    continue
                results = _call_tools(envs[i], calls)
                episodes[i]["tool_calls"] += len(calls)
                suffix = _tool_result_ids(tokenizer, results)
                if len(seqs[i]) + len(suffix) - len(prompts[i]) > max_completion_length:
                    continue  # TRL drops a result that would overflow the budget and ends the episode
                episodes[i]["completion"].extend(results)
                seqs[i] += suffix
                next_active.append(i)
        active = next_active
        if not active:
            break
    model.train(was_training)
    return episodes


def evaluate_tool_accuracy(model: Any, tokenizer: Any, dataset: Any, max_completion_length: int = 200,
                           temperature: float = 0.0, seed: int = 0) -> dict[str, float]:
    """``{"accuracy", "tool_use"}`` on ``dataset``: fraction of episodes whose final answer is right, and fraction
    with at least one tool call (greedy unless ``temperature`` > 0)."""
    rows = list(dataset)
    if not rows:
        raise ValueError("dataset is empty")
    episodes = run_tool_episodes(model, tokenizer, rows, max_completion_length, temperature=temperature, seed=seed)
    rewards = tool_answer_reward([e["completion"] for e in episodes], [r["answer"] for r in rows])
    return {"accuracy": sum(rewards) / len(rows),
            "tool_use": sum(e["tool_calls"] > 0 for e in episodes) / len(rows)}
