"""The results: one row per tool from its samples, and the Markdown report of all of them.

``summarize`` turns samples into a row (medians of the good runs, the worst peak RSS);
``report`` prints the tables, the resume trials, the scaling fit and the targets, and adds
``verify_cost`` and ``targets`` to the results it is given (they go to the JSON file too).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Any

from harness import GiB, MiB, Sample, mb_s
from tools import Tool


def linearity(rows: list[dict[str, Any]]) -> dict[str, Any]:
    pts = [(r["size_bytes"], r["median_wall_s"]) for r in rows if r.get("median_wall_s")]
    if len(pts) < 2:
        return {}
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    intercept = my - slope * mx
    worst = max(abs(y - (intercept + slope * x)) / y for x, y in pts)
    return {
        "fit_seconds_per_gib": round(slope * GiB, 3),
        "fit_fixed_seconds": round(intercept, 3),
        "fit_worst_deviation_pct": round(100 * worst, 1),
        "mb_s_smallest_vs_largest": [pts and rows[0]["mb_s"], rows[-1]["mb_s"]],
    }


def summarize(tool: Tool, samples: list[Sample], expected: int) -> dict[str, Any]:
    row: dict[str, Any] = {
        "tool": tool.name,
        "group": tool.group,
        "label": tool.label,
        "available": not tool.missing,
        "note": tool.missing,
    }
    good = [s for s in samples if s.ok]
    row["runs"] = [asdict(s) for s in samples]
    row["ok"] = bool(samples) and len(good) == len(samples)
    if not good:
        row.update(
            median_wall_s=None,
            mb_s=None,
            cpu_s=None,
            peak_rss_mib=None,
            server_cpu_s=None,
            other_cpu_s=None,
        )
        if samples:
            row["note"] = samples[-1].error
        return row
    wall = statistics.median(s.wall_s for s in good)
    row.update(
        median_wall_s=round(wall, 3),
        mb_s=round(mb_s(expected, wall), 1),
        cpu_s=round(statistics.median(s.cpu_s for s in good), 2),
        peak_rss_mib=round(max(s.peak_rss_bytes for s in good) / MiB, 1),
        server_cpu_s=round(statistics.median(s.server_cpu_s for s in good), 2),
        other_cpu_s=round(statistics.median(s.other_cpu_s for s in good), 2),
        walls=[s.wall_s for s in good],
    )
    return row


# ---- report ------------------------------------------------------------------------------------


def fmt(v: Any, spec: str = "") -> str:
    return "-" if v is None else format(v, spec)


def ratio_rows(rows: list[dict[str, Any]]) -> None:
    """Time of each row over the prefetch row of its group (>1: slower than prefetch)."""
    ref = {"s3": "prefetch", "ceiling": "prefetch", "hub": "hf-prefetch"}
    walls = {r["tool"]: r["median_wall_s"] for r in rows}
    for r in rows:
        base = walls.get(ref.get(r["group"], "prefetch"))
        r["time_vs_prefetch"] = (
            round(r["median_wall_s"] / base, 2) if base and r["median_wall_s"] else None
        )


def table(rows: list[dict[str, Any]], title: str) -> str:
    out = [
        f"### {title}",
        "",
        "| tool | runs | median s | MB/s | time / prefetch | CPU s | peak RSS MiB | server CPU s "
        "| other load CPU s | what |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in rows:
        if not r["available"]:
            out.append(f"| {r['tool']} | - | - | - | - | - | - | - | - | {r['note']} |")
            continue
        walls = ", ".join(f"{w:.2f}" for w in r.get("walls", []))
        note = r["label"] + ("" if r["ok"] else f" **FAILED** {r['note']}")
        out.append(
            f"| {r['tool']} | {walls} | {fmt(r['median_wall_s'], '.2f')} | {fmt(r['mb_s'], '.0f')}"
            f" | {fmt(r.get('time_vs_prefetch'), '.2f')} | {fmt(r['cpu_s'], '.2f')}"
            f" | {fmt(r['peak_rss_mib'], '.0f')} | {fmt(r['server_cpu_s'], '.2f')}"
            f" | {fmt(r['other_cpu_s'], '.2f')} | {note} |"
        )
    return "\n".join(out)


def _small_and_noop_targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 15's targets for many small files (<= 1.2x s5cmd) and the no-op pull (< 0.3 s
    warm, < 0.5 s cold, per source)."""
    out: list[dict[str, Any]] = []
    small = {r["tool"]: r for r in res.get("small_files", {}).get("rows", []) if r["available"]}
    pf, s5 = small.get("prefetch"), small.get("s5cmd")
    if pf and s5 and pf["median_wall_s"] and s5["median_wall_s"]:
        ratio = pf["median_wall_s"] / s5["median_wall_s"]
        out.append(
            {
                "target": "many small files: <= 1.2x s5cmd",
                "value": f"{ratio:.2f}x ({pf['median_wall_s']:.2f}s vs {s5['median_wall_s']:.2f}s)",
                "met": ratio <= 1.2,
            }
        )
    for mode, limit in (("warm", 0.3), ("cold", 0.5)):
        for r in res.get("noop", {}).get(mode, []):
            if r["tool"] in ("prefetch", "hf-prefetch") and r["available"] and r["median_wall_s"]:
                out.append(
                    {
                        "target": f"no-op pull ({r['tool']}, {mode}) < {limit} s",
                        "value": f"{r['median_wall_s']:.2f}s",
                        "met": r["median_wall_s"] < limit,
                    }
                )
    return out


