"""CAPO -- Curvature-Aware Policy Optimization (arXiv:2510.00819, "Stabilizing Policy Gradients for Sample-Efficient
Reinforcement Learning in LLM Reasoning").

CAPO models the next optimizer step on the **last layer only** (the LM head ``psi``, logits ``z = psi h``) and, for
every token, predicts how much that token's own update would move the policy and the objective; tokens predicted to
destabilise the step are dropped from the loss mask (the paper reports under 8% of tokens rejected).

Facts from the official code (``luckeciano/stable-pg-llm`` @ 933fe01, ``src/open_r1/grpo_entropy_trainer.py``; the
main recipe ``recipes/Qwen2.5-Math-7B/grpo/config_drgrpo_efficient_adam_fisher_mask_token_1e-2_hessian_mask_token_5e-4
.yaml``), token level, all under no grad at the loss stage of the current forward:

1. Policy on the top-k vocabulary (``_compute_entropy``, l.2624): ``pi = softmax`` of the ``k`` largest logits
   (renormalised over them), ``e`` the one-hot of the sampled token among them (all zero when it is outside),
   ``v = e - pi`` (k,). ``k`` is the generation ``top_k`` (l.152): transformers' ``GenerationConfig`` default 50,
   since the official trainer builds its config without one (``modifiable_grpo_trainer.py`` l.509-514).
2. Per-token last-layer gradient of ``A * ratio`` at ratio 1 (``_compute_token_level_gradients``, l.437):
   ``g = A v (x) h`` (k, d), ``h`` the final hidden state that predicts the token.
3. Step direction ``Delta`` (``SparseAdamModel.batch_compute_effective_token_gradients``,
   ``sparse_optim_models/sparse_adam_model.py`` l.26-59): an Adam step simulated per vocabulary row from tracked
   moments ``m, v`` of the LM-head rows, ``m' = b1 m + (1-b1) g``, ``v' = b2 v + (1-b2) g^2``,
   ``Delta = (m'/(1-b1^(t+1))) / (sqrt(v'/(1-b2^(t+1))) + eps)``; rows never updated have zero moments; before the
   first moment update (``t = 0``, empty state) ``Delta = g`` (l.36-37). ``optimizer_model="sgd"``: ``Delta = g``.
4. With ``u = Delta h`` (k,), ``s = v . u`` and ``F = diag(pi) - pi pi^T`` (``_compute_and_log_hessian_coefficient``,
   l.1375-1434; ``_compute_and_log_fisher_curvature``, l.1631-1730), at the current learning rate ``lr``
   (the scheduler's last value):

   * objective shift ``m_H = lr <g, Delta> + lr^2 / 2 * A (s^2 - u^T F u)`` (first order plus the Hessian of the
     ratio surrogate, ``A h h^T (x) (v v^T - F)``, along ``Delta``);
   * policy shift ``m_F = lr^2 / 2 * s^2`` (the Fisher quadratic form of the sampled action along ``Delta``).
5. Keep a token iff ``m_F < tau_F`` and ``-tau_H < m_H < tau_H`` (``hessian_symmetric=True``; else
   ``0 <= m_H < tau_H``) (``_compute_{hessian,fisher}_token_mask``, l.1009-1048); a threshold of 0 switches its test
   off. Dropped tokens leave the loss mask (here: token weight 0 through ``ctx.scale_tokens``).
6. Moment update once per loss call, after masking (l.290, ``_sparsify_global_gradients`` l.512,
   ``_compute_all_global_gradients`` l.654, ``SparseAdamModel.update_effective_gradient_moments`` l.192): per
   vocabulary row, the mean of the kept tokens' gradient rows ``g[k]`` over every process (mean over the tokens whose
   top-k holds that row); only those rows' moments move; ``t += 1``.

Defaults (main recipe): ``fisher_tau = 1e-2``, ``hessian_tau = 5e-4``, symmetric, Adam model with the run's
``adam_beta1/2`` and ``adam_epsilon``; the recipe trains Dr.GRPO (``loss_type="dr_grpo"``, ``beta=0``, lr 1.5e-5,
G = 8). With ``dr_grpo`` a zero token weight equals the official mask exactly; with loss types normalising by the token
count, the dropped tokens still count in the denominator (documented deviation).

Reconstructed / deviating details: the curvature uses TRL's temperature-scaled logits (the official forward used
unscaled logits) and treats the transformed logits as linear in the head (exact without softcapping); it runs in
float32 (official: the model dtype); ``top_k`` only sets the curvature model's vocabulary (TRL 1.16 samples without
top-k unless its config sets one); moments are not updated in eval mode; the sentence/global-level variants and the
sequential masking of the official code are not implemented. ``learning_rate`` overrides the scheduler's value.

Cost: no (B, T, V) logits: the head runs ``head_stats_chunk_size`` positions at a time (one extra no-grad LM-head
pass) and the (n, k, d) gradient tensors ``chunk_tokens`` positions at a time. The Adam model keeps two (V, d) float32
moment tensors per process plus a (V, d) float32 accumulator during the loss (for Qwen2.5-7B: about 6.5 GB; SmolLM2-
135M: 0.34 GB), and all-gathers the touched rows once per loss call; ``optimizer_model="sgd"`` keeps no state and
gathers nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import LossContext, OfficialSource, Plugin, PluginError, PluginOptions, hookimpl, option

_SHIFTS = ("objective", "policy")


@dataclass
class CapoOptions(PluginOptions):
    fisher_tau: float = option(
        1e-2, min=0.0, allow_nonfinite=True,
        help="Reject a token when its predicted policy shift m_F = lr^2/2 (v.Delta h)^2 reaches this; 0 switches the "
        "test off.",
    )
    hessian_tau: float = option(
        5e-4, min=0.0, allow_nonfinite=True,
        help="Reject a token when its predicted objective shift m_H leaves (-tau, tau) (or [0, tau)); 0 switches the "
        "test off.",
    )
    hessian_symmetric: bool = option(
        True, help="Keep -tau < m_H < tau (recipe); False keeps 0 <= m_H < tau (the official code's default)."
    )
    optimizer_model: Literal["adam", "sgd"] = option(
        "adam", help="Step model: 'adam' simulates Adam on the LM-head rows (recipe); 'sgd' takes Delta = g (no state)."
    )
    top_k: int = option(
        50, min=1,
        help="Vocabulary of the curvature model: the k most likely tokens, renormalised (the official generation "
        "top_k, transformers' default 50).",
    )
    learning_rate: float | None = option(
        None, min=0.0, min_exclusive=True,
        help="Step size of the curvature model; None: the optimizer's current learning rate (official).",
    )
    chunk_tokens: int = option(
        64, min=1, help="Positions whose (k, d) gradients are built at once (memory: chunk_tokens * k * d * 16 bytes)."
    )

    @property
    def active(self) -> bool:
        """Whether any test is on (both thresholds 0: vanilla TRL, nothing computed)."""
        return self.fisher_tau != 0 or self.hessian_tau != 0


# ------------------------------------------------------------------------------------------------ formulas
def topk_policy(z: torch.Tensor, labels: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k policy of logits ``z`` (n, V): ids (n, k'), ``pi`` (n, k') renormalised over them and ``v = e - pi``
    (``e`` the one-hot of ``labels`` (n,) among the ids; zero when outside), ``k' = min(k, V)``."""
    vals, ids = torch.topk(z.to(torch.promote_types(z.dtype, torch.float32)), min(k, z.shape[-1]), dim=-1)
    pi = torch.softmax(vals, dim=-1)
    e = (ids == labels[:, None]).to(pi.dtype)
    return ids, pi, e - pi


