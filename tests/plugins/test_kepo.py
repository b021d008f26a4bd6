"""kepo: quality-gated teacher distillation and teacher-hinted rejection sampling (reconstruction of arXiv:2602.00400).

Pure functions and hooks on the kit's hand-made contexts with stub teachers; checks at construction (tokenizer
mismatch, a teacher without log-probs, a dead endpoint, a missing hints column); the neutral setting; a LoRA run on
the tiny model with a local teacher; a teacher endpoint dying during training."""

import math
import socket

import pytest
import torch

from trl_plugins import PluginConfigError
from trl_plugins.components.client import EndpointError
from trl_plugins.components.local_server import serve_openai_compatible
from trl_plugins.components.teacher import clear_shared_teachers
from trl_plugins.tasks.tiny import build_and_save
from trl_plugins.testing import (
    assert_reduces_to_vanilla,
    build_stack,
    digit_fraction_reward,
    loss_from_context,
    make_advantage_context,
    make_loss_context,
    make_rollout_context,
    make_tiny_trainer,
    run_hook,
    stub_policy_stats,
    stub_rows,
    tiny_dataset,
)
from trl_plugins_builtin.kepo import HINTED, all_fail_groups, mixed_advantages, teacher_kl_k3, with_hint


@pytest.fixture(autouse=True)
def _fresh_teachers():
    yield
    clear_shared_teachers()


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory):
    return str(build_and_save(tmp_path_factory.mktemp("kepo") / "teacher", hidden_size=16, num_layers=1, num_heads=2))


def _dead_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def _plugin(options, **config):
    return build_stack("kepo", {"kepo": options}, configure=False, **config).by_name["kepo"]


# ------------------------------------------------------------------------------------------ pure functions
def test_advantage_mixing_acts_only_on_scored_unmasked_tokens():
    adv = torch.tensor([[1.0], [-1.0]]).expand(2, 3)
    teacher = torch.tensor([[-0.5, -1.0, -2.0], [math.nan] * 3])
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    mixed, present = mixed_advantages(adv, teacher, old, mask, lam=0.25)
    assert torch.equal(present, torch.tensor([[True, True, False], [False, False, False]]))
    assert torch.allclose(mixed[0, :2], torch.tensor([0.25 + 0.75 * 0.5, 0.25 + 0.75 * 0.0]))
    assert mixed[0, 2] == 1.0 and torch.equal(mixed[1], adv[1])  # masked token, unscored row: A_GRPO
    same, _ = mixed_advantages(adv, teacher, old, mask, lam=1.0)
    assert torch.equal(same, adv)


def test_k3_teacher_kl_is_zero_when_policy_equals_teacher_and_zero_where_unscored():
    lp = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]])
    assert torch.equal(teacher_kl_k3(lp, lp.clone()), torch.zeros(2, 2))
    kl = teacher_kl_k3(lp, torch.tensor([[-0.5, math.nan], [-3.0, -2.0]]))
    d = torch.tensor(0.5)
    assert torch.isclose(kl[0, 0], d.exp() - d - 1) and kl[0, 1] == 0 and kl[1, 0] > 0 and kl[1, 1] == 0


def test_hint_joins_the_last_user_message_and_all_fail_groups_are_found():
    prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert with_hint(prompt, "h", "{question} | {hint}") == [{"role": "system", "content": "S"},
                                                             {"role": "user", "content": "Q | h"}]
    assert prompt[1]["content"] == "Q" and with_hint("Q", "h", "{hint}: {question}") == "h: Q"
    success = torch.tensor([False, False, True, False, False, False])
    assert all_fail_groups(success, 2).tolist() == [True, False, True]


