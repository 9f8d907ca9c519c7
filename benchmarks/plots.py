"""PNG plots of a results document: latency distributions and footprints (for docs/performance.md)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

LATENCY_PNG = "latency.png"
FOOTPRINT_PNG = "footprint.png"


def _figures(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return doc.get("results", {}).get(name, {}).get("figures", {})


def _subtitle(doc: dict[str, Any]) -> str:
    m = doc.get("machine", {})
    return f"{m.get('cpu_model', '?')}, {m.get('nproc', '?')} cores, Python {m.get('python', '?')}, {doc.get('mode', '?')} mode, {m.get('date', '')[:10]}"


def draw(doc: dict[str, Any], outdir: Path) -> list[Path]:
    """Draw what the document has figures for; returns the files written (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    latency = _figures(doc, "latency")
    samples = doc.get("results", {}).get("latency", {}).get("samples_ms") or latency.get("samples_ms")
    if samples:
        written.append(_latency(plt, doc, latency, samples, outdir / LATENCY_PNG))
    if _figures(doc, "poll_cost") or _figures(doc, "footprint") or _figures(doc, "fleet"):
        written.append(_footprint(plt, doc, outdir / FOOTPRINT_PNG))
    return written


def _cdf(ax: Any, samples: list[float], label: str, color: str) -> None:
    xs = sorted(samples)
    n = len(xs)
    ax.step(xs, [(i + 1) / n for i in range(n)], where="post", label=f"{label} (n={n})", color=color)


def _latency(plt: Any, doc: dict[str, Any], fig_data: dict[str, Any], samples: dict[str, list[float]],
             path: Path) -> Path:
    detection = samples.get("detection") or []
    processing = samples.get("processing") or []
    interval = (fig_data.get("detection_latency_ms") or {}).get("poll_interval_ms")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    if detection:
        _cdf(left, detection, "detection", "tab:blue")
        p99 = (fig_data.get("detection_latency_ms") or {}).get("p99")
        if interval:
            limit = 1.05 * interval + 20
            left.axvline(limit, color="tab:red", linestyle="--", label=f"goal p99 ≤ {limit:.0f} ms")
            left.axvline(interval, color="grey", linestyle=":", label=f"poll interval {interval:.0f} ms")
        if p99 is not None:
            left.axhline(0.99, color="tab:orange", linestyle=":", label=f"p99 = {p99:.0f} ms")
    left.set_title("Detection: IMDS change → stdout record")
    left.set_xlabel("milliseconds")
    left.set_ylabel("share of samples (CDF)")
    left.legend(loc="lower right", fontsize=8)
    left.grid(alpha=0.3)
    if processing:
        _cdf(right, processing, "processing", "tab:green")
        p99 = (fig_data.get("processing_latency_ms") or {}).get("p99")
        right.axvline(15, color="tab:red", linestyle="--", label="goal p99 ≤ 15 ms")
        if p99 is not None:
            right.axhline(0.99, color="tab:orange", linestyle=":", label=f"p99 = {p99:.1f} ms")
        right.set_xlim(0, max(20.0, max(processing) * 1.05))
    right.set_title("Processing: poll answer → webhook 2xx (fsync included)")
    right.set_xlabel("milliseconds")
    right.legend(loc="lower right", fontsize=8)
    right.grid(alpha=0.3)
    fig.suptitle(_subtitle(doc), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bars(ax: Any, labels: list[str], values: list[float], goals: list[float | None], title: str, unit: str) -> None:
    colors = ["tab:blue" if g is None or v <= g else "tab:red" for v, g in zip(values, goals)]
    bars = ax.bar(labels, values, color=colors)
    for bar, v in zip(bars, values):
        ax.annotate(f"{v:g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    for i, g in enumerate(goals):
        if g is not None:
            ax.hlines(g, i - 0.4, i + 0.4, colors="tab:red", linestyles="--")
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(unit)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="y", alpha=0.3)


def _footprint(plt: Any, doc: dict[str, Any], path: Path) -> Path:
    poll = _figures(doc, "poll_cost")
    foot = _figures(doc, "footprint")
    fleet = _figures(doc, "fleet")
    fig, axes = plt.subplots(1, 4, figsize=(13, 3.8))
    cpu = poll.get("cpu_ms_per_poll") or {}
    _bars(axes[0], ["sefwd", "seed sample"], [cpu.get("sefwd", 0), cpu.get("seed_sample", 0)], [0.5, None],
          "CPU per unchanged poll", "ms")
    rss = foot.get("rss_mib") or {}
    each = fleet.get("rss_mib_each") or {}
    each_v = each.get("median", 0) if isinstance(each, dict) else each or 0
    _bars(axes[1], ["stdout only", "all sinks", "fleet agent"], [rss.get("stdout_only", 0), rss.get("all_sinks", 0), each_v],
          [40, 120, None], "Resident memory", "MiB")
    start = foot.get("startup_ms") or {}
    _bars(axes[2], ["stdout only", "all sinks"], [start.get("stdout_only", 0), start.get("all_sinks", 0)], [400, None],
          "Start to first poll", "ms")
    share = fleet.get("cpu_percent")
    agents = fleet.get("agents", 0)
    _bars(axes[3], [f"{agents} agents"], [share if isinstance(share, (int, float)) else 0], [25],
          "Fleet CPU (share of all cores)", "%")
    fig.suptitle(_subtitle(doc), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
