"""critique_grpo: Critique-GRPO as in its official code.

Hook tests on hand-built RolloutContexts (real tiny tokenizer, bundled verifier, a scripted generation service and a
loopback critic endpoint); a trainer-level run checks slot 0's training prompt and provenance on the tiny model."""

import math
from types import SimpleNamespace

import pytest
import torch
import trl

from trl_plugins import Completion, IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.components.client import EndpointConfig
from trl_plugins.components.local_server import chat_response, serve_openai_compatible
from trl_plugins.components.teacher import EndpointTeacher
from trl_plugins.api.contexts import OFFPOLICY_KEY
from trl_plugins.tasks.arithmetic import Problem, accuracy_reward
from trl_plugins.testing import (
    assert_runs_equal,
    digit_fraction_reward,
    make_rollout_context,
    make_tiny_trainer,
    record_run,
    tiny_tokenizer,
)
from trl_plugins_builtin.critique_grpo import (
    DEFAULT_REFINEMENT,
    DEFAULT_SYSTEM,
    pick_refinement,
    refinement_prompt,
    simple_critique,
)

TOK = tiny_tokenizer()
EOS = TOK.eos_token_id
PROBLEM = Problem.from_expression([3, 4, 2], ["+", "*"])  # Answer: 14
WRONG = "3+4=7\n7*2=15\nAnswer: 15"


def _ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"] + [EOS]


def _text(c):
    return c if isinstance(c, str) else c[-1]["content"]


