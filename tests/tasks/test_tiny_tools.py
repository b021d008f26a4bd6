"""The tiny model as a tool agent: held-out split, tool-use warm-start batches, and the multi-turn episode runner."""

import random

import torch

from trl_plugins.tasks.tiny_tools import (
    _sft_batch, evaluate_tool_accuracy, make_tool_split, run_tool_episodes, tool_question_split, trace_messages,
)
from trl_plugins.tasks.tools import enable_tool_calling, gold_trace_script
from trl_plugins.testing import tiny_tokenizer


def _pairs(dataset):
    return {(row["entities"][0], row["prompt"][-1]["content"].split(" of ")[0].split("the ")[-1]) for row in dataset}


def test_held_out_questions_ask_about_place_fact_pairs_never_asked_in_training():
    train, test = make_tool_split(200, "train"), make_tool_split(60, "test", seed=1)
    assert {tool_question_split(r) for r in train} == {"train"} and {tool_question_split(r) for r in test} == {"test"}
    assert _pairs(train).isdisjoint(_pairs(test))
    assert {r["kind"] for r in train} == {"lookup", "scaled"}
    assert all(len(r["prompt"]) == 1 for r in train)  # no system message


def test_warm_start_labels_cover_exactly_the_assistant_turns():
    tokenizer = enable_tool_calling(tiny_tokenizer())
    row = make_tool_split(4, "train", seed=2, kinds=["scaled"])[0]
    messages = trace_messages(row, shortcut=False, rng=random.Random(0))
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert messages[-1]["content"] == f"Answer: {row['answer']}" and messages[3]["content"] == row["answer"]
    ids, mask, labels = _sft_batch(tokenizer, [row["prompt"] + messages])
    labelled = tokenizer.decode(ids[0][labels[0] != -100].tolist(), skip_special_tokens=False)
    assert labelled.count("<|end|>") == 3 and "<tool_response>" not in labelled and "What is" not in labelled
    assert labelled.startswith("<tool_call>") and labelled.endswith(f"Answer: {row['answer']}<|end|>")
    shortcut = trace_messages(row, shortcut=True, rng=random.Random(0))
    assert len(shortcut) == 1 and shortcut[0]["content"] != f"Answer: {row['answer']}"


class ScriptedPolicy(torch.nn.Module):
    """A stand-in policy for the episode runner: ``generate`` writes ``script(prompt text, row)`` for each row."""

    def __init__(self, tokenizer, script):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tokenizer, self.script = tokenizer, script

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **kwargs):
        rows = []
        for row, ids in enumerate(input_ids):
            text = self.script(self.tokenizer.decode(ids[attention_mask[row] == 1].tolist(), skip_special_tokens=False),
                               row)
            rows.append(self.tokenizer(text, add_special_tokens=False)["input_ids"][:max_new_tokens] + [eos_token_id])
        width = max(map(len, rows))
        new = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, new], dim=1)


def test_episodes_run_the_tools_between_turns_and_are_scored_on_the_final_answer():
    tokenizer = enable_tool_calling(tiny_tokenizer())
    dataset = make_tool_split(6, "test", seed=1)
    gold = ScriptedPolicy(tokenizer, gold_trace_script(dataset, shortcut_every=0))
    episodes = run_tool_episodes(gold, tokenizer, list(dataset), max_completion_length=400)
    for episode, row in zip(episodes, dataset):
        assert episode["tool_calls"] == row["num_calls"]
        assert [m["role"] for m in episode["completion"]].count("tool") == row["num_calls"]
    assert evaluate_tool_accuracy(gold, tokenizer, dataset, max_completion_length=400) == {"accuracy": 1.0,
                                                                                           "tool_use": 1.0}
    # every second row answers at once, wrongly: half the accuracy, half the tool use
    shortcut = ScriptedPolicy(tokenizer, gold_trace_script(dataset, shortcut_every=2))
    assert evaluate_tool_accuracy(shortcut, tokenizer, dataset, max_completion_length=400) == {"accuracy": 0.5,
                                                                                               "tool_use": 0.5}
    # a budget too small for the first tool result ends the episode without an answer
    assert evaluate_tool_accuracy(gold, tokenizer, dataset, max_completion_length=80)["accuracy"] == 0.0
