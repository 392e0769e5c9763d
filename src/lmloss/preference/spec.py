"""`PreferenceSpec`: every option of a preference loss, in one frozen, validated value.

A spec names a *family* (``"dpo"``, ``"kto"``, ``"orpo"``, ``"cpo"``: TRL 1.16's ``DPOTrainer``,
``KTOTrainer`` and ``trl.experimental``'s ``ORPOTrainer`` / ``CPOTrainer``) and the options that family reads,
with TRL's names and defaults. It is checked once, when it is made (`PreferenceSpec.__post_init__`: every
error names the field), and is what the rank agreement compares (`PreferenceSpec.agreement_vector`, a fixed
number of int64 values whatever the options) and what an integration translates a trainer's config into
(`lmloss.integrations.trl`).

The math these options select is in `lmloss.preference.losses` (docs/preference.md has the formulas).
"""

from __future__ import annotations

import dataclasses
import math
import struct

import torch

__all__ = ["AGREEMENT_FIELDS", "FAMILIES", "F_DIVERGENCES", "LOSS_TYPES", "PreferenceSpec"]

#: Each family's loss types (TRL 1.16's names). CPO's ``"alphapo"`` is TRL's sugar for ``"simpo"`` with
#: ``cpo_alpha=0`` and is resolved to that when the spec is made.
LOSS_TYPES: dict[str, tuple[str, ...]] = {
    "dpo": (
        "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
        "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
    ),
    "kto": ("kto", "apo_zero_unpaired"),
    "orpo": ("orpo",),
    "cpo": ("sigmoid", "hinge", "ipo", "simpo", "alphapo"),
}  # fmt: skip
FAMILIES = tuple(LOSS_TYPES)
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
#: DPO loss types that take an f-divergence other than reverse KL (TRL refuses the others).
F_DIVERGENCE_LOSS_TYPES = frozenset({"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"})
#: How many loss types one spec may combine (MPO: each at most once, so every DPO type): the agreement vector
#: has a slot for each.
MAX_LOSS_TYPES = len(LOSS_TYPES["dpo"])
#: The agreement vector's fields, in order: the same length for every spec.
AGREEMENT_FIELDS = (
    "family", *(f"loss_type_{i}" for i in range(MAX_LOSS_TYPES)), *(f"loss_weight_{i}" for i in range(MAX_LOSS_TYPES)),
    "beta", "label_smoothing", "f_divergence", "f_alpha", "ld_alpha", "use_weighting", "discopop_tau",
    "desirable_weight", "undesirable_weight", "cpo_alpha", "simpo_gamma", "alpha",
)  # fmt: skip


def _number(name: str, v: object, *, low: float | None = None, high: float | None = None, open_low=False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"PreferenceSpec.{name} must be a finite number, got {v!r}")
    if low is not None and (v < low or (open_low and v == low)):
        raise ValueError(f"PreferenceSpec.{name} must be {'>' if open_low else '>='} {low}, got {v!r}")
    if high is not None and v > high:
        raise ValueError(f"PreferenceSpec.{name} must be <= {high}, got {v!r}")
    return float(v)


