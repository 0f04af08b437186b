"""``kvlease plan --plot FILE.png``: hit rate and reused prefill tokens against the retention cap per
node. matplotlib is imported only here, only when a plot is asked for (as the analyzer's plot)."""

from __future__ import annotations

from pathlib import Path

from kvlease._analyze._plan_report import CapacityPlan
from kvlease._analyze._plot import _matplotlib

GIB = 2**30


def plot_plan(plan: CapacityPlan, path: str | Path) -> Path:
    """Write a two-panel PNG; return its path."""
    plt = _matplotlib()
    fig, (ax_hit, ax_tok) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    c = plan.config
    caps = [p.cap_bytes / GIB for p in plan.sweep]
    series = (
        ("lease", f"kvlease leases (max-idle {c.max_idle:g} s), oldest deadline evicted", "#55a868"),
        ("ttl", f"fixed TTL {c.ttl:g} s (upstream vLLM)", "#c44e52"),
    )
    for key, label, color in series:
        points = [getattr(p, key) for p in plan.sweep]
        uncapped = getattr(plan, key)
        if points:
            ax_hit.plot(caps, [100 * (r.hit_rate or 0) for r in points], marker="o", color=color, label=label)
            ax_tok.plot(caps, [r.reused_tokens / 1e6 for r in points], marker="o", color=color, label=label)
        ax_hit.axhline(100 * (uncapped.hit_rate or 0), color=color, linestyle=":", alpha=0.7)
        ax_tok.axhline(uncapped.reused_tokens / 1e6, color=color, linestyle=":", alpha=0.7)
    rec = plan.recommendation
    for ax in (ax_hit, ax_tok):
        if caps:
            ax.set_xscale("log", base=2)
        if rec.cap_bytes:
            ax.axvline(rec.cap_bytes / GIB, color="#4c72b0", linestyle="--", label="recommended cap")
        if c.node_kv_bytes:
            ax.axvline(c.node_kv_bytes / GIB, color="#8172b2", linestyle="-.", label="node KV cache")
        ax.set_xlabel("retention cap per decode node (GiB, log scale)")
        ax.grid(alpha=0.3)
    ax_hit.set_ylim(0, 100)
    ax_hit.set_ylabel("follow-up turns that hit retained KV (%)")
    ax_hit.set_title("Hit rate against retention memory (dotted: uncapped)")
    ax_hit.legend(loc="lower right", fontsize="small")
    ax_tok.set_ylabel("prefill tokens reused (millions)")
    ax_tok.set_title("Reused prefill tokens against retention memory")
    fig.suptitle(
        f"kvlease plan: {plan.conversations:,} conversations, {plan.turns:,} turns, {c.nodes} decode "
        f"node{'s' if c.nodes != 1 else ''}{f', {c.model}' if c.model else ''}"
    )
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
