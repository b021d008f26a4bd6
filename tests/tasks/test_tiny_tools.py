"""The tiny model as a tool agent: held-out split, tool-use warm-start batches, and the multi-turn episode runner."""

import json
import random

import pytest
import torch

from trl_plugins.tasks.tiny_tools import (
    PREAMBLES, ToolWarmStartSettings, _sft_batch, _training_trace, evaluate_tool_accuracy, make_tool_split,
    run_tool_episodes, tool_question_split, trace_messages,
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


def test_variation_traces_repeat_the_search_or_write_a_preamble_and_still_answer_right():
    tokenizer = enable_tool_calling(tiny_tokenizer())
    row = make_tool_split(4, "train", seed=2, kinds=["lookup"])[0]
    plain = trace_messages(row, shortcut=False, rng=random.Random(0))
    redundant = trace_messages(row, shortcut=False, rng=random.Random(0), redundant_search=True,
                               preamble="Let me search.")
    assert [m["role"] for m in redundant] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert redundant[0]["tool_calls"] == redundant[2]["tool_calls"] == plain[0]["tool_calls"]
    assert redundant[1]["content"] == redundant[3]["content"] == plain[1]["content"]  # the same search result
    assert redundant[-1] == plain[-1] == {"role": "assistant", "content": f"Answer: {row['answer']}"}
    assert redundant[0]["content"] == "Let me search." and redundant[2]["content"] == ""
    ids, _, labels = _sft_batch(tokenizer, [row["prompt"] + redundant])
    labelled = tokenizer.decode(ids[0][labels[0] != -100].tolist(), skip_special_tokens=False)
    assert labelled.startswith("Let me search.<tool_call>") and labelled.count("<tool_call>") == 2


def test_the_variation_leaves_batches_and_shortcuts_alone_and_follows_its_fractions():
    rows = list(make_tool_split(64, "train", seed=0, kinds=["lookup"]))
    plain, varied = ToolWarmStartSettings(), ToolWarmStartSettings(redundant_search_fraction={"lookup": 0.5},
                                                                   preamble_fraction={"lookup": 0.5})

    def traces(settings):
        rng, variation_rng = random.Random(0), random.Random("0:variation")
        return [_training_trace(row, settings, rng, variation_rng) for row in rows * 4]

    a, b = traces(plain), traces(varied)
    shortcut = [len(t) == 1 for t in a]
    assert [len(t) == 1 for t in b] == shortcut and 0 < sum(shortcut) < len(a)  # same shortcut draws
    assert all(x == y for x, y, s in zip(a, b, shortcut) if s)  # same wrong numbers
    gold = [t for t, s in zip(b, shortcut) if not s]
    assert all(len(t) == 3 and t[0]["content"] == "" for t, s in zip(a, shortcut) if not s)  # no variation: gold
    repeated = [len(t) == 5 for t in gold]
    preamble = [t[0]["content"] in PREAMBLES for t in gold]
    assert all(r != p for r, p in zip(repeated, preamble))  # fractions summing to 1: exactly one variation each
    assert 0.35 < sum(repeated) / len(gold) < 0.65 and {len(t) for t in gold} == {3, 5}


def test_warm_start_settings_refuse_bad_variation_and_keep_the_old_cache_key():
    with pytest.raises(ValueError, match="redundant_search_fraction.*'combined'"):
        ToolWarmStartSettings(redundant_search_fraction={"combined": 0.5})
    with pytest.raises(ValueError, match="preamble_fraction.*1.5"):
        ToolWarmStartSettings(preamble_fraction={"lookup": 1.5})
    with pytest.raises(ValueError, match="at most one variation.*'scaled'"):
        ToolWarmStartSettings(redundant_search_fraction={"scaled": 0.6}, preamble_fraction={"scaled": 0.6})
    # the key the default warm start was cached under before the variation fields existed
    assert ToolWarmStartSettings().cache_key("base") == "23f80fce174a8db7"
    assert ToolWarmStartSettings(preamble_fraction={"lookup": 0.3}).cache_key("base") != "23f80fce174a8db7"


def test_episodes_with_a_preamble_and_a_repeated_search_count_both_calls():
    tokenizer = enable_tool_calling(tiny_tokenizer())
    dataset = make_tool_split(4, "test", seed=1, kinds=["lookup"])
    calls = {row["prompt"][-1]["content"]: (json.loads(row["gold_calls"])[0], row["answer"]) for row in dataset}

    def script(prompt_text, _row):
        call, answer = next(v for q, v in calls.items() if q in prompt_text)
        done = prompt_text.count("<tool_response>")
        if done == 0:  # the longest preamble and a repeated search (the warm start never combines them)
            return f"I will look it up.<tool_call>{json.dumps(call)}</tool_call>"
        return f"<tool_call>{json.dumps(call)}</tool_call>" if done == 1 else f"Answer: {answer}"

    episodes = run_tool_episodes(ScriptedPolicy(tokenizer, script), tokenizer, list(dataset), max_completion_length=400)
    for episode in episodes:
        assert episode["tool_calls"] == 2
        assert episode["completion"][0]["content"] == "I will look it up." and episode["completion"][0]["tool_calls"]
    assert evaluate_tool_accuracy(ScriptedPolicy(tokenizer, script), tokenizer, dataset,
                                  max_completion_length=400) == {"accuracy": 1.0, "tool_use": 1.0}
