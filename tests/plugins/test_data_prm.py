"""data_prm: DataPRM's ternary generative step verdicts (parsing, unparsable accounting), the verdict -> step reward
mapping and the dense per-token step rewards on small tensors, text and tool-trajectory steps, a loopback judge,
bad options refused at construction, and the neutral setting equal to vanilla TRL."""

import math

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.api.turns import build_turn_structure
from trl_plugins.components import serve_openai_compatible
from trl_plugins.components.genrm import (
    TERNARY_STEP_TEMPLATE,
    GenerativeRewardModel,
    GenRMParseError,
    GenRMTemplate,
    ScriptedGenRMBackend,
    clear_shared_genrm_backends,
    genrm_handler,
    scripted_genrm,
)
from trl_plugins.tasks.arithmetic import Problem, accuracy_reward, make_dataset
from trl_plugins.testing import (
    assert_reduces_to_vanilla,
    make_advantage_context,
    make_reward_context,
    make_tiny_trainer,
    record_run,
)
from trl_plugins_builtin.data_prm import FINAL_NOTE, step_token_rewards, verdict_reward


@pytest.fixture(autouse=True)
def _fresh_backends():
    clear_shared_genrm_backends()
    yield
    clear_shared_genrm_backends()


def _plugin(**options):
    stack = build_plugins(["data_prm"], {"data_prm": {"genrm": "scripted", "step_separator": "\n", **options}})
    return stack, list(stack)[0]


# ------------------------------------------------------------------------------------------ ternary parsing
@pytest.mark.parametrize("text, value", [
    ("ok <score>1</score>", 1.0), ("<score> 0.5 </score><summary>minor</summary>", 0.5), ("<score>0</score>", 0.0),
    ("<score>1.0</score>", 1.0), ("<score>0.50</score>", 0.5),  # the official float reading
    ("<score>0</score> on reflection <score>1</score>", 1.0),  # the last score counts
    ("<think><score>0</score></think><score>0.5</score>", 0.5),  # thinking is skipped
    ("<score>0.7</score>", None), ("<score>-1</score>", None), ("<score>good</score>", None), ("score: 1", None),
    (None, None),
])
def test_ternary_step_verdicts_parse_as_the_official_scores(text, value):
    assert TERNARY_STEP_TEMPLATE.protocol == "step"
    assert TERNARY_STEP_TEMPLATE.parse(text) == value


def test_step_templates_are_checked():
    with pytest.raises(PluginConfigError, match="needs exactly"):
        GenRMTemplate("t", "", "{question} {response}", r"<s>(.*)</s>", labels={"1": 1.0}, step=True)
    with pytest.raises(PluginConfigError, match="step template needs verdict labels"):
        GenRMTemplate("t", "", "{question} {history} {step}", r"<s>(.*)</s>", step=True)
    grm = GenerativeRewardModel(ScriptedGenRMBackend(lambda m: "<score>1</score>"), TERNARY_STEP_TEMPLATE)
    with pytest.raises(PluginConfigError, match="needs a pointwise template"):
        grm.score(["q"], ["r"])


def test_unparsable_verdicts_are_counted_and_refused_above_the_share():
    answers = iter(["<score>1</score>", "no verdict here", "<score>0</score>", "<score>0.5</score>"] * 2)
    backend = ScriptedGenRMBackend(lambda messages: next(answers))
    grm = GenerativeRewardModel(backend, TERNARY_STEP_TEMPLATE, k=1, aggregate="mean", max_unparsable=0.25,
                                name="data_prm")
    result = grm.judge_steps(["q"] * 4, ["", "a", "a\nb", "a\nb\nc"], ["a", "b", "c", "d"])
    assert result.values[0] == 1.0 and math.isnan(result.values[1]) and result.values[2:] == [0.0, 0.5]
    assert grm.stats["unparsable_samples"] == 1 and grm.stats["unparsable_rows"] == 1
    strict = GenerativeRewardModel(backend, TERNARY_STEP_TEMPLATE, max_unparsable=0.2, name="data_prm")
    with pytest.raises(GenRMParseError, match=r"'data_prm' at scripted .* row 1 .*'no verdict here'"):
        strict.judge_steps(["q2"] * 4, ["", "a", "b", "c"], ["a", "b", "c", "d"])