# ------------------------------------------------------------------------------------------ options, construction
def test_bad_options_are_refused_with_the_allowed_values():
    with pytest.raises(PluginConfigError, match=r"lam"):
        _plugin({"lam": 1.5})
    with pytest.raises(PluginConfigError, match=r"'hint_template' .* must contain \{hint\}"):
        _plugin({"hints": "none", "lam": 1.0, "hint_template": "{question}"})
    with pytest.raises(PluginConfigError, match="teacher_base_url"):
        _plugin({"teacher": "endpoint"})
    with pytest.raises(PluginConfigError, match="needs teacher_model"):
        _plugin({})
    with pytest.raises(PluginConfigError, match="distill"):
        _plugin({"distill": "sft", "teacher_model": "x"})
    _plugin({"lam": 1.0, "hints": "none"})  # neutral: no teacher needed


def test_a_teacher_with_another_tokenizer_is_refused_when_the_trainer_is_built(tmp_path, teacher_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher_path)
    tok.add_tokens(["<scratch>"])
    tok.save_pretrained(teacher_path + "-other")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(teacher_path).save_pretrained(teacher_path + "-other")
    with pytest.raises(PluginConfigError, match=r"does not share the policy's tokenizer: vocabulary sizes differ"):
        make_tiny_trainer(plugins=["kepo"], output_dir=str(tmp_path),
                          plugin_config={"kepo": {"teacher_model": teacher_path + "-other", "hints": "none"}})


def test_an_endpoint_without_logprobs_or_dead_is_refused_at_construction(tmp_path):
    chat_only = lambda path, payload: {"choices": [{"index": 0, "text": "ok"}]}  # noqa: E731
    with serve_openai_compatible(chat_only) as url:
        with pytest.raises(EndpointError, match=rf"{url}/completions cannot return teacher log-probs"):
            make_tiny_trainer(plugins=["kepo"], output_dir=str(tmp_path), plugin_config={"kepo": {
                "teacher": "endpoint", "teacher_base_url": url, "hints": "none", "teacher_max_retries": 0}})
    url = _dead_url()
    with pytest.raises(EndpointError, match=rf"{url}/completions failed after 1 attempts"):
        make_tiny_trainer(plugins=["kepo"], output_dir=str(tmp_path), plugin_config={"kepo": {
            "teacher": "endpoint", "teacher_base_url": url, "hints": "none", "teacher_max_retries": 0}})


def test_a_missing_hints_column_is_refused_at_construction(tmp_path):
    with pytest.raises(PluginConfigError, match=r"needs the dataset column 'hint'"):
        make_tiny_trainer(plugins=["kepo"], output_dir=str(tmp_path),
                          plugin_config={"kepo": {"hints": "column", "lam": 1.0}})


# ------------------------------------------------------------------------------------------ hooks
class StubTeacher:
    def __init__(self):
        self.logprob_calls, self.chat_calls = [], []

    def logprobs(self, prompt_ids, completion_ids):
        self.logprob_calls.append(list(completion_ids))
        return [torch.full((len(c),), -0.5) for c in completion_ids]

    def chat(self, conversations, **kwargs):
        self.chat_calls.append(conversations)
        return [" think of 7 " for _ in conversations]


def test_only_successful_rows_are_scored_by_the_teacher():
    plugin = _plugin({"teacher_model": "unused", "hints": "none"})
    plugin.teacher = StubTeacher()
    mask = torch.ones(4, 3)
    ctx = make_advantage_context([1.0, 0.0, 0.0, 1.0], num_generations=2, policy_stats=stub_policy_stats(4, 3, mask=mask))
    run_hook(_stack_of(plugin), "trl_plugins_transform_advantages", ctx)
    assert len(plugin.teacher.logprob_calls) == 1 and len(plugin.teacher.logprob_calls[0]) == 2
    scored = ~torch.isnan(ctx.local_extras["teacher_logps"]).all(-1)
    assert scored.tolist() == [True, False, False, True]
    assert ctx.metrics["plugins/kepo/gated_fraction"] == [0.5]
    evaluation = make_advantage_context([1.0, 0.0], num_generations=2, mode="eval")
    run_hook(_stack_of(plugin), "trl_plugins_transform_advantages", evaluation)
    assert "teacher_logps" not in evaluation.local_extras  # no teacher calls on evaluation batches


def _stack_of(plugin):
    from trl_plugins.runtime.manager import PluginStack

    return PluginStack([plugin])


