"""The table of ``python -m tools.bench``: its rows (:func:`row`, what each
section returns) and their text (:func:`print_table`)."""

from __future__ import annotations

import math
import sys

_OPS = {"<=": lambda v, t: v <= t, ">=": lambda v, t: v >= t,
        "<": lambda v, t: v < t, ">": lambda v, t: v > t}


def row(metric: str, ours=None, seed=None, *, unit: str = "", target=None,
        on: str = "ratio", ratio=None, note: str = "", section: str = "") -> dict:
    """One line of the table.

    Args:
        metric: what is measured.
        ours, seed: the two figures (numbers in ``unit``, or None).
        target: ``(op, value)`` such as ``("<=", 2.0)``, or None for an info row.
        on: what the target applies to: ``"ratio"`` (ours / seed) or ``"ours"``.
        ratio: override ours / seed (computed when both are numbers); False
            for none.
    """
    if ratio is False:
        ratio = None
    elif ratio is None and _num(ours) and _num(seed) and seed != 0:
        ratio = ours / seed
    met = None
    if target is not None:
        op, tv = target
        v = ratio if on == "ratio" else ours
        met = bool(_OPS[op](v, tv)) if _num(v) else None
    return {"section": section, "metric": metric, "shmcache": ours, "seed": seed,
            "ratio": ratio, "unit": unit,
            "target": None if target is None else f"{'ratio' if on == 'ratio' else 'value'} "
                                                 f"{target[0]} {target[1]:g}",
            "met": met, "note": note}


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _fmt(v, unit: str) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if not _num(v):
        return str(v)
    if unit == "us":
        return f"{v:.3f} us" if v < 10 else f"{v:.1f} us"
    if unit == "s":
        return f"{v * 1e3:.1f} ms" if v < 1 else f"{v:.2f} s"
    if unit == "B":
        return f"{v:,.1f} B" if v < 1e4 else f"{v / 2**20:,.1f} MiB"
    if unit == "ops/s":
        return f"{v / 1e6:.2f} M/s" if v >= 1e6 else f"{v / 1e3:,.0f} k/s"
    if unit == "x":
        return f"{v:.2f}x"
    return f"{v:.4g} {unit}".rstrip()


def print_table(rows: list, out=sys.stdout) -> None:
    head = ["metric", "shmcache", "seed", "ratio", "target", "met?"]
    body = []
    for r in rows:
        met = {True: "yes", False: "NO", None: ""}[r["met"]]
        body.append([r["metric"], _fmt(r["shmcache"], r["unit"]), _fmt(r["seed"], r["unit"]),
                     "" if r["ratio"] is None else f"{r['ratio']:.3f}x",
                     r["target"] or "", met])
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
              for i, h in enumerate(head)]
    line = " | ".join(h.ljust(w) for h, w in zip(head, widths))
    print(line, file=out)
    print("-+-".join("-" * w for w in widths), file=out)
    section = None
    for r, b in zip(rows, body):
        if r["section"] != section and section is not None:
            print("-+-".join("-" * w for w in widths), file=out)
        section = r["section"]
        print(" | ".join(c.ljust(w) for c, w in zip(b, widths)), file=out)
    notes = [(r["metric"], r["note"]) for r in rows if r["note"]]
    if notes:
        print("\nnotes:", file=out)
        for m, n in notes:
            print(f"  {m}: {n}", file=out)
