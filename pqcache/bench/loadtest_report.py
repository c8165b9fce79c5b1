"""The load test's report (pqcache/bench/loadtest.py runs it): requests by kind and outcome, the server's memory,
threads and child processes before, at the peak and after each round, and the readable messages it got back."""

from __future__ import annotations


def message_counts(records) -> dict:
    """How often each readable message came back (its first words)."""
    counts: dict = {}
    for r in records:
        if r["outcome"] == "message":
            key = " ".join(r["reply"].replace("**Error:**", "Error:").split()[:7])
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def format_report(r: dict) -> str:
    lines = [
        f"{r['rounds']} rounds of {r['clients']} clients for {r['duration_s']:.0f} s ({r['wall_s']} s wall), "
        f"{r['requests']} requests, {r['failures']} failures, {r['hung_clients']} hung clients, "
        f"caches drained: {r['caches_drained']}",
        "| request | n | ok | readable message | failure | median s | max s |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, k in sorted(r["by_kind"].items()):
        lines.append(
            f"| {kind} | {k['requests']} | {k['ok']} | {k['message']} | {k['failure']} | {k['median_s']} "
            f"| {k['max_s']} |"
        )
    if r["server_before"]:
        b, p, after = r["server_before"], r["server_peak"], r["server_after_rounds"]
        rounds = [f"after round {i + 1}" for i in range(len(after))]
        lines += ["| server | baseline | peak | " + " | ".join(rounds) + " |", "|---" * (3 + len(after)) + "|"]
        for key, label, fmt in [
            ("rss_mib", "resident memory (MiB)", "{:.0f}"),
            ("threads", "threads", "{}"),
            ("children", "child processes", "{}"),
        ]:
            lines.append(
                f"| {label} | {fmt.format(b[key])} | {fmt.format(p[key])} | "
                + " | ".join(fmt.format(a[key]) for a in after)
                + " |"
            )
        lines.append(
            f"| document caches (MiB) | 0 | {p.get('cache_mib', 0):.0f} | "
            + " | ".join("0" if r["caches_drained"] else "?" for _ in after)
            + " |"
        )
    if r.get("replicas_rss_mib"):
        base, peak, *after = r["replicas_rss_mib"]
        lines.append(
            f"| Ray replicas' resident memory (MiB, added up) | {base:.0f} | {peak or base:.0f} | "
            + " | ".join(f"{a:.0f}" for a in after)
            + " |"
        )
    lines += ["| readable message (first words) | n |", "|---|---|"]
    lines += [f"| {m} | {n} |" for m, n in r["messages"].items()]
    for reply in r["failure_replies"]:
        lines.append(f"failure: {reply}")
    return "\n".join(lines)
