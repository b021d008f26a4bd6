"""The policy probe: no-grad forwards of the current policy that the stage contexts offer plugins.

``ctx.policy_entropies`` (rollout context), ``ctx.policy_features`` (reward context), ``ctx.policy_logprobs`` and
``ctx.policy_stats`` (advantage context) are methods of :class:`PolicyProbe`, one per trainer
(``trainer.policy_probe``). Every forward runs through TRL's fused log-prob head
(:meth:`~trl_plugins.runtime.trl_seam.TrlSeamTrainer.per_token_logps_and_entropies`: the run's temperature applied, no
(B, T, V) logits kept), in chunks of ``per_device_train_batch_size`` rows, on TRL's prompt/completion layout
(:func:`prompt_completion_batch`).
"""

from __future__ import annotations

from typing import Any

import torch

from trl_plugins.api.contexts import PolicyStats
from trl_plugins.runtime.generation import SCORING_FAILED, check_text_only
from trl_plugins.runtime.trl_seam import multimodal_forward_kwargs
from trl_plugins.api.model_utils import prompt_completion_batch


class PolicyProbe:
    """No-grad forwards of ``trainer``'s current policy (a :class:`~trl_plugins.PluginGRPOTrainer`)."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def stats(self, output: dict, cache: dict, head_stats: bool) -> PolicyStats:
        """:class:`~trl_plugins.api.contexts.PolicyStats` of the local generation batch ``output`` (TRL's dict): one
        no-grad forward, kept in ``cache`` (the batch's) for the next call; ``head_stats`` also captures the hidden
        states for :class:`~trl_plugins.runtime.head_stats.HeadStats`."""
        key = "with_head" if head_stats else "plain"
        if key in cache:
            return cache[key]
        if "with_head" in cache:
            return cache["with_head"]
        tr = self.trainer
        prompt_completion_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        logits_to_keep = output["completion_ids"].size(1)
        mask = output["completion_mask"] * output.get("tool_mask", 1)
        batch_size = tr.args.per_device_train_batch_size
        images = {k: v for k, v in multimodal_forward_kwargs(output).items() if v is not None}
        if images:  # TRL slices the image fields by rows inside its own chunk loop, not ours: one chunk here
            batch_size = prompt_completion_ids.size(0)
        stats_obj = None
        with torch.no_grad():
            if head_stats:
                from trl_plugins.runtime.head_stats import HeadStats, capture_hidden_states, lm_head_of

                hidden_parts = []
                logps_parts, ent_parts = [], []
                for start in range(0, prompt_completion_ids.size(0), batch_size):
                    sl = slice(start, start + batch_size)
                    with capture_hidden_states(tr.model) as cap:
                        lp, ent, _ = tr.per_token_logps_and_entropies(
                            tr.model, prompt_completion_ids[sl], attention_mask[sl], logits_to_keep,
                            compute_entropy=True, **images,
                        )
                    hidden_parts.append(cap.hidden[:, -(logits_to_keep + 1):])
                    logps_parts.append(lp)
                    ent_parts.append(ent)
                logps, entropies = torch.cat(logps_parts), torch.cat(ent_parts)
                weight, bias, logit_scale, softcap = lm_head_of(tr.model)
                stats_obj = HeadStats(
                    torch.cat(hidden_parts), logits_to_keep, mask, weight, bias, logit_scale=logit_scale,
                    softcap=softcap, temperature=tr.temperature, chunk_size=tr.args.head_stats_chunk_size,
                )
            else:
                logps, entropies, _ = tr.per_token_logps_and_entropies(
                    tr.model, prompt_completion_ids, attention_mask, logits_to_keep,
                    batch_size=batch_size, compute_entropy=True, **images,
                )
        mean_entropy = (entropies * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        result = PolicyStats(
            per_token_logps=logps,
            entropies=entropies,
            mask=mask,
            completion_ids=output["completion_ids"],
            mean_entropy=tr.accelerator.gather(mean_entropy),
            head_stats=stats_obj,
        )
        cache[key] = result
        return result

    def forward(self, prompt_ids: list[list[int]], completion_ids: list[list[int]], entropy: bool) -> torch.Tensor:
        """No-grad forward of the current policy over prompt+completion rows in TRL's layout (prompts left-padded,
        completions right-padded; an empty prompt or completion stands as one EOS token).

        Returns (R, C) per-token entropies (``entropy``) or log-probs of the completion positions, C the longest
        completion; chunks of ``per_device_train_batch_size`` rows.
        """
        tr = self.trainer
        check_text_only(tr, "The policy probe on given token ids (ctx.policy_logprobs / ctx.policy_entropies)")
        eos_id = tr.eos_token_ids[0]
        pad_id = tr.text_tokenizer.pad_token_id
        rows = [(list(p) or [eos_id], list(c) or [eos_id]) for p, c in zip(prompt_ids, completion_ids)]
        input_ids, attention_mask, c_len = prompt_completion_batch(
            [p for p, _ in rows], [c for _, c in rows], eos_id if pad_id is None else pad_id, tr.accelerator.device
        )
        with torch.no_grad():
            logps, entropies, _ = tr.per_token_logps_and_entropies(
                tr.model, input_ids, attention_mask, c_len,
                batch_size=tr.args.per_device_train_batch_size, compute_entropy=entropy,
            )
        return entropies if entropy else logps

    def _largest_count(self, n_local: int) -> int:
        """The largest request count across processes (a held reward error raises here, on every process)."""
        acc = self.trainer.accelerator
        counts = self.trainer.held_reward_errors.gather_with_flag(acc.gather, [n_local], acc.device, SCORING_FAILED)
        return int(counts.max().item())

    def entropies(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[torch.Tensor]:
        """No-grad per-token entropies of the current policy over completions (``RolloutContext.policy_entropies``).

        Collective-safe: every process runs the same number of forward chunks (requests padded with dummy rows to the
        largest count across processes), as ZeRO-3/FSDP forwards require. Returns one (len(completion),) tensor each.
        """
        n_local = len(completion_ids)
        max_n = self._largest_count(n_local)
        if max_n == 0:
            return []
        dummy = [self.trainer.eos_token_ids[0]]
        entropies = self.forward(
            list(prompt_ids) + [dummy] * (max_n - n_local), list(completion_ids) + [dummy] * (max_n - n_local), True
        )
        return [entropies[j, : len(completion_ids[j])].detach() for j in range(n_local)]

    def features(self, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                 reference: bool = False) -> torch.Tensor:
        """(R, d) no-grad mean of the backbone's last hidden state over each completion's tokens
        (``RewardContext.policy_features``; ``reference``: the reference policy's, ``RewardContext.reference_features``).
        Runs the backbone only (no LM head, no logits), in chunks of ``per_device_train_batch_size`` rows;
        collective-safe like :meth:`entropies`."""
        if reference:
            from trl_plugins.runtime.reference import reference_model

            with reference_model(self.trainer) as model:
                return self._features(model, prompt_ids, completion_ids)
        return self._features(self.trainer.model, prompt_ids, completion_ids)

    def _features(self, model, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> torch.Tensor:
        tr = self.trainer
        check_text_only(tr, "The policy features on given token ids (ctx.policy_features / ctx.reference_features)")
        acc = tr.accelerator
        n_local = len(completion_ids)
        max_n = self._largest_count(n_local)
        eos_id = tr.eos_token_ids[0]
        pad_id = tr.text_tokenizer.pad_token_id
        rows = [(list(p) or [eos_id], list(c) or [eos_id]) for p, c in zip(prompt_ids, completion_ids)]
        rows += [([eos_id], [eos_id])] * (max_n - n_local)
        step, means = tr.args.per_device_train_batch_size, []
        through_root = getattr(tr, "engine", None) in ("fsdp1", "fsdp2") and model is tr.model
        for start in range(0, len(rows), step):
            chunk = rows[start:start + step]
            input_ids, attention_mask, c_len = prompt_completion_batch(
                [p for p, _ in chunk], [c for _, c in chunk], eos_id if pad_id is None else pad_id, acc.device
            )
            with torch.no_grad():
                hidden = self._last_hidden(model, input_ids, attention_mask, through_root)
            mask = attention_mask[:, -c_len:].unsqueeze(-1).float()
            means.append((hidden[:, -c_len:].float() * mask).sum(1) / mask.sum(1).clamp(min=1.0))
        return torch.cat(means)[:n_local] if means else torch.zeros(0, 0, device=acc.device)

    @staticmethod
    def _last_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, through_root: bool) -> torch.Tensor:
        """(R, L, d) last hidden state. The backbone alone, except under FSDP (``through_root``): there the root unit
        (embeddings, final norm, head) only gathers its parameters in its own forward, so the whole model runs with
        TRL's fused head (chunked log-probs; no (R, L, V) logits) and the backbone's output is captured."""
        from trl_plugins.runtime.head_stats import backbone_of, capture_hidden_states

        if not through_root:
            return backbone_of(model)(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        with capture_hidden_states(model) as cap:
            model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids, fused_lm_head=True)
        return cap.hidden

    def logprobs(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[torch.Tensor]:
        """No-grad per-token log-probs of completions under the current policy (``ctx.policy_logprobs``).

        Collective like :meth:`entropies`: every process must call it (with any number of rows, zero included) the
        same number of times; the rows are padded to the largest count across processes, because a forward of a
        sharded model (FSDP, ZeRO-3) is itself a collective. Returns one (len(completion),) tensor each."""
        n_local = len(completion_ids)
        max_n = self._largest_count(n_local)
        if max_n == 0:
            return []
        dummy = [self.trainer.eos_token_ids[0]]
        logps = self.forward(
            list(prompt_ids) + [dummy] * (max_n - n_local), list(completion_ids) + [dummy] * (max_n - n_local), False
        )
        return [logps[j, : len(completion_ids[j])].detach() for j in range(n_local)]

    def continuation_stats(
        self, prompt_ids: list[list[int]], completion_ids: list[list[int]], positions: list[list[int]], top_k: int
    ) -> tuple[list[torch.Tensor], list[list[tuple[list[int], list[float], float]]]]:
        """No-grad log-probs of every completion token and, at the given completion ``positions`` of each row, the
        policy's top-``top_k`` next tokens and the entropy there (the branching seam's teacher-forced half).

        Collective like :meth:`logprobs` (rows padded to the largest count across processes; the LM head is read once
        per call on every process, itself a collective under FSDP1 / ZeRO-3). Only the probed positions go through the
        head a second time: ``(M, V)`` logits for the ``M`` probes of a chunk, never ``(R, L, V)``.

        Returns:
            ``(logps, probes)``: one (len(completion),) tensor per row; per row, one ``(top_ids, top_logprobs,
            entropy)`` per position, temperature applied as in TRL's log-probs.
        """
        from trl_plugins.runtime.head_stats import capture_hidden_states, lm_head_of, transform_logits

        tr = self.trainer
        check_text_only(tr, "The branching seam (ctx.continue_prefixes)")
        n_local = len(completion_ids)
        max_n = self._largest_count(n_local)
        if max_n == 0:
            return [], []
        eos_id = tr.eos_token_ids[0]
        pad_id = tr.text_tokenizer.pad_token_id
        rows = [(list(p) or [eos_id], list(c) or [eos_id]) for p, c in zip(prompt_ids, completion_ids)]
        rows += [([eos_id], [eos_id])] * (max_n - n_local)
        wanted = list(positions) + [[] for _ in range(max_n - n_local)]
        step = tr.args.per_device_train_batch_size
        logps_out: list[torch.Tensor] = []
        hidden_out: list[torch.Tensor] = []  # (d,) hidden state before each probed position, in row order
        for start in range(0, len(rows), step):
            chunk = rows[start:start + step]
            input_ids, attention_mask, c_len = prompt_completion_batch(
                [p for p, _ in chunk], [c for _, c in chunk], eos_id if pad_id is None else pad_id,
                tr.accelerator.device,
            )
            with torch.no_grad(), capture_hidden_states(tr.model) as cap:
                logps, _, _ = tr.per_token_logps_and_entropies(
                    tr.model, input_ids, attention_mask, c_len, batch_size=len(chunk), compute_entropy=False
                )
            block = cap.hidden[:, -(c_len + 1):-1]  # (R, C, d): the state that predicts completion token t
            for r in range(len(chunk)):
                logps_out.append(logps[r, : len(chunk[r][1])].detach())
                for t in wanted[start + r]:
                    hidden_out.append(block[r, t].detach())
        weight, bias, logit_scale, softcap = lm_head_of(tr.model)
        probes: list[list[tuple[list[int], list[float], float]]] = [[] for _ in range(n_local)]
        if hidden_out:
            with torch.no_grad():
                h = torch.stack(hidden_out).to(weight.dtype)
                z = h @ weight.T if bias is None else h @ weight.T + bias
                logp = torch.log_softmax(transform_logits(z.float(), logit_scale, softcap, tr.temperature), dim=-1)
                entropy = -(logp.exp() * logp).sum(-1)
                k = min(top_k, logp.size(-1))
                top_lp, top_ids = torch.topk(logp, k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
            m = 0
            for j in range(n_local):
                for _ in wanted[j]:
                    probes[j].append((top_ids[m].tolist(), top_lp[m].tolist(), float(entropy[m])))
                    m += 1
        return logps_out[:n_local], probes
