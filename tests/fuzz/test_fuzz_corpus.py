"""The coverage-guided fuzzer's committed corpus (fuzz/corpus/), replayed through its targets
(fuzz/targets.py) without atheris: every input the fuzzer kept still passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from fuzz.targets import TARGETS

CORPUS = Path(__file__).resolve().parents[2] / "fuzz" / "corpus"


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_corpus_replays(target):
    files = sorted((CORPUS / target).iterdir())
    assert files, f"empty corpus for {target}"
    for f in files:
        TARGETS[target](f.read_bytes())  # raises on a violated property


def test_ingest_rejects_a_non_finite_heartbeat_before_it_reaches_candidates():
    """The property the ingest target checks is not vacuous: a non-finite KV usage is stopped
    by validation, so the candidate list stays finite."""
    import math

    from gpumesh.v1 import control_pb2 as cpb

    def frame(m):
        raw = m.SerializeToString()
        return len(raw).to_bytes(2, "big") + raw

    reg = cpb.NodeMessage(registration=cpb.Registration(
        node_id="n", address="h:1", models=[cpb.ServedModel(name="m")]))
    bad = cpb.NodeMessage(heartbeat=cpb.Heartbeat(seq=1, load=cpb.LoadReport(
        kv_cache_usage=math.nan)))
    TARGETS["ingest"](frame(reg) + frame(bad))
