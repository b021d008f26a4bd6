"""VERL -- effective-rank advantage shaping (arXiv:2509.23808, "Beyond the Exploration-Exploitation Trade-off: A
Hidden State Approach for LLM Reasoning in RLVR").

Exploration is measured by the effective rank (ER) of a response's hidden states, exploitation by its first and
second differences along the response (ERV, "velocity"; ERA, "acceleration"). ERA, relative to a running baseline,
steers a bonus between an exploration profile and an exploitation profile; the bonus is added to the GRPO
advantage, clipped to a fraction of its magnitude. Facts from the official code (hf618/VERL @3de68f1; restated, not
copied):

1. ER of ``H`` (L, d) (``verl/trainer/metrics_utils.py:32-61``): centre the rows, singular values ``S``,
   ``p = S / (sum S + 1e-8)``, ``ER = exp(-sum p log(p + 1e-8))``; 0 for fewer than 2 tokens. Zeroth order: the
   whole response.
2. ERV, ERA (``metrics_utils.py:117-189``, the "optimized" calculator; ``calculate_diffs_for_single_sample_
   original`` at :193 is the same quantity): keep the last ``max_len`` tokens; for ``t = s, 2s, ... < L`` take
   ``m_t = ER(H[:t+1])``; ``diff_t = m_t - mean(m before t)``, ``diff2_t = diff_t - diff_{t-1}``; ERV and ERA are
   the means over ``t`` (0 when ``L < 2s``).
3. Bonus (``verl/trainer/reward_manager_versions.py:160-219``): indicators ``x = (ERA, ERV, ER)``; relative
   deviation ``d_k = clamp((x_k - mid_k) / (|mid_k| + 1e-8), -5, 5)``; tendency ``tau = sigmoid(gain * d_ERA)``;
   weights ``w = tau w_explore + (1 - tau) w_exploit``; ``aux = scale * sum_k tanh(d_k) w_k``. ``mid_k`` is an EMA
   (``ema_alpha``, from 0) of the previous step's batch means, updated after the bonus is taken; no bonus on the
   first step (``metrics_old`` is empty there).
4. Advantage (``verl/trainer/ppo/ray_trainer.py:157-168``): ``A = A_0 + min(relu(aux), |A_0| / kappa)`` on the token
   that carries the auxiliary reward, the last completion token (:213 places it there).

Defaults are the released launch script's (``train.sh``: ER indicators, weights explore (0, 0, 1) / exploit
(0, 1, 0), ``diff_stride`` 40, ``modulation_gain`` 2.0, ``aux_reward_global_weight`` 1.0, ``aux_fix`` True,
``reward_ema_alpha`` 0.3, ``adv_shaping_kappa`` 2.0; ``max_seq_len`` 512 from ``metrics_calculator.py:14``). That
script also passes ``--add_reward False``, which in ``reward_manager_versions.py:107`` switches the bonus itself off
(the released run's advantage is GRPO's); this plugin implements the advantage-shaping case the paper describes
(bonus computed, used only in the advantage).

Reconstructed: the hidden states are the policy's own (a no-grad teacher-forced forward, ``ctx.hidden_states``) at
the last layer, where the official run takes vLLM's decode-time hidden states; the dynamic scale (``aux_fix=False``)
is not implemented.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import AdvantageContext, OfficialSource, Plugin, PluginOptions, hookimpl, option
from trl_plugins.api.errors import PluginConfigError
from trl_plugins.api.reasons import without_images

#: Indicator order of the official ``indicator_names``: acceleration, velocity, rank.
INDICATORS = ("era", "erv", "er")


@dataclass
class VerlErankOptions(PluginOptions):
    kappa: float = option(2.0, min=0.0, min_exclusive=True, allow_nonfinite=True,
                          help="Bonus clip: at most |A| / kappa (adv_shaping_kappa; inf: no bonus).")
    aux_weight: float = option(1.0, min=0.0, help="Scale of the bonus (aux_reward_global_weight; 0: vanilla GRPO).")
    modulation_gain: float = option(2.0, help="Gain of the sigmoid on ERA's relative deviation (modulation_gain).")
    ema_alpha: float = option(0.3, min=0.0, max=1.0, min_exclusive=True,
                              help="EMA weight of the newest batch mean in the baselines (reward_ema_alpha).")
    explore_era: float = option(0.0, help="Exploration-profile weight of ERA (weights[0]).")
    explore_erv: float = option(0.0, help="Exploration-profile weight of ERV (weights[1]).")
    explore_er: float = option(1.0, help="Exploration-profile weight of ER (weights[2]).")
    exploit_era: float = option(0.0, help="Exploitation-profile weight of ERA (weights_exploit[0]).")
    exploit_erv: float = option(1.0, help="Exploitation-profile weight of ERV (weights_exploit[1]).")
    exploit_er: float = option(0.0, help="Exploitation-profile weight of ER (weights_exploit[2]).")
    stride: int = option(40, min=1, help="Token stride of the prefixes whose ER gives ERV/ERA (diff_stride).")
    max_len: int = option(512, min=2, help="ERV/ERA use the last max_len tokens of a response (max_seq_len).")
    layer: int = option(-1, reconstructed=True,
                        help="Hidden-state layer (transformers' numbering, -1 the final output).")
    bonus_tokens: Literal["last", "all"] = option(
        "last", help="'last': the bonus on the last completion token (official); 'all': on every token (variant).")

    def validate(self) -> None:
        if self.kappa == -math.inf or math.isnan(self.kappa):
            raise PluginConfigError(f"Plugin 'verl_erank': kappa={self.kappa!r}; allowed: a number > 0 or inf.")

    @property
    def w_explore(self) -> torch.Tensor:
        return torch.tensor([self.explore_era, self.explore_erv, self.explore_er])

    @property
    def w_exploit(self) -> torch.Tensor:
        return torch.tensor([self.exploit_era, self.exploit_erv, self.exploit_er])


def effective_rank(h: torch.Tensor) -> float:
    """ER of ``h`` (L, d): exp of the entropy of the normalised singular values of the centred rows; 0 if L < 2."""
    if h.size(0) < 2:
        return 0.0
    x = h.float()
    x = x - x.mean(dim=0, keepdim=True)
    s = torch.linalg.svdvals(x)
    p = s / (s.sum() + 1e-8)
    return float(torch.exp(-(p * torch.log(p + 1e-8)).sum()))


def rank_dynamics(h: torch.Tensor, stride: int, max_len: int) -> tuple[float, float, float]:
    """``(ERA, ERV, ER)`` of one response's hidden states ``h`` (L, d) (valid tokens only); see the module doc."""
    er = effective_rank(h)
    h = h[-max_len:]
    length = h.size(0)
    if length < 2 * stride:
        return 0.0, 0.0, er
    history, diffs, diffs2, prev = [], [], [], None
    for t in range(stride, length, stride):
        m = effective_rank(h[: t + 1])
        if history:
            d = m - sum(history) / len(history)
            diffs.append(d)
            if prev is not None:
                diffs2.append(d - prev)
            prev = d
        history.append(m)
    mean = lambda v: sum(v) / len(v) if v else 0.0  # noqa: E731
    return mean(diffs2), mean(diffs), er