def test_loss_hooks_mix_advantages_or_add_the_kl_term():
    lp = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.25]])).requires_grad_(True)
    teacher = torch.tensor([[-0.1, -0.2], [math.nan, math.nan]])
    ctx = make_loss_context(lp, advantages=torch.tensor([1.0, 1.0]).unsqueeze(1).expand(2, 2).clone(),
                            teacher_logps=teacher)
    run_hook(_stack_of(_plugin({"teacher_model": "x", "hints": "none", "lam": 0.5})),
             "trl_plugins_loss_advantages", ctx)
    want = 0.5 + 0.5 * (teacher[0] - lp.detach()[0])
    assert torch.allclose(ctx.advantages[0], want) and torch.equal(ctx.advantages[1], torch.ones(2))
    kl_ctx = make_loss_context(lp, teacher_logps=teacher)
    base = loss_from_context(kl_ctx)
    run_hook(_stack_of(_plugin({"teacher_model": "x", "hints": "none", "distill": "kl_penalty", "kl_coef": 0.3})),
             "trl_plugins_loss", kl_ctx)
    (term,) = kl_ctx.token_terms
    assert torch.allclose(term, 0.3 * teacher_kl_k3(lp, teacher)) and term[1].abs().sum() == 0
    assert loss_from_context(kl_ctx) > base
    plain = make_loss_context(lp)  # no teacher log-probs attached (evaluation): nothing happens
    run_hook(_stack_of(_plugin({"teacher_model": "x", "hints": "none"})), "trl_plugins_loss_advantages", plain)
    assert plain.advantages.shape == (2, 1)


def _answer_reward(completions, **kwargs):
    return [1.0 if "=7" in (c if isinstance(c, str) else c[-1]["content"]) else 0.0 for c in completions]


def test_all_fail_groups_are_resampled_with_a_hint_and_positives_replace_their_rows():
    rows = stub_rows(2, 2, hint=["use 3+4", "unused"])
    service_answers = {0: "3+4=7", 1: "3+4=8"}

    ctx = make_rollout_context([["wrong", "bad"], ["=7", "no"]], rows=rows, reward_funcs=[_answer_reward])
    ctx.service.respond = lambda prompt, j: service_answers[j]
    run_hook(_stack_of(_plugin({"hints": "column", "lam": 1.0})), "trl_plugins_after_generation", ctx)
    (prompts,) = ctx.service.calls
    assert len(prompts) == 2 and all(p[-1]["content"] == "Q0\n\nHint: use 3+4" for p in prompts)  # group 0 only
    assert ctx.completions[0][-1]["content"] == "3+4=7" and ctx.annotations[0][HINTED]
    assert ctx.prompt_swapped[0] and all(ctx.offpolicy[0]) and ctx.training_prompts[0] == rows[0]["prompt"]
    assert all(math.isnan(x) for x in ctx.sampling_logprobs[0])
    assert ctx.completions[1][-1]["content"] == "bad" and not ctx.prompt_swapped[1]  # rejected: row unchanged
    assert ctx.completions[2][-1]["content"] == "=7"  # group 1 has a success: untouched
    assert ctx.metrics["plugins/kepo/hinted_rows"] == [1.0] and ctx.metrics["plugins/kepo/hinted_success_rate"] == [0.5]
    assert ctx.metrics["plugins/kepo/hard_group_fraction"] == [0.5]


def test_teacher_hints_are_asked_once_per_group():
    plugin = _plugin({"teacher_model": "x", "lam": 1.0})
    plugin.teacher = StubTeacher()
    ctx = make_rollout_context([["a", "b"], ["c", "d"]], reward_funcs=[_answer_reward])
    run_hook(_stack_of(plugin), "trl_plugins_after_generation", ctx)
    (asked,) = plugin.teacher.chat_calls
    assert len(asked) == 2 and "Q0" in asked[0][0]["content"] and "Q1" in asked[1][0]["content"]
    assert all(p[-1]["content"].endswith("Hint: think of 7") for p in ctx.service.calls[0])


