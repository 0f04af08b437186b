"""Pull-or-recompute decision for a verified prefix (sans-IO).

Pull iff the verified gain is at least ``kv_recompute_threshold`` tokens AND the predicted transfer
time is below the predicted recompute time. Both predictions use online estimates (exponentially
weighted) of the observed pull bandwidth and prefill throughput, and configured defaults until the
first observation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvlease_vllm._verify import Reason


@dataclass(frozen=True)
class Decision:
    pull: bool
    reason: Reason
    gain_tokens: int
    predicted_pull_s: float
    predicted_recompute_s: float

    def describe(self) -> str:
        return (
            f"{'pull' if self.pull else 'recompute'} ({self.reason.value}): gain={self.gain_tokens} tokens, "
            f"predicted pull {self.predicted_pull_s * 1e3:.1f} ms vs recompute {self.predicted_recompute_s * 1e3:.1f} ms"
        )


class _Ewma:
    """Exponentially weighted mean; ``None`` until the first sample."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.value: float | None = None
        self.samples = 0

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x
        self.samples += 1


class CostModel:
    """Predicts pull and recompute times from observations.

    ``bytes_per_token``: KV bytes one token occupies on this node (all layers).
    """

    def __init__(
        self,
        *,
        bytes_per_token: float,
        default_bandwidth_bps: float,
        default_prefill_tokens_per_s: float,
        fixed_latency_s: float,
        alpha: float = 0.3,
    ) -> None:
        if bytes_per_token <= 0 or default_bandwidth_bps <= 0 or default_prefill_tokens_per_s <= 0:
            raise ValueError("bytes_per_token, bandwidth and prefill throughput must be positive")
        self.bytes_per_token = bytes_per_token
        self.default_bandwidth_bps = default_bandwidth_bps
        self.default_prefill_tokens_per_s = default_prefill_tokens_per_s
        self.fixed_latency_s = fixed_latency_s
        self._bw = _Ewma(alpha)
        self._tps = _Ewma(alpha)

    @property
    def bandwidth_bps(self) -> float:
        return self._bw.value if self._bw.value is not None else self.default_bandwidth_bps

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._tps.value if self._tps.value is not None else self.default_prefill_tokens_per_s

    @property
    def observations(self) -> tuple[int, int]:
        """(pull samples, prefill samples)."""
        return self._bw.samples, self._tps.samples

    def observe_pull(self, tokens: int, seconds: float) -> None:
        """A pull of ``tokens`` tokens took ``seconds`` (from the decision to the completed read)."""
        if tokens <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        # the fixed part is modelled separately; never let it drive the bandwidth to ~0
        transfer = max(seconds - self.fixed_latency_s, seconds * 0.1)
        self._bw.add(tokens * self.bytes_per_token / transfer)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """``tokens`` prompt tokens were computed in ``seconds``."""
        if tokens <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        self._tps.add(tokens / seconds)

    def predict_pull_s(self, tokens: int) -> float:
        return self.fixed_latency_s + tokens * self.bytes_per_token / self.bandwidth_bps

    def predict_recompute_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def decide(self, gain_tokens: int, threshold: int) -> Decision:
        t_pull = self.predict_pull_s(max(gain_tokens, 0))
        t_rec = self.predict_recompute_s(max(gain_tokens, 0))
        if gain_tokens <= 0:
            return Decision(False, Reason.LOCAL_HIT, gain_tokens, t_pull, t_rec)
        if gain_tokens < threshold:
            return Decision(False, Reason.BELOW_THRESHOLD, gain_tokens, t_pull, t_rec)
        if not t_pull < t_rec:
            return Decision(False, Reason.COST, gain_tokens, t_pull, t_rec)
        return Decision(True, Reason.PULL, gain_tokens, t_pull, t_rec)
