"""`dflash-bench report`: receipts as PNG plots and one HTML page that embeds them.

A reviewer looks at a page, not at JSON. Each plot reads what the receipts hold and says so when they
hold nothing for it (a version-1 decode receipt has no chunk times, so no ITL; without a plan
receipt there is no predicted-vs-measured plot):
- speedup by streams per probe: drafted over plain aggregate tok/s (decode receipts);
- tokens a round: rounds by tokens (accepted + 1) from the acceptance histograms (decode, version 2),
  else each drafted reply's tokens a round (any check's records);
- TTFT and ITL: the streamed records' time to first token and gaps between chunks, per mode;
- planner: predicted against measured peak bytes (plan --check receipts).
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit
import matplotlib.pyplot as plt  # noqa: E402

from dflash_bench.checks import aggregates as agg  # noqa: E402
from dflash_bench.checks.receipt import Receipt  # noqa: E402
from dflash_bench.engine.constants import GIB  # noqa: E402

SIZE = (6.4, 3.6)  # inches at DPI: 640 x 360 pixels, small enough to commit
DPI = 100


@dataclass
class Plot:
    """One figure of the page: its file (None when the receipts hold nothing for it) and what it shows."""

    name: str
    title: str
    file: str | None
    caption: str


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=DPI)
    plt.close(fig)
    return f"{name}.png"


def _of(receipts: list[tuple[Path, Receipt]], kind: str) -> list[tuple[Path, Receipt]]:
    return [(p, r) for p, r in receipts if r.kind == kind]


def speedup(receipts: list[tuple[Path, Receipt]], out: Path) -> Plot:
    title = "speedup by streams: drafted / plain aggregate tok/s"
    bars: dict[str, dict[str, float]] = {}  # "<receipt> <probe>" -> level -> ratio
    for path, r in _of(receipts, "decode"):
        a: agg.DecodeAggregates = r.typed().aggregates
        for probe, levels in a.aggregate_tps.items():
            for level, by_mode in levels.items():
                d, p = by_mode.get("drafted"), by_mode.get("plain")
                if d and p and d.median and p.median:
                    bars.setdefault(f"{path.stem}: {probe}", {})[level] = d.median / p.median
    if not bars:
        return Plot("speedup", title, None, "no decode receipt with drafted and plain runs")
    levels = sorted({lv for by in bars.values() for lv in by}, key=int)
    fig, ax = plt.subplots(figsize=SIZE)
    width = 0.8 / len(bars)
    for i, (label, by) in enumerate(bars.items()):
        xs = [j + i * width for j in range(len(levels))]
        ax.bar(xs, [by.get(lv, 0) for lv in levels], width, label=label)
    ax.axhline(1.0, color="grey", linewidth=1, linestyle="--")
    ax.set_xticks([j + width * (len(bars) - 1) / 2 for j in range(len(levels))], [f"x{lv}" for lv in levels])
    ax.set_xlabel("streams")
    ax.set_ylabel("drafted / plain")
    ax.set_title(title)
    ax.legend(fontsize="small")
    return Plot("speedup", title, _save(fig, out, "speedup"),
                "Median aggregate tok/s of drafted replies over plain ones, per probe and stream count; "
                "above the dashed line drafting is faster.")


def tokens_per_round(receipts: list[tuple[Path, Receipt]], out: Path) -> Plot:
    title = "tokens a round"
    hist: list[int] = []
    for _, r in _of(receipts, "decode"):
        for levels in r.typed().aggregates.acceptance.values():
            for by_mode in levels.values():
                for acc in by_mode.values():
                    hist += [0] * (len(acc.histogram) - len(hist))
                    for k, n in enumerate(acc.histogram):
                        hist[k] += n
    fig, ax = plt.subplots(figsize=SIZE)
    if any(hist):
        ax.bar([k + 1 for k in range(len(hist))], hist)
        ax.set_xlabel("tokens a round (accepted drafts + 1)")
        ax.set_ylabel("rounds")
        caption = "Drafted rounds by the tokens each produced, from the replies' acceptance histograms."
    else:
        values = [rec.get("tokens_per_round") for _, r in receipts for rec in r.records
                  if rec.get("draft") and rec.get("status") == "ok" and rec.get("tokens_per_round")]
        if not values:
            plt.close(fig)
            return Plot("tokens-per-round", title, None, "no drafted replies with tokens a round")
        ax.hist(values, bins=20)
        ax.set_xlabel("tokens a round (one reply's mean)")
        ax.set_ylabel("replies")
        caption = "Each drafted reply's mean tokens a round (these receipts have no per-round histogram)."
    ax.set_title(title)
    return Plot("tokens-per-round", title, _save(fig, out, "tokens-per-round"), caption)


def latency(receipts: list[tuple[Path, Receipt]], out: Path) -> Plot:
    title = "TTFT and ITL by mode (streamed replies)"
    ttft: dict[str, list[float]] = {}
    itl: dict[str, list[float]] = {}
    for _, r in receipts:
        for rec in r.records:
            if rec.get("status") != "ok" or rec.get("ttft") is None:
                continue
            mode = (rec.get("labels") or {}).get("mode") or ("plain" if rec.get("draft") is False else "drafted")
            ttft.setdefault(mode, []).append(rec["ttft"] * 1000)
            times = rec.get("chunk_times") or []
            itl.setdefault(mode, []).extend((b - a) * 1000 for a, b in zip(times, times[1:]))
    if not ttft:
        return Plot("latency", title, None, "no streamed replies")
    fig, (left, right) = plt.subplots(1, 2, figsize=SIZE)
    left.boxplot(list(ttft.values()), tick_labels=list(ttft))
    left.set_title("TTFT")
    left.set_ylabel("ms")
    with_itl = {m: v for m, v in itl.items() if v}
    if with_itl:
        right.boxplot(list(with_itl.values()), tick_labels=list(with_itl))
        right.set_title("ITL (gaps between chunks)")
    else:
        right.text(0.5, 0.5, "no chunk times\n(receipt version 1)", ha="center", va="center")
        right.set_axis_off()
    fig.suptitle(title)
    return Plot("latency", title, _save(fig, out, "latency"),
                "Client-side time to first token and inter-token latency of the streamed replies, per mode.")


def planner(receipts: list[tuple[Path, Receipt]], out: Path) -> Plot:
    title = "planner: predicted vs measured peak"
    points = []
    for path, r in _of(receipts, "plan"):
        for what, c in r.typed().aggregates.peaks.items():
            points.append((f"{path.stem}\n{what}", c.predicted_bytes / GIB, c.measured_bytes / GIB))
    if not points:
        return Plot("planner", title, None, "no plan --check receipt")
    fig, ax = plt.subplots(figsize=SIZE)
    xs = range(len(points))
    ax.bar([x - 0.2 for x in xs], [p[1] for p in points], 0.4, label="predicted")
    ax.bar([x + 0.2 for x in xs], [p[2] for p in points], 0.4, label="measured")
    ax.set_xticks(list(xs), [p[0] for p in points], fontsize="x-small")
    ax.set_ylabel("GiB")
    ax.set_title(title)
    ax.legend(fontsize="small")
    return Plot("planner", title, _save(fig, out, "planner"),
                "The memory plan's total against the measured peak, per plan --check receipt.")


PLOTS = (speedup, tokens_per_round, latency, planner)


def page(receipts: list[tuple[Path, Receipt]], plots: list[Plot]) -> str:
    """The HTML page: the receipts (kind, when, commit, verdict), then each plot or why it is missing."""
    rows = "".join(
        f"<tr><td>{html.escape(str(p))}</td><td>{html.escape(r.kind)}</td><td>{html.escape(r.started_at or '')}</td>"
        f"<td>{html.escape(((r.tool or {}).get('git') or {}).get('commit') or '')[:12]}</td>"
        f"<td class={'pass' if r.passed else 'fail'}>{'passed' if r.passed else 'not passed'}</td></tr>"
        for p, r in receipts)
    figures = "".join(
        f"<figure><img src=\"{p.file}\" alt=\"{html.escape(p.title)}\"><figcaption>{html.escape(p.caption)}"
        f"</figcaption></figure>" if p.file else
        f"<p class=missing>{html.escape(p.title)}: {html.escape(p.caption)}</p>" for p in plots)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>dflash-bench report</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1200px}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px}} .pass{{color:#080}} .fail{{color:#b00}}
figure{{display:inline-block;margin:1em}} figcaption{{max-width:640px;font-size:90%}} .missing{{color:#666}}</style>
</head><body><h1>dflash-bench report</h1>
<table><tr><th>receipt</th><th>kind</th><th>started</th><th>commit</th><th>verdict</th></tr>{rows}</table>
{figures}
</body></html>
"""


def write_report(receipts: list[tuple[Path, Receipt]], out: Path) -> list[Plot]:
    """Writes each plot's PNG and index.html into `out`; returns the plots (file None where no data)."""
    out.mkdir(parents=True, exist_ok=True)
    plots = [make(receipts, out) for make in PLOTS]
    (out / "index.html").write_text(page(receipts, plots), encoding="utf-8")
    return plots
