"""THR -- Token Hidden Reward (arXiv:2510.03669, "Token Hidden Reward: Steering Exploration-Exploitation in Group
Relative Deep Reinforcement Learning").

THR estimates how much the GRPO update on one token changes the likelihood of the group's *correct* responses.
Under the paper's learning-dynamics view (the same analysis as NTHR in the authors' earlier paper), a gradient step
on token ``(i, k)`` with advantage ``A_i`` moves the log-likelihood of a correct token ``(j, k')`` by about
``A_i <g_{i,k}, g_{j,k'}> <h_{i,k}, h_{j,k'}>``, with ``h`` the final hidden state that predicts the token and
``g = e_y - pi(.|context)`` its prediction error. So

    THR_{i,k} = A_{i,k} * s_{i,k},   s_{i,k} = g_{i,k}^T M_+ h_{i,k},   M_+ = sum over correct tokens of g h^T,

and the token-level advantage is reweighted by the sign of THR: ``A_{i,k} <- A_{i,k} (1 + p sign(THR_{i,k}))``.
``p > 0`` amplifies positive-THR tokens and weakens negative ones (exploitation: greedy accuracy); ``p < 0`` the
reverse (exploration: Pass@K); ``p = 0`` is vanilla GRPO.

No official code was reachable here (no repository of the paper in the stored index; the authors' NTHR/LLDS
repository ``vengdeng/LLDS-On-Group-Relative-Policy-Optimization-Collapse-in-Search-R1`` is a different method).
Reconstructed: the prediction errors are restricted to the group's generated vocabulary (the NTHR papers' device; the
probabilities are not renormalised), the score keeps no learning-rate constant (only its sign is used), the
reweighting ``1 + p sign(THR)`` and the default ``p``. Groups without a correct response have ``M_+ = 0`` (THR 0,
unchanged). Cost: two no-grad forwards of the generation batch per step (``M_+`` needs every correct response before
any score), chunked by ``ctx.hidden_states``; ``M_+`` is one (|V_group|, d) float32 matrix per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trl_plugins.api import AdvantageContext, OfficialSource, Plugin, hookimpl, option
from trl_plugins.api.reasons import without_images
from trl_plugins.api.success import SuccessOptions


@dataclass
class ThrOptions(SuccessOptions):
    p: float = option(0.1, min=-1.0, max=1.0, reconstructed=True,
                      help="Reweighting strength: A (1 + p sign(THR)); > 0 exploitation, < 0 exploration, 0 vanilla.")


def prediction_errors(logps: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``g = e_y - q`` (L, K) on a vocabulary subset: ``logps`` (L, K) log-probs of the subset, ``index`` (L,) the
    column of each generated token in it."""
    g = -logps.float().exp()
    g[torch.arange(g.size(0), device=g.device), index] += 1.0
    return g


def thr_scores(g: torch.Tensor, h: torch.Tensor, m_pos: torch.Tensor) -> torch.Tensor:
    """``s = g^T M_+ h`` per token: ``g`` (L, K), ``h`` (L, d), ``m_pos`` (K, d) -> (L,)."""
    return ((g @ m_pos) * h.float()).sum(-1)


def thr_weights(advantages: torch.Tensor, scores: torch.Tensor, p: float) -> torch.Tensor:
    """``1 + p sign(A s)`` (same shape as ``scores``)."""
    return 1.0 + p * torch.sign(advantages * scores)