def erank_bonus(x: torch.Tensor, mids: torch.Tensor, gain: float, w_explore: torch.Tensor, w_exploit: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Bonus ``aux`` (N,) and tendency (N,) from indicators ``x`` (N, 3) = (ERA, ERV, ER) and baselines ``mids`` (3,)."""
    dev = ((x - mids) / (mids.abs() + 1e-8)).clamp(-5.0, 5.0)
    tendency = torch.sigmoid(gain * dev[:, 0])
    w = tendency[:, None] * w_explore + (1 - tendency[:, None]) * w_exploit
    return scale * (torch.tanh(dev) * w).sum(-1), tendency


def shape_advantages(adv: torch.Tensor, aux: torch.Tensor, kappa: float, mask: torch.Tensor | None) -> torch.Tensor:
    """``A + min(relu(aux), |A| / kappa)``: on every token when ``mask`` is None (``adv`` (N,) or (N, T)), else only on
    each row's last masked token (``mask`` (N, T); returns (N, T))."""
    if mask is None:
        aux_b = aux if adv.dim() == 1 else aux[:, None]
        return adv + torch.minimum(aux_b.clamp(min=0), adv.abs() / kappa)
    tok = adv if adv.dim() == 2 else adv[:, None].expand_as(mask)
    tok = tok[:, : mask.size(1)].clone()
    has = mask.sum(-1) > 0
    last = (mask.size(1) - 1 - mask.flip(-1).float().argmax(-1)).clamp(min=0)
    rows = torch.arange(mask.size(0), device=mask.device)[has]
    a_last = tok[rows, last[has]]
    tok[rows, last[has]] = a_last + torch.minimum(aux[has].clamp(min=0).to(tok.dtype), a_last.abs() / kappa)
    return tok


class VerlErankPlugin(Plugin):
    """Effective-rank (ER/ERV/ERA) bonus on the GRPO advantage (advantage stage)."""

    name = "verl_erank"
    version = "0.1.0"
    paper = (
        "Beyond the Exploration-Exploitation Trade-off: A Hidden State Approach for LLM Reasoning in RLVR (VERL), "
        "arXiv:2509.23808"
    )
    summary = "Advantage bonus from the effective rank of hidden states and its velocity/acceleration (ERA-steered)."
    Options = VerlErankOptions
    needs_hidden_states = True
    image_inputs = without_images("it reads hidden states through ctx.hidden_states (text-only policy forwards)")
    multi_turn = True
    official = OfficialSource(
        "hf618/VERL", "3de68f1", verdict="faithful",
        files=("verl/trainer/metrics_utils.py", "verl/trainer/reward_manager_versions.py",
               "verl/trainer/ppo/ray_trainer.py", "train.sh"),
        note="The released train.sh passes --add_reward False, which also switches the bonus off "
        "(reward_manager_versions.py:107); implemented here is the advantage-shaping case. Hidden states from a "
        "teacher-forced forward, not vLLM's decode pass.",
        variants=("bonus_tokens",),
    )
    claim_metric = ("aux", "mean effective-rank bonus before clipping")
    reconstructed = (
        "hidden states of the policy's teacher-forced forward at the last layer (official: vLLM decode-time states)",
        "aux_fix=False (the performance-scaled bonus) is not implemented; the fixed scale is the released setting",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.hidden_states_layer = self.options.layer
        self.mids = [0.0, 0.0, 0.0]
        self.prev_means: list[float] | None = None

    def _indicators(self, ctx: AdvantageContext) -> torch.Tensor:
        o = self.options

        def reduce(chunk):
            out = torch.zeros(chunk.hidden.size(0), 3)
            for r in range(chunk.hidden.size(0)):
                valid = chunk.hidden[r][chunk.mask[r].bool()]
                out[r] = torch.tensor(rank_dynamics(valid, o.stride, o.max_len))
            return out

        local = ctx.hidden_states(reduce, layer=self.hidden_states_layer)
        return ctx.gather(local.to(ctx.device)).float().cpu()

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        x = self._indicators(ctx)
        means = x.mean(0).tolist()
        for k, name in enumerate(INDICATORS):
            ctx.log_metric(name, means[k])
        if self.prev_means is None:  # first step: no baseline yet (official: metrics_old is empty)
            self.prev_means = means
            ctx.log_metric("aux", 0.0)
            return
        aux, tendency = erank_bonus(x, torch.tensor(self.mids), o.modulation_gain, o.w_explore, o.w_exploit,
                                    o.aux_weight)
        self.mids = [(1 - o.ema_alpha) * m + o.ema_alpha * v for m, v in zip(self.mids, self.prev_means)]
        self.prev_means = means
        ctx.log_metric("tendency", float(tendency.mean()))
        ctx.log_metric("aux", float(aux.mean()))
        if not (aux > 0).any() or math.isinf(o.kappa):  # no positive bonus: the advantages stay as they are
            return
        adv = ctx.advantages
        aux = aux.to(device=adv.device, dtype=adv.dtype)
        mask = ctx.completion_mask().to(adv.device) if o.bonus_tokens == "last" else None
        ctx.advantages = shape_advantages(adv, aux, o.kappa, mask)

    @hookimpl
    def trl_plugins_state_dict(self):
        return {"mids": list(self.mids), "prev_means": None if self.prev_means is None else list(self.prev_means)}

    @hookimpl
    def trl_plugins_load_state_dict(self, state):
        self.mids = [float(v) for v in state.get("mids", [0.0, 0.0, 0.0])]
        prev = state.get("prev_means")
        self.prev_means = None if prev is None else [float(v) for v in prev]
