"""chart.png from run.py's results.json: three panels (output tokens/s, median TTFT, median
TPOT), one group of bars per workload, one bar per server. Needs only matplotlib (the peers'
tooling venv has it: benchmarks/peers/install_tools.sh).

    python -m benchmarks.peers.chart RESULTS.json CHART.png
"""

from __future__ import annotations

import json
import sys

PANELS = (("output_throughput", "output tokens/s (higher is better)", False),
          ("median_ttft_ms", "median TTFT, ms (lower is better; log scale)", True),
          ("median_tpot_ms", "median TPOT, ms (lower is better)", False))


def draw(results: dict, path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("the chart needs matplotlib: bash benchmarks/peers/install_tools.sh "
                         "installs it into ~/.cache/pyserve/peers/tools; run this with that "
                         "venv's python") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(results["workloads"])
    servers = [n for n, s in results["servers"].items() if s["workloads"]]
    width = 0.8 / max(1, len(servers))
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5.2 * len(PANELS), 4.6))
    for ax, (key, title, log) in zip(axes, PANELS):
        for i, name in enumerate(servers):
            rows = results["servers"][name]["workloads"]
            offset = (i - (len(servers) - 1) / 2) * width
            xs = [j + offset for j, w in enumerate(workloads) if w in rows]
            ys = [rows[w]["median"][key] for w in workloads if w in rows]
            bars = ax.bar(xs, ys, width, label=name)
            ax.bar_label(bars, labels=[f"{y:.0f}" if y >= 100 else f"{y:.3g}" for y in ys],
                         fontsize=6, rotation=90, padding=2)
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_title(title, fontsize=10)
        if log:
            ax.set_yscale("log")
        ax.margins(y=0.2)
    axes[0].legend(fontsize=8)
    ceilings = results["machine"].get("ceilings")
    note = (f"; ceilings: {ceilings['gemm_gflops']:.0f} GFLOP/s, "
            f"{ceilings['read_bandwidth_gbs']:.0f} GB/s" if ceilings else "")
    fig.suptitle(f"{results['model'].rstrip('/').split('/')[-1]} on {results['machine']['cpus']} "
                 f"CPU cores, medians of {results['repeats']} run(s){note}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        raise SystemExit("usage: python -m benchmarks.peers.chart RESULTS.json CHART.png")
    with open(argv[0], encoding="utf-8") as f:
        draw(json.load(f), argv[1])
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