class ThrPlugin(Plugin):
    """Token-level advantage reweighting by the sign of the Token Hidden Reward (advantage stage)."""

    name = "thr"
    version = "0.1.0"
    paper = (
        "Token Hidden Reward: Steering Exploration-Exploitation in Group Relative Deep Reinforcement Learning (THR), "
        "arXiv:2510.03669"
    )
    summary = "Reweights token advantages by the sign of each token's hidden-state influence on correct responses."
    Options = ThrOptions
    needs_hidden_states = True
    image_inputs = without_images("it reads hidden states through ctx.hidden_states (text-only policy forwards)")
    multi_turn = True
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code reachable; THR's score, the group-vocabulary restriction of the prediction errors, "
        "the 1 + p sign(THR) reweighting and the default p are reconstructed from the paper (and the NTHR analysis "
        "of the same authors).",
    )
    claim_metric = ("positive_fraction", "fraction of loss tokens with positive THR")
    reconstructed = (
        "THR score g^T M_+ h on the group's generated vocabulary (no official code reachable)",
        "reweighting A (1 + p sign(THR)) and the default p",
    )

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if o.p == 0:  # neutral: every weight is 1, nothing to compute
            return
        G = ctx.num_generations
        start = ctx.process_slice.start or 0
        correct = ctx.success(o.success_rule).cpu()
        local_ids, local_mask = ctx.local_completion_ids, ctx.local_completion_mask
        B = local_ids.size(0)
        all_ids = ctx.gather_padded(torch.where(local_mask.bool(), local_ids, -1), dim=1, pad_value=-1).cpu()
        N = all_ids.size(0)
        vocab = {}
        for g in {(start + r) // G for r in range(B)}:
            ids = all_ids[g * G:(g + 1) * G]
            if correct[g * G:(g + 1) * G].any():
                vocab[g] = torch.unique(ids[ids >= 0])
        m_pos: dict[int, torch.Tensor] = {}
        dim = []

        def columns(row_ids: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return torch.searchsorted(v.to(row_ids.device), row_ids)

        def accumulate(chunk):
            dim.append(chunk.hidden.size(-1))
            for r in range(chunk.hidden.size(0)):
                gi = start + chunk.rows.start + r
                g = gi // G
                if not correct[gi] or g not in vocab:
                    continue
                valid = chunk.mask[r].bool()
                h, ids = chunk.hidden[r][valid], chunk.completion_ids[r][valid]
                err = prediction_errors(chunk.head_logprobs(vocab[g], hidden=h), columns(ids, vocab[g]))
                m = err.T @ h.float()
                m_pos[g] = m if g not in m_pos else m_pos[g] + m

        ctx.hidden_states(accumulate, layer=-1, head=True)
        self._merge_boundary_groups(ctx, m_pos, vocab, N, B, G, dim[0] if dim else 0)

        def score(chunk):
            out = torch.zeros(chunk.mask.shape, device=chunk.hidden.device)
            for r in range(chunk.hidden.size(0)):
                g = (start + chunk.rows.start + r) // G
                if g not in m_pos:
                    continue
                valid = chunk.mask[r].bool()
                h, ids = chunk.hidden[r][valid], chunk.completion_ids[r][valid]
                err = prediction_errors(chunk.head_logprobs(vocab[g], hidden=h), columns(ids, vocab[g]))
                out[r, valid] = thr_scores(err, h, m_pos[g].to(h.device))
            return out

        local_scores = ctx.hidden_states(score, layer=-1, head=True)
        mask = ctx.completion_mask()
        scores = ctx.gather_padded(local_scores.to(ctx.device), dim=1)[:, : mask.size(1)].to(ctx.advantages.device)
        mask = mask.to(scores.device)
        adv = ctx.advantages
        tok = adv if adv.dim() == 2 else adv[:, None].expand_as(mask)
        tok = tok[:, : mask.size(1)]
        weights = thr_weights(tok, scores, o.p)
        ctx.advantages = tok * weights
        thr_sign = torch.sign(tok * scores) * mask
        n = mask.sum().clamp(min=1)
        ctx.log_metric("positive_fraction", float((thr_sign > 0).sum() / n))
        ctx.log_metric("negative_fraction", float((thr_sign < 0).sum() / n))

    @staticmethod
    def _merge_boundary_groups(ctx: AdvantageContext, m_pos: dict, vocab: dict, N: int, B: int, G: int,
                               dim: int) -> None:
        """Sum the partial ``M_+`` of groups whose rows lie on two processes (collective; same call everywhere)."""
        if B >= N:
            return
        boundary = sorted({(p * B) // G for p in range(1, N // B) if (p * B) % G})
        if not boundary:
            return
        k_max = max(int(vocab[g].numel()) if g in vocab else 0 for g in boundary)
        sizes = ctx.gather(torch.tensor([k_max, dim], device=ctx.device)).view(-1, 2).max(0).values.tolist()
        k_max, dim = int(sizes[0]), int(sizes[1])
        local = torch.zeros(1, len(boundary), k_max, dim, device=ctx.device)
        for i, g in enumerate(boundary):
            if g in m_pos:
                local[0, i, : m_pos[g].size(0)] = m_pos[g].to(ctx.device)
        total = ctx.gather(local).sum(0)
        for i, g in enumerate(boundary):
            if g in vocab:
                m_pos[g] = total[i, : vocab[g].numel()]
