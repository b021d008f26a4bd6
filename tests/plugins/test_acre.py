"""acre: the options shuffled, the question re-asked with the same reasoning; the accuracy reward only when both answers
name the same option. The re-ask on hand-built rollout contexts with a scripted generation service, the gate on small
tensors, a trainer run through the real generation service, the neutral setting and the refusals."""

import pytest
import torch
import trl
from datasets import Dataset

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.api.errors import PluginError
from trl_plugins.testing import (
    StubGenerationService,
    make_reward_context,
    make_rollout_context,
    make_tiny_trainer,
    record_run,
    script_generation,
)
from trl_plugins_builtin.acre import KEY, answer_letter, gate, options_block, permutation

OPTIONS = ["7", "8", "9", "12"]
BLOCK = options_block(OPTIONS, "{letter}. {option}")
QUESTION = f"What is 3+4?\n{BLOCK}\nEnd with 'Answer: X'."


def _row():
    return {"prompt": [{"role": "user", "content": QUESTION}], "options": OPTIONS, "answer": "A"}


def _call(hook, ctx, **options):
    build_plugins(["acre"], {"acre": options}).call(hook, ctx)


def _faithful(prompt, j):
    """A policy whose reasoning fixes the option text '7': it names wherever '7' now stands."""
    content = prompt[-1]["content"] if not isinstance(prompt, str) else prompt
    for line in content.splitlines():
        if line.endswith(". 7"):
            return " " + line[0]
    raise AssertionError(content)


def test_helpers_on_small_inputs():
    assert options_block(["x", "y"], "({letter}) {option}", [1, 0]) == "(A) y\n(B) x"
    for index in range(20):
        order = permutation(4, 0, 3, index)
        assert sorted(order) == [0, 1, 2, 3] and order != [0, 1, 2, 3]
    assert permutation(4, 0, 3, 5) == permutation(4, 0, 3, 5)
    assert [answer_letter(t, 4) for t in [" B", "(c) because", "D.", "E", " none", ""]] == [1, 2, 3, None, None, None]
    column = torch.tensor([1.0, 1.0, 0.0, 1.0])
    assert gate(column, [True, False, False, None], 0.0).tolist() == [1.0, 0.0, 0.0, 1.0]
    assert gate(column, [True, False, False, None], 0.25).tolist() == [1.0, 0.25, 0.0, 1.0]


def test_the_permutation_depends_on_the_seed_and_the_row():
    orders = {tuple(permutation(4, seed, 0, index)) for seed in range(3) for index in range(5)}
    assert len(orders) > 3


def test_reask_keeps_the_reasoning_and_maps_the_answer_back_through_the_shuffle():
    service = StubGenerationService(_faithful)
    texts = ["3+4=7\nAnswer: A", "3+4=8\nAnswer: B", "no answer here", "3+4=7\nAnswer: C"]
    ctx = make_rollout_context(texts, num_generations=2, rows=[_row()] * 4, service=service)
    _call("trl_plugins_after_generation", ctx)
    (asked,) = service.calls
    assert len(asked) == 3 and service.greedy_calls == [True]  # the row without an answer is not re-asked
    for prompt in asked:
        content = prompt[-1]["content"]
        assert BLOCK not in content  # never the identity shuffle
        assert sorted(line[3:] for line in content.splitlines()[1:5]) == sorted(OPTIONS)
    # the faithful re-ask always names '7': consistent with A ('7'), not with B ('8') or C ('9')
    assert [a.get(KEY) for a in ctx.annotations] == [True, False, False, False]
    assert ctx.metrics["plugins/acre/consistency_rate"] == [pytest.approx(1 / 3)]
    assert ctx.metrics["plugins/acre/reasked_fraction"] == [0.75]


def test_the_reask_continues_after_the_reasoning_and_the_answer_prefix():
    seen = []

    class Recording(StubGenerationService):
        def generate(self, prompts=None, *, prompt_ids=None, prefix_ids=None, greedy=False):
            seen.extend(prefix_ids)
            return super().generate(prompts, prompt_ids=prompt_ids, prefix_ids=prefix_ids, greedy=greedy)

    ctx = make_rollout_context(["3+4=7\nAnswer: A"], num_generations=1, rows=[_row()], service=Recording(_faithful))
    _call("trl_plugins_after_generation", ctx)
    assert [ctx.tokenizer.decode(p) for p in seen] == ["3+4=7\nAnswer:"]