#: The whole-model peers of issue 33's second row ("ahead of every peer, every run").
PEERS = ("s5cmd", "s5cmd-tuned", "rclone", "rclone-mts8", "aws", "boto3")


def _available(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["tool"]: r for r in rows if r.get("available") and r.get("median_wall_s")}


def _small_row(res: dict[str, Any]) -> dict[str, Any] | None:
    """1000 x 100 KiB: CPU per file (user+sys of the process tree / files), prefetch vs s5cmd."""
    small = res.get("small_files") or {}
    rows = _available(small.get("rows", []))
    pf, s5 = rows.get("prefetch"), rows.get("s5cmd")
    if not (pf and s5 and pf.get("cpu_s") and s5.get("cpu_s")):
        return None
    files = small["files"]
    per = {n: 1000 * r["cpu_s"] / files for n, r in (("prefetch", pf), ("s5cmd", s5))}
    ratio = per["prefetch"] / per["s5cmd"]
    return {
        "row": f"{files} x {small['file_size'] // 1024} KiB",
        "prefetch": f"{pf['median_wall_s']:.2f} s, **{per['prefetch']:.2f} ms CPU per file**",
        "peer": f"s5cmd {s5['median_wall_s']:.2f} s, {per['s5cmd']:.2f} ms per file",
        "target": f"CPU per file <= 1.2x s5cmd ({ratio:.2f}x)",
        "met": ratio <= 1.2,
    }


def _wall_row(res: dict[str, Any]) -> dict[str, Any] | None:
    """The whole model: prefetch's wall against every peer's, round by round (runs alternate,
    so round i of each tool ran under the same load)."""
    compare = res.get("compare") or {}
    rows = _available(compare.get("rows", []))
    pf = rows.get("prefetch")
    peers = {n: rows[n] for n in PEERS if n in rows}
    if not (pf and peers):
        return None
    best = min(peers, key=lambda n: peers[n]["median_wall_s"])
    ratios = []
    for i, w in enumerate(pf.get("walls", [])):
        rivals = [r["walls"][i] for r in peers.values() if i < len(r.get("walls", []))]
        if rivals:
            ratios.append(w / min(rivals))
    walls = ", ".join(f"{w:.2f}" for w in pf.get("walls", []))
    return {
        "row": f"{compare['expected_bytes'] / GiB:.3g} GiB, whole model",
        "prefetch": f"{walls} s",
        "peer": f"{best} {peers[best]['median_wall_s']:.2f} s (median)",
        "target": "ahead of every peer, every run (ratio to the round's best: "
        + (", ".join(f"{r:.2f}" for r in ratios) or "-")
        + ")",
        "met": bool(ratios) and max(ratios) < 1.0,
    }


def _cpu_row(res: dict[str, Any]) -> dict[str, Any] | None:
    """CPU-s per GB of the whole model, prefetch vs the curl ceiling (same bytes)."""
    compare = res.get("compare") or {}
    rows = _available(compare.get("rows", []))
    pf, curl = rows.get("prefetch"), rows.get("ceiling-get")
    if not (pf and curl and pf.get("cpu_s") and curl.get("cpu_s")):
        return None
    gb = compare["expected_bytes"] / 1e9
    mine, theirs = pf["cpu_s"] / gb, curl["cpu_s"] / gb
    return {
        "row": "CPU per GB",
        "prefetch": f"{mine:.2f} CPU-s",
        "peer": f"8 curl ranged GETs {theirs:.2f} CPU-s",
        "target": f"<= 1.5x curl ({mine / theirs:.2f}x)",
        "met": mine <= 1.5 * theirs,
    }


def _ceiling_row(res: dict[str, Any]) -> dict[str, Any] | None:
    compare = res.get("compare") or {}
    rows = _available(compare.get("rows", []))
    pf = rows.get("prefetch")
    ceil = {n: rows[n]["mb_s"] for n in ("ceiling-get", "ceiling-dd") if n in rows}
    if not (pf and ceil):
        return None
    name = min(ceil, key=lambda n: ceil[n])
    share = pf["mb_s"] / ceil[name]
    return {
        "row": "share of the ceiling",
        "prefetch": f"{100 * share:.0f}% ({pf['mb_s']:.0f} MB/s)",
        "peer": f"{name} {ceil[name]:.0f} MB/s",
        "target": ">= 90%",
        "met": share >= 0.9,
    }


