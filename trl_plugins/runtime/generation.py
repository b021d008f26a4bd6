"""The generation service: in-step (re-)generation for sampling plugins through TRL's own backend."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from typing import Any

import torch

from trl_plugins.api.collectives import HeldRewardErrors
from trl_plugins.api.contexts import Completion, Continuation, TokenProbe, ToolEpisode
from trl_plugins.api.errors import GenerationBudgetExceeded, PluginError
from trl_plugins.api.reasons import VLLM_BRANCHING, VLLM_TOOL_EPISODES


#: How a process that waited names the failure of another process's reward scoring in the sampling stage.
SCORING_FAILED = "reward functions (sampling-stage scoring)"


def check_text_only(trainer: Any, service: str) -> None:
    """Refuse ``service`` (a framework service that runs the policy on token ids alone: the generation service, the
    no-grad probes on given ids) when the run's prompts carry images (``trainer.image_prompts``): it would run without
    them. Built-in plugins that call such a service declare it (``Plugin.image_inputs``) and are refused at
    construction; this catches a plugin that does not."""
    if getattr(trainer, "image_prompts", False):
        raise PluginError(
            f"{service} runs the policy on token ids alone, without the prompts' images, so it is not available with "
            "image prompts (the training dataset has an 'image' / 'images' column). A plugin calling it should declare "
            "Plugin.image_inputs with that reason, so that it is refused when the trainer is built."
        )


class GenerationService:
    """Extra completions within a training step, through the trainer's generation backend.

    * **Same backend as TRL.** Requests go through TRL's generation backend (the trainer's
      :meth:`~trl_plugins.runtime.trl_seam.TrlSeamTrainer.sample_completions`) with one completion per prompt: HF
      ``generate`` (with TRL's generation config and model unwrapping) or vLLM (server or colocate; weights
      already synced for this step).
    * **Collective-safe.** Every process first all-gathers its request count; all pad to the largest count
      with dummy prompts, so every process issues the same number of calls with the same number of prompts
      (vLLM server mode slices results by process, ZeRO-3/FSDP gather parameters). Dummy results are dropped.
      Call :meth:`generate` on every process the same number of times (decide from gathered data).
    * **Budget.** Real (non-dummy) completions are counted per generation batch and process
      (``used_this_batch``) and in total over all processes (``total``, identical on every process and saved
      in checkpoints);
      ``PluginGRPOConfig.plugin_generation_budget`` caps them per batch and process. The decision to refuse is
      taken on the gathered counts, so every process raises together rather than deadlocking.
    * **Policy rollouts.** ``policy_rollouts`` counts the completions sampled from the policy on this process while
      training: this service's requests (dummy padding rows included: the backend samples them too) and TRL's own
      generation rounds, which the trainer reports with :meth:`count_rollouts`. The later turns of a tool episode
      continue a rollout already counted. Equal-budget runs read it
      (:func:`trl_plugins.cli.equal_budget.count_policy_rollouts`).
    * **Policy tokens.** ``policy_tokens`` counts the tokens those rollouts sampled from the policy: new tokens only
      (a continued or forked prefix is not counted again, so trees that share prefixes pay for them once; tool
      responses are not sampled and not counted, the later turns of a tool episode are). Equal-budget runs in
      generated tokens read it.
    """

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.budget = getattr(trainer.args, "plugin_generation_budget", None)
        self.used_this_batch = 0
        self.total = 0
        self.policy_rollouts = 0
        self.policy_tokens = 0
        self._dummy_ids: list[int] | None = None

    def begin_batch(self, dummy_prompt_ids: list[int]) -> None:
        """Reset the per-batch counter; ``dummy_prompt_ids`` pads this process when it has nothing to ask."""
        self.used_this_batch = 0
        self._dummy_ids = list(dummy_prompt_ids)

    @property
    def remaining(self) -> int | float:
        """Completions still allowed in this generation batch on this process (inf when unlimited)."""
        return math.inf if self.budget is None else self.budget - self.used_this_batch

    def count_rollouts(self, n: int, tokens: int = 0) -> None:
        """Count ``n`` completions just sampled from the policy, with ``tokens`` new tokens sampled in them (not
        counted in evaluation mode)."""
        if self.trainer.model.training:
            self.policy_rollouts += int(n)
            self.policy_tokens += int(tokens)

    def tokenize(self, prompts: list) -> list[list[int]]:
        """Prompt token ids exactly as TRL builds them for generation (chat template with generation prompt)."""
        if not prompts:
            return []
        prompt_ids, _, _ = self.trainer.tokenize_prompts(prompts)
        return [list(ids) for ids in prompt_ids]

    def generate(
        self,
        prompts: list | None = None,
        *,
        prompt_ids: list[list[int]] | None = None,
        prefix_ids: list[list[int]] | None = None,
        greedy: bool = False,
    ) -> list[Completion]:
        """Generate one completion per prompt (collective: call on every process, possibly with zero prompts).

        Args:
            prompts: prompts in the dataset's format (conversational or text); or give ``prompt_ids``.
            prompt_ids: already tokenized generation prompts (one list of ids per request).
            prefix_ids: optional completion prefix per request; generation continues after it and the returned
                ``completion_ids`` are ``prefix + new tokens`` (cut to ``max_completion_length``), with NaN
                sampling log-probs on the prefix.
            greedy: decode greedily (argmax at every step) instead of sampling with the run's settings, e.g. for a
                greedy baseline; every process must pass the same value. Counted in the budget like any request.

        Returns:
            One :class:`~trl_plugins.api.contexts.Completion` per request, in order.
        """
        if (prompts is None) == (prompt_ids is None):
            raise PluginError("GenerationService.generate: pass exactly one of `prompts` or `prompt_ids`.")
        check_text_only(self.trainer, "The generation service (ctx.generate / ctx.service.generate)")
        ids = self.tokenize(prompts) if prompt_ids is None else [list(p) for p in prompt_ids]
        prefixes = [list(p) for p in prefix_ids] if prefix_ids is not None else [[] for _ in ids]
        if len(prefixes) != len(ids):
            raise PluginError(f"GenerationService.generate: {len(prefixes)} prefixes for {len(ids)} prompts.")
        n_local = len(ids)
        # (P, 2): what each process asks for now and has already used; every process takes the same decision
        gathered = self._gather_counts(n_local)
        counts = gathered[:, 0]
        max_n = self._check_budget(gathered)
        if max_n == 0:
            return []
        full = [p + q for p, q in zip(ids, prefixes)]
        dummy = full[0] if full else (self._dummy_ids or [self.trainer.text_tokenizer.eos_token_id])
        padded = full + [dummy] * (max_n - n_local)
        with greedy_decoding(self.trainer) if greedy else contextlib.nullcontext():
            completion_ids, logprobs = self.trainer.sample_completions(padded, num_generations=1)
        self.count_rollouts(len(completion_ids), sum(len(c) for c in completion_ids))
        self.used_this_batch += n_local
        self.total += int(counts.sum().item())  # all processes: the same on every process, so rank 0 saves it
        limit = self.trainer.max_completion_length
        results = []
        for j in range(n_local):
            new_ids = list(completion_ids[j])
            # vLLM reports a NaN log-prob as None: NaN here, as TRL maps it
            new_lps = [math.nan if x is None else x for x in logprobs[j]] if logprobs is not None else None
            out_ids = (prefixes[j] + new_ids)[:limit]
            out_lps = None if new_lps is None else ([math.nan] * len(prefixes[j]) + new_lps)[:limit]
            text = self.trainer.processing_class.batch_decode([out_ids], skip_special_tokens=True)[0]
            results.append(Completion(completion_ids=out_ids, logprobs=out_lps, text=text))
        return results

    def continue_prefixes(
        self,
        prompt_ids: list[list[int]],
        prefix_ids: list[list[int]],
        max_new_tokens: int | list[int],
        *,
        stop: list[str] | list[list[str]] | None = None,
        probe_positions: list[list[int]] | None = None,
        top_k: int = 0,
    ) -> list[Continuation]:
        """The branching seam: continue ``prompt_ids[j] + prefix_ids[j]`` (token ids) for every request ``j``.

        Args:
            prompt_ids: generation-prompt ids per request (as :meth:`tokenize` builds them).
            prefix_ids: the partial completion each request continues (may be empty).
            max_new_tokens: new tokens at most, one int for all requests or one per request (>= 1); also capped so
                that the prefix and the new tokens fit in ``max_completion_length``.
            stop: stop strings, one list for all requests or one list per request (non-empty strings); a
                continuation ends just after the first token that completes one of them.
            probe_positions: per request, completion indices ``t`` in ``[0, len(prefix)]`` at which to return the
                policy's next-token distribution (:class:`~trl_plugins.api.contexts.TokenProbe`: top-``top_k`` ids
                and log-probs, entropy). ``t = len(prefix)`` is the fork point of the prefix.
            top_k: how many most-likely next tokens each probe lists (0: entropy only).

        Returns:
            One :class:`~trl_plugins.api.contexts.Continuation` per request, with the per-token sampling log-probs of
            its new tokens.

        Collective: every process calls it the same number of times (zero requests where it has none); the requests
        are padded to the largest count across processes, and every process generates with the same
        ``max_new_tokens`` (the largest requested anywhere), then runs one padded teacher-forced forward for the
        log-probs and probes. Counted in the budget like :meth:`generate`. Through TRL's HF-generate backend only:
        TRL's vLLM client takes one set of sampling parameters for a whole call (no per-request length or stop) and
        returns no distribution at a step, so a call under vLLM raises (plugins using the seam are refused when the
        trainer is built, :data:`~trl_plugins.api.reasons.VLLM_BRANCHING`). The log-probs are the temperature-scaled
        policy log-probs of the same weights that sampled; they are the exact sampling log-probs when the run's
        ``top_k``/``top_p``/``min_p`` leave the distribution untruncated (TRL's defaults).
        """
        from trl_plugins.runtime.branching import check_requests, cut_continuation

        tr = self.trainer
        if getattr(tr, "use_vllm", False) or getattr(tr, "use_transformers_continuous_batching", False):
            raise PluginError(f"GenerationService.continue_prefixes: {VLLM_BRANCHING}")
        check_text_only(tr, "The branching seam (ctx.continue_prefixes / ctx.service.continue_prefixes)")
        requests = check_requests(prompt_ids, prefix_ids, max_new_tokens, stop, probe_positions, top_k,
                                  tr.max_completion_length)
        n_local = len(requests)
        local_max = max([r.max_new for r in requests], default=0)
        gathered = self._gather_counts(n_local, local_max)
        max_n = self._check_budget(gathered)
        if max_n == 0:
            return []
        full = [r.prompt + r.prefix for r in requests]
        dummy = full[0] if full else (self._dummy_ids or [tr.text_tokenizer.eos_token_id])
        padded = full + [dummy] * (max_n - n_local)
        with transformers_generation_settings(tr, {"max_new_tokens": int(gathered[:, 2].max().item())}):
            completion_ids, _ = tr.sample_completions(padded, num_generations=1)
        self.count_rollouts(len(completion_ids), sum(len(c) for c in completion_ids))
        self.used_this_batch += n_local
        self.total += int(gathered[:, 0].sum().item())
        decode = lambda ids: tr.text_tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        cuts = [cut_continuation(list(completion_ids[j]) or [tr.eos_token_ids[0]], r.max_new, r.stop,
                                 tr.eos_token_ids, decode) for j, r in enumerate(requests)]
        logps, probes = tr.policy_probe.continuation_stats(
            [r.prompt for r in requests], [r.prefix + ids for r, (ids, _, _) in zip(requests, cuts)],
            [r.positions for r in requests], top_k,
        )
        results = []
        for j, (r, (ids, finished, hit)) in enumerate(zip(requests, cuts)):
            results.append(Continuation(
                completion_ids=r.prefix + ids, new_ids=ids, logprobs=logps[j][len(r.prefix):].float().tolist(),
                finished=finished, stop=hit,
                probes=[TokenProbe(t, top, lps, ent) for t, (top, lps, ent) in zip(r.positions, probes[j])],
            ))
        return results

    def fork_prefixes(
        self,
        prompt_ids: list[list[int]],
        prefix_ids: list[list[int]],
        ranks: list[int],
        max_new_tokens: int | list[int],
        *,
        exclude: list[int | None] | None = None,
        stop: list[str] | list[list[str]] | None = None,
    ) -> list[Continuation]:
        """The branching seam's fork: continue ``prompt_ids[j] + prefix_ids[j]`` with its first new token forced to the
        ``ranks[j]``-th most likely next token of the policy there (0: the most likely), ``exclude[j]`` left out.

        Requests sharing a prefix with ranks ``0 .. k-1`` fork it into ``k`` continuations with distinct next tokens
        (the top-``k`` of the policy's distribution at the fork, leaving out e.g. the token the original rollout
        took). Each result's ``probes`` holds one :class:`~trl_plugins.api.contexts.TokenProbe` at the fork (position
        ``len(prefix)``: the top ids and log-probs it chose from, and the entropy there); its ``logprobs`` start with
        the forced token's policy log-prob (a forced token is chosen, not sampled). A forced EOS, or a forced token
        that fills ``max_completion_length``, ends the continuation there.

        Collective like :meth:`continue_prefixes`: a padded no-grad forward for the distributions at the forks, then
        one :meth:`continue_prefixes` call; every process calls it the same number of times (zero requests where it
        has none). Counted in the budget like :meth:`continue_prefixes`; HF-generate backend only.
        """
        from trl_plugins.runtime.branching import check_fork_ranks, check_requests, forced_token

        tr = self.trainer
        if getattr(tr, "use_vllm", False) or getattr(tr, "use_transformers_continuous_batching", False):
            raise PluginError(f"GenerationService.fork_prefixes: {VLLM_BRANCHING}")
        check_text_only(tr, "The branching seam (ctx.fork_prefixes)")
        excluded = check_fork_ranks(ranks, exclude, len(prompt_ids))
        requests = check_requests(prompt_ids, prefix_ids, max_new_tokens, stop, None, 0, tr.max_completion_length)
        eos = tr.eos_token_ids[0]
        top_k = max([r + 2 for r in ranks], default=1)  # one spare for the excluded token
        # the distribution at position len(prefix): probe a placeholder token there (causal, so it does not matter)
        _, probes = tr.policy_probe.continuation_stats(
            [r.prompt for r in requests], [r.prefix + [eos] for r in requests], [[len(r.prefix)] for r in requests],
            top_k,
        )
        forced, conts_in, rows = [], [], []
        for j, r in enumerate(requests):
            top, lps, ent = probes[j][0]
            tok = forced_token(top, ranks[j], excluded[j])
            forced.append((tok, lps[top.index(tok)], TokenProbe(len(r.prefix), top, lps, ent)))
            if tok not in tr.eos_token_ids and len(r.prefix) + 1 < tr.max_completion_length and r.max_new > 1:
                rows.append(j)
                conts_in.append(r)
        conts = self.continue_prefixes(
            [r.prompt for r in conts_in], [r.prefix + [forced[j][0]] for j, r in zip(rows, conts_in)],
            [r.max_new - 1 for r in conts_in], stop=[r.stop for r in conts_in],
        )
        by_row = dict(zip(rows, conts))
        results = []
        for j, r in enumerate(requests):
            tok, lp, probe = forced[j]
            c = by_row.get(j)
            if c is None:  # the forced token ends it (EOS) or fills the length limit
                results.append(Continuation(completion_ids=r.prefix + [tok], new_ids=[tok], logprobs=[lp],
                                            finished=tok in tr.eos_token_ids, probes=[probe]))
                continue
            results.append(Continuation(
                completion_ids=c.completion_ids, new_ids=[tok] + c.new_ids, logprobs=[lp] + c.logprobs,
                finished=c.finished, stop=c.stop, probes=[probe],
            ))
        return results

    def episode_requests(self, ctx: Any, rows: list[int], turns: list[int]) -> list:
        """The checked :class:`~trl_plugins.runtime.tool_episodes.EpisodeRequest` of each ``(rows[j], turns[j])`` of a
        :class:`~trl_plugins.api.contexts.RolloutContext` (a bad row or turn raises a ``PluginError`` naming it)."""
        from trl_plugins.runtime.tool_episodes import WHERE, EpisodeRequest, check_turns

        if not ctx.turns:
            raise PluginError(f"RolloutContext.{WHERE}: the run has no tools (tools= or environment_factory=); continue "
                              "single-turn completions with ctx.continue_prefixes.")
        for i in rows:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(ctx.rows):
                raise PluginError(f"RolloutContext.{WHERE}: row {i!r}; allowed: a local row index in [0, {len(ctx.rows)}).")
            if i in ctx.changed and i not in ctx.episodes:
                raise PluginError(f"RolloutContext.{WHERE}: local row {i} was replaced by replace_row in this stage, "
                                  "so its turns are no longer TRL's; allowed: rows TRL generated or replace_episode set.")
            if ctx.prompt_swapped[i]:
                raise PluginError(f"RolloutContext.{WHERE}: local row {i} is prompt-swapped (trained under another "
                                  "prompt than it was generated with); allowed: rows generated under their training "
                                  "prompt.")
            if i in ctx.behaviour_logprobs:
                raise PluginError(f"RolloutContext.{WHERE}: local row {i} holds a replayed episode (sampled by an "
                                  "earlier policy); allowed: rows this step's policy sampled.")
        checked = check_turns(turns, [ctx.turns[i].num_turns for i in rows], rows)
        names = self.trainer.batch_environment_names or []
        return [
            EpisodeRequest(
                row=i, global_row=ctx.global_index[i], turn=u, prompt=ctx.prompts[i], prompt_ids=list(ctx.prompt_ids[i]),
                completion_ids=list(ctx.completion_ids[i]), tool_mask=list(ctx.turns[i].tool_mask),
                messages=list(ctx.completions[i]), data=dict(ctx.rows[i]),
                environment_name=names[i] if i < len(names) else None,
            )
            for i, u in zip(rows, checked)
        ]

    def continue_tool_episodes(self, requests: list) -> list[ToolEpisode]:
        """The tool-episode branching seam: continue each request's tool rollout from its boundary turn through TRL's
        own tool loop (:mod:`trl_plugins.runtime.tool_episodes`; requests are
        :class:`~trl_plugins.runtime.tool_episodes.EpisodeRequest`, built by
        :meth:`~trl_plugins.api.contexts.RolloutContext.continue_tool_episodes`).

        Returns one :class:`~trl_plugins.api.contexts.ToolEpisode` per request, in order: the kept prefix followed by
        the new turns and tool results, TRL's tool mask and messages, the turn structure, the per-token sampling
        log-probs of the new model tokens (NaN on the kept prefix and on tool results) and the continuation's own
        environment instance.

        Collective: every process calls it the same number of times (zero requests where it has none). Each request
        counts as one completion in the budget (``plugin_generation_budget``) and as one policy rollout; every backend
        call of the continuation (its first turn, each of TRL's tool rounds) is a lockstep round padded with dummy
        requests, then one padded teacher-forced forward gives the log-probs. HF-generate backend only
        (:data:`~trl_plugins.api.reasons.VLLM_TOOL_EPISODES`).
        """
        from trl_plugins.runtime.tool_episodes import (
            WHERE, Lockstep, cut_to_rounds, fresh_environment, initial_prompts, nan_outside_new_turns,
            replay_kept_calls,
        )

        tr = self.trainer
        if getattr(tr, "use_vllm", False) or getattr(tr, "use_transformers_continuous_batching", False):
            raise PluginError(f"GenerationService.{WHERE}: {VLLM_TOOL_EPISODES}")
        check_text_only(tr, "The tool-episode seam (ctx.continue_tool_episodes)")
        if not getattr(tr, "tools", None):
            raise PluginError(f"GenerationService.{WHERE}: the run has no tools (tools= or environment_factory=); "
                              "continue single-turn completions with ctx.continue_prefixes.")
        limit = tr.max_completion_length
        for r in requests:
            if r.start >= limit:
                raise PluginError(f"GenerationService.{WHERE}: local row {r.row}'s kept prefix (turns before "
                                  f"{r.turn}) has {r.start} tokens; allowed: fewer than max_completion_length={limit}, "
                                  "so that one new token fits.")
        n_local = len(requests)
        gathered = self._gather_counts(n_local)
        max_n = self._check_budget(gathered)
        if max_n == 0:
            return []
        environments, sync_dicts, async_dicts = [], [], []
        standalone = set(tr.tool_dicts_for(None)[0])
        for r in requests:
            env = fresh_environment(tr, r)
            sync, asynchronous = tr.tool_dicts_for(env)
            replay_kept_calls(env, {k: v for k, v in sync.items() if k not in standalone}, r)
            environments.append(env)
            sync_dicts.append(sync)
            async_dicts.append(asynchronous)
        tr.raise_reset_errors_together(environments)
        firsts = [r.prompt_ids + r.completion_ids[: r.start] for r in requests]
        dummy = firsts[0] if firsts else (self._dummy_ids or [tr.text_tokenizer.eos_token_id])
        lock: list[Lockstep] = []

        def wrap(backend):
            lock.append(Lockstep(backend, tr.accelerator.gather, tr.accelerator.device, dummy))
            return lock[0]

        rounds_left = [max(tr.max_tool_calling_iterations - r.turn, 0) for r in requests]
        saved_rounds = tr.max_tool_calling_iterations
        with tr.wrapped_generation_backend(wrap):
            new_ids, _ = tr.sample_completions(firsts, num_generations=1)
            self.count_rollouts(lock[0].rounds[-1][1])
            completion_ids, messages = [], []
            for r, ids in zip(requests, new_ids):
                ids = list(ids)[: limit - r.start] or [tr.eos_token_ids[0]]
                completion_ids.append(r.completion_ids[: r.start] + ids)
                messages.append([tr.parse_tool_turn(ids, r.prompt_ids + r.completion_ids[: r.start],
                                                    r.environment_name)])
            tr.max_tool_calling_iterations = max(rounds_left, default=0)
            try:
                with tr.tool_rows(sync_dicts, async_dicts, [r.environment_name for r in requests]):
                    tr.tool_loop_lockstep = lock[0]
                    loop = tr.tool_call_loop(initial_prompts(requests), [r.prompt_ids for r in requests],
                                             completion_ids, messages, None, None, {})
            finally:
                tr.tool_loop_lockstep = None
                tr.max_tool_calling_iterations = saved_rounds
        loop_mask, loop_messages, loop_ids = loop[0], loop[1], loop[2]
        episodes = []
        for j, r in enumerate(requests):
            mask = list(r.tool_mask[: r.start]) + list(loop_mask[j][r.start:])
            ids, mask, new_messages = cut_to_rounds(list(loop_ids[j]), mask, list(loop_messages[j]), r.start,
                                                    rounds_left[j])
            episodes.append((ids, mask, r.kept_messages + new_messages))
        self.count_rollouts(0, sum(sum(e[1][r.start:]) for r, e in zip(requests, episodes)))  # new sampled tokens
        logps, _ = tr.policy_probe.continuation_stats(
            [r.prompt_ids for r in requests], [e[0] for e in episodes], [[] for _ in requests], 0
        )
        self.used_this_batch += n_local
        self.total += int(gathered[:, 0].sum().item())
        results = []
        for j, (r, (ids, mask, msgs)) in enumerate(zip(requests, episodes)):
            results.append(ToolEpisode(
                row=r.row, turn=r.turn, start=r.start, completion_ids=ids, tool_mask=mask, messages=msgs,
                logprobs=nan_outside_new_turns(logps[j], mask, r.start),
                turns=tr.turn_structure(ids, mask, msgs, environments[j], r.global_row),
                environment=environments[j],
            ))
        return results

    def store_tool_episodes(self, ctx: Any, rows: list) -> list:
        """:meth:`~trl_plugins.api.contexts.RolloutContext.store_tool_episodes` (:mod:`trl_plugins.runtime.episode_replay`)."""
        from trl_plugins.runtime.episode_replay import store_episodes

        check_text_only(self.trainer, "The tool-episode replay (ctx.store_tool_episodes)")  # a run-wide setting
        return store_episodes(self.trainer, ctx, rows)

    def replay_tool_episodes(self, ctx: Any, rows: list, episodes: list) -> list[ToolEpisode]:
        """:meth:`~trl_plugins.api.contexts.RolloutContext.replay_tool_episodes` (:mod:`trl_plugins.runtime.episode_replay`)."""
        from trl_plugins.runtime.episode_replay import replay_episodes

        return replay_episodes(self.trainer, ctx, rows, episodes)

    def _check_budget(self, gathered: torch.Tensor) -> int:
        """Raise on every process together when a process's requests pass the budget; else the largest count."""
        counts, used = gathered[:, 0], gathered[:, 1]
        if self.budget is not None and int((used + counts).max().item()) > self.budget:
            j = int(torch.argmax(used + counts).item())
            raise GenerationBudgetExceeded(
                f"Plugins requested {int(counts[j].item())} more completions on process {j}, which already used "
                f"{int(used[j].item())} in this generation batch; plugin_generation_budget is {self.budget} per "
                "generation batch and process."
            )
        return int(counts.max().item())

    def _gather_counts(self, n_local: int, *more: int) -> torch.Tensor:
        """(num_processes, 2 + len(more)) long tensor: each process's request count, completions already used this
        batch, then ``more`` (e.g. the branching seam's largest ``max_new_tokens``).

        A reward-function error that the sampling stage holds on some process (see the trainer) rides in the same
        collective and is raised here on every process, before anything is generated.
        """
        acc = self.trainer.accelerator
        held = getattr(self.trainer, "held_reward_errors", None) or HeldRewardErrors()  # (a bare stand-in trainer)
        return held.gather_with_flag(acc.gather, [n_local, self.used_this_batch, *more], acc.device, SCORING_FAILED)

    def state_dict(self) -> dict:
        return {"total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.total = int(state.get("total", 0))


@contextlib.contextmanager
def greedy_decoding(trainer: Any) -> Iterator[None]:
    """Within the block, the trainer's generation backend decodes greedily; its own settings are restored after.

    vLLM (server or colocate): temperature 0, vLLM's greedy decoding. Transformers: ``do_sample=False``, with the
    sampling-only settings unset (:func:`transformers_generation_settings`).
    """
    if getattr(trainer, "use_vllm", False):
        vllm = trainer.vllm_generation
        saved = vllm.temperature
        vllm.temperature = 0.0
        try:
            yield
        finally:
            vllm.temperature = saved
        return
    with transformers_generation_settings(trainer, {"do_sample": False}, unset=SAMPLING_SETTINGS):
        yield


#: Generation settings that only sampling reads.
SAMPLING_SETTINGS = ("temperature", "top_p", "top_k", "min_p")


@contextlib.contextmanager
def transformers_generation_settings(trainer: Any, settings: dict, unset: tuple[str, ...] = ()) -> Iterator[None]:
    """Within the block, TRL's transformers generation uses ``settings`` (and leaves the names in ``unset`` unset);
    the trainer's own settings are restored after.

    TRL passes both ``trainer.generation_config`` to ``generate`` and ``trainer.generation_kwargs`` written over the
    model's own generation config, so both get the change: a setting left in either one would win.
    """
    saved_config, saved_kwargs = trainer.generation_config, getattr(trainer, "generation_kwargs", None)
    config = copy.deepcopy(saved_config)
    for name in unset:
        if hasattr(config, name):
            setattr(config, name, None)
    for name, value in settings.items():
        setattr(config, name, value)
    trainer.generation_config = config
    if saved_kwargs is not None:
        trainer.generation_kwargs = {**{k: v for k, v in saved_kwargs.items() if k not in unset}, **settings}
    try:
        yield
    finally:
        trainer.generation_config = saved_config
        if saved_kwargs is not None:
            trainer.generation_kwargs = saved_kwargs
