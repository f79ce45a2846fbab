"""What a trace's prefills would cost with a given tier speed and compute speed.

Hit ratios say how much of a trace's prompts the cache serves, not how much
time that saves: a block on a slow tier can cost more to load than to
compute again. Given a lower tier's load cost (a latency per call plus bytes
over a bandwidth) and the model's prefill cost (seconds per token, plus per
query-key pair for attention), :class:`PrefillClock` adds up each admitted
request's prefill under four rules:

* ``uncached``: no cache at all, every prompt token computed;
* ``recompute``: the device's hits are free, the tier's blocks are computed;
* ``load_all``: the tier's blocks are loaded, whatever they cost;
* ``plan``: kvtier's rule (:func:`kvtier.costs.best_load`, what the engine's
  connector does with its learned costs): load the tier blocks whose load
  finishes before computing them would, compute the rest.

Each request is timed alone (one prefill pass, no queueing), which is what
the rule compares. The cache's contents do not depend on the rule (a block
recomputed is stored as a block loaded would be), so one replay gives all
four.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtier.costs import LoadEstimate, PrefillEstimate, best_load
from kvtier.errors import ConfigError

#: The tier's name in the load plan (the replay has one lower tier).
_TIER = "tier"


@dataclass(frozen=True, slots=True)
class CostSpec:
    """The costs a replay times prefills with (``kvtier replay --prefill-rate`` and friends)."""

    #: Tokens a second the model computes, before attention.
    prefill_tokens_s: float
    #: Seconds per query-key pair of attention (0: attention is free next to the rest).
    pair_s: float = 0.0
    #: The lower tier's bytes a second, once a load call is under way (``inf``: free).
    tier_bytes_s: float = math.inf
    #: Seconds each load call from the tier pays, whatever its size.
    tier_latency_s: float = 0.0
    #: Bytes one block weighs on the tier.
    block_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.prefill_tokens_s > 0 or math.isinf(self.prefill_tokens_s):
            raise ConfigError(
                f"--prefill-rate must be a positive number of tokens a second, "
                f"got {self.prefill_tokens_s!r}"
            )
        if not self.pair_s >= 0 or math.isinf(self.pair_s):
            raise ConfigError(f"--prefill-pair-cost must be >= 0 seconds, got {self.pair_s!r}")
        if not self.tier_bytes_s > 0:
            raise ConfigError(
                f"--tier-bandwidth must be a positive rate (e.g. 3MB/s), got {self.tier_bytes_s!r}"
            )
        if not self.tier_latency_s >= 0 or math.isinf(self.tier_latency_s):
            raise ConfigError(f"--tier-latency must be >= 0 seconds, got {self.tier_latency_s!r}")
        if self.block_bytes < 0:
            raise ConfigError(f"a block's bytes must be >= 0, got {self.block_bytes!r}")

    @property
    def prefill(self) -> PrefillEstimate:
        return PrefillEstimate(0.0, 1.0 / self.prefill_tokens_s, self.pair_s, 0)

    @property
    def load(self) -> LoadEstimate:
        return LoadEstimate(self.tier_latency_s, self.tier_bytes_s, 0)


@dataclass(slots=True)
class PrefillClock:
    """Seconds of prefill a replay's admitted requests add up to, under each rule."""

    spec: CostSpec
    requests: int = 0
    uncached_s: float = 0.0
    recompute_s: float = 0.0
    load_all_s: float = 0.0
    plan_s: float = 0.0
    #: Tier blocks found, and how many of them the plan loads (the rest it computes).
    tier_blocks: int = 0
    loaded_blocks: int = 0
    #: Requests whose tier hit the plan loaded only in part, or not at all.
    partial_plans: int = 0
    recompute_plans: int = 0

    def add(
        self, prompt_tokens: int, device_tokens: int, tier_blocks: int, block_size: int
    ) -> None:
        """One admitted request: ``device_tokens`` cached on the device, then
        ``tier_blocks`` blocks on the tier, the rest of its ``prompt_tokens`` computed."""
        if not 0 <= device_tokens < prompt_tokens or tier_blocks < 0:
            raise ConfigError(
                f"a request's {device_tokens} device and {tier_blocks} tier blocks' tokens "
                f"must leave its {prompt_tokens}-token prompt's last token to compute"
            )
        prefill = self.spec.prefill
        self.requests += 1
        self.uncached_s += prefill.seconds(0, prompt_tokens)
        if not tier_blocks:
            own = prefill.seconds(device_tokens, prompt_tokens)
            self.recompute_s += own
            self.load_all_s += own
            self.plan_s += own
            return
        k, totals = best_load(
            device_tokens,
            prompt_tokens,
            block_size,
            [_TIER] * tier_blocks,
            [self.spec.block_bytes] * tier_blocks,
            prefill,
            {_TIER: self.spec.load},
        )
        self.recompute_s += totals[0]
        self.load_all_s += totals[tier_blocks]
        self.plan_s += totals[k]
        self.tier_blocks += tier_blocks
        self.loaded_blocks += k
        if k == 0:
            self.recompute_plans += 1
        elif k < tier_blocks:
            self.partial_plans += 1

    def to_json(self) -> dict[str, float | int]:
        return {
            "requests": self.requests,
            "uncached_s": round(self.uncached_s, 6),
            "recompute_s": round(self.recompute_s, 6),
            "load_all_s": round(self.load_all_s, 6),
            "plan_s": round(self.plan_s, 6),
            "tier_blocks": self.tier_blocks,
            "loaded_blocks": self.loaded_blocks,
            "partial_plans": self.partial_plans,
            "recompute_plans": self.recompute_plans,
        }
