"""gpumesh router: fleet registry from heartbeats, weighted least-load routing, dispatch."""
