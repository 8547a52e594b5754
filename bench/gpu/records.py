"""The GPU report's vocabulary: the raw-vLLM reference figures records are compared with
(raw vLLM 0.26.0 on H200s), and how a record is keyed (setup, workload, harness run)."""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpumesh_bench.workload import REFERENCE_OUTPUT, REFERENCE_PROMPT

# Raw vLLM 0.26.0 on one and two H200s (a closed-loop AsyncLLM script, 2026-11-29):
# (shape, setup) -> (QPS, p50 latency s, TTFT p50 s or None), input 32, output 256, ignore_eos.
RAW_REFERENCE: dict[tuple[str, str], tuple[float, float, float | None]] = {
    ("0.5b", "1gpu"): (128.0, 0.92, None), ("0.5b", "dp2"): (161.0, 0.72, None),
    ("0.5b", "tp2"): (145.0, 0.84, None),
    ("7b", "1gpu"): (60.0, 3.19, 1.65), ("7b", "dp2"): (137.0, 1.63, 0.09),
    ("7b", "tp2"): (85.0, 2.41, None),
}
RAW_CONCURRENCY = {"0.5b": 128, "7b": 256}
# The seed's table (older GPUs): setup -> (QPS, p50 latency s).
SEED_TABLE = {"1gpu": (20.0, 1.2), "dp2": (38.0, 1.3), "tp2": (22.0, 1.8)}


def _call(rec: dict[str, Any]) -> int | None:
    """The 1-based harness run that measured a record (``cmd_run`` records it); None for
    archived records from before it did."""
    return rec.get("call") or None


def pair_key(rec: dict[str, Any]) -> tuple[int | None, int]:
    """What two records of one interleaved phase are paired on: the same round of the same
    harness run (``call``, made unique across files by ``load_results``)."""
    return _call(rec), rec["round"]


def load_results(files: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The records and the merged meta of results files (``.json`` or ``.json.gz``); a
    record's ``call`` indexes the merged ``meta["calls"]``, so each file's calls are shifted
    by the earlier files' (rounds of different runs never pair)."""
    records: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    for f in files:
        raw = Path(f).read_bytes()
        doc = json.loads(gzip.decompress(raw) if f.endswith(".gz") else raw)
        shift = len(meta.get("calls", []))
        records += [{**r, "call": r["call"] + shift} if _call(r) and shift else r
                    for r in doc.get("records", [])]
        for k, v in doc.get("meta", {}).items():
            if isinstance(v, dict):
                meta.setdefault(k, {}).update(v)
            elif isinstance(v, list):
                meta.setdefault(k, []).extend(v)
            else:
                meta[k] = v
    return records, meta


def _call_tagger(records: list[dict[str, Any]]) -> Callable[[dict[str, Any]], str]:
    """`` (call N)`` for a row's label where the records come from more than one call (one
    results.json several harness runs appended to, or several files), else ""."""
    multi = len({_call(r) for r in records} - {None}) > 1
    return lambda r: f" (call {_call(r)})" if multi and _call(r) is not None else ""


def _setup_key(rec: dict[str, Any]) -> str:
    s = rec["setup"]
    if "data parallel" in s:
        return "dp2"
    if "tensor parallel" in s:
        return "tp2"
    return "1gpu"


# The raw reference's workload as (prompt, output) length specs (gpumesh_bench.workload).
REFERENCE_WORKLOAD = (str(REFERENCE_PROMPT), str(REFERENCE_OUTPUT))


def _workload(rec: dict[str, Any]) -> tuple[str, str]:
    """(prompt, output) length specs of a record; older records without them ran the
    reference's workload."""
    return (str(rec.get("prompt") or REFERENCE_WORKLOAD[0]),
            str(rec.get("output") or REFERENCE_WORKLOAD[1]))


def _workload_label(rec: dict[str, Any]) -> str:
    wl = _workload(rec)
    return "reference" if wl == REFERENCE_WORKLOAD else f"{wl[0]} -> {wl[1]}"


def _by_workload(records: list[dict[str, Any]]
                 ) -> dict[tuple[int | None, str, tuple[str, str]], list[dict[str, Any]]]:
    out: dict[tuple[int | None, str, tuple[str, str]], list[dict[str, Any]]] = {}
    for r in records:
        if r["phase"] in ("p05", "p7"):
            out.setdefault((_call(r), r["shape"], _workload(r)), []).append(r)
    return out


def fmt(x: Any, nd: int = 2) -> str:
    """A number for a table cell: ``nd`` decimals, "-" for None or NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{nd}f}"


def dedupe(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last record of each (call, phase, setup, shape, C, prompt, output): a rerun within
    one call replaces; another call's records stay (each row says its call)."""
    last: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in records:
        last[(_call(r), r["phase"], r["setup"], r["shape"], r["concurrency"], r.get("prompt"),
              r.get("output"))] = r
    return list(last.values())


def median_of(xs: Sequence[float | None]) -> float:
    """The median of the finite values (NaN when there is none)."""
    kept = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(kept) if kept else math.nan


def median_field(recs: Sequence[dict[str, Any]], key: str) -> float:
    """The median of one field over records (``median_of``)."""
    return median_of([r[key] for r in recs])


def spread(xs: Sequence[float | None], nd: int = 1) -> str:
    """``median (min–max)`` of the finite values; the value alone when there is one."""
    kept = [x for x in xs if x is not None and not math.isnan(x)]
    if not kept:
        return "–"
    m = statistics.median(kept)
    if len(kept) == 1:
        return f"{m:.{nd}f}"
    return f"{m:.{nd}f} ({min(kept):.{nd}f}–{max(kept):.{nd}f})"


def ms(x: float | None) -> str:
    """Seconds as whole milliseconds ("–" for none)."""
    return "–" if x is None or math.isnan(x) else f"{x * 1000:.0f}"


def report_cli(prog: str, doc: str | None, argv: Sequence[str] | None,
               render: Callable[[list[dict[str, Any]], dict[str, Any], int], str]) -> int:
    """The command line of a one-kind report: ``FILES... [--md OUT.md] [--from-round N]``;
    ``render(records, meta, from_round)`` makes the markdown, printed and written to --md."""
    ap = argparse.ArgumentParser(prog=prog, description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--md", default="")
    ap.add_argument("--from-round", type=int, default=0,
                    help="leave each run's rounds before N out (warm rounds only)")
    a = ap.parse_args(argv)
    records, meta = load_results(a.files)
    md = render(records, meta, a.from_round)
    if a.md:
        Path(a.md).write_text(md)
    print(md)
    return 0