def test_scripted_judge_grades_steps_with_the_verifier():
    row = make_dataset(1, levels=(2,), seed=3, split="test")[0]
    steps = Problem.from_json(row["problem"]).solution.splitlines()
    judge = scripted_genrm("arithmetic")

    def verdict(history, step):
        messages = TERNARY_STEP_TEMPLATE.messages(question=row["prompt"][-1]["content"], history=history, step=step)
        return TERNARY_STEP_TEMPLATE.parse(judge(messages))

    history = "\n".join(f"[Paragraph_{i + 1}]\n{s}\n[/Paragraph_{i + 1}]" for i, s in enumerate(steps[:-1]))
    assert verdict(history, f"[Paragraph_{len(steps)}]\n{steps[-1]}\n[/Paragraph_{len(steps)}]\n{FINAL_NOTE}") == 1.0
    assert verdict("", "[Paragraph_1]\n" + steps[0] + "1\n[/Paragraph_1]") == 0.0  # a wrong number: fatal
    assert verdict("[Paragraph_1]\n" + steps[0] + "1\n[/Paragraph_1]", "[Paragraph_2]\nAnswer: 0\n[/Paragraph_2]") == 0.5


# ------------------------------------------------------------------------------------------ the formulas
def test_verdict_reward_maps_the_ternary_scale():
    assert [verdict_reward(v, 1.0, 0.5, 0.0) for v in (1.0, 0.5, 0.0)] == [1.0, 0.5, 0.0]  # official values
    assert [verdict_reward(v, 1.0, 0.0, -1.0) for v in (1.0, 0.5, 0.0, 0.75, 0.25)] == [1.0, 0.0, -1.0, 0.5, -0.5]
    assert math.isnan(verdict_reward(math.nan, 1.0, 0.5, 0.0))


def test_step_token_rewards_on_small_tensors():
    rewards = [[1.0, 0.0], [0.5, math.nan], [1.0], []]
    ends = [[2, 4], [3, 5], [1], []]
    raw = step_token_rewards(rewards, ends, group_size=2, width=5, normalize=False)
    torch.testing.assert_close(raw, torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.0, 0.0],
                                                  [1.0, 0.0, 0.0, 0.0, 0.0], [0.0] * 5]))
    z = step_token_rewards(rewards, ends, group_size=2, width=5, normalize=True, eps=0.0)
    values = torch.tensor([1.0, 0.0, 0.5])  # the judged steps of group 0 (the NaN step is left out)
    n = (values - values.mean()) / values.std()
    torch.testing.assert_close(z[0], torch.stack([n[0], n[0], n[1], n[1], torch.tensor(0.0)]))
    torch.testing.assert_close(z[1], torch.stack([n[2]] * 3 + [torch.tensor(0.0)] * 2))
    torch.testing.assert_close(z[2:], torch.zeros(2, 5))  # one judged step in the group: std 1, z = 0


