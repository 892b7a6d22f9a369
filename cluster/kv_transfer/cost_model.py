"""Copy or compute: the receiver's choice for the leading blocks another replica holds.

A copy of `b` bytes from holder `h` is predicted to take `latency(h) + b / bandwidth(h)`, both
exponentially smoothed from the pulls this replica completed (priors until the first one);
computing `t` tokens takes `t x seconds_per_token`, the engine's own measured figure (the
scheduler's preemption cost model). A pull happens when the copy is predicted faster.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TransferCostModel:
    bandwidth_prior_bytes_per_s: float = 1e9
    latency_prior_s: float = 0.005
    smoothing: float = 0.3
    bandwidth: dict[str, float] = field(default_factory=dict)
    latency: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.bandwidth_prior_bytes_per_s <= 0 or self.latency_prior_s < 0:
            raise ValueError("the bandwidth prior must be > 0 and the latency prior >= 0")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")

    def copy_seconds(self, holder: str, num_bytes: int) -> float:
        bandwidth = self.bandwidth.get(holder, self.bandwidth_prior_bytes_per_s)
        return self.latency.get(holder, self.latency_prior_s) + num_bytes / bandwidth

    def prefer_copy(
        self, holder: str, num_bytes: int, num_tokens: int, seconds_per_token: float
    ) -> bool:
        return self.copy_seconds(holder, num_bytes) < num_tokens * seconds_per_token

    def observe(self, holder: str, num_bytes: int, seconds: float, fixed_seconds: float) -> None:
        """A completed pull of `num_bytes` in `seconds`, `fixed_seconds` of which did not grow
        with the size (the round trip's own cost, as far as it is known)."""
        alpha = self.smoothing
        moving = max(seconds - fixed_seconds, 1e-9)
        sample = num_bytes / moving
        old = self.bandwidth.get(holder)
        self.bandwidth[holder] = sample if old is None else old + alpha * (sample - old)
        old_latency = self.latency.get(holder)
        fixed = max(fixed_seconds, 0.0)
        self.latency[holder] = (
            fixed if old_latency is None else old_latency + alpha * (fixed - old_latency)
        )
