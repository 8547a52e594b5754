"""Two router variants side by side: the paired, interleaved loop of the TLS and security parts.

Each repeat measures every variant once, in an order that reverses every repeat (ABBA...), so
slow drift of a shared machine hits both alike; the result is each variant's medians over the
repeats and the ratio of one variant's router CPU per stream to the other's, paired by repeat.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from gpumesh_bench.stats import percentile

V = TypeVar("V")


def tls_flags(d: Path, stem: str) -> list[str]:
    """The ``--tls-*`` flags of a process whose certificate is ``d/stem.pem`` (``gpumesh certs``
    layout: ``ca.pem`` beside it)."""
    return ["--tls-cert-file", str(d / f"{stem}.pem"), "--tls-key-file", str(d / f"{stem}.key"),
            "--tls-ca-file", str(d / "ca.pem")]


def interleave(part: str, variants: Mapping[str, V], repeats: int, cpu_key: str,
               measure: Callable[[V], dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """``repeats`` rounds of ``measure`` on every variant, the order reversed every round; each
    run is a dict with ``req_per_s``, ``errors`` and ``cpu_key`` (router CPU ms per stream)."""
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in variants}
    names = list(variants)
    for rep in range(repeats):
        for name in (names if rep % 2 == 0 else names[::-1]):
            r = measure(variants[name])
            runs[name].append(r)
            print(f"[overhead] {part} {name:10s} rep={rep} {r['req_per_s']:7.1f} req/s "
                  f"router {r[cpu_key]:.3f} ms/stream errors={r['errors']}",
                  file=sys.stderr, flush=True)
    return runs


def paired_result(runs: dict[str, list[dict[str, Any]]], cpu_key: str, num: str,
                  den: str) -> dict[str, Any]:
    """Per variant the median of every numeric field; ``runs``; and ``cpu_ratio``: ``num``'s
    ``cpu_key`` over ``den``'s, repeat by repeat (median, min, max and the paired list)."""
    ratios = [n[cpu_key] / d[cpu_key] for n, d in zip(runs[num], runs[den], strict=True)]
    result: dict[str, Any] = {name: {key: percentile([r[key] for r in rs], 50)
                                     for key in rs[0] if isinstance(rs[0][key], int | float)}
                              for name, rs in runs.items()}
    result["runs"] = runs
    result["cpu_ratio"] = {"median": percentile(ratios, 50), "min": min(ratios),
                           "max": max(ratios), "paired": ratios}
    return result


def ratio_line(c: dict[str, Any], what: str) -> str:
    return (f"Router CPU per stream, {what}: {c['median']:.3f} (median of {len(c['paired'])} "
            f"paired repeats; min {c['min']:.3f}, max {c['max']:.3f})")