def token_gradients(h: torch.Tensor, v: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Last-layer gradients ``g = A v (x) h`` (n, k, d) of ``A * ratio`` at ratio 1: ``h`` (n, d), ``v`` (n, k), ``A``
    (n,)."""
    return advantages[:, None, None] * v[:, :, None] * h[:, None, :]


def shift_estimates(
    g: torch.Tensor, delta: torch.Tensor, h: torch.Tensor, pi: torch.Tensor, v: torch.Tensor,
    advantages: torch.Tensor, lr: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Predicted objective shift ``m_H`` and policy shift ``m_F`` (both (n,)) of the step ``lr * Delta``.

    ``m_H = lr <g, Delta> + lr^2/2 A (s^2 - u^T F u)``, ``m_F = lr^2/2 s^2``, with ``u = Delta h`` (n, k), ``s = v.u``,
    ``F = diag(pi) - pi pi^T``. ``g``, ``delta`` (n, k, d); ``h`` (n, d); ``pi``, ``v`` (n, k); ``advantages`` (n,).
    """
    first = (g * delta).sum(dim=(1, 2))
    u = torch.einsum("nkd,nd->nk", delta, h)
    s = (v * u).sum(-1)
    pu = pi * u
    fisher_form = (pu * u).sum(-1) - pu.sum(-1) ** 2
    objective = lr * first + 0.5 * lr * lr * advantages * (s * s - fisher_form)
    return objective, 0.5 * lr * lr * s * s


def keep_tokens(objective: torch.Tensor, policy: torch.Tensor, fisher_tau: float, hessian_tau: float,
                symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(fisher_ok, hessian_ok) bool masks of the same shape; a threshold of 0 passes every token."""
    fisher_ok = policy < fisher_tau if fisher_tau != 0 else torch.ones_like(policy, dtype=torch.bool)
    if hessian_tau == 0:
        hessian_ok = torch.ones_like(objective, dtype=torch.bool)
    elif symmetric:
        hessian_ok = (objective < hessian_tau) & (objective > -hessian_tau)
    else:
        hessian_ok = (objective < hessian_tau) & (objective >= 0)
    return fisher_ok, hessian_ok


class HeadAdamModel:
    """Adam moments of the LM-head rows (the official sparse Adam model, stored dense: (V, d) float32 each).

    :meth:`direction` forms the prospective Adam step of per-token gradients without changing the state;
    :meth:`update` moves the moments of the given rows by their mean gradients and counts the step.
    """

    def __init__(self, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8):
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)
        self.m: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.step = 0

    def direction(self, g: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``Delta`` (n, k, d) for gradients ``g`` (n, k, d) on head rows ``ids`` (n, k); ``g`` itself before any
        update."""
        if self.step == 0 or self.m is None:
            return g
        t = self.step + 1
        m = self.m[ids] * self.beta1 + (1 - self.beta1) * g
        v = self.v[ids] * self.beta2 + (1 - self.beta2) * g * g
        return (m / (1 - self.beta1**t)) / ((v / (1 - self.beta2**t)).sqrt() + self.eps)

    def update(self, rows: torch.Tensor, grads: torch.Tensor, vocab_size: int) -> None:
        """Move the moments of ``rows`` (U,) by ``grads`` (U, d) (their mean gradients) and count one step."""
        if self.m is None:
            self.m = torch.zeros(vocab_size, grads.shape[-1], dtype=torch.float32, device=grads.device)
            self.v = torch.zeros_like(self.m)
        self.step += 1
        self.m[rows] = self.m[rows] * self.beta1 + (1 - self.beta1) * grads
        self.v[rows] = self.v[rows] * self.beta2 + (1 - self.beta2) * grads * grads

    def state_dict(self) -> dict:
        return {"step": self.step, "m": self.m, "v": self.v, "betas": [self.beta1, self.beta2, self.eps]}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.m, self.v = state["m"], state["v"]


def _sgd_direction(g: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return g


# ------------------------------------------------------------------------------------------------ plugin
class CapoPlugin(Plugin):
    """Drops tokens whose predicted last-layer update shifts the policy or the objective too much (loss stage)."""

    name = "capo"
    version = "0.1.0"
    paper = (
        "Stabilizing Policy Gradients for Sample-Efficient Reinforcement Learning in LLM Reasoning (CAPO), "
        "arXiv:2510.00819"
    )
    summary = "Masks tokens whose predicted LM-head step moves the policy (Fisher) or objective (Hessian) too much."
    Options = CapoOptions
    needs_head_stats = True
    image_inputs = True
    multi_turn = True
    official = OfficialSource(
        "luckeciano/stable-pg-llm", "933fe01", verdict="faithful",
        files=("src/open_r1/grpo_entropy_trainer.py", "src/open_r1/sparse_optim_models/sparse_adam_model.py",
               "src/open_r1/configs.py",
               "recipes/Qwen2.5-Math-7B/grpo/"
               "config_drgrpo_efficient_adam_fisher_mask_token_1e-2_hessian_mask_token_5e-4.yaml"),
        note="Token-level CAPO only (no sentence/global levels, no sequential masking); temperature-scaled float32 "
        "logits; moments frozen in eval; the recipe's loss_type is dr_grpo.",
    )
    claim_metric = ("rejected_token_fraction", "tokens rejected")
    reconstructed = (
        "curvature of TRL's temperature-scaled logits, taken as linear in the head (official: unscaled logits)",
    )

    def __init__(self, options: CapoOptions | None = None):
        super().__init__(options)
        self.adam = HeadAdamModel() if self.options.optimizer_model == "adam" else None

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        if self.adam is not None:
            self.adam.beta1, self.adam.beta2 = float(args.adam_beta1), float(args.adam_beta2)
            self.adam.eps = float(args.adam_epsilon)

    @hookimpl
    def trl_plugins_state_dict(self):
        return {"adam": self.adam.state_dict()} if self.adam is not None else {}

    @hookimpl
    def trl_plugins_load_state_dict(self, state):
        if self.adam is not None and "adam" in state:
            self.adam.load_state_dict(state["adam"])

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        o = self.options
        if not o.active:
            return
        lr = o.learning_rate if o.learning_rate is not None else ctx.run.learning_rate
        if lr is None:
            raise PluginError(
                "capo needs the learning rate (ctx.run.learning_rate is None): set the learning_rate option."
            )
        stats = ctx.head_stats()
        hidden = stats.hidden_c.detach()
        positions = stats.mask.nonzero()  # (N, 2), the row-major order of HeadStats' valid tokens
        labels = ctx.completion_ids.to(stats.mask.device)[stats.mask]
        advantages = ctx.advantages.detach().float().expand(stats.mask.shape).to(hidden.device)[stats.mask]
        update = self.adam is not None and ctx.mode == "train"
        direction = self.adam.direction if self.adam is not None else _sgd_direction
        acc = {}

        def fn(z, rows):
            ids, pi, v = topk_policy(z, labels[rows].to(z.device), o.top_k)
            pos = positions[rows]
            h = hidden[pos[:, 0], pos[:, 1]].float()
            adv = advantages[rows].float()
            out = []
            for s in range(0, h.shape[0], o.chunk_tokens):
                sl = slice(s, s + o.chunk_tokens)
                g = token_gradients(h[sl], v[sl], adv[sl])
                objective, policy = shift_estimates(g, direction(g, ids[sl]), h[sl], pi[sl], v[sl], adv[sl], lr)
                fisher_ok, hessian_ok = keep_tokens(objective, policy, o.fisher_tau, o.hessian_tau, o.hessian_symmetric)
                if update:
                    self._accumulate(acc, g, ids[sl], fisher_ok & hessian_ok, stats.vocab_size)
                out.append(torch.stack([objective, policy, fisher_ok.float(), hessian_ok.float()], dim=-1))
            return torch.cat(out) if out else z.new_zeros((0, 4))

        est = stats.map_chunks(fn)  # (N, 4)
        if update:
            self._update_moments(ctx, acc, stats.vocab_size, hidden.shape[-1], hidden.device)
        fisher_ok, hessian_ok = est[:, 2].bool(), est[:, 3].bool()
        keep = stats.to_bc((fisher_ok & hessian_ok).float(), fill=1.0)
        ctx.scale_tokens(keep.to(ctx.per_token_logps.device, ctx.per_token_logps.dtype))

        def bc(x):
            return stats.to_bc(x.float()).to(ctx.mask.device)

        mask = stats.mask.to(ctx.mask.device).float()
        ctx.log_metric("rejected_token_fraction", ctx.global_masked_mean(1.0 - bc(fisher_ok & hessian_ok), mask))
        ctx.log_metric("fisher_rejected_fraction", ctx.global_masked_mean(1.0 - bc(fisher_ok), mask))
        ctx.log_metric("hessian_rejected_fraction", ctx.global_masked_mean(1.0 - bc(hessian_ok), mask))
        ctx.log_metric("policy_shift_mean", ctx.global_masked_mean(bc(est[:, 1]), mask))
        ctx.log_metric("objective_shift_abs_mean", ctx.global_masked_mean(bc(est[:, 0].abs()), mask))

    @staticmethod
    def _accumulate(acc: dict, g: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor, vocab_size: int) -> None:
        """Add the kept tokens' gradient rows (and counts) to the (V, d) / (V,) sums of this loss call."""
        if "sums" not in acc:
            acc["sums"] = torch.zeros(vocab_size, g.shape[-1], dtype=torch.float32, device=g.device)
            acc["counts"] = torch.zeros(vocab_size, dtype=torch.float32, device=g.device)
        rows = ids[keep].reshape(-1)
        acc["sums"].index_add_(0, rows, g[keep].reshape(-1, g.shape[-1]))
        acc["counts"].index_add_(0, rows, torch.ones_like(rows, dtype=torch.float32))

    def _update_moments(self, ctx: LossContext, acc: dict, vocab_size: int, dim: int, device) -> None:
        """Global per-row mean gradient of the kept tokens over every process, then one Adam-moment step.

        Collective: three ``gather_padded`` calls on every process in every train-mode loss call."""
        if "counts" in acc:
            rows = acc["counts"].nonzero().squeeze(-1)
            sums, counts = acc["sums"][rows], acc["counts"][rows]
        else:
            rows = torch.zeros(0, dtype=torch.long, device=device)
            sums, counts = torch.zeros(0, dim, device=device), torch.zeros(0, device=device)
        all_rows = ctx.gather_padded(rows, dim=0, pad_value=-1)
        all_sums = ctx.gather_padded(sums, dim=0, pad_value=0)
        all_counts = ctx.gather_padded(counts, dim=0, pad_value=0)
        real = all_rows >= 0
        all_rows, all_sums, all_counts = all_rows[real], all_sums[real], all_counts[real]
        if all_rows.numel() == 0:
            return
        unique, inverse = torch.unique(all_rows, return_inverse=True)
        total = torch.zeros(unique.numel(), dim, dtype=torch.float32, device=all_sums.device)
        total.index_add_(0, inverse, all_sums.float())
        count = torch.zeros(unique.numel(), dtype=torch.float32, device=all_sums.device)
        count.index_add_(0, inverse, all_counts.float())
        self.adam.update(unique, total / count[:, None], vocab_size)
