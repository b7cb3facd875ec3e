"""verify-run's charts as inline SVG from matplotlib's SVG backend. Text stays text
(svg.fonttype "none"): no embedded glyphs, a small file, and axis labels a reader, a search or a
test can find. Figures are built without pyplot (no global state, no GUI backend). Each chart
takes the current run's rows and, with --compare, the earlier run's, drawn dashed or hollow."""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from functools import wraps
from typing import Any

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

MODES = ("plain", "mtp", "as served")
COLORS = {"plain": "#7f7f7f", "mtp": "#1f77b4", "as served": "#2ca02c"}
CYCLE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2")
EARLIER = "#222222"
WINDOW = 8  # rounds in the rolling mean of the per-round charts
STYLE = {"font.size": 9, "axes.titlesize": 10, "axes.spines.top": False,
         "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
         "svg.fonttype": "none", "path.simplify": True}

Rows = Mapping[str, Mapping[str, Any]]


def styled(chart: Callable[..., str]) -> Callable[..., str]:
    """Build the chart under STYLE (rc settings are read as artists are made, not at save)."""
    @wraps(chart)
    def inner(*args: Any, **kw: Any) -> str:
        with matplotlib.rc_context(STYLE):
            return chart(*args, **kw)
    return inner


def _figure(width: float, height: float, rows: int = 1) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, list(fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0])


def svg(fig: Figure, name: str) -> str:
    """The figure as an inline <svg> element (no XML prolog), each axis label in a group with
    an id ("NAME-xlabel-I"). Ids are salted by `name`: charts in one page never share one."""
    for i, ax in enumerate(fig.axes):  # named groups: a reader (or test) can find each label
        for kind, label in (("xlabel", ax.xaxis.label), ("ylabel", ax.yaxis.label)):
            if label.get_text():
                label.set_gid(f"{name}-{kind}-{i}")
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": name}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _modes(rows: Rows) -> list[str]:
    return [m for m in MODES if any((r.get(m) or {}).get("decode_tps") for r in rows.values())]


def _empty(ax: Axes, why: str) -> None:
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="#666666")


def _bars(ax: Axes, rows: Rows, earlier: Rows | None, value: Any, unit: str) -> None:
    """Grouped bars per load and mode of value(mode_row) -> (bar, tick or None); the earlier
    run's bars as hollow outlines beside them."""
    names, modes = list(rows), _modes(rows) or ["plain"]
    width = 0.8 / len(modes)
    drawn = False
    for j, mode in enumerate(modes):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(names))]
        now = [value(rows[n].get(mode) or {}) for n in names]
        bars = [b for b, _ in now]
        ax.bar(xs, [b or 0.0 for b in bars], width * 0.9, color=COLORS[mode], label=mode)
        ticks = [(x, t) for x, (_, t) in zip(xs, now, strict=True) if t is not None]
        if ticks:
            ax.plot(*zip(*ticks, strict=True), "_", color="black", markersize=12, mew=1.5)
        if earlier is not None:
            old = [value((earlier.get(n) or {}).get(mode) or {})[0] for n in names]
            pts = [(x, o) for x, o in zip(xs, old, strict=True) if o is not None]
            if pts:
                ax.bar(*zip(*pts, strict=True), width * 0.9, fill=False, edgecolor=EARLIER,
                       linestyle="--", linewidth=1.2, label=f"{mode} (earlier)")
        drawn = drawn or any(b is not None for b in bars)
    ax.set_xticks(range(len(names)), names)
    ax.set_xlabel("load")
    ax.set_ylabel(unit)
    if not drawn:
        _empty(ax, "not measured")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)


@styled
def decode_chart(rows: Rows, earlier: Rows | None = None) -> str:
    """Decode tok/s per load, plain vs MTP: P50 bars, P95 ticks (earlier P50: dashed outline)."""
    fig, (ax,) = _figure(6.4, 3.0)

    def value(m: Mapping[str, Any]) -> tuple[float | None, float | None]:
        tps = m.get("decode_tps")
        return (tps["p50"], tps["p95"]) if tps else (None, None)

    _bars(ax, rows, earlier, value, "decode tok/s (bar P50, tick P95)")
    ax.set_title("Steady decode speed")
    return svg(fig, "decode")


@styled
def ttft_memory_chart(rows: Rows, earlier: Rows | None = None, state: str | None = None) -> str:
    """TTFT (P50 bars, P95 ticks) and peak memory per load and mode; state: how TTFT was
    measured ("cold" in every mode), said in the title so no one compares warm with cold."""
    fig, axes = _figure(6.4, 4.8, rows=2)
    for ax in axes:
        ax.tick_params(labelbottom=True)

    def ttft(m: Mapping[str, Any]) -> tuple[float | None, float | None]:
        t = m.get("ttft_s")
        return (1000 * t["p50"], 1000 * t["p95"]) if t else (None, None)

    def memory(m: Mapping[str, Any]) -> tuple[float | None, None]:
        peak = m.get("peak_memory_bytes")
        return (peak / 2**20 if peak else None), None

    _bars(axes[0], rows, earlier, ttft, "TTFT ms (bar P50, tick P95)")
    axes[0].set_title("Time to first token" + (f" ({state}, every mode)" if state else ""))
    _bars(axes[1], rows, earlier, memory, "peak memory MiB")
    axes[1].set_title("Peak memory")
    return svg(fig, "ttft-memory")


def positions(mode: Mapping[str, Any]) -> list[float]:
    """A mode's acceptance per draft position, cut after the last position any round drafted
    (a depth-auto run lists every position up to its ceiling, most of them never proposed)."""
    accept = mode.get("acceptance_by_depth") or []
    sources = (mode.get("sources") or {}).values()
    if not sources:
        return accept
    proposed = [sum(p) for p in zip(*(s["proposed"] for s in sources), strict=False)]
    return accept[:max((i + 1 for i, n in enumerate(proposed) if n), default=0)]