def test_a_prompt_without_its_options_block_is_named():
    row = {**_row(), "prompt": [{"role": "user", "content": "What is 3+4? A) 7 B) 8 C) 9 D) 12"}]}
    ctx = make_rollout_context(["Answer: A"], num_generations=1, rows=[row], service=StubGenerationService(_faithful))
    with pytest.raises(PluginError, match=r"does not contain its options block.*option_format"):
        _call("trl_plugins_after_generation", ctx)


def test_rows_without_options_are_left_alone_and_the_gate_reads_the_annotations():
    ctx = make_rollout_context(["x\nAnswer: A"], num_generations=1, rows=[{"prompt": "plain"}],
                               service=StubGenerationService(_faithful))
    _call("trl_plugins_after_generation", ctx)
    assert ctx.annotations == [{}]
    rctx = make_reward_context(torch.tensor([[1.0, 0.5], [1.0, 0.5], [0.0, 0.5], [1.0, 0.5]]), num_generations=2,
                               annotations=[{KEY: True}, {KEY: False}, {KEY: False}, {}])
    _call("trl_plugins_transform_rewards", rctx)
    assert rctx.rewards_per_func.tolist() == [[1.0, 0.5], [0.0, 0.5], [0.0, 0.5], [1.0, 0.5]]
    assert rctx.metrics["plugins/acre/inconsistent_correct"] == [0.25]


@pytest.mark.parametrize(("options", "message"), [
    ({"answer_marker": "(["}, "answer_marker"),
    ({"option_format": "{letter}"}, "option_format"),
    ({"inconsistent_scale": 2.0}, "inconsistent_scale"),
])
def test_bad_options_are_refused_at_construction(options, message):
    with pytest.raises(PluginConfigError, match=message):
        build_plugins(["acre"], {"acre": options})


def _mcq_dataset(n=8):
    return Dataset.from_list([_row() for _ in range(n)])


def _letter_reward(completions, answer, **kwargs):
    texts = [c[-1]["content"] if not isinstance(c, str) else c for c in completions]
    return [1.0 if t.strip().endswith(f"Answer: {a}") else 0.0 for t, a in zip(texts, answer)]


def _policy(prompt_text, row):
    """First answers: even rows reason to '7' and answer A; odd rows answer A with reasoning about '8'. Re-asks
    (prompts ending in the reasoning): the '7' reasoning names wherever '7' stands, the '8' reasoning names '8'."""
    reasoning = prompt_text.split("'Answer: X'.")[-1]
    if "Answer:" in reasoning:
        target = "7" if "so 7" in reasoning else "8"
        line = next(x for x in prompt_text.splitlines() if x.endswith(f". {target}"))
        return " " + line[0]
    return "3+4 so 7\nAnswer: A" if row % 2 == 0 else "3+4 so 8\nAnswer: A"


def test_trainer_gates_the_accuracy_column_through_the_generation_service(tmp_path):
    trainer = make_tiny_trainer(plugins=["acre"], dataset=_mcq_dataset(), reward_funcs=[_letter_reward],
                                max_steps=1, output_dir=str(tmp_path), log_level="error", max_completion_length=32)
    script_generation(trainer, _policy)
    run_ = record_run(trainer)
    (rewards,) = run_.rewards
    assert rewards[:, 0].tolist() == [1.0 if n % 2 == 0 else 0.0 for n in range(len(rewards))]
    log = next(log for log in run_.logs if "loss" in log)
    assert log["plugins/acre/consistency_rate"] == pytest.approx(0.5)
    assert log["plugins/acre/inconsistent_correct"] == pytest.approx(0.5)


def test_neutral_scale_one_matches_vanilla_grpo(tmp_path):
    common = dict(max_steps=1, dataset=_mcq_dataset(), reward_funcs=[_letter_reward], output_dir=str(tmp_path),
                  log_level="error", max_completion_length=32)
    vanilla = make_tiny_trainer(trainer_cls=trl.GRPOTrainer, **common)
    script_generation(vanilla, _policy)
    neutral = make_tiny_trainer(plugins=["acre"], plugin_config={"acre": {"inconsistent_scale": 1.0}}, **common)
    script_generation(neutral, _policy)
    a, b = record_run(vanilla), record_run(neutral)
    for x, y in zip(a.rewards, b.rewards):
        assert torch.equal(x, y)
    for key in a.params:
        torch.testing.assert_close(a.params[key], b.params[key], atol=0, rtol=0)
