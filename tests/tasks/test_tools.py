"""The bundled offline tool environment: tools, corpus-consistent questions, verifier, chat templates."""

import json

import pytest

from trl_plugins.tasks.tool_corpus import PLACES, place_by_name
from trl_plugins.tasks.tools import (
    KINDS, ToolEnvironment, ToolInputError, calculator, enable_tool_calling, gold_trace_script, make_tool_dataset,
    search, tool_answer_reward,
)


def test_calculator():
    assert calculator("4120*3") == "12360"
    assert calculator("(7 + 5) / 4") == "3"
    assert calculator("7/2") == "3.5"
    for bad in ("__import__('os')", "2**", "1/0", "x+1"):
        with pytest.raises(ToolInputError):
            calculator(bad)


def test_search_finds_each_place_by_name():
    for place in PLACES:
        assert search(f"population of {place.name}") == place.text
    assert search("zzz").startswith("No document")
    with pytest.raises(ToolInputError):
        search("  ")


def _execute(calls):
    """Run a gold trace with the real tools; the calculator's result."""
    results = []
    for call in calls:
        tool = {"search": search, "calculator": calculator}[call["name"]]
        results.append(tool(**call["arguments"]))
    return results


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_answer_follows_from_the_corpus_through_its_gold_trace(kind):
    dataset = make_tool_dataset(12, kinds=[kind], seed=3)
    for row in dataset:
        calls = json.loads(row["gold_calls"])
        assert row["num_calls"] == len(calls) == KINDS[kind]
        results = _execute(calls)
        for call, result in zip(calls, results):
            if call["name"] == "search":  # the document holds the fact the next call uses
                assert result == place_by_name(call["arguments"]["query"]).text
        final = results[-1] if kind != "lookup" else None
        if final is not None:
            assert final == row["answer"]
        else:
            assert row["answer"] in results[0]


def test_dataset_is_deterministic_and_validated():
    assert make_tool_dataset(6, seed=1)[:] == make_tool_dataset(6, seed=1)[:]
    with pytest.raises(ValueError, match="kinds"):
        make_tool_dataset(2, kinds=["riddle"])


def test_verifier_reads_the_last_assistant_turn():
    completion = [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "search"}}]},
        {"role": "tool", "name": "search", "content": "Answer: 9"},
        {"role": "assistant", "content": "Answer: 12"},
    ]
    assert tool_answer_reward([completion, completion], ["12", "9"]) == [1.0, 0.0]


def test_environment_records_calls_and_per_call_rewards():
    env = ToolEnvironment()
    row = make_tool_dataset(3, kinds=["scaled"])[0]
    env.reset(**row)
    calls = json.loads(row["gold_calls"])
    env.search(**calls[0]["arguments"])
    env.search("Hask" if row["entities"][0] != "Hask" else "Pell")  # a place the question is not about
    env.calculator(**calls[1]["arguments"])
    assert [c["name"] for c in env.calls] == ["search", "search", "calculator"]
    assert env.turn_rewards == [1.0, 0.0, 1.0]
    env.reset(**row)
    assert env.calls == [] and env.turn_rewards == []


def test_gold_trace_script_follows_the_trace_and_shortcuts():
    dataset = make_tool_dataset(2, kinds=["scaled"])
    script = gold_trace_script(dataset, shortcut_every=2)
    question = dataset[0]["prompt"][-1]["content"]
    calls = json.loads(dataset[0]["gold_calls"])
    assert json.loads(script(f"<|user|>{question}", 0).removeprefix("<tool_call>").removesuffix("</tool_call>")) == calls[0]
    assert script(f"<|user|>{question}", 1) == f"Answer: {int(dataset[0]['answer']) + 1}"
    done = f"<|user|>{question}" + "<tool_response>r</tool_response>" * 2
    assert script(done, 1) == f"Answer: {dataset[0]['answer']}"


def test_tiny_tokenizer_gets_a_tool_calling_template():
    from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

    from trl_plugins.testing import tiny_tokenizer

    tokenizer = enable_tool_calling(tiny_tokenizer())
    assert supports_tool_calling(tokenizer) and is_chat_template_prefix_preserving(tokenizer)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "q"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    text = 'Look.<tool_call>{"name": "search", "arguments": {"query": "Pell"}}</tool_call>'
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    parsed = parse_response(tokenizer, ids, prefix=prompt)
    assert parsed["content"] == "Look."
    assert parsed["tool_calls"][0]["function"] == {"name": "search", "arguments": {"query": "Pell"}}
    assert enable_tool_calling(tokenizer) is tokenizer  # idempotent


def test_chatml_tokenizer_gets_a_tool_calling_template():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import supports_tool_calling

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    tokenizer.chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    enable_tool_calling(tokenizer)
    assert supports_tool_calling(tokenizer)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "q"}], tools=[search], tokenize=False,
                                             add_generation_prompt=True)
    assert '"name": "search"' in rendered and rendered.endswith("<|im_start|>assistant\n")


def test_unknown_template_is_refused_clearly():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    tokenizer.chat_template = "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="ChatML"):
        enable_tool_calling(tokenizer)
