"""The tables ``tools.bench.serve`` prints: per workload, the figures of every
configuration (min-max over rounds) and the ratios of (a) to each other
configuration, paired round by round, with issue 26's targets checked.
"""

from __future__ import annotations

from typing import Optional

#: issue 26, "Done when" (16 cores, 8 workers, the realistic model): per
#: workload, per configuration that (a) is divided by, metric -> (op, bound)
TARGETS = {
    "chat": {"c": {"throughput": (">=", 1.5), "ttft_warm_p50": ("<=", 0.5),
                   "max_gap_p50": ("<=", 2.0), "pss_bytes": ("<=", 0.4)},
             "c-sticky": {"throughput": (">=", 1.2)},
             "b": {"throughput": (">=", 1.2)}},
    "unique": {"c": {"throughput": (">=", 1.0), "pss_bytes": ("<=", 0.4)}},
    "shared": {"c": {"pss_bytes": ("<=", 0.4)}},
}


# ------------------------------------------------------------------ formatting
def _ms(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v * 1e3:.0f}"


def _s(v: Optional[float]) -> str:
    return "n/a" if v is None else (f"{v:.2f}" if v < 10 else f"{v:.1f}")


def _span(vals: list, fmt) -> str:
    vals = [v for v in vals if v is not None]
    if not vals:
        return "n/a"
    lo, hi = min(vals), max(vals)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}-{fmt(hi)}"


def _cold_warm(workload: str) -> tuple[str, str]:
    return {"chat": ("turn 1", "later turns"), "shared": ("uncached", "cached")}.get(
        workload, ("", "warm"))


def metrics(workload: str) -> list[tuple]:
    """(key, column head, format) of the figures table of a workload."""
    cold, warm = _cold_warm(workload)
    out = [("throughput", "tok/s", lambda v: f"{v:.2f}" if v < 10 else f"{v:.1f}"),
           ("ttft_cold_p50", f"TTFT {cold} p50 s".replace("  ", " "), _s),
           ("ttft_cold_p90", "p90 s", _s)]
    if workload != "unique":
        out += [("ttft_warm_p50", f"TTFT {warm} p50 s", _s), ("ttft_warm_p90", "p90 s", _s)]
    out += [("itl_p99", "ITL p99 s", _s), ("max_gap_p50", "longest pause p50 s", _s),
            ("pss_bytes", "PSS MiB", lambda v: f"{v / 2**20:.0f}"),
            ("cores_busy", "cores busy", lambda v: f"{v:.2f}")]
    if workload != "unique":
        out.append(("cached_tokens_warm", f"cached tok/{warm} req", lambda v: f"{v:.0f}"))
    return out


def ratios(workload: str) -> list[tuple[str, str]]:
    cold, warm = _cold_warm(workload)
    out = [("throughput", "throughput"), ("ttft_cold_p50", f"TTFT {cold} p50".replace("  ", " "))]
    if workload != "unique":
        out.append(("ttft_warm_p50", f"TTFT {warm} p50"))
    out += [("itl_p99", "ITL p99"), ("max_gap_p50", "longest pause p50"), ("pss_bytes", "PSS")]
    return out


_OPS = {">=": lambda v, t: v >= t, "<=": lambda v, t: v <= t}


def _table(head: list[str], rows: list[list[str]]) -> str:
    w = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    out = [" | ".join(h.ljust(x) for h, x in zip(head, w)), "-+-".join("-" * x for x in w)]
    out += [" | ".join(c.ljust(x) for c, x in zip(r, w)) for r in rows]
    return "\n".join(out)


