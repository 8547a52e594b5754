"""``gpumesh sim``: a discrete-event, virtual-time fleet simulator that runs the router's own
registry, accounting and scheduling code against the simulated node's own engine model
(``core``), with workloads (``workloads``), fleets (``fleets``), metrics with confidence
intervals (``metrics``), the policy grid and its report (``grid``, ``report``) and capacity
planning (``capacity``). docs/simulator.md is the user guide."""
