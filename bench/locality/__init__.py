"""What cache-aware routing buys: the multi-tenant shared-prefix workload
(``gpumesh_bench.tenants``) on a live simulated fleet per setup, SMG's ``cache_aware`` beside
it (``live``), the same in the virtual-time simulator (``sim``), and how fast a restarted
router's prefix index is whole again (``restart``). Results: ``results/``."""

from gpumesh_bench.commands import Command

QUESTION = "what cache-aware routing buys on a shared-prefix workload"
COMMANDS = (
    Command("prefix", "cache-aware routing on a live simulated fleet: a multi-tenant "
            "shared-prefix workload, per setup", "gpumesh_bench.locality.live"),
    Command("prefix-restart", "how fast a restarted router's prefix index is whole again (in "
            "process, simulated nodes)", "gpumesh_bench.locality.restart"),
    Command("prefix-sim", "cache-aware routing in the virtual-time simulator (multi-tenant "
            "shared-prefix workload, per setup)", "gpumesh_bench.locality.sim"),
)