# ------------------------------------------------------------------------------------------ runs
def test_neutral_setting_reduces_to_vanilla():
    assert_reduces_to_vanilla("kepo", {"lam": 1.0, "hints": "none"})


def test_kepo_trains_under_lora_with_a_local_teacher(tmp_path, teacher_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = make_tiny_trainer(plugins=["kepo"], reward_funcs=[digit_fraction_reward], peft_config=lora,
                                output_dir=str(tmp_path), max_steps=2, dataset=tiny_dataset(8),
                                plugin_config={"kepo": {"teacher_model": teacher_path, "success_threshold": 0.1,
                                                        "teacher_max_tokens": 8}})
    teacher = trainer.plugin_stack.by_name["kepo"].teacher
    scored = []
    original = teacher.logprobs
    teacher.logprobs = lambda p, c: scored.append(len(c)) or original(p, c)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert all("lora_" in n for n in before)
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before if "lora_B" in n)
    logs = {k: v for e in trainer.state.log_history for k, v in e.items()}
    assert sum(scored) > 0 and logs["plugins/kepo/gated_fraction"] > 0
    assert "plugins/kepo/teacher_advantage" in logs and "plugins/kepo/hard_group_fraction" in logs


def test_a_teacher_endpoint_dying_during_training_stops_it_with_the_url(tmp_path):
    url = _dead_url()
    trainer = make_tiny_trainer(plugins=["kepo"], reward_funcs=[digit_fraction_reward], output_dir=str(tmp_path),
                                max_steps=1, plugin_config={"kepo": {
                                    "teacher": "endpoint", "teacher_base_url": url, "teacher_probe": False,
                                    "hints": "none", "success_threshold": 0.0, "teacher_max_retries": 1}})
    trainer.plugin_stack.by_name["kepo"].teacher.client.config.backoff = 0.01
    with pytest.raises(EndpointError, match=rf"{url}/completions failed after 2 attempts"):
        trainer.train()


class _BadTeacher(StubTeacher):
    def __init__(self, value, length_delta=0):
        super().__init__()
        self.value, self.length_delta = value, length_delta

    def logprobs(self, prompt_ids, completion_ids):
        out = [torch.full((len(c) + self.length_delta,), -0.5) for c in completion_ids]
        if not self.length_delta:
            out[-1][1] = self.value
        return out


@pytest.mark.parametrize("value, length_delta, expected", [
    (-math.inf, 0, "kepo: teacher log-probs (ctx.teacher_logps): -inf for completion token 1 of row 3; allowed: a finite"),
    (math.nan, 0, "nan for completion token 1 of row 3"),
    (0.5, 0, "0.5 for completion token 1 of row 3; allowed: a finite number <= 0"),
    (0.0, 1, "4 values for the 3 completion tokens of row 0"),
])
def test_a_teacher_log_prob_that_cannot_enter_the_loss_is_refused_naming_plugin_row_and_token(value, length_delta,
                                                                                                expected):
    from trl_plugins import PluginError

    plugin = _plugin({"teacher_model": "unused", "hints": "none"})
    plugin.teacher = _BadTeacher(value, length_delta)
    mask = torch.ones(4, 3)
    ctx = make_advantage_context([1.0, 0.0, 0.0, 1.0], num_generations=2, policy_stats=stub_policy_stats(4, 3, mask=mask))
    with pytest.raises(PluginError) as err:
        run_hook(_stack_of(plugin), "trl_plugins_transform_advantages", ctx)
    assert expected in str(err.value)


def test_an_endpoint_answering_minus_inf_is_an_endpoint_error_naming_the_url():
    from trl_plugins.components.teacher_logprobs import parse_echo_logprobs

    choice = {"logprobs": {"token_logprobs": [None, -0.1, float("-inf")]}}
    with pytest.raises(EndpointError, match=r"http://h/v1/completions answered an invalid log-prob -inf for "
                                            r"completion token 1 \(allowed: a finite number <= 0\)"):
        parse_echo_logprobs(choice, [1, 2, 3], 1, "http://h/v1/completions")
