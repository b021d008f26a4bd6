"""fbos_rl: FBOS-RL feedback-guided second round with EPA/ECC.

Unit tests drive the sampling and advantage hooks on hand-built contexts (real tiny tokenizer, bundled verifier and
feedback, a scripted generation service); trainer-level tests check the rollout budget (exactly G per prompt through
the backend), the training prompt of every row and NaN sampling log-probs on EPA rows; one end-to-end run stacks
fbos_rl with canon."""

import math

import pytest
import torch
import trl

from trl_plugins import Completion, PluginConfigError, build_plugins
from trl_plugins.components.prm import arithmetic_row
from trl_plugins.api.contexts import OFFPOLICY_KEY
from trl_plugins.tasks.arithmetic import Problem, accuracy_reward, feedback
from trl_plugins.testing import (
    assert_runs_equal,
    digit_fraction_reward,
    make_advantage_context,
    make_prompt_context,
    make_rollout_context,
    make_tiny_trainer,
    record_run,
    tiny_tokenizer,
)
from trl_plugins_builtin.fbos_rl import (
    DEFAULT_REVISE,
    DEFAULT_SINGLE_TURN,
    feedback_prompt,
    recentre,
    round2_sources,
    simple_feedback,
    subgroup_advantages,
)

TOK = tiny_tokenizer()
EOS = TOK.eos_token_id
PROBLEMS = [Problem.from_expression([3, 4, 2], ["+", "*"]), Problem.from_expression([6, 2, 3], ["-", "*"])]
SLIP = ["3+4=7\n7*2=15\nAnswer: 15", "6-2=4\n4*3=13\nAnswer: 13"]  # per problem: second step wrong


def _ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"] + [EOS]


def _text(c):
    return c if isinstance(c, str) else c[-1]["content"]


def _rows_prompts(n_groups, G):
    rows, prompts = [], []
    for g in range(n_groups):
        p = PROBLEMS[g % 2]
        prompt = [{"role": "user", "content": p.question}]
        for _ in range(G):
            prompts.append(prompt)
            rows.append({"prompt": prompt, "answer": str(p.answer), "solution": p.solution, "problem": p.to_json()})
    return rows, prompts


def run_prompts(n_groups, G, **options):
    rows, _ = _rows_prompts(n_groups, G)
    pctx = make_prompt_context(rows, num_generations=G)
    stack = build_plugins(["fbos_rl"], {"fbos_rl": options})
    stack.call("trl_plugins_generation_prompts", pctx)
    return pctx, stack