class ScriptedService:
    """Refinements: the response number k (in call order) gets ``answers[k]`` as its text."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def generate(self, prompts=None, **kwargs):
        self.calls.append(list(prompts))
        return [Completion(completion_ids=_ids(self.answers[k]), logprobs=[-0.2] * len(_ids(self.answers[k])),
                           text=self.answers[k]) for k in range(len(prompts))]


def make_ctx(texts, G, service, step=0, process_index=0, gather=None):
    prompt = [{"role": "user", "content": PROBLEM.question}]
    rows = [{"prompt": prompt, "answer": "14", "solution": PROBLEM.solution} for _ in texts]
    return make_rollout_context(
        texts, num_generations=G, rows=rows, service=service, step=step, tokenizer=TOK, eos=True,
        scorer=lambda rows_, prompts_, comps: torch.tensor(accuracy_reward(comps, [r["answer"] for r in rows_])),
        process_index=process_index, gather=gather,
    )


def run(ctx, critic=None, **options):
    stack = build_plugins(["critique_grpo"], {"critique_grpo": options})
    list(stack)[0].critic = critic
    stack.call("trl_plugins_after_generation", ctx)
    return ctx


# ------------------------------------------------------------------------------------------ pure functions
def test_pick_refinement_first_success_else_highest():
    assert pick_refinement([0.0, 1.0, 1.0, 0.0], 0.5) == 1
    assert pick_refinement([0.2, 0.4, 0.4, 0.1], 0.5) == 1  # highest, first of ties
    assert pick_refinement([math.nan, 0.3, math.nan], 0.5) == 1
    assert pick_refinement([math.nan, math.nan], 0.5) is None


def test_critiques_and_refinement_prompt():
    assert simple_critique(False, 14) == "The generated solution is incorrect, the ground truth is 14."
    assert simple_critique(True) == "The generated solution is correct."
    conv = refinement_prompt([{"role": "system", "content": "orig"}, {"role": "user", "content": "Q?"}], "R", "C",
                             DEFAULT_REFINEMENT, DEFAULT_SYSTEM)
    assert conv == [{"role": "system", "content": DEFAULT_SYSTEM},
                    {"role": "user", "content": DEFAULT_REFINEMENT.format(question="Q?", response="R", critique="C")}]
    assert refinement_prompt("Q?", "R", "C", "{question}|{response}|{critique}", DEFAULT_SYSTEM) == "Q?|R|C"


# ------------------------------------------------------------------------------------------ the hook
def test_one_refinement_replaces_slot_zero_fully_off_policy():
    G = 4
    service = ScriptedService([WRONG, PROBLEM.solution, PROBLEM.solution, WRONG])
    ctx = make_ctx([WRONG, WRONG, PROBLEM.solution, "junk"], G, service)
    prompt_before = (ctx.training_prompts[0], ctx.prompt_ids[0])
    kept = [(list(ctx.completion_ids[i]), list(ctx.sampling_logprobs[i])) for i in range(1, 4)]
    run(ctx)
    (prompts,) = service.calls  # one refinement per response, in one collective call
    assert len(prompts) == G
    assert prompts[0] == refinement_prompt(ctx.prompts[0], WRONG, simple_critique(False, "14"), DEFAULT_REFINEMENT,
                                           DEFAULT_SYSTEM)
    assert simple_critique(True, "14") in prompts[2][1]["content"]  # correct responses are refined too
    assert ctx.changed == {0}  # only slot 0, with the first successful refinement (response 1's)
    assert ctx.completion_ids[0] == _ids(PROBLEM.solution)
    assert all(ctx.offpolicy[0]) and all(math.isnan(x) for x in ctx.sampling_logprobs[0])
    assert ctx.prompt_swapped[0] is True and (ctx.training_prompts[0], ctx.prompt_ids[0]) == prompt_before
    assert ctx.annotations[0] == {"critique_refined": True, "critique_source": 1}
    assert [(ctx.completion_ids[i], ctx.sampling_logprobs[i]) for i in range(1, 4)] == kept
    m = {k.split("/")[-1]: v[0] for k, v in ctx.metrics.items()}
    assert m["initial_success_rate"] == 0.25 and m["refinement_success_rate"] == 0.5
    assert m["replaced_with_success_fraction"] == 1.0


def test_without_a_successful_refinement_the_highest_still_replaces_slot_zero():
    service = ScriptedService([WRONG, WRONG])
    ctx = run(make_ctx([WRONG, WRONG], 2, service))
    assert ctx.changed == {0} and _text(ctx.completions[0]) == WRONG
    ctx = run(make_ctx([WRONG, WRONG], 2, ScriptedService([WRONG, WRONG])), require_success=True)
    assert not ctx.changed


def test_refine_failed_only_and_replace_index():
    service = ScriptedService([PROBLEM.solution])
    ctx = run(make_ctx([PROBLEM.solution, WRONG, PROBLEM.solution], 3, service), refine="failed", replace_index=2)
    assert len(service.calls[0]) == 1 and WRONG in service.calls[0][0][1]["content"]
    assert ctx.changed == {2}


def test_text_critique_from_a_loopback_critic():
    seen = []

    def handler(path, payload):
        seen.append(payload["messages"][-1]["content"])
        return chat_response("Step 2 multiplies wrongly.")

    service = ScriptedService([PROBLEM.solution, PROBLEM.solution])
    with serve_openai_compatible(handler) as url:
        critic = EndpointTeacher(EndpointConfig(base_url=url, max_retries=0))
        run(make_ctx([WRONG, PROBLEM.solution], 2, service), critic=critic, critique_type="text",
            critic_base_url=url)
        critic.close()
    assert len(seen) == 1  # only the incorrect response goes to the critic
    assert PROBLEM.question in seen[0] and WRONG in seen[0] and PROBLEM.solution in seen[0]
    assert "Step 2 multiplies wrongly." in service.calls[0][0][1]["content"]
    assert simple_critique(True, "14") in service.calls[0][1][1]["content"]


def test_options_and_construction(tmp_path):
    with pytest.raises(PluginConfigError, match="refinement_template"):
        build_plugins(["critique_grpo"], {"critique_grpo": {"refinement_template": "{question}"}})
    with pytest.raises(PluginConfigError, match="critic_base_url"):
        build_plugins(["critique_grpo"], {"critique_grpo": {"critique_type": "text"}})
    plugin = list(build_plugins(["critique_grpo"], None))[0]
    with pytest.raises(IncompatiblePluginsError, match="offpolicy_shaping_gamma"):
        plugin.trl_plugins_configure(trainer=None, args=SimpleNamespace(offpolicy_shaping_gamma=0.2))
    with pytest.warns(UserWarning, match="scale_rewards='none'"):
        plugin.trl_plugins_configure(trainer=None, args=SimpleNamespace(offpolicy_shaping_gamma=0.1,
                                                                        scale_rewards="group"))


# ------------------------------------------------------------------------------------------ trainer level
def test_end_to_end_slot_zero_trained_under_the_original_prompt(tmp_path):
    G = 4
    trainer = make_tiny_trainer(plugins=["critique_grpo"], reward_funcs=[accuracy_reward, digit_fraction_reward],
                                scale_rewards="none", loss_type="dr_grpo", max_completion_length=16, max_steps=2,
                                output_dir=str(tmp_path), log_level="error")
    batches = []
    original = trainer._generate_and_score_completions

    def gen(inputs):
        out = original(inputs)
        batches.append((inputs, out))
        return out

    trainer._generate_and_score_completions = gen
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run_ = record_run(trainer)
    tok = trainer.processing_class
    for inputs, out in batches:
        off = out[OFFPOLICY_KEY]
        mask = out["completion_mask"].bool()
        assert off[0][mask[0]].all() and not off[1:].any()  # slot 0 of the (single) group, fully off-policy
        expected = tok(tok.apply_chat_template(inputs[0]["prompt"], add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False)["input_ids"]
        assert out["prompt_ids"][0][out["prompt_mask"][0].bool()].tolist() == expected  # the original question
    logs = [log for log in run_.logs if "loss" in log]
    assert len(logs) == 2 and all(log["plugins/framework/extra_rollouts"] == G for log in logs)
    assert all("plugins/critique_grpo/replaced_group_fraction" in log for log in logs)
    assert any(not torch.equal(before[n], p) for n, p in run_.params.items())


def test_neutral_setting_reduces_to_vanilla_grpo(tmp_path):
    """warmup_steps beyond the run: never active -> identical to trl.GRPOTrainer."""
    common = dict(max_steps=1, reward_funcs=[accuracy_reward, digit_fraction_reward], scale_rewards="none",
                  output_dir=str(tmp_path), log_level="error")
    vanilla = record_run(make_tiny_trainer(trainer_cls=trl.GRPOTrainer, **common))
    neutral = record_run(make_tiny_trainer(plugins=["critique_grpo"],
                                           plugin_config={"critique_grpo": {"warmup_steps": 10}}, **common))
    assert_runs_equal(vanilla, neutral)


class _FailingCritic:
    def chat(self, conversations):
        raise RuntimeError("critic endpoint timed out")


def test_a_critic_failing_on_one_process_stops_both():
    """G = 4 over 2 processes: only rank 1 holds wrong responses, so only its critic call fails; rank 0 must not
    wait in the refinement collective alone."""
    from trl_plugins import PluginError
    from trl_plugins.testing import run_on_processes

    def work(rank, gather):
        texts = [PROBLEM.solution, PROBLEM.solution] if rank == 0 else [WRONG, WRONG]
        ctx = make_ctx(texts, 4, ScriptedService([PROBLEM.solution] * 2), process_index=rank, gather=gather)
        try:
            run(ctx, critic=_FailingCritic(), critique_type="text", critic_base_url="http://127.0.0.1:9/v1")
        except Exception as exc:  # returned: both ranks' outcomes are checked
            return exc
        return None

    first, second = run_on_processes(2, work, timeout=10)
    assert isinstance(second, RuntimeError) and "timed out" in str(second)
    assert isinstance(first, PluginError) and "critique_grpo: process 1 failed" in str(first)
