"""The generative reward model run by the real model itself: builtin:smollm2 as deepseek_grm's pointwise judge.

Issue 31's real-model check. ``builtin:smollm2`` (SmolLM2-135M-Instruct, offline) judges held-out questions of the
bundled chat-arithmetic task (``trl_plugins.tasks.chat_arith``) through the local Hugging Face backend
(:class:`~trl_plugins.components.genrm.HFGenRMBackend`), with ``deepseek_grm``'s pointwise template (principles,
critique, ``\\boxed{score}`` from 1 to 10): each question is asked twice, once with the right number as the response
and once with a wrong one, ``k`` sampled judgements per request, parsed and voted (SPCT's sum of the k scores). It
prints and records, end to end:

* the verdict parsing: the share of the judgements with a parsable score, the rows with no verdict at all;
* the vote: per request the k parsed scores and their sum;
* the reward column as ``deepseek_grm`` writes it: the vote, rows without a verdict filled with their group's mean
  (:func:`~trl_plugins.components.genrm.neutral_fill`; a group is a question's two responses here);
* whether the judge tells right from wrong: the mean vote of right and of wrong responses, and the share of
  questions whose right response gets the higher vote (ties count one half).

``--templates deepseek_grm rating`` (the default) runs the check twice: with ``deepseek_grm``'s template, and with
``rating``, a one-line rating prompt of our own (:data:`RATING_TEMPLATE`: "rate the answer from 1 to 10, reply with the
number only"), the form a small instruction-tuned model can follow; ``deepseek_grm``'s plugin can take it through its
template option only in code (it is not one of its modes: SPCT's principles and critique are the method).

Usage: ``python scripts/genrm_smollm2_check.py [--n 8] [--k 4] [--max-tokens 192] [--templates ...] [--json PATH]
[--write-docs]``.
``--write-docs`` writes the ``genrm_smollm2`` block of docs/benchmarks.md. On a 2-core CPU the defaults take a few
minutes (64 judgements of at most 192 tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=8, help="held-out questions (each judged with a right and a wrong reply)")
    p.add_argument("--k", type=int, default=4, help="sampled judgements per request (the paper: 8)")
    p.add_argument("--max-tokens", type=int, default=192, help="new tokens per judgement")
    p.add_argument("--temperature", type=float, default=0.5, help="judge sampling temperature (deepseek_grm's)")
    p.add_argument("--templates", nargs="+", choices=["deepseek_grm", "rating"], default=["deepseek_grm", "rating"],
                   help="judge templates to run, one check each (main() only; run() takes one)")
    p.add_argument("--rating-max-tokens", type=int, default=12, help="new tokens per judgement of the rating template")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=str(ROOT / "docs" / "benchmarks" / "genrm_smollm2.json"))
    p.add_argument("--write-docs", action="store_true", help="write the genrm_smollm2 block of docs/benchmarks.md")
    return p.parse_args(argv)


def wrong_reply(answer: int, seed: int) -> int:
    """A wrong number near the answer (deterministic per question)."""
    delta = [1, -1, 2, -2, 10, -10][seed % 6]
    return answer + delta


def rating_template():
    """Our one-line pointwise rating prompt for small judges (the ``rating`` check): an answer whose first line is a
    number from 1 to 10 (optionally ``/10``) is the verdict; anything else is unparsable (a judge that restates the
    sum, "3 - 1 = 2", gave no rating)."""
    from trl_plugins.components.genrm import GenRMTemplate

    return GenRMTemplate(
        name="genrm_smollm2/rating", system="",
        user="Question: {question}\nAnswer: {response}\nIs the answer correct? Rate it from 1 (wrong) to 10 "
        "(correct). Reply with the number only.",
        verdict_regex=r"\A\s*(\d+(?:\.\d+)?)(?:\s*/\s*10)?[.!]?[ \t]*(?:\n|\Z)", low=1.0, high=10.0,
    )


def run(args, template: str = "deepseek_grm") -> dict:
    """One check with ``template`` (``deepseek_grm`` or ``rating``): the judged requests and the summary numbers."""
    import torch
    from transformers import set_seed

    from trl_plugins.components.genrm import GenerativeRewardModel, HFGenRMBackend, neutral_fill
    from trl_plugins.runtime.models import smollm2_path
    from trl_plugins.tasks.chat_arith import make_chat_dataset
    from trl_plugins_builtin.deepseek_grm import GRM_TEMPLATE

    judge_template = GRM_TEMPLATE if template == "deepseek_grm" else rating_template()
    max_tokens = args.max_tokens if template == "deepseek_grm" else args.rating_max_tokens

    set_seed(args.seed)
    rows = make_chat_dataset(args.n, seed=args.seed, split="test", max_operand=20)
    questions, responses, labels = [], [], []
    for j, row in enumerate(rows):
        question, answer = row["prompt"][-1]["content"], int(row["answer"])
        for reply, right in ((str(answer), True), (str(wrong_reply(answer, j)), False)):
            questions.append(question)
            responses.append(reply)
            labels.append(right)
    backend = HFGenRMBackend(str(smollm2_path()), temperature=args.temperature, max_tokens=max_tokens)
    judge = GenerativeRewardModel(backend, judge_template, k=args.k, aggregate="vote", max_unparsable=1.0,
                                  name="smollm2")
    start = time.time()
    result = judge.score(questions, responses)
    seconds = time.time() - start
    votes = torch.tensor(result.values, dtype=torch.float32)
    reward, missing = neutral_fill(votes, 2)
    samples = [s for row in result.samples for s in row]
    parsed = [s for s in samples if s is not None]
    right = [v for v, lab in zip(result.values, labels) if lab and not math.isnan(v)]
    wrong = [v for v, lab in zip(result.values, labels) if not lab and not math.isnan(v)]
    wins = []
    for j in range(args.n):
        a, b = result.values[2 * j], result.values[2 * j + 1]
        if not (math.isnan(a) or math.isnan(b)):
            wins.append(1.0 if a > b else 0.5 if a == b else 0.0)
    return {
        "command": "python scripts/genrm_smollm2_check.py " + " ".join(sys.argv[1:]),
        "model": "builtin:smollm2 (SmolLM2-135M-Instruct)", "template": judge_template.name,
        "n_questions": args.n, "k": args.k, "max_tokens": max_tokens, "temperature": args.temperature,
        "seconds": round(seconds, 1), "judgements": len(samples), "parsed": len(parsed),
        "rows_without_verdict": int(missing.sum()),
        "mean_vote_right": sum(right) / len(right) if right else float("nan"),
        "mean_vote_wrong": sum(wrong) / len(wrong) if wrong else float("nan"),
        "right_preferred": sum(wins) / len(wins) if wins else float("nan"), "pairs_compared": len(wins),
        "requests": [
            {"question": q, "response": r, "right": lab, "scores": s, "vote": v, "reward": float(w),
             "first_judgement": (t[0][-300:] if t else "")}
            for q, r, lab, s, v, w, t in zip(questions, responses, labels, result.samples, result.values,
                                             reward.tolist(), result.texts or [[]] * len(questions))
        ],
    }


def markdown(res: dict) -> str:
    def fmt(x):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}" if isinstance(x, float) \
            else str(x)

    out = [
        f"{res['model']} as a pointwise generative judge (template `{res['template']}`), local HF backend, "
        f"{res['n_questions']} held-out chat-arithmetic questions x 2 responses (the right number, a wrong one), "
        f"k = {res['k']} judgements each at temperature {res['temperature']}, at most {res['max_tokens']} tokens; "
        f"{res['seconds']:.0f} s on this machine. Parsed: {res['parsed']} of {res['judgements']} judgements "
        f"({res['parsed'] / max(res['judgements'], 1):.0%}); requests with no verdict: "
        f"{res['rows_without_verdict']} of {2 * res['n_questions']} (reward column: their group's mean). Mean vote "
        f"(sum of the k scores, 1-10 each): right responses {fmt(res['mean_vote_right'])}, wrong ones "
        f"{fmt(res['mean_vote_wrong'])}; the right response gets the higher vote on "
        f"{fmt(res['right_preferred'])} of the {res['pairs_compared']} questions with both voted (ties count 1/2).",
        "",
        "| question | response | right | parsed scores | vote | reward column |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["requests"]:
        scores = ", ".join("-" if s is None else f"{s:g}" for s in r["scores"])
        out.append(f"| {r['question']} | {r['response']} | {'yes' if r['right'] else 'no'} | {scores} | "
                   f"{fmt(r['vote'])} | {fmt(r['reward'])} |")
    return "\n".join(out)


def main(argv=None) -> None:
    args = parse_args(argv)
    results = [run(args, template) for template in args.templates]
    Path(args.json).write_text(json.dumps({"checks": results}, indent=1))
    md = "\n\n".join(markdown(res) for res in results)
    print(md)
    if args.write_docs:
        from bench_overhead import write_docs_section

        print(f"wrote {write_docs_section('genrm_smollm2', md, results[0]['command'])}")


if __name__ == "__main__":
    main()
