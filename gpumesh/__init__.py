"""gpumesh: a gRPC mesh for LLM serving (shared pieces: protos, client, CLI, telemetry)."""

__version__ = "0.1.0"
