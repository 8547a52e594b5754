"""gpumesh against other gateways: SMG (the Rust gateway) in front of one real vLLM CPU worker
(``vs_smg``: router overhead, each against its own direct baseline) and in front of the same
simulated fleet (``smg_fleet``, with ``smg_gateway``, ``smg_clients`` and ``smg_report``).
nginx ``least_conn`` runs beside the policies in ``gpumesh_bench.policies`` and on GPUs in
``gpumesh_bench.gpu``."""

from gpumesh_bench.commands import Command

QUESTION = "gpumesh against other gateways (SMG) on the same workers"
COMMANDS = (
    Command("vs-smg", "gpumesh router vs SMG, each against one vLLM CPU worker",
            "gpumesh_bench.peers.vs_smg"),
    Command("smg-fleet", "gpumesh vs SMG on the same simulated fleet ('smg-fleet report "
            "FILE...' tabulates)", "gpumesh_bench.peers.smg_fleet", "cli", own_args=True),
)