# ------------------------------------------------------------------ summary
def summarize_workload(workload: str, results: dict[str, list[dict]]) -> dict:
    """min/max per metric over rounds; (a)/x ratios paired by round; targets."""
    summary, rat = {}, {}
    for name, rounds in results.items():
        good = [r for r in rounds if "error" not in r]
        summary[name] = {k: [min(v), max(v)] if (v := [r[k] for r in good
                                                      if r.get(k) is not None]) else None
                         for k, _, _ in metrics(workload)}
    # the ratios' reference: (a), else the first variant of it (a-NAME) run
    ref = "a" if "a" in results else next((n for n in results if n.startswith("a-")), None)
    a = {r["round"]: r for r in results.get(ref, []) if "error" not in r} if ref else {}
    for name, rounds in results.items():
        if name == ref or not a:
            continue
        per = {}
        for key, _ in ratios(workload):
            vals = [a[r["round"]][key] / r[key] for r in rounds
                    if "error" not in r and r["round"] in a and a[r["round"]].get(key)
                    is not None and r.get(key)]
            entry = {"min": min(vals), "max": max(vals), "rounds": vals} if vals else None
            t = TARGETS.get(workload, {}).get(name, {}).get(key)
            if t and entry:
                ok = [_OPS[t[0]](v, t[1]) for v in vals]
                entry["target"] = f"{t[0]} {t[1]:g}"
                entry["met"] = "yes" if all(ok) else ("NO" if not any(ok) else "in some rounds")
            per[key] = entry
        rat[name] = per
    return {"summary": summary, "ratios": rat, "reference": ref}


def summarize(results: dict[str, dict[str, list[dict]]]) -> dict:
    return {w: summarize_workload(w, per) for w, per in results.items()}


def report_workload(workload: str, results: dict[str, list[dict]], summ: dict,
                    describe: str) -> str:
    lines = [f"== workload {workload}: {describe}"]
    rows = []
    ms = metrics(workload)
    for name, rounds in results.items():
        s = summ["summary"][name]
        bad = sum(1 for r in rounds if "error" in r)
        rows.append([name] + [_span(s[k] or [], f) for k, _, f in ms] +
                    [f"{len(rounds) - bad}/{len(rounds)}"])
    lines.append(_table(["config"] + [h for _, h, _ in ms] + ["ok rounds"], rows))
    if summ["ratios"]:
        lines.append("")
        ref = summ.get("reference") or "a"
        lines.append(f"({ref}) / other, paired by round (min-max over rounds), with issue "
                     "26's targets:")
        rrows = []
        rs = ratios(workload)
        for name, per in summ["ratios"].items():
            cells = [("n/a" if not (e := per.get(key)) else
                      _span(e["rounds"], lambda v: f"{v:.2f}x")) for key, _ in rs]
            tg = [f"{dict(rs)[k]} {e['target']}: {e['met']}"
                  for k, e in per.items() if e and "target" in e]
            rrows.append([f"{ref} / {name}"] + cells + ["; ".join(tg)])
        lines.append(_table(["ratio"] + [h for _, h in rs] + ["target met?"], rrows))
    return "\n".join(lines)


def report(results, configs, summ, describe: dict, bench_cmd: str, notes: list[str]) -> str:
    lines = []
    for w, per in results.items():
        lines.append(report_workload(w, per, summ[w], describe[w]))
        lines.append("")
    lines.append("configurations:")
    names = list(dict.fromkeys(n for per in results.values() for n in per))
    for name in names:
        lines.append(f"  {name:<9} {configs[name].label}")
    lines.append("")
    lines.append("commands (ports are free ports picked per run; all runs in the JSON):")
    lines.append(f"  bench:    {bench_cmd}")
    for name in names:
        cmds = next((r["commands"] for per in results.values() for r in per.get(name, [])
                     if r.get("commands")), [])
        for k, c in enumerate(cmds[:2]):
            lines.append(f"  {name if k == 0 else '':<9} {c}")
        if len(cmds) > 2:
            lines.append(f"  {'':<9} ... ({len(cmds)} servers, the same command on other ports)")
    fails = [f"  {w} {name} round {r['round']}: {r['error'].splitlines()[0]}"
             for w, per in results.items() for name, rounds in per.items()
             for r in rounds if "error" in r]
    if notes:
        lines.append("")
        lines.append("notes:")
        lines += [f"  {n}" for n in notes]
    if fails:
        lines.append("")
        lines.append("failures:")
        lines += fails
    return "\n".join(lines)