class ScriptedService:
    """Answers a FAP (a prompt with more than one message) with the reference solution, the original prompt with a
    wrong one; records every call."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts=None, **kwargs):
        self.calls.append(list(prompts))
        out = []
        for p in prompts:
            question = p[0]["content"]
            problem = Problem.from_json(arithmetic_row(question)["problem"])
            text = problem.solution if len(p) > 1 else "9+9=1\nAnswer: 1"
            ids = _ids(text)
            out.append(Completion(completion_ids=ids, logprobs=[-0.3] * len(ids), text=text))
        return out


def make_ctx(round1_texts, G, *, step=0, service=None, **options):
    """Round-1 texts per group (G1 each); deferred rows hold empty completions as the trainer leaves them."""
    n_groups = len(round1_texts)
    pctx, stack = run_prompts(n_groups, G, **options)
    texts = []
    for g, group in enumerate(round1_texts):
        texts += list(group) + [""] * (G - len(group))
    ctx = make_rollout_context(
        texts, num_generations=G, rows=pctx.rows, step=step, annotations=pctx.annotations, tokenizer=TOK, eos=True,
        service=service or ScriptedService(), deferred=[i for i, d in enumerate(pctx.deferred) if d],
        scorer=lambda rows_, prompts_, comps: torch.tensor(accuracy_reward(comps, [r["answer"] for r in rows_])),
    )
    stack.call("trl_plugins_after_generation", ctx)
    return ctx


# ------------------------------------------------------------------------------------------ pure functions
def test_round2_sources_failed_first_cycling():
    assert round2_sources(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4, 0.5, "original") == [1, 3, 1, 3]
    assert round2_sources(torch.tensor([0.0, 0.0]), 3, 0.5, "original") == [0, 1, 0]
    assert round2_sources(torch.tensor([1.0, 1.0]), 2, 0.5, "original") == [None, None]
    assert round2_sources(torch.tensor([1.0, 1.0]), 3, 0.5, "feedback") == [0, 1, 0]


def test_feedback_prompt_formats():
    prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}]
    multi = feedback_prompt(prompt, "ATTEMPT", "FEEDBACK", "multi_turn", DEFAULT_REVISE, DEFAULT_SINGLE_TURN)
    assert multi == prompt + [{"role": "assistant", "content": "ATTEMPT"},
                              {"role": "user", "content": f"FEEDBACK\n\n{DEFAULT_REVISE}"}]
    single = feedback_prompt(prompt, "ATTEMPT", "FEEDBACK", "single_turn", DEFAULT_REVISE, DEFAULT_SINGLE_TURN)
    assert single[0] == prompt[0] and len(single) == 2
    assert all(x in single[1]["content"] for x in ("Q?", "ATTEMPT", "FEEDBACK"))
    assert feedback_prompt("Q?", "A", "F", "multi_turn", DEFAULT_REVISE, "{question}|{response}|{feedback}") == "Q?|A|F"
    assert prompt == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}]  # not mutated
    assert simple_feedback(False, 7) == "The solution is incorrect. The correct final answer is 7."


def test_subgroup_advantages_zero_mean_per_subgroup():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    keys = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    for scale in ("group", "batch", "none"):
        adv = subgroup_advantages(rewards, keys, scale)
        for k in range(4):
            assert abs(adv[keys == k].sum().item()) < 1e-6
    adv = subgroup_advantages(rewards, keys, "none")
    assert adv.tolist() == [0.5, -0.5, 0.0, 0.0, 0.0, 0.0, -0.5, 0.5]  # all-equal sub-groups: zeros
    g = subgroup_advantages(rewards, keys, "group")
    torch.testing.assert_close(g[:2], torch.tensor([0.5, -0.5]) / (torch.tensor([1.0, 0.0]).std() + 1e-4))
    nan = subgroup_advantages(torch.tensor([1.0, float("nan"), 0.0]), torch.tensor([0, 0, 0]), "none")
    assert nan.tolist() == [0.5, 0.0, -0.5]
    assert recentre(torch.tensor([1.0, 3.0, 5.0, 5.0]), torch.tensor([0, 0, 1, 1])).tolist() == [-1.0, 1.0, 0.0, 0.0]


# ------------------------------------------------------------------------------------------ sampling hooks
def test_round_two_rows_are_deferred_within_the_budget():
    pctx, _ = run_prompts(2, 4)
    assert pctx.deferred == [False, False, True, True] * 2
    pctx, _ = run_prompts(1, 8, g1=6)
    assert pctx.deferred == [False] * 6 + [True] * 2
    pctx, _ = run_prompts(1, 4, g1=4)  # G1 = G: plain GRPO
    assert pctx.deferred == []


def test_fap_ecc_and_epa_rows():
    G = 4
    service = ScriptedService()
    ctx = make_ctx([[SLIP[0], PROBLEMS[0].solution], [SLIP[1], "junk"]], G, service=service)
    # budget: one collective call with exactly G2 = 2 prompts per group
    assert len(service.calls) == 1 and len(service.calls[0]) == 4
    # group 0: the only failure (slot 0) feeds both round-2 slots; group 1: slots take failures 0 and 1
    fb0 = feedback(PROBLEMS[0], SLIP[0])
    assert fb0 == "Step 2 is wrong: 7*2 is 14, not 15."
    expected_fap0 = ctx.prompts[0] + [{"role": "assistant", "content": SLIP[0]},
                                     {"role": "user", "content": f"{fb0}\n\n{DEFAULT_REVISE}"}]
    assert service.calls[0][0] == service.calls[0][1] == expected_fap0
    assert service.calls[0][3][1]["content"] == "junk"
    for i in (2, 3, 6, 7):  # ECC rows: trained under their FAP, on-policy, the service's log-probs kept
        assert ctx.training_prompts[i] == service.calls[0][[2, 3, 6, 7].index(i)]
        assert ctx.prompt_ids[i] == TOK.apply_chat_template(ctx.training_prompts[i], add_generation_prompt=True,
                                                            return_dict=False)
        assert ctx.prompt_swapped[i] is False and not any(ctx.offpolicy[i])
        assert ctx.sampling_logprobs[i] == [-0.3] * len(ctx.completion_ids[i])
        assert ctx.annotations[i]["fbos_role"] == "ecc"
    # EPA: at most one per group, onto the failed source of the first successful round-2 row, under x
    for i, source_row in ((0, 2), (4, 6)):
        assert ctx.completion_ids[i] == ctx.completion_ids[source_row]
        assert ctx.training_prompts[i] == ctx.prompts[i] and ctx.prompt_swapped[i] is True
        assert all(ctx.offpolicy[i]) and all(math.isnan(x) for x in ctx.sampling_logprobs[i])
        assert ctx.annotations[i] == {"fbos_role": "epa", "fbos_source": 2}
    assert ctx.annotations[1]["fbos_role"] == "round1" and ctx.annotations[5]["fbos_role"] == "round1"
    assert _text(ctx.completions[5]) == "junk"  # the second failure of group 1 stays (epa_max_per_group = 1)
    m = {k.split("/")[-1]: v[0] for k, v in ctx.metrics.items()}
    assert m["round1_success_rate"] == 0.25 and m["round2_success_rate"] == 1.0
    assert m["rescued_group_fraction"] == 0.5 and m["epa_fraction"] == 0.25 and m["ecc_fraction"] == 0.5


def test_groups_without_failure_sample_round_two_under_x():
    service = ScriptedService()
    ctx = make_ctx([[PROBLEMS[0].solution, PROBLEMS[0].solution]], 4, service=service)
    assert service.calls[0] == [ctx.prompts[2], ctx.prompts[3]]  # the original prompt
    assert [a["fbos_role"] for a in ctx.annotations] == ["round1"] * 4
    assert ctx.training_prompts == ctx.prompts and not any(any(f) for f in ctx.offpolicy)
    service = ScriptedService()
    ctx = make_ctx([[PROBLEMS[0].solution, PROBLEMS[0].solution]], 4, service=service, all_success="feedback")
    assert service.calls[0][0][-1]["content"] == f"Correct.\n\n{DEFAULT_REVISE}"


def test_options_epa_off_plain_alternate_and_feedback_kinds():
    groups = [[SLIP[0], "junk"]]
    ctx = make_ctx(groups, 4, epa=False)
    assert [a["fbos_role"] for a in ctx.annotations] == ["round1", "round1", "ecc", "ecc"]
    ctx = make_ctx(groups, 4, epa_offpolicy="plain")
    assert ctx.prompt_swapped[0] is True and not any(ctx.offpolicy[0])  # swapped, on the plain surrogate
    assert all(math.isnan(x) for x in ctx.sampling_logprobs[0])  # still no IS correction
    ctx = make_ctx(groups, 4, schedule="alternate", step=1)  # odd step: ECC only, no EPA copy
    assert "epa" not in [a["fbos_role"] for a in ctx.annotations]
    service = ScriptedService()
    make_ctx(groups, 4, service=service, feedback="simple_gt")
    assert service.calls[0][0][-1]["content"].startswith("The solution is incorrect. The correct final answer is 14.")
    service = ScriptedService()
    make_ctx(groups, 4, service=service, feedback="simple", leak_answer=True, fap_format="single_turn")
    content = service.calls[0][0][-1]["content"]
    assert "The solution is incorrect. The correct final answer is 14." in content and SLIP[0] in content
    with pytest.raises(PluginConfigError, match="single_turn_template"):
        build_plugins(["fbos_rl"], {"fbos_rl": {"single_turn_template": "{question}"}})
    with pytest.raises(PluginConfigError, match="judge_base_url"):
        build_plugins(["fbos_rl"], {"fbos_rl": {"feedback": "judge"}})


# ------------------------------------------------------------------------------------------ advantage hook
def _adv_ctx(rewards, roles, G, step=0):
    N = len(rewards)
    return make_advantage_context(torch.tensor(rewards), num_generations=G, advantages=torch.zeros(N),
                                  completion_lengths=torch.ones(N), annotations=[{"fbos_role": x} for x in roles],
                                  step=step)


@pytest.mark.parametrize("schedule,step,weight", [("joint", 0, 0.5), ("alternate", 0, 0.0), ("alternate", 1, 0.5)])
def test_subgroup_advantages_and_ecc_weight(schedule, step, weight):
    stack = build_plugins(["fbos_rl"], {"fbos_rl": {"ecc_weight": 0.5, "schedule": schedule}})
    list(stack)[0]._scale = "none"
    ctx = _adv_ctx([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0], ["epa", "round1", "ecc", "ecc"] * 2, 4, step)
    stack.call("trl_plugins_transform_advantages", ctx)
    assert ctx.advantages.tolist() == [0.5, -0.5, 0.5 * weight, -0.5 * weight, 0.0, 0.0, -0.5 * weight, 0.5 * weight]


def test_eval_batches_keep_trl_advantages():
    stack = build_plugins(["fbos_rl"], None)
    ctx = _adv_ctx([1.0, 0.0, 0.0, 0.0], ["x"] * 4, 4)
    ctx.annotations = [{} for _ in range(4)]
    ctx.advantages = torch.tensor([9.0, 8.0, 7.0, 6.0])
    stack.call("trl_plugins_transform_advantages", ctx)
    assert ctx.advantages.tolist() == [9.0, 8.0, 7.0, 6.0]


# ------------------------------------------------------------------------------------------ trainer level
G = 4


def _backend(tok, calls):
    """vLLM-like backend: FAP prompts (they contain the revise request) get the reference solution, others fail."""

    def fake(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        calls.append(len(prompt_ids))
        ids_out, lps_out = [], []
        for ids in prompt_ids:
            text = tok.decode(ids, skip_special_tokens=True)
            problem = Problem.from_json(arithmetic_row(text[text.index("Compute"):])["problem"])
            completion = problem.solution if "Revise" in text else problem.step_lines[0] + "\nAnswer: 0"
            out = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids_out.append(out)
            lps_out.append([-0.25] * len(out))
        return ids_out, lps_out

    return fake


def test_trainer_budget_training_prompts_and_nan_logps(tmp_path, monkeypatch):
    trainer = make_tiny_trainer(plugins=["fbos_rl"], max_completion_length=40, output_dir=str(tmp_path),
                                log_level="error")
    calls = []
    trainer._generate_single_turn = _backend(trainer.processing_class, calls)
    monkeypatch.setattr(trainer, "use_vllm", True)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_correction", True)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_mode", "token_truncate")
    ds = trainer.train_dataset
    rows = [dict(ds[k]) for k in range(2) for _ in range(G)]
    trainer.model.train()
    out = trainer._generate_and_score_completions(rows)
    assert calls == [4, 4]  # round 1: G1 = 2 per prompt; round 2: G2 = 2 per prompt -> exactly G per prompt
    tok = trainer.processing_class

    def template(prompt):
        return tok(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"]

    prompt_ids = [row[m.bool()].tolist() for row, m in zip(out["prompt_ids"], out["prompt_mask"])]
    mask = out["completion_mask"].bool()
    lps, off = out["sampling_per_token_logps"], out[OFFPOLICY_KEY]
    for g in range(2):
        x = rows[g * G]["prompt"]
        problem = Problem.from_json(rows[g * G]["problem"])
        attempt = problem.step_lines[0] + "\nAnswer: 0"
        fap = x + [{"role": "assistant", "content": attempt},
                   {"role": "user", "content": f"{feedback(problem, attempt)}\n\n{DEFAULT_REVISE}"}]
        epa, failed, ecc = g * G, g * G + 1, (g * G + 2, g * G + 3)
        assert prompt_ids[epa] == prompt_ids[failed] == template(x)  # EPA and round-1 rows: the original prompt
        for i in ecc:
            assert prompt_ids[i] == template(fap)  # ECC rows: the feedback-augmented prompt
            assert not off[i].any() and torch.all(lps[i][mask[i]] == -0.25)
        n = int(mask[epa].sum())
        assert tok.decode(out["completion_ids"][epa, :n], skip_special_tokens=True) == problem.solution
        assert off[epa, :n].all() and torch.isnan(lps[epa, :n]).all()  # EPA: off-policy, no IS correction
        assert torch.all(out["importance_sampling_ratio"][epa, :n] == 1)
    adv = out["advantages"]
    assert adv[0] > 0 and adv[1] < 0 and abs(adv[2]) < 1e-6  # x sub-group [1, 0]; ECC sub-group all correct


def test_neutral_g1_equal_g_reduces_to_vanilla_grpo(tmp_path):
    common = dict(max_steps=1, reward_funcs=[accuracy_reward, digit_fraction_reward], output_dir=str(tmp_path),
                  log_level="error")
    vanilla = record_run(make_tiny_trainer(trainer_cls=trl.GRPOTrainer, **common))
    with pytest.warns(UserWarning, match="plain GRPO"):
        neutral_trainer = make_tiny_trainer(plugins=["fbos_rl"], plugin_config={"fbos_rl": {"g1": G}}, **common)
    assert_runs_equal(vanilla, record_run(neutral_trainer))


def test_end_to_end_fbos_rl_with_canon(tmp_path):
    """Real HF generation, canon's conditional advantages recentred within FBOS sub-groups."""
    trainer = make_tiny_trainer(
        plugins=["canon", "fbos_rl"], plugin_config={"fbos_rl": {"advantage": "recentre"}, "canon": {"lam": 0.5}},
        reward_funcs=[accuracy_reward, digit_fraction_reward], loss_type="dr_grpo", max_completion_length=24,
        max_steps=2, output_dir=str(tmp_path), log_level="error")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run_ = record_run(trainer)
    logs = [log for log in run_.logs if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        assert log["plugins/fbos_rl/ecc_fraction"] == 0.5 and "plugins/canon/lam" in log
        assert log["plugins/framework/extra_rollouts"] == 2  # G2 = 2 of the G = 4 rollouts, from round 2
    assert any(not torch.equal(before[n], p) for n, p in run_.params.items())
    for adv, ids in zip(run_.advantages, run_.completion_ids):
        assert adv.shape[0] == ids.shape[0] == G


# ------------------------------------------------------------------------------------------ rule-based feedback
def test_rule_feedback_format_violations_correctness_and_error_location():
    from trl_plugins.api.answers import get_extractor
    from trl_plugins_builtin.fbos_rl import rule_feedback

    boxed = get_extractor("boxed_or_last_number")
    hint = "State the final answer as \\boxed{...}."
    assert rule_feedback("  \n ", "14", boxed) == f"The solution is empty. Solve the problem step by step. {hint}"
    assert rule_feedback("I am not sure.", "14", boxed) == f"Format problem: no final answer could be found. {hint}"
    assert rule_feedback("\\boxed{14} or maybe \\boxed{15}", "14", boxed).startswith(
        "Format problem: the solution gives 2 different final answers.")
    assert rule_feedback("3+4=7\n7*2=14\nSo \\boxed{14.0}", "14", boxed) == "The final answer is correct."
    # the reference value is reached in step 2, the answer (step 4) is wrong: the error comes after step 2
    slip = "3+4=7\n7*2=14\n14+1=15\nSo \\boxed{15}"
    assert rule_feedback(slip, "14", boxed) == (
        "The final answer 15 is incorrect. Step 2 already reaches the expected result; the first error comes after it.")
    # never reached: located at the step that states the wrong answer (step 3 here, not the last line)
    wrong = "3+4=8\n8*2=16\nAnswer: \\boxed{16}\nDone."
    assert rule_feedback(wrong, "14", boxed) == (
        "The final answer 16 is incorrect. No step reaches the expected result: the error is in step 3 or before it.")
    for text in (slip, wrong):
        assert "14" not in rule_feedback(text, "14", boxed)  # the right answer is never stated
    assert rule_feedback("a=1\n\nb=1+1=2\n\nAnswer: 2", "1", boxed, separator="\n\n").startswith(
        "The final answer 2 is incorrect. Step 1 already reaches")
    # only a step's result counts, not its operands: 14 is an operand of step 3, never a result
    assert rule_feedback("3+4=7\n7*2=15\n15-1=14\nAnswer: 16", "7", boxed).startswith(
        "The final answer 16 is incorrect. Step 1 already reaches")
    assert "No step reaches" in rule_feedback("3+4=7\n14+2=16\nAnswer: 16", "14", boxed)


def test_rule_feedback_works_without_the_task_column_and_task_feedback_says_so():
    from trl_plugins.testing import make_rollout_context, stub_rows

    rows = stub_rows(1, 4, answer="42")  # a generic dataset: prompt + answer, no 'problem' column
    ctx = make_rollout_context([["x"] * 4], rows=rows)
    texts = ["6*7=42\nthen 42+1=43\nAnswer: 43", "no idea"]
    rule = build_plugins(["fbos_rl"], {"fbos_rl": {"feedback": "rule"}}).by_name["fbos_rl"]
    assert rule.required_columns() == ["answer"]
    assert rule._feedback(ctx, [0, 1], texts, [False, False]) == [
        "The final answer 43 is incorrect. Step 1 already reaches the expected result; the first error comes after it.",
        "Format problem: no final answer could be found. State the final answer as \\boxed{...}.",
    ]
    leaky = build_plugins(["fbos_rl"], {"fbos_rl": {"feedback": "rule", "leak_answer": True}}).by_name["fbos_rl"]
    assert leaky._feedback(ctx, [1], texts[1:], [False])[0].endswith("The correct final answer is 42.")
    task = build_plugins(["fbos_rl"], None).by_name["fbos_rl"]
    with pytest.raises(PluginConfigError, match="bundled arithmetic tasks.*feedback='rule'"):
        task._feedback(ctx, [0], texts[:1], [False])
    with pytest.raises(PluginConfigError, match="extractor"):
        build_plugins(["fbos_rl"], {"fbos_rl": {"feedback": "rule", "extractor": "nope"}})


def test_trainer_rule_feedback_on_a_dataset_without_the_task_column(tmp_path):
    from trl_plugins.testing import tiny_dataset

    dataset = tiny_dataset().remove_columns(["problem", "rubrics"])
    trainer = make_tiny_trainer(plugins=["fbos_rl"], plugin_config={"fbos_rl": {"feedback": "rule"}},
                                dataset=dataset, max_completion_length=40, output_dir=str(tmp_path), log_level="error")
    calls = []
    trainer._generate_single_turn = _backend(trainer.processing_class, calls)
    rows = [dict(dataset[k]) for k in range(2) for _ in range(G)]
    trainer.model.train()
    out = trainer._generate_and_score_completions(rows)
    assert calls == [4, 4]  # the budget is unchanged: G1 then G2 per prompt
    tok = trainer.processing_class
    for g in range(2):
        prompt_ids = out["prompt_ids"][g * G + 2][out["prompt_mask"][g * G + 2].bool()]
        fap = tok.decode(prompt_ids, skip_special_tokens=True)
        answer = rows[g * G]["answer"]
        assert "The final answer 0 is incorrect." in fap and DEFAULT_REVISE in fap
        assert f"answer is {answer}" not in fap  # no leak
    assert out["advantages"][0] > 0  # the EPA copy of a successful FAP rollout, under the original prompt
