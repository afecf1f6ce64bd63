"""Results as pictures: a load bench's rows drawn against load, one line per policy, one SVG per trace and size.

`kvmesh sim --sweep --chart DIR` and `kvmesh bench policies --chart DIR` hand their rows here; the
manual shows what they write beside the tables. Each figure has a panel per metric (warm %, TTFT p50
and p99, failed turns), the x axis the offered load, a line per policy (kvmesh drawn first and
thickest). Text stays text in the SVG (`svg.fonttype: none`): small, searchable, diffable. A file is
written through a temporary one beside it, so a reader never sees half a chart. matplotlib is the
`report` extra's; without it nothing is drawn and the caller is told why.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]
# (row key, panel title, y axis label); a row without the key (or with None) leaves a gap in its line.
SWEEP_METRICS = (("warm_pct", "warm handoffs", "% of follow-ups warm"), ("ttft_p50_s", "TTFT p50", "seconds"),
                 ("ttft_p99_s", "TTFT p99", "seconds"), ("failed_pct", "turns failed", "% of turns (retries out or timed out)"))
POLICIES_METRICS = (("reused_pct", "prompt reused from cache", "% of prompt tokens"), ("ttft_p50_s", "TTFT p50", "seconds"),
                    ("ttft_p99_s", "TTFT p99", "seconds"), ("failed_pct", "turns failed", "% of turns (retries out or timed out)"))


class ChartsUnavailable(RuntimeError):
    """matplotlib is missing (the `report` extra)."""


def require_matplotlib() -> None:
    """Raise ChartsUnavailable unless matplotlib imports."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ChartsUnavailable("matplotlib is not installed (pip install 'kvmesh[report]'): no chart can be drawn") from e


def file_name(trace: str, hosts: int) -> str:
    """`<trace>-<hosts>hosts.svg`, the trace named by its last path part, in safe characters."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(trace.rstrip("/")).name or "trace").strip("._") or "trace"
    return f"{stem}-{hosts}hosts.svg"


def groups(rows: Iterable[Row]) -> dict[tuple[str, int], list[Row]]:
    """Rows by (trace, hosts), in the order first seen."""
    out: dict[tuple[str, int], list[Row]] = {}
    for r in rows:
        out.setdefault((str(r["trace"]), int(r["hosts"])), []).append(r)
    return out


def write_charts(rows: Sequence[Row], out_dir: Path, metrics: Sequence[tuple[str, str, str]], *,
                 title: str) -> list[Path]:
    """One SVG per (trace, hosts) of `rows` into `out_dir` (made if missing); the paths written."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "kvmesh", "font.size": 9}):
        for (trace, hosts), cell in groups(rows).items():
            fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3.0), squeeze=False)
            policies = sorted({str(r["policy"]) for r in cell}, key=lambda p: (p != "kvmesh", p))
            for ax, (key, name, unit) in zip(axes[0], metrics):
                for policy in policies:
                    pts = sorted((float(r["load"]), r.get(key)) for r in cell if r["policy"] == policy)
                    xs = [x for x, _ in pts]
                    ys = [float("nan") if y is None else float(y) for _, y in pts]
                    ax.plot(xs, ys, marker="o", label=policy, linewidth=2.4 if policy == "kvmesh" else 1.2,
                            zorder=3 if policy == "kvmesh" else 2)
                ax.set_title(name)
                ax.set_xlabel("offered load per host")
                ax.set_ylabel(unit)
                if key.startswith("ttft"):
                    ax.set_yscale("log")
                ax.grid(True, alpha=0.3)
            axes[0][0].legend(fontsize=7)
            fig.suptitle(f"{title}: {Path(trace.rstrip('/')).name or trace}, {hosts} hosts")
            fig.tight_layout()
            path = out_dir / file_name(trace, hosts)
            tmp = path.with_name(f".{path.name}.tmp")
            try:
                fig.savefig(tmp, format="svg", metadata={"Date": None})
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
                plt.close(fig)
            written.append(path)
    return written


def policies_rows(result: Row) -> list[Row]:
    """`bench policies`' JSON as chart rows: its trace and hosts on each run, and the share of prompt tokens reused."""
    out = []
    for run in result["runs"]:
        prompt, recomputed = run.get("prompt_tokens") or 0, run.get("prompt_tokens_recomputed") or 0
        reused = round(100.0 * (prompt - recomputed) / prompt, 2) if prompt else None
        out.append({**run, "trace": result["trace"], "hosts": result["hosts"], "reused_pct": reused})
    return out
