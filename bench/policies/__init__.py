"""Which routing policy serves a fleet best: every gpumesh policy and nginx ``least_conn`` on
the same live simulated fleet and the same trace (``compare``). The virtual-time counterpart
is ``gpumesh sim`` (``gpumesh_bench.sim``)."""

from gpumesh_bench.commands import Command

QUESTION = "which routing policy serves a fleet best (live simulated fleets)"
COMMANDS = (
    Command("compare-policies", "every policy + nginx on one fleet and one trace",
            "gpumesh_bench.policies.compare"),
    Command("compare-report", "medians over compare-policies result files",
            "gpumesh_bench.policies.compare", "report", "report_arguments"),
)
