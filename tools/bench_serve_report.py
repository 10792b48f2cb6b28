"""The tables ``tools.bench_serve`` prints: figures per configuration (min-max
over rounds) and the ratios of (a) to each other configuration, paired round by
round, with the targets checked.
"""

from __future__ import annotations

from typing import Optional

TARGETS = {"b-sameblas": {"throughput": (">=", 1.5), "ttft_cached_p50": ("<=", 0.2)}}


# ------------------------------------------------------------------ report
def _ms(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v * 1e3:.0f}"


def _span(vals: list, fmt) -> str:
    vals = [v for v in vals if v is not None]
    if not vals:
        return "n/a"
    lo, hi = min(vals), max(vals)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}-{fmt(hi)}"


METRICS = [  # key, column head, format
    ("throughput", "tok/s", lambda v: f"{v:.1f}"),
    ("ttft_cached_p50", "TTFT cached p50 ms", _ms),
    ("ttft_cached_p90", "p90 ms", _ms),
    ("ttft_unique_p50", "TTFT unique p50 ms", _ms),
    ("ttft_unique_p90", "p90 ms", _ms),
    ("pss_bytes", "PSS MiB", lambda v: f"{v / 2**20:.0f}"),
    ("cached_tokens_shared", "cached tok/req", lambda v: f"{v:.0f}"),
]
RATIOS = [("throughput", "throughput"), ("ttft_cached_p50", "TTFT cached p50"),
          ("ttft_unique_p50", "TTFT unique p50"), ("pss_bytes", "PSS")]
_OPS = {">=": lambda v, t: v >= t, "<=": lambda v, t: v <= t}


def _table(head: list[str], rows: list[list[str]]) -> str:
    w = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    out = [" | ".join(h.ljust(x) for h, x in zip(head, w)), "-+-".join("-" * x for x in w)]
    out += [" | ".join(c.ljust(x) for c, x in zip(r, w)) for r in rows]
    return "\n".join(out)


def summarize(results: dict[str, list[dict]]) -> dict:
    """min/max per metric over rounds; (a)/x ratios paired by round; targets."""
    summary, ratios = {}, {}
    for name, rounds in results.items():
        good = [r for r in rounds if "error" not in r]
        summary[name] = {k: [min(v), max(v)] if (v := [r[k] for r in good
                                                      if r.get(k) is not None]) else None
                         for k, _, _ in METRICS}
    a = {r["round"]: r for r in results.get("a", []) if "error" not in r}
    for name, rounds in results.items():
        if name == "a":
            continue
        per = {}
        for key, _ in RATIOS:
            vals = [a[r["round"]][key] / r[key] for r in rounds
                    if "error" not in r and r["round"] in a and a[r["round"]].get(key)
                    is not None and r.get(key)]
            entry = {"min": min(vals), "max": max(vals), "rounds": vals} if vals else None
            t = TARGETS.get(name, {}).get(key)
            if t and entry:
                ok = [_OPS[t[0]](v, t[1]) for v in vals]
                entry["target"] = f"{t[0]} {t[1]:g}"
                entry["met"] = "yes" if all(ok) else ("NO" if not any(ok) else "in some rounds")
            per[key] = entry
        ratios[name] = per
    return {"summary": summary, "ratios": ratios}


def report(results, configs, summ, args, bench_cmd) -> str:
    lines = []
    rows = []
    for name, rounds in results.items():
        s = summ["summary"][name]
        bad = sum(1 for r in rounds if "error" in r)
        rows.append([name] + [_span(s[k] or [], f) for k, _, f in METRICS] +
                    [f"{len(rounds) - bad}/{len(rounds)}"])
    lines.append(_table(["config"] + [h for _, h, _ in METRICS] + ["ok rounds"], rows))
    if summ["ratios"]:
        lines.append("")
        lines.append("(a) / other, paired by round (min-max over rounds); "
                     "targets against b-sameblas:")
        rrows = []
        for name, per in summ["ratios"].items():
            cells = []
            for key, _ in RATIOS:
                e = per.get(key)
                cells.append("n/a" if not e else _span(e["rounds"], lambda v: f"{v:.2f}x"))
            tg = [f"{dict(RATIOS)[k]} {e['target']}: {e['met']}"
                  for k, e in per.items() if e and "target" in e]
            rrows.append([f"a / {name}"] + cells + ["; ".join(tg)])
        lines.append(_table(["ratio"] + [h for _, h in RATIOS] + ["target met?"], rrows))
    lines.append("")
    lines.append("configurations:")
    for name in results:
        lines.append(f"  {name:<10} {configs[name].label}")
    lines.append("")
    lines.append("commands (ports are free ports picked per round; all rounds in the JSON):")
    lines.append(f"  bench:      {bench_cmd}")
    for name, rounds in results.items():
        cmds = next((r["commands"] for r in rounds if r.get("commands")), [])
        for k, c in enumerate(cmds):
            lines.append(f"  {name if k == 0 else '':<10}  {c}")
    notes = []
    for name, rounds in results.items():
        for r in rounds:
            if "error" in r:
                notes.append(f"  {name} round {r['round']}: {r['error'].splitlines()[0]}")
    if notes:
        lines.append("")
        lines.append("failures:")
        lines += notes
    return "\n".join(lines)