@styled
def acceptance_chart(rows: Rows, earlier: Rows | None = None) -> str:
    """Acceptance per draft position, one line per load (earlier run: dashed)."""
    fig, (ax,) = _figure(6.4, 3.0)
    longest = 0
    for i, (name, row) in enumerate(rows.items()):
        color = CYCLE[i % len(CYCLE)]
        for run, style, label in ((row, "-o", name), ((earlier or {}).get(name), "--x",
                                                       f"{name} (earlier)")):
            accept = positions((run or {}).get("mtp") or {})
            if accept:
                ax.plot(range(1, len(accept) + 1), [100 * a for a in accept], style, color=color,
                        label=label)
                longest = max(longest, len(accept))
    ax.set_xlabel("draft position")
    ax.set_ylabel("drafts kept (%)")
    ax.set_ylim(0, 105)
    ax.set_title("Acceptance per draft position")
    if longest:
        ax.set_xticks(range(1, longest + 1))
        ax.legend(fontsize=7)
    else:
        _empty(ax, "no acceptance reported (plain decoding, or a target without MTP telemetry)")
    return svg(fig, "acceptance")


def _rolling(values: list[float], window: int = WINDOW) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def per_round(series: Mapping[str, list]) -> dict[str, list[float]]:
    """One run's rounds -> per round: share of drafts kept, and tok/s since the round before
    (tokens committed between the two verdicts, plain steps included, over the seconds)."""
    t, tokens, depth, kept = (series[k] for k in ("t", "tokens", "depth", "kept"))
    rate = [(tokens[i] - tokens[i - 1]) / (t[i] - t[i - 1]) for i in range(1, len(t))
            if t[i] > t[i - 1]]
    return {"kept": [k / d for k, d in zip(kept, depth, strict=True)], "tps": rate,
            "depth": [float(d) for d in depth]}


@styled
def rounds_chart(name: str, row: Mapping[str, Any]) -> str:
    """Over the rounds of each MTP run: drafts kept, decode tok/s (rolling over WINDOW rounds,
    plain decoding's P50 for reference) and the depth each round drafted."""
    fig, axes = _figure(6.4, 5.0, rows=3)
    runs = (row.get("mtp") or {}).get("rounds") or []
    for r, series in enumerate(runs):
        got = per_round(series)
        alpha = 1.0 if r == len(runs) - 1 else 0.45
        label = f"run {r + 1}"
        axes[0].plot(range(1, len(got["kept"]) + 1), [100 * v for v in _rolling(got["kept"])],
                     color=CYCLE[r % len(CYCLE)], alpha=alpha, label=label)
        axes[1].plot(range(2, len(got["tps"]) + 2), _rolling(got["tps"]),
                     color=CYCLE[r % len(CYCLE)], alpha=alpha, label=label)
        axes[2].step(range(1, len(got["depth"]) + 1), got["depth"], where="mid",
                     color=CYCLE[r % len(CYCLE)], alpha=alpha, label=label)
    plain = (row.get("plain") or {}).get("decode_tps")
    if plain:
        axes[1].axhline(plain["p50"], color=COLORS["plain"], linestyle="--",
                        label=f"plain P50 {plain['p50']:.1f}")
    axes[0].set_ylabel(f"drafts kept (%,\nmean of {WINDOW})")
    axes[0].set_ylim(0, 105)
    axes[1].set_ylabel(f"decode tok/s\n(mean of {WINDOW})")
    axes[2].set_ylabel("draft depth")
    axes[2].set_xlabel("round of the generation")
    axes[2].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[2].yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_title(f"Load {name}: acceptance and speed over the rounds")
    if runs:
        for ax in axes:
            ax.legend(fontsize=7, loc="lower right", ncols=4)
    else:
        _empty(axes[0], "no per-round telemetry from this target")
    return svg(fig, f"rounds-{name}")


@styled
def costs_chart(costs: Mapping[str, Any] | None, chosen: Mapping[int, int],
                earlier: Mapping[str, Any] | None = None) -> str:
    """The verify cost curve c(T)/c(1) over T rows, a plain step on the same scale, and the
    depths the run drafted at (a depth d verifies d + 1 rows), marked with their round counts."""
    fig, (ax,) = _figure(6.4, 3.2)
    if costs:
        ratios = costs["ratios"]
        ax.plot(range(1, len(ratios) + 1), ratios, "-o", color=COLORS["mtp"], markersize=3,
                label="verify c(T) / c(1)")
        ax.axhline(costs["plain"] / costs["verify"][0], color=COLORS["plain"], linestyle=":",
                   label="plain step / c(1)")
        if earlier:
            old = earlier["ratios"]
            ax.plot(range(1, len(old) + 1), old, "--x", color=EARLIER, markersize=3,
                    label="c(T) / c(1) (earlier)")
        total = sum(chosen.values()) or 1
        for depth, n in sorted(chosen.items()):
            if depth > 0 and depth < len(ratios):
                ax.axvline(depth + 1, color="#d62728", alpha=0.25 + 0.75 * n / total)
                ax.annotate(f"d{depth}: {n}", (depth + 1, ratios[depth]), fontsize=7,
                            xytext=(3, 6), textcoords="offset points", color="#d62728")
        ax.legend(fontsize=7, loc="upper left")
    else:
        _empty(ax, "no cost curve (an endpoint, or a forced depth with none cached: mtpkit tune)")
    ax.set_xlabel("verify rows T (depth d verifies d + 1; red: depths drafted, rounds)")
    ax.set_ylabel("c(T) / c(1)")
    ax.set_title("Verify cost curve and the depths chosen")
    return svg(fig, "costs")