@dataclasses.dataclass(frozen=True)
class PreferenceSpec:
    """The options of one preference loss (TRL 1.16's names and defaults).

    Every family:
        family: ``"dpo"`` (default), ``"kto"``, ``"orpo"`` or ``"cpo"``.
        loss_type: one name or a tuple of names of `LOSS_TYPES`\\ [family]; DPO sums several with
            `loss_weights` (MPO). Default: the family's first (``"sigmoid"``, ``"kto"``, ``"orpo"``,
            ``"sigmoid"``).
        beta: the reward scale β (ORPO: λ, the odds-ratio term's weight; IPO: τ). > 0.
        label_smoothing: ε of ``robust``, ``exo_pair`` (> 0 there), ``aot``, ``aot_unpaired`` and CPO's
            ``sigmoid`` / ``simpo`` (TRL 1.16's DPO ``sigmoid`` does not read it). In [0, 0.5) for robust,
            [0, 1) otherwise.
    DPO:
        loss_weights: one weight per loss type (None: 1.0 each).
        f_divergence: `F_DIVERGENCES`; other than ``reverse_kl`` only with `F_DIVERGENCE_LOSS_TYPES`.
        f_alpha: the α of ``alpha_divergence``.
        ld_alpha: LD-DPO's weight of the tokens beyond the shorter completion of a pair, in [0, 1] (None:
            off; `lmloss.preference.per_token_weights`).
        use_weighting: WPO's per-pair weight (needs each token's ``log Σ p²``).
        discopop_tau: DiscoPOP's τ (> 0).
    KTO:
        desirable_weight, undesirable_weight: the weights of the desirable / undesirable sequences' losses.
    CPO:
        cpo_alpha: the weight of the NLL term (``alphapo`` sets it to 0).
        simpo_gamma: SimPO's target margin γ.
        alpha: AlphaPO's reward shape (0: log-prob rewards).
    """

    family: str = "dpo"
    loss_type: tuple[str, ...] | str | None = None
    beta: float = 0.1
    label_smoothing: float = 0.0
    loss_weights: tuple[float, ...] | None = None
    f_divergence: str = "reverse_kl"
    f_alpha: float = 0.5
    ld_alpha: float | None = None
    use_weighting: bool = False
    discopop_tau: float = 0.05
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    cpo_alpha: float = 1.0
    simpo_gamma: float = 0.5
    alpha: float = 0.0

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen: normalised once, here)
        if self.family not in LOSS_TYPES:
            raise ValueError(f"PreferenceSpec.family must be one of {FAMILIES}, got {self.family!r}")
        known = LOSS_TYPES[self.family]
        types = self.loss_type if self.loss_type is not None else known[0]
        types = (types,) if isinstance(types, str) else tuple(types)
        if not types or len(types) > MAX_LOSS_TYPES:
            raise ValueError(f"PreferenceSpec.loss_type must name 1 to {MAX_LOSS_TYPES} loss types, got {types!r}")
        for t in types:
            if t not in known:
                raise ValueError(f"PreferenceSpec.loss_type {t!r} is not a {self.family} loss type; one of {known}")
        if len(set(types)) != len(types):
            raise ValueError(f"PreferenceSpec.loss_type names a loss type twice: {types!r}")
        if len(types) > 1 and self.family != "dpo":
            raise ValueError(f"PreferenceSpec.loss_type: only family 'dpo' combines loss types, got {types!r}")
        if self.family == "cpo" and types == ("alphapo",):  # TRL's CPOConfig sugar
            types = ("simpo",)
            set_("cpo_alpha", 0.0)
        set_("loss_type", types)
        if self.loss_weights is not None:
            weights = tuple(_number("loss_weights", w) for w in self.loss_weights)
            if len(weights) != len(types):
                raise ValueError(
                    f"PreferenceSpec.loss_weights must have one weight per loss type ({len(types)}), got {len(weights)}"
                )
            set_("loss_weights", weights)
        set_("beta", _number("beta", self.beta, low=0.0, open_low=True))
        smoothing_high = 0.5 if "robust" in types else 1.0
        ls = _number("label_smoothing", self.label_smoothing, low=0.0)
        if ls >= smoothing_high:
            raise ValueError(f"PreferenceSpec.label_smoothing must be < {smoothing_high}, got {ls!r}")
        if "exo_pair" in types and ls == 0.0:
            raise ValueError("PreferenceSpec.label_smoothing must be > 0 for loss_type 'exo_pair' (log ε is taken)")
        set_("label_smoothing", ls)
        if self.f_divergence not in F_DIVERGENCES:
            raise ValueError(f"PreferenceSpec.f_divergence must be one of {F_DIVERGENCES}, got {self.f_divergence!r}")
        if self.f_divergence != "reverse_kl" and (self.family != "dpo" or not set(types) <= F_DIVERGENCE_LOSS_TYPES):
            raise ValueError(
                f"PreferenceSpec.f_divergence {self.f_divergence!r} applies to DPO loss types "
                f"{sorted(F_DIVERGENCE_LOSS_TYPES)} only, got family {self.family!r} with {types!r}"
            )
        set_("f_alpha", _number("f_alpha", self.f_alpha))
        if self.ld_alpha is not None:
            if self.family != "dpo":
                raise ValueError(f"PreferenceSpec.ld_alpha is a DPO option (family {self.family!r})")
            set_("ld_alpha", _number("ld_alpha", self.ld_alpha, low=0.0, high=1.0))
        if not isinstance(self.use_weighting, bool):
            raise ValueError(f"PreferenceSpec.use_weighting must be a bool, got {self.use_weighting!r}")
        if self.use_weighting and (self.family != "dpo" or {"aot", "aot_unpaired"} & set(types)):
            raise ValueError(
                "PreferenceSpec.use_weighting (WPO) applies to DPO loss types other than 'aot' / 'aot_unpaired' "
                "(those sort the pairs, which would misalign the weights)"
            )
        set_("discopop_tau", _number("discopop_tau", self.discopop_tau, low=0.0, open_low=True))
        for name in ("desirable_weight", "undesirable_weight", "cpo_alpha"):
            set_(name, _number(name, getattr(self, name), low=0.0))
        set_("simpo_gamma", _number("simpo_gamma", self.simpo_gamma))
        set_("alpha", _number("alpha", self.alpha))

    @property
    def weights(self) -> tuple[float, ...]:
        """One weight per loss type (`loss_weights`, or 1.0 each)."""
        return self.loss_weights if self.loss_weights is not None else (1.0,) * len(self.loss_type)

    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads the reference policy's log-probs (DPO and KTO; ORPO and CPO have none)."""
        return self.family in ("dpo", "kto")

    @property
    def needs_log_sum_sq_probs(self) -> bool:
        """Whether the loss reads each token's ``log Σ_v p_v²`` (WPO)."""
        return self.use_weighting

    @property
    def needs_sft(self) -> bool:
        """Whether the loss has an NLL term over the chosen sequences (`SequenceStats.sft_logps`)."""
        return self.family == "orpo" or (self.family == "cpo" and self.cpo_alpha != 0.0) or "sft" in self.loss_type

    def options(self) -> dict[str, object]:
        """The options as a dict (what an op's agreement text shows on a mismatch)."""
        return dataclasses.asdict(self)

    def agreement_values(self) -> dict[str, float]:
        """`AGREEMENT_FIELDS` -> a number: names by their index in `FAMILIES` / `LOSS_TYPES` / `F_DIVERGENCES`
        (-1 for an empty slot), floats as they are, ``ld_alpha`` None as -1."""
        types = LOSS_TYPES[self.family]
        values: dict[str, float] = {"family": FAMILIES.index(self.family)}
        for i in range(MAX_LOSS_TYPES):
            there = i < len(self.loss_type)
            values[f"loss_type_{i}"] = types.index(self.loss_type[i]) if there else -1
            values[f"loss_weight_{i}"] = self.weights[i] if there else 0.0
        values.update(
            beta=self.beta, label_smoothing=self.label_smoothing, f_divergence=F_DIVERGENCES.index(self.f_divergence),
            f_alpha=self.f_alpha, ld_alpha=-1.0 if self.ld_alpha is None else self.ld_alpha,
            use_weighting=int(self.use_weighting), discopop_tau=self.discopop_tau,
            desirable_weight=self.desirable_weight, undesirable_weight=self.undesirable_weight,
            cpo_alpha=self.cpo_alpha, simpo_gamma=self.simpo_gamma, alpha=self.alpha,
        )  # fmt: skip
        return values

    def agreement_vector(self, device: torch.device | str | None = None) -> torch.Tensor:
        """int64 ``[len(AGREEMENT_FIELDS)]``: `agreement_values` in field order, every value as its float64
        bits (equal vectors <=> equal specs; the length does not depend on the options)."""
        values = self.agreement_values()
        bits = [struct.unpack("<q", struct.pack("<d", float(values[k])))[0] for k in AGREEMENT_FIELDS]
        return torch.tensor(bits, dtype=torch.int64, device=device)
