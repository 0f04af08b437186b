"""Pull-or-recompute decision for a verified prefix (sans-IO).

Pull iff the verified gain is at least ``kv_recompute_threshold`` tokens AND the predicted transfer
time is below the predicted recompute time. Both predictions use online estimates (exponentially
weighted): the pull's seconds per token from completed pulls, the prefill's tokens per second from
recomputes (both sides learn). Until the first observation the defaults apply; they come from a NIXL
READ measured on an H200 (``benchmarks/gpu_nixl_pull.json``): vLLM's worker posts one descriptor per
(registered region, block), ~3.2 us each, plus the bytes at the coalesced rate (~750 GB/s) and a
fixed cost (~5 ms). vLLM 0.32 and 0.33 register one region per attention layer (K and V packed,
:func:`kvlease_vllm._layout.kv_regions`); that measurement had two per layer, each half a page.

A staged pull (``kvlease_vllm._worker``: D gathers, one READ, P scatters) has no per-descriptor
cost: its default is the bytes at the staged rate measured on the same H200 (6.4 GB in 18.1 ms, the
fixed cost included), and it learns from its own observations (``staged=True``), apart from the
per-block pulls.

A model that never pulls never learns the pull rate, so a small fraction of cost declines is
explored (pulled anyway, deterministically every ``1 / explore_fraction``-th one, and only when the
prediction is within :data:`EXPLORE_MAX_RATIO` of recompute): a wrong default corrects itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

from kvlease_vllm._layout import kv_regions, transfer_groups
from kvlease_vllm._verify import Reason

#: Explore only pulls predicted at most this many times slower than recompute.
EXPLORE_MAX_RATIO: Final = 10.0


@dataclass(frozen=True)
class Decision:
    pull: bool
    reason: Reason
    gain_tokens: int
    predicted_pull_s: float
    predicted_recompute_s: float
    explored: bool = False  # a cost decline pulled anyway, to measure the pull rate

    def describe(self) -> str:
        verdict = (
            "pull (exploring: predicted slower)" if self.explored else "pull" if self.pull else "recompute"
        )
        return (
            f"{verdict} ({self.reason.value}): gain={self.gain_tokens} tokens, "
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

    ``bytes_per_token``: KV bytes one token occupies on this node (all layers);
    ``descriptors_per_token``: NIXL descriptors vLLM posts per token (regions / block size);
    ``per_descriptor_s``: the posting cost of one descriptor.
    """

    def __init__(
        self,
        *,
        bytes_per_token: float,
        default_bandwidth_bps: float,
        default_prefill_tokens_per_s: float,
        fixed_latency_s: float,
        descriptors_per_token: float = 0.0,
        per_descriptor_s: float = 0.0,
        explore_fraction: float = 0.0,
        staged_bandwidth_bps: float | None = None,
        host_bandwidth_bps: float | None = None,
        alpha: float = 0.3,
    ) -> None:
        if bytes_per_token <= 0 or default_bandwidth_bps <= 0 or default_prefill_tokens_per_s <= 0:
            raise ValueError("bytes_per_token, bandwidth and prefill throughput must be positive")
        if descriptors_per_token < 0 or per_descriptor_s < 0 or not 0 <= explore_fraction <= 1:
            raise ValueError("descriptor costs must be >= 0 and explore_fraction in [0, 1]")
        self.bytes_per_token = bytes_per_token
        self.default_bandwidth_bps = default_bandwidth_bps
        self.default_prefill_tokens_per_s = default_prefill_tokens_per_s
        self.fixed_latency_s = fixed_latency_s
        self.default_pull_s_per_token = (
            descriptors_per_token * per_descriptor_s + bytes_per_token / default_bandwidth_bps
        )
        if staged_bandwidth_bps is not None and staged_bandwidth_bps <= 0:
            raise ValueError("staged_bandwidth_bps must be positive")
        #: staged: the bytes at the staged rate, no per-descriptor cost
        self.default_staged_s_per_token = (
            bytes_per_token / staged_bandwidth_bps if staged_bandwidth_bps else self.default_pull_s_per_token
        )
        if host_bandwidth_bps is not None and host_bandwidth_bps <= 0:
            raise ValueError("host_bandwidth_bps must be positive")
        #: a pull of a host-placed lease: D's promotion from its arena before the staged pull
        self.host_s_per_token = bytes_per_token / host_bandwidth_bps if host_bandwidth_bps else 0.0
        self._explore_every = round(1 / explore_fraction) if explore_fraction > 0 else 0
        self._cost_declines = 0
        self._spt = _Ewma(alpha)  # pull seconds per token, after the fixed cost
        self._staged = _Ewma(alpha)  # the same, of staged pulls
        self._tps = _Ewma(alpha)

    @property
    def pull_s_per_token(self) -> float:
        return self._spt.value if self._spt.value is not None else self.default_pull_s_per_token

    @property
    def staged_s_per_token(self) -> float:
        return self._staged.value if self._staged.value is not None else self.default_staged_s_per_token

    @property
    def bandwidth_bps(self) -> float:
        """The effective pull rate in KV bytes per second (descriptor posting included)."""
        return self.bytes_per_token / self.pull_s_per_token

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._tps.value if self._tps.value is not None else self.default_prefill_tokens_per_s

    @property
    def observations(self) -> tuple[int, int]:
        """(pull samples, prefill samples)."""
        return self._spt.samples, self._tps.samples

    def observe_pull(self, tokens: int, seconds: float, *, staged: bool = False) -> None:
        """A pull of ``tokens`` tokens took ``seconds`` (from the decision to the completed read);
        ``staged``: it was planned as a staged pull."""
        if tokens <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        # the fixed part is modelled separately; never let it drive the rate to ~0
        transfer = max(seconds - self.fixed_latency_s, seconds * 0.1)
        (self._staged if staged else self._spt).add(transfer / tokens)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """``tokens`` prompt tokens were computed in ``seconds``."""
        if tokens <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        self._tps.add(tokens / seconds)

    def predict_pull_s(self, tokens: int, *, staged: bool = False) -> float:
        rate = self.staged_s_per_token if staged else self.pull_s_per_token
        return self.fixed_latency_s + tokens * rate

    def predict_recompute_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def decide(
        self, gain_tokens: int, threshold: int, *, staged: bool = False, host: bool = False
    ) -> Decision:
        """``staged``: the pull is expected to take the staged path (predicted at its rate);
        ``host``: from D's host arena (its promotion added; a device copy D still has is faster)."""
        t_pull = self.predict_pull_s(max(gain_tokens, 0), staged=staged)
        if host:
            t_pull += max(gain_tokens, 0) * self.host_s_per_token
        t_rec = self.predict_recompute_s(max(gain_tokens, 0))
        if gain_tokens <= 0:
            return Decision(False, Reason.LOCAL_HIT, gain_tokens, t_pull, t_rec)
        if gain_tokens < threshold:
            return Decision(False, Reason.BELOW_THRESHOLD, gain_tokens, t_pull, t_rec)
        if not t_pull < t_rec:
            self._cost_declines += 1
            if (
                self._explore_every
                and self._cost_declines % self._explore_every == 0
                and t_pull <= EXPLORE_MAX_RATIO * t_rec
            ):
                return Decision(True, Reason.PULL, gain_tokens, t_pull, t_rec, explored=True)
            return Decision(False, Reason.COST, gain_tokens, t_pull, t_rec)
        return Decision(True, Reason.PULL, gain_tokens, t_pull, t_rec)


