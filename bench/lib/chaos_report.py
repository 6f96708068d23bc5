"""The chaos soak's tables for BENCHMARKS.md, from its result (pure, but for publish())."""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from bench.lib.load_sampler import load_phrase
from bench.lib.tables import Section, md_table

SECTION = Section("chaos", "python -m bench chaos", "## Chaos soak (issue 21)")
# `--tp 2`: every worker a tensor-parallel group; its own section, so the plain soak's table stays.
TP_SECTION = Section("chaos-tp", "python -m bench chaos --tp 2", "### Chaos soak with tensor-parallel groups (issue 28)")


def _outcomes(r: dict[str, Any]) -> list[str]:
    o, n = r["outcomes"], r["requests"]
    kinds = ", ".join(f"{k} {v}" for k, v in r["errors_by_kind"].items()) or "none"
    rows = [["completed identically to the undisturbed run", str(o["identical"])],
            ["ended with an error the client saw and can retry (5xx, 429, error event, broken stream)",
             str(o["clean_error"])],
            ["refused with another 4xx, which a client takes as final", str(o.get("refused", 0))],
            ["truncated without an error", str(o["truncated"])],
            ["completed with other text", str(o["wrong_text"])],
            [f"hung (silent for {r['settings']['read_timeout_s']:.0f} s)", str(o["hung"])]]
    return [md_table(["requests", f"{n}"], rows), "", f"Errors by kind: {kinds}.", ""]


def _kills(r: dict[str, Any]) -> list[str]:
    by = Counter((e["process"].rsplit("-", 1)[0] + (f" {e['rank']}" if e.get("rank") else ""), e["signal"])
                 for e in r["events"])
    back = [e["back_after_s"] for e in r["events"] if "back_after_s" in e]
    failed = [e for e in r["events"] if "restart_error" in e]
    line = (f"{len(r['events'])} kills: " + ", ".join(f"{role} {sig} {n}" for (role, sig), n in sorted(by.items()))
            + (f"; serving again after {statistics.median(back):.0f} s (median, max {max(back):.0f} s)" if back else "")
            + (f"; {len(failed)} restarts failed" if failed else "") + ".")
    return [line, ""]


def _left(r: dict[str, Any]) -> list[str]:
    rows = []
    for name, d in r["left"]["final"].items():
        at_end = r["left"]["at_load_end"].get(name, {})
        if "in_flight" in d:
            rows.append([name, "–", "–", f"{d['in_flight']:.0f} in flight (at load end {at_end.get('in_flight', 0):.0f})"])
        elif d.get("unreachable"):
            rows.append([name, "unreachable", "unreachable", ""])
        else:
            rows.append([name, str(d["blocks_held"]), str(d["leased"]),
                         f"running {d['running']}, waiting {d['waiting']} (at load end: blocks "
                         f"{at_end.get('blocks_held', '?')}, leases {at_end.get('leased', '?')})"])
    res = r["resources"]
    fd_rows = [[n, str(v["restarts"]), f"{v['start']['fds']} → {v['end']['fds']}",
                f"{v['start']['rss_mib']:.0f} → {v['end']['rss_mib']:.0f}"] for n, v in res.items()]
    return [f"Left after the load stopped (settled after {r['left']['settled_after_s']:.0f} s):", "",
            md_table(["process", "KV blocks held", "leases", ""], rows), "",
            "Open file descriptors and RSS (MiB) when the chaos started and at the end (a restarted "
            "process's figures at the end are its last incarnation's):", "",
            md_table(["process", "restarts", "fds", "RSS MiB"], fd_rows), ""]


def _spared(r: dict[str, Any]) -> list[str]:
    """Growth within the processes the soak never killed: fds, RSS and KV peers over its samples."""
    series = r.get("spared_series") or []
    lines = []
    for name in r["settings"].get("spare") or []:
        pts = [p[name] for p in series if name in p and p[name]["fds"] >= 0]
        if not pts:
            continue
        fds, rss, peers = [p["fds"] for p in pts], [p["rss_mib"] for p in pts], [p["kv_peers"] for p in pts]
        lines.append(f"- **{name}**, never killed, sampled {len(pts)} times every {r['settings']['watch_s']:.0f} s: "
                     f"open fds {fds[0]} at the first sample, {min(fds)}-{max(fds)} throughout, {fds[-1]} at the "
                     f"last; RSS {rss[0]:.0f} → {rss[-1]:.0f} MiB (max {max(rss):.0f}); KV peers known "
                     f"{peers[0]} → {peers[-1]} (max {max(peers)}).")
    return (["Processes spared by the chaos (one incarnation from start to end):", "", *lines, ""]
            if lines else [])


def results_markdown(r: dict[str, Any], run_id: str, command: str) -> str:
    s = r["settings"]
    spared = f", never killed: {', '.join(s['spare'])}" if s.get("spare") else ""
    load = load_phrase(r.get("loadavg"))
    head = (f"Run `{run_id}` (UTC): `{command}`; {s['duration_s'] / 60:.0f} minutes of chaos, a kill every "
            f"{s['interval_s'][0]:.0f}-{s['interval_s'][1]:.0f} s{spared}, {s['streams']} streams, KV over "
            f"{s['kv_backend']}, workers {' '.join(s['worker_arg'])}"
            + (f"; the shared cores' {load} through the run" if load else "") + ". Verdict: "
            + ("**nothing lost, nothing left**." if r["ok"] else "**failures found** (below)."))
    return "\n".join([head, "", *_outcomes(r), *_kills(r), *_left(r), *_spared(r)])


def publish(r: dict[str, Any], run_id: str, command: str, markdown: Path) -> Path:
    section = TP_SECTION if r["settings"].get("tp", 1) > 1 else SECTION
    return section.write(results_markdown(r, run_id, command), markdown)
