"""Does the mesh hold up and scale: a mesh broken on purpose (``faultmesh``, also the chaos
tests' harness), hours of load with node churn and router restarts (``soak``), data-parallel
scaling of simulated nodes (``scaling``), and the scaling signal on a traffic ramp with an
autoscaler acting on it (``scaling_ramp``). Results: ``results/``."""

from gpumesh_bench.commands import Command

QUESTION = "whether the mesh loses requests under faults, leaks over hours, and scales"
COMMANDS = (
    Command("soak", "N minutes at 80 % of the fleet's slots with node churn and a router "
            "restart: lost requests, RSS over time", "gpumesh_bench.reliability.soak"),
    Command("scaling", "data-parallel scaling of sim (and vLLM CPU) nodes",
            "gpumesh_bench.reliability.scaling"),
    Command("scaling-ramp", "the scaling signal on a traffic ramp, with an autoscaler, in the "
            "simulator", "gpumesh_bench.reliability.scaling_ramp", own_args=True),
)