# ------------------------------------------------------------------------------------------ the plugin
def _arithmetic_ctx(texts, G=2):
    rows = make_dataset(len(texts) // G, levels=(2,), seed=5, split="test")
    rows = [r for r in rows for _ in range(G)]
    return make_reward_context(torch.tensor([1.0, 0.0] * (len(texts) // 2)), num_generations=G,
                               reward_func_names=["accuracy_reward"], rows=rows,
                               completions=[[{"role": "assistant", "content": t}] for t in texts]), rows


def test_text_steps_get_their_verdicts_on_their_tokens():
    rows = make_dataset(1, levels=(2,), seed=5, split="test")
    right = Problem.from_json(rows[0]["problem"]).solution
    first, rest = right.split("\n", 1)
    wrong = first + "1\n" + rest  # the first step is wrong, the later ones build on it
    stack, plugin = _plugin(normalize=False)
    ctx, _ = _arithmetic_ctx([right, wrong])
    stack.call("trl_plugins_transform_rewards", ctx)
    n = len(right.splitlines())
    (good, good_ends), (bad, bad_ends) = plugin._batch
    assert good == [1.0] * n and bad == [0.0] + [0.5] * (n - 1)
    assert good_ends == [len(line) + sum(len(x) + 1 for x in right.splitlines()[:i])
                         for i, line in enumerate(right.splitlines())]  # char tokens: just after each step
    assert ctx.metrics["plugins/data_prm/wrong_fraction"] == [pytest.approx(1 / (2 * n))]
    assert ctx.metrics["plugins/data_prm/unparsable_fraction"] == [0.0]
    actx = make_advantage_context(torch.tensor([1.0, 0.0]), num_generations=2,
                                  completion_lengths=[len(right), len(wrong)])
    before = actx.advantages.clone()
    stack.call("trl_plugins_transform_advantages", actx)
    mask = actx.completion_mask().float()
    expected = before.unsqueeze(1) + step_token_rewards([good, bad], [good_ends, bad_ends], 2, mask.size(1),
                                                        normalize=False) * mask
    torch.testing.assert_close(actx.advantages, expected)
    assert actx.advantages[1, 0] == before[1] and actx.advantages[1, bad_ends[0]] == before[1] + 0.5
    assert plugin._batch is None


def test_tool_trajectory_steps_are_turns_with_their_results():
    """A step is an assistant turn with the tool results answering it (the official paragraph); its reward lands on
    the turn's tokens, not past the next turn's start."""
    messages = [
        {"role": "assistant", "content": "look it up", "tool_calls": [
            {"type": "function", "function": {"name": "search", "arguments": {"query": "Brellin"}}}]},
        {"role": "tool", "name": "search", "content": "Brellin population 4000"},
        {"role": "assistant", "content": "Answer: 4000"},
    ]
    seen = []

    def judge(request):
        text = request[-1]["content"]
        seen.append(text)
        step = text.split("[Step]\n", 1)[1]
        return "<score>1</score>" if "Tool result: Brellin population 4000" in step or "4000" in step else \
            "<score>0</score>"

    ids, mask = list(range(12)), [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]
    turns = [build_turn_structure(ids, mask, messages)] * 2
    stack, plugin = _plugin(normalize=False)
    plugin.grm = GenerativeRewardModel(ScriptedGenRMBackend(judge), TERNARY_STEP_TEMPLATE, name="data_prm")
    ctx = make_reward_context(torch.tensor([1.0, 0.0]), num_generations=2, completions=[messages] * 2, turns=turns,
                              local_completion_ids=[ids] * 2, rows=[{"prompt": "Population of Brellin?"}] * 2)
    stack.call("trl_plugins_transform_rewards", ctx)
    assert plugin._batch[0] == ([1.0, 1.0], [8, 12])  # step 0 = turn 0 + its tool result, up to turn 1's start
    assert "Tool call: " in seen[0] and "search" in seen[0] and "[History]\n\n[End of History]" in seen[0]
    assert "[Paragraph_1]" in seen[1].split("[Step]")[0] and FINAL_NOTE in seen[1]


def test_a_loopback_endpoint_judges_the_steps():
    rows = make_dataset(1, levels=(2,), seed=5, split="test")
    right = Problem.from_json(rows[0]["problem"]).solution
    requests = []
    with serve_openai_compatible(genrm_handler(ScriptedGenRMBackend(scripted_genrm()), requests)) as url:
        stack, plugin = _plugin(genrm="endpoint", genrm_base_url=url, genrm_max_retries=0)
        ctx, _ = _arithmetic_ctx([right, "Answer: 0"])
        stack.call("trl_plugins_transform_rewards", ctx)
    n = len(right.splitlines())
    assert len(requests) == n + 1 and requests[0]["temperature"] == 0.7  # one request per step, official sampling
    assert [s for s, _ in plugin._batch] == [[1.0] * n, [0.0]]


@pytest.mark.parametrize("options, match", [
    ({"correct_reward": 0.0, "wrong_reward": 1.0}, "wrong_reward <= neutral_reward <= correct_reward"),
    ({"neutral_reward": 2.0}, "neutral_reward"), ({"correct_reward": 0.0, "neutral_reward": 0.0}, "wrong_reward <"),
    ({"wrong_reward": float("nan")}, "finite"), ({"step_weight": -1.0}, "step_weight"), ({"k": 0}, "'k'"),
    ({"step_separator": ""}, "step_separator"), ({"eps": 0.0}, "eps"), ({"genrm": "hf"}, "genrm_model"),
    ({"genrm": "endpoint"}, "genrm"),
])
def test_bad_options_are_refused_at_construction(options, match):
    with pytest.raises(PluginConfigError, match=match):
        build_plugins(["data_prm"], {"data_prm": {"genrm": "scripted", **options}})


def test_declarations():
    _, plugin = _plugin()
    assert isinstance(plugin.image_inputs, str) and plugin.image_inputs.endswith(".")
    assert plugin.multi_turn is True
    assert plugin.official.repository == "zjunlp/DataMind" and plugin.official.verdict == "reconstructed"


def test_an_unrecorded_batch_is_refused():
    stack, _ = _plugin()
    with pytest.raises(Exception, match="did not record"):
        stack.call("trl_plugins_transform_advantages",
                   make_advantage_context(torch.tensor([1.0, 0.0]), num_generations=2))


def test_neutral_setting_matches_vanilla_grpo():
    assert_reduces_to_vanilla("data_prm", {"genrm": "scripted", "step_weight": 0.0}, loss_types=("grpo", "dapo"),
                              steps=1)


def test_trainer_runs_with_the_scripted_judge(tmp_path):
    trainer = make_tiny_trainer(plugins=["data_prm"], plugin_config={"data_prm": {"genrm": "scripted"}}, max_steps=1,
                                reward_funcs=[accuracy_reward], output_dir=str(tmp_path), log_level="error")
    run = record_run(trainer)
    logs = {k for entry in trainer.state.log_history for k in entry}
    assert {"plugins/data_prm/step_reward_mean", "plugins/data_prm/dense_advantage_abs_mean"} <= logs
    assert run.advantages[0].dim() == 2


@pytest.mark.slow
def test_smollm2_judges_its_own_steps_through_the_local_hf_backend(capsys):
    """builtin:smollm2 (135M) gives ternary verdicts on the one-line completions of 2 prompts (4 steps, 16 tokens each)
    through the local HF backend. A 135M model follows the <score> format poorly: the test checks the accounting
    (every step judged or counted as unparsable, parsed verdicts on the ternary scale), not the quality, and prints
    the numbers."""
    from trl_plugins.runtime.models import smollm2_path

    rows = make_dataset(2, levels=(1,), seed=7, split="test")
    texts = [t for r in rows for t in (Problem.from_json(r["problem"]).solution.splitlines()[-1], "Answer: 12")]
    ctx = make_reward_context(torch.zeros(4), num_generations=2, rows=[r for r in rows for _ in range(2)],
                              completions=[[{"role": "assistant", "content": t}] for t in texts])
    stack, plugin = _plugin(genrm="hf", genrm_model=str(smollm2_path()), genrm_max_tokens=16,
                            genrm_max_unparsable=1.0)
    stack.call("trl_plugins_transform_rewards", ctx)
    stats = dict(plugin.grm.stats)
    flat = [r for s, _ in plugin._batch for r in s]
    share = ctx.metrics["plugins/data_prm/unparsable_fraction"][0]
    with capsys.disabled():
        print(f"\nsmollm2 as DataPRM judge: stats {stats}; step rewards {flat}; unparsable share {share:.2f}")
    assert stats["requests"] == len(flat) == sum(len(t.splitlines()) for t in texts)
    assert stats["unparsable_rows"] == sum(math.isnan(r) for r in flat) == round(share * len(flat))
    assert all(r in (0.0, 0.5, 1.0) for r in flat if not math.isnan(r))