# ---- the layout's part of the defaults (duck-typed vLLM KVCacheConfig: no vLLM import) --------
def descriptors_per_token(kv_cache_config: Any, block_size: int) -> float:
    """NIXL descriptors vLLM's worker posts per token: one per (registered region, block)."""
    return float(kv_regions(kv_cache_config)) / max(block_size, 1)


def bytes_per_token(kv_cache_config: Any, block_size: int) -> float:
    """KV bytes a pulled token moves on this node: each transferable group's page (every layer's K
    and V) over the tokens one page holds, summed over the groups.

    From the specs, not from ``kv_cache_tensors``: a ``KVCacheTensor``'s ``size`` is the whole
    backing allocation, repeated on every tensor (one per group and spec), so summing it counts a
    multi-spec model's memory several times over.
    """
    try:
        total = 0.0
        for group in transfer_groups(kv_cache_config):
            spec = group.kv_cache_spec
            per_layer = getattr(spec, "kv_cache_specs", None)  # vLLM's UniformTypeKVCacheSpecs
            page = (
                sum(s.page_size_bytes for s in per_layer.values())
                if isinstance(per_layer, dict)
                else spec.page_size_bytes * len(group.layer_names)
            )
            total += page / max(int(getattr(spec, "block_size", 0) or block_size), 1)
        if total > 0:
            return total
    except Exception:  # a config we cannot read: the guess below
        pass
    return 131072.0  # a conservative guess: bytes per token of a bf16 7B model
