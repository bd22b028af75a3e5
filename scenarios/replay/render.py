"""Reports people look at: `report.md` with the policies side by side, and PNG plots.

Everything is drawn from `report.json` alone (`edgeroute report DIR` re-renders a saved run):
`latency_cdf.png` (per policy and priority), `timeline.png` (throughput and SLO attainment over time,
faults marked, warm-up shaded), `node_load.png` (completions per node over time, per policy), and for
policies that tune a delay-scheduling timer `delay_timer.png` (its value per site over time), and
with a model catalogue `copies.png` (each model's warm copies over time, per policy). A report
that also carries a simulation (`--mode both`) gets `sim_*.png` and a live-vs-sim table.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from scenarios.replay.report import format_canaries, format_recorded  # noqa: E402
from scenarios.replay.tenants import format_tenants  # noqa: E402
from scenarios.replay.trust import warnings  # noqa: E402

STYLES = ["-", "--", ":", "-."]


def _faults(ax: Any, policies: dict[str, Any]) -> None:
    seen: set[tuple[float, str]] = set()
    for p in policies.values():
        for t, label in p.get("faults", []):
            if (round(t), label) in seen:
                continue
            seen.add((round(t), label))
            ax.axvline(t, color="crimson", alpha=0.6, lw=1)
            ax.text(t, ax.get_ylim()[1], f" {label}", color="crimson", fontsize=7, va="top", rotation=90)


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _label(ax: Any, report: dict[str, Any], xlabel: str, ylabel: str, what: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{report['scenario']} ({report['mode']}): {what}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_delay(report: dict[str, Any], path: Path) -> None:
    """The delay-scheduling timer per site over time, for runs whose policy tunes one (`delay_spill`)."""
    series = [
        (name, site, [(t, d) for t, s, d in p["policy_state"]["delay_spill"]["history"] if s == site])
        for name, p in report["policies"].items()
        if "delay_spill" in p.get("policy_state", {})
        for site in p["policy_state"]["delay_spill"].get("sites", {})
    ]
    if not series:
        return
    fig, ax = plt.subplots(figsize=(9, 3.5))
    end = float(report.get("duration_s", 0)) + float(report.get("warmup_s", 0))
    for name, site, points in series:
        if not points:
            continue
        ts = [max(0.0, t) for t, _ in points] + [end]
        ds = [d for _, d in points] + [points[-1][1]]
        ax.step(ts, ds, where="post", label=f"{name} {site}")
    _faults(ax, report["policies"])
    _label(ax, report, "time (s)", "delay D (ms)", "tuned delay-scheduling timer per site")
    _save(fig, path)


def plot_cdf(report: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, p) in enumerate(report["policies"].items()):
        for j, (prio, qs) in enumerate(sorted(p.get("cdf_ms", {}).items(), key=lambda kv: -int(kv[0]))):
            ax.plot(
                qs,
                [q / 100 for q in range(101)],
                STYLES[j % len(STYLES)],
                color=colors[i % len(colors)],
                label=f"{name} prio {prio}",
            )
    ax.set_xscale("log")
    _label(ax, report, "latency (ms, log)", "share of completed requests", "latency CDF")
    _save(fig, path)


def plot_timeline(report: dict[str, Any], path: Path) -> None:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name, p in report["policies"].items():
        tl = p.get("timeline")
        if not tl:
            continue
        xs = [i * tl["bucket_s"] for i in range(len(tl["throughput_rps"]))]
        top.plot(xs, tl["throughput_rps"], label=name)
        slo = [None if v is None else v * 100 for v in tl["slo_attainment"]]
        bottom.plot(xs, slo, label=name)
    for ax in (top, bottom):
        ax.axvspan(0, report.get("warmup_s", 0), color="grey", alpha=0.15)
        ax.grid(alpha=0.3)
    top.set_ylabel("completed / s")
    bottom.set_ylabel("SLO attainment %")
    bottom.set_xlabel("seconds from start (shaded: warm-up, not counted)")
    top.set_title(f"{report['scenario']} ({report['mode']}): throughput and SLO attainment")
    top.legend(fontsize=8)
    _faults(top, report["policies"])
    _faults(bottom, report["policies"])
    _save(fig, path)


def _per_policy(
    report: dict[str, Any], path: Path, key: str, draw: Callable[[Any, dict[str, Any]], None], ylabel: str, what: str
) -> None:
    """One panel per policy whose timeline has `key`, drawn by `draw(ax, timeline)`, faults marked."""
    names = [n for n, p in report["policies"].items() if p.get("timeline") and key in p["timeline"]]
    if not names:
        return
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 2.6 * len(names)), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        draw(ax, report["policies"][name]["timeline"])
        ax.set_title(name, fontsize=9)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        _faults(ax, {name: report["policies"][name]})
    axes[0, 0].legend(fontsize=7, ncol=4)
    axes[-1, 0].set_xlabel("seconds from start")
    fig.suptitle(f"{report['scenario']} ({report['mode']}): {what}")
    _save(fig, path)


def plot_nodes(report: dict[str, Any], path: Path) -> None:
    def draw(ax: Any, tl: dict[str, Any]) -> None:
        for node, counts in tl["by_node"].items():
            ax.plot([i * tl["bucket_s"] for i in range(len(counts))], counts, label=node, lw=1)

    _per_policy(report, path, "by_node", draw, "completed / s", "load per node")


def plot_copies(report: dict[str, Any], path: Path) -> None:
    """Warm copies of each catalogue model over time, per policy (a run with a model catalogue)."""

    def draw(ax: Any, tl: dict[str, Any]) -> None:
        for model, counts in tl["copies"].items():
            xs = [(i + 1) * tl["bucket_s"] for i, c in enumerate(counts) if c is not None]
            ax.step(xs, [c for c in counts if c is not None], where="post", label=model, lw=1.2)

    _per_policy(report, path, "copies", draw, "warm copies", "warm copies per model")


def _residency_rows(report: dict[str, Any]) -> list[str]:
    """Per policy and model: requests at the nodes, those that found the model cold, loads, evictions."""
    rows = [
        (name, model, r)
        for name, p in report["policies"].items()
        for model, r in (p.get("residency") or {}).get("by_model", {}).items()
    ]
    if not rows:
        return []
    lines = [
        "",
        "Residency per model (at the nodes: requests, of which found the model cold, loads, evictions):",
        "",
        "| policy | model | requests | cold | warm hit | loads | evictions |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, model, r in rows:
        lines.append(
            f"| {name} | {model} | {r['model_requests']} | {r['cold_requests']} | {r['warm_hit_rate'] * 100:.1f}% | "
            f"{r['loads']} | {r['evictions']} |"
        )
    return lines


def _table(report: dict[str, Any]) -> list[str]:
    lines = [
        "| policy | sent | completed | errors | lost | p50 ms | p95 ms | p99 ms | SLO | throughput/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in report["policies"].items():
        lat = p["latency_ms"]
        errs = ", ".join(f"{k}: {v}" for k, v in p["errors"].items()) or "0"
        lines.append(
            f"| {name} | {p['sent']} | {p['completed']} | {errs} | {p['lost']} | {lat['p50']:.1f} | "
            f"{lat['p95']:.1f} | {lat['p99']:.1f} | {p['slo_attainment'] * 100:.1f}% | "
            f"{p.get('throughput_rps', 0):.1f} |"
        )
    starved = warnings(report)
    if starved:
        lines += ["", *(f"**{line}**" for line in starved)]
    noted = format_recorded(report) + format_canaries(report) + format_tenants(report)
    if noted:
        lines += ["", *(f"- {line.strip()}" for line in noted)]
    lines += [
        "",
        "By priority (p99 ms / SLO attainment):",
        "",
        "| policy | " + " | ".join(f"prio {k}" for k in _prios(report)) + " |",
        "|---|" + "---|" * len(_prios(report)),
    ]
    for name, p in report["policies"].items():
        cells = []
        for k in _prios(report):
            bp = p["by_priority"].get(k)
            cells.append("-" if bp is None else f"{bp['latency_ms']['p99']:.1f} / {bp['slo_attainment'] * 100:.1f}%")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += _residency_rows(report)
    if any("reroute" in p or "executions" in p for p in report["policies"].values()):
        lines += [
            "",
            "Work: moves (re-routing), cancels that came too late, queueing the moves threw away, executions at "
            "the nodes, requests executed twice, executions whose answer no client got:",
            "",
            "| policy | moves | displaced | too late | moved wait s | executions | duplicates | wasted |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, p in report["policies"].items():
            rr, ex = p.get("reroute") or {}, p.get("executions") or {}
            lines.append(
                f"| {name} | {rr.get('moves', '-')} | {rr.get('displaced', '-')} | {rr.get('misses', '-')} | "
                f"{_seconds(rr.get('moved_wait_ms'))} | {ex.get('executions', '-')} | "
                f"{ex.get('duplicate_executions', '-')} | {ex.get('wasted_executions', '-')} |"
            )
    return lines


def _prios(report: dict[str, Any]) -> list[str]:
    keys = {k for p in report["policies"].values() for k in p["by_priority"]}
    return sorted(keys, key=int, reverse=True)


def write_markdown(report: dict[str, Any], out_dir: Path, images: list[str]) -> Path:
    lines = [f"# {report['scenario']}: {report['mode']} replay", ""]
    lines.append(
        f"Seed {report.get('seed')}, {report.get('duration_s')} s measured after {report.get('warmup_s')} s of warm-up."
    )
    lines += ["", *_table(report), ""]
    faults = {(t, label) for p in report["policies"].values() for t, label in p.get("faults", [])}
    if faults:
        lines += [
            "Faults (seconds from start): " + ", ".join(f"{t:g} s {label}" for t, label in sorted(faults)),
            "",
        ]
    tel = report.get("telemetry") or {}
    if tel:
        lines += [
            f"Telemetry: {tel.get('messages')} messages, {tel.get('malformed')} malformed, lag p50 "
            f"{tel['lag_ms']['p50']:.1f} ms, p99 {tel['lag_ms']['p99']:.1f} ms.",
            "",
        ]
    if "comparison" in report:
        lines += [
            "## Simulation against live",
            "",
            "| policy | p50 live | p50 sim | error | p99 live | p99 sim | error | SLO live | SLO sim | points "
            "| overhead p50 live / sim |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, row in report["comparison"].items():
            p50, p99, slo = row["p50"], row["p99"], row["slo_attainment"]
            ovh = row.get("overhead_p50")
            overhead = f"{ovh['live']:.2f} / {ovh['sim']:.2f} ms" if ovh else "n/a"
            lines.append(
                f"| {name} | {p50['live']:.1f} | {p50['sim']:.1f} | {_pct(p50['rel_err'])} | {p99['live']:.1f} | "
                f"{p99['sim']:.1f} | {_pct(p99['rel_err'])} | {slo['live'] * 100:.1f}% | {slo['sim'] * 100:.1f}% | "
                f"{slo['points']:+.1f} | {overhead} |"
            )
        lines += ["", "### Simulated", "", *_table(report["sim"]), ""]
    for img in images:
        lines += [f"![{img}]({img})", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:+.1f}%"


def render(report: dict[str, Any], out_dir: Path) -> Path:
    """Write the plots and report.md next to report.json; returns the markdown path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    images: list[str] = []
    for prefix, rep in [("", report)] + ([("sim_", report["sim"])] if "sim" in report else []):
        for name, fn in (
            ("latency_cdf", plot_cdf),
            ("timeline", plot_timeline),
            ("node_load", plot_nodes),
            ("delay_timer", plot_delay),
            ("copies", plot_copies),
        ):
            file = f"{prefix}{name}.png"
            fn(rep, out_dir / file)
            if (out_dir / file).exists():
                images.append(file)
    return write_markdown(report, out_dir, images)


def _seconds(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1000.0:.2f}"