def issue33_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 33's table: the cost of a file (1000 x 100 KiB, CPU per file against s5cmd), the
    whole model's wall against every peer, CPU per GB against curl, the share of the ceiling.
    A row whose tools did not run is left out."""
    rows = (_small_row(res), _wall_row(res), _cpu_row(res), _ceiling_row(res))
    return [r for r in rows if r is not None]


def issue33_table(rows: list[dict[str, Any]]) -> str:
    parts = [
        "### The cost of a file and of a byte (issue 33)",
        "",
        "| | prefetch | best peer | target | met |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        met = "yes" if r["met"] else "**no**"
        parts.append(f"| {r['row']} | {r['prefetch']} | {r['peer']} | {r['target']} | {met} |")
    return "\n".join(parts)


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = {r["tool"]: r for r in res.get("compare", {}).get("rows", [])}
    out: list[dict[str, Any]] = []

    def wall(name: str) -> float | None:
        r = rows.get(name)
        return r["median_wall_s"] if r and r["available"] else None

    pf = wall("prefetch")
    rivals = {n: wall(n) for n in ("s5cmd", "s5cmd-tuned", "rclone", "rclone-mts8")}
    rivals = {n: w for n, w in rivals.items() if w}
    if pf and rivals:
        best = min(rivals, key=lambda n: rivals[n])
        out.append(
            {
                "target": "S3: wall <= best of s5cmd/rclone",
                "value": f"{pf:.2f}s vs {best} {rivals[best]:.2f}s",
                "met": pf <= rivals[best],
            }
        )
    hp, hs = wall("hf-prefetch"), wall("hf-snapshot")
    if hp and hs:
        out.append(
            {
                "target": "Hub: >= 2.5x snapshot_download",
                "value": f"{hs / hp:.2f}x",
                "met": hs / hp >= 2.5,
            }
        )
    elif hs:
        out.append(
            {
                "target": "Hub: >= 2.5x snapshot_download",
                "value": "hf-prefetch not available",
                "met": None,
            }
        )
    ceil = [
        rows[n]["mb_s"] for n in ("ceiling-get", "ceiling-dd") if n in rows and rows[n].get("mb_s")
    ]
    if pf and ceil:
        c = min(ceil)
        got = rows["prefetch"]["mb_s"]
        out.append(
            {
                "target": ">= 90% of the ceiling (min of GET and dd)",
                "value": f"{100 * got / c:.0f}% ({got:.0f} of {c:.0f} MB/s)",
                "met": got >= 0.9 * c,
            }
        )
    curl = rows.get("ceiling-get")
    if pf and curl and curl.get("cpu_s") and rows["prefetch"].get("cpu_s"):
        ratio = rows["prefetch"]["cpu_s"] / curl["cpu_s"]
        out.append(
            {
                "target": "client CPU-s per GB <= 1.5x curl's",
                "value": f"{ratio:.2f}x ({rows['prefetch']['cpu_s']:.2f} vs "
                f"{curl['cpu_s']:.2f} CPU-s for the same bytes)",
                "met": ratio <= 1.5,
            }
        )
    out += _small_and_noop_targets(res)
    rss = [
        r["peak_rss_mib"]
        for r in res.get("compare", {}).get("rows", [])
        if r["tool"] in ("prefetch", "prefetch-noverify", "hf-prefetch") and r["peak_rss_mib"]
    ]
    rss += [
        r["peak_rss_mib"] for r in res.get("scaling", {}).get("points", []) if r["peak_rss_mib"]
    ]
    if rss:
        out.append(
            {
                "target": "peak RSS <= 150 MB",
                "value": f"{max(rss) * MiB / 1e6:.0f} MB "
                "(max over prefetch rows and scaling points)",
                "met": max(rss) * MiB <= 150e6,
            }
        )
    pct = res.get("resume", {}).get("median_refetched_pct")
    if pct is not None:
        out.append({"target": "resume re-fetches <= 5%", "value": f"{pct:.2f}%", "met": pct <= 5})
    return out


def report(res: dict[str, Any]) -> str:
    meta = res["meta"]
    parts = [
        f"## model-prefetch benchmark ({meta['date']})",
        "",
        f"`{meta['command']}`",
        "",
        f"Data: {res['dataset']['total'] / MiB:.0f} MiB in {res['dataset']['files']} files "
        f"({res['dataset']['shards']} shards); {meta['runs']} run(s) per tool, alternating; "
        f"{meta['cache']}. Machine: {meta['cpus']} CPUs shared by client and server, "
        f"{meta['mem_gib']} GiB RAM. MB/s = 10^6 bytes/s. CPU s = user+sys of the tool's process "
        "tree; server CPU s = SeaweedFS / hub server meanwhile; other load = the rest of the "
        "machine (noise). S3 transport: "
        + ("HTTPS (private CA)." if meta.get("tls") else "plain HTTP."),
        "",
    ]
    if "compare" in res:
        rows = res["compare"]["rows"]
        ratio_rows(rows)
        parts += [
            table(
                [r for r in rows if r["group"] in ("s3", "ceiling")], "S3 (SeaweedFS), whole model"
            ),
            "",
        ]
        hub = [r for r in rows if r["group"] == "hub"]
        if hub:
            parts += [table(hub, "Hugging Face Hub (local Hub-compatible server)"), ""]
        on = next((r for r in rows if r["tool"] == "prefetch"), None)
        off = next((r for r in rows if r["tool"] == "prefetch-noverify"), None)
        if on and off and on.get("median_wall_s") and off.get("median_wall_s"):
            res["verify_cost"] = {
                "verify_on_s": on["median_wall_s"],
                "verify_off_s": off["median_wall_s"],
                "cost_pct": round(100 * (on["median_wall_s"] / off["median_wall_s"] - 1), 1),
                "cpu_on_s": on["cpu_s"],
                "cpu_off_s": off["cpu_s"],
            }
            v = res["verify_cost"]
            parts += [
                f"Verification: on {v['verify_on_s']:.2f}s / off {v['verify_off_s']:.2f}s "
                f"({v['cost_pct']:+.1f}% wall), CPU {v['cpu_on_s']:.2f}s vs "
                f"{v['cpu_off_s']:.2f}s.",
                "",
            ]
    if "small_files" in res:
        s = res["small_files"]
        ratio_rows(s["rows"])
        parts += [
            table(s["rows"], f"Many small files ({s['files']} x {s['file_size'] // 1024} KiB)"),
            "",
        ]
    if "noop" in res:
        for mode, what in (
            ("warm", "nothing dropped"),
            ("cold", "page cache dropped, the tools' code not read back in"),
        ):
            rows = res["noop"][mode]
            ratio_rows(rows)
            parts += [table(rows, f"No-op pull, everything current ({mode}: {what})"), ""]
    if "resume" in res:
        r = res["resume"]
        parts += ["### Resume after SIGKILL at 50%", ""]
        for t in r["trials"]:
            if "refetched_pct" in t:
                parts.append(
                    f"- killed after {t['killed_after_bytes'] / MiB:.0f} MiB written; the "
                    f"second pull fetched {t['second_pull_bytes_downloaded'] / MiB:.0f} MiB "
                    f"(resumed {t['second_pull_resumed_bytes'] / MiB:.0f} MiB from the "
                    f"journal): re-fetched {t['refetched_bytes'] / MiB:.1f} MiB = "
                    f"**{t['refetched_pct']:.2f}%**{'' if t['ok'] else ' FAILED'}"
                )
            else:
                parts.append(f"- {t['error']}")
        parts.append("")
    if "scaling" in res:
        sc = res["scaling"]
        parts += [
            "### Scaling (prefetch pull, verify on)",
            "",
            "| size | median s | MB/s | CPU s | peak RSS MiB | runs |",
            "|--:|--:|--:|--:|--:|---|",
        ]
        for r in sc["points"]:
            parts.append(
                f"| {r['size_bytes'] / GiB:g} GiB | {fmt(r['median_wall_s'], '.2f')} | "
                f"{fmt(r['mb_s'], '.0f')} | {fmt(r['cpu_s'], '.2f')} | "
                f"{fmt(r['peak_rss_mib'], '.0f')} | "
                f"{', '.join(f'{w:.2f}' for w in r.get('walls', []))} |"
            )
        if "fit_seconds_per_gib" in sc:
            parts += [
                "",
                f"Linear fit: {sc['fit_fixed_seconds']:.2f}s + "
                f"{sc['fit_seconds_per_gib']:.2f}s/GiB; worst point off the line by "
                f"{sc['fit_worst_deviation_pct']:.1f}%.",
            ]
        parts.append("")
    res["issue33"] = issue33_rows(res)
    if res["issue33"]:
        parts += [issue33_table(res["issue33"]), ""]
    res["targets"] = targets(res)
    if res["targets"]:
        parts += ["### Targets", "", "| target | value | met |", "|---|---|---|"]
        for t in res["targets"]:
            met = "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**")
            parts.append(f"| {t['target']} | {t['value']} | {met} |")
        parts.append("")
    return "\n".join(parts)
