"""gpumesh router: fleet registry from heartbeats, predicted-latency routing, dispatch."""
