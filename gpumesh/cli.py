"""`gpumesh` command line: node, router, generate, status, demo, calibrate, make-tiny-model, and the
commands of installed plugins (``gpumesh bench`` with the ``gpumesh-bench`` package)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

import grpc


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _cmd_node(args: argparse.Namespace) -> int:
    from gpumesh.config import cli_values
    from gpumesh.node.app import serve
    from gpumesh.node.config import load_node_config

    try:   # ConfigError is a ValueError
        cfg = load_node_config(args.config, cli_values(args.node_cli, args))
    except (ValueError, OSError) as exc:
        print(f"gpumesh node: {exc}", file=sys.stderr)
        return 2
    if cfg.engine.kind == "vllm" and not cfg.engine.model:
        print("gpumesh node: --model PATH is required for the vllm engine", file=sys.stderr)
        return 2
    from gpumesh.security.tls import PlaintextRefused

    try:
        return asyncio.run(serve(cfg))
    except PlaintextRefused as exc:   # a non-loopback bind without TLS or --insecure
        print(f"gpumesh node: {exc}", file=sys.stderr)
        return 2


def _cmd_router(args: argparse.Namespace) -> int:
    from gpumesh.router.app import serve
    from gpumesh.router.workers import serve_workers
    from gpumesh.router.config import from_args

    try:
        cfg = from_args(args)
    except (ValueError, OSError) as exc:
        print(f"gpumesh router: {exc}", file=sys.stderr)
        return 2
    if args.workers > 1:
        return serve_workers(cfg, args.workers)
    from gpumesh.security.tls import PlaintextRefused

    try:
        asyncio.run(serve(cfg))
    except PlaintextRefused as exc:   # a non-loopback bind without TLS or --insecure
        print(f"gpumesh router: {exc}", file=sys.stderr)
        return 2
    return 0


def _request_from_args(args: argparse.Namespace):
    from gpumesh.client import build_request

    return build_request(args.prompt, model=args.model or "", max_tokens=args.max_tokens,
                         temperature=args.temperature, seed=args.seed, stop=args.stop or (),
                         ignore_eos=args.ignore_eos)


async def _generate(args: argparse.Namespace) -> int:
    from gpumesh.client import MeshClient, StreamResult
    from gpumesh.telemetry import client_trace_metadata

    req = _request_from_args(args)
    metadata, trace_id = client_trace_metadata(args.trace)
    if args.trace:
        print(f"trace id: {trace_id}", file=sys.stderr)
    tls, api_key = _client_security(args)
    async with MeshClient(args.target, lookaside=args.lookaside, tls=tls,
                          api_key=api_key) as client:
        try:
            if args.stream or args.lookaside:
                result = StreamResult()
                usage = None
                finish = 0
                async for chunk in client.stream(req, timeout=args.timeout, metadata=metadata,
                                                 result=result):
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    if chunk.HasField("usage"):
                        usage, finish = chunk.usage, chunk.finish_reason
                print()
                if usage is not None:
                    from gpumesh.v1 import inference_pb2 as pb
                    print(f"[{pb.FinishReason.Name(finish)}] prompt_tokens={usage.prompt_tokens} "
                          f"completion_tokens={usage.completion_tokens} node={result.node_id}",
                          file=sys.stderr)
            else:
                from gpumesh.v1 import inference_pb2 as pb
                resp = await client.generate(req, timeout=args.timeout, metadata=metadata)
                print(resp.text)
                print(f"[{pb.FinishReason.Name(resp.finish_reason)}] "
                      f"prompt_tokens={resp.usage.prompt_tokens} "
                      f"completion_tokens={resp.usage.completion_tokens}", file=sys.stderr)
        except grpc.aio.AioRpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    return asyncio.run(_generate(args))


def _cmd_status(args: argparse.Namespace) -> int:
    from gpumesh.status import run_status

    tls, api_key = _client_security(args)
    return asyncio.run(run_status(args.router, as_json=args.json, watch_s=args.watch,
                                  count=args.count, check=args.check, timeout_s=args.timeout,
                                  tls=tls, api_key=api_key))


def _cmd_health(args: argparse.Namespace) -> int:
    from gpumesh.health import check

    return asyncio.run(check(args.target, args.service, timeout_s=args.timeout,
                             ca=args.tls_ca or "", cert=args.tls_cert or "",
                             key=args.tls_key or "", server_name=args.tls_server_name or ""))


def _cmd_drain(args: argparse.Namespace) -> int:
    from gpumesh.drain import run_drain

    return asyncio.run(run_drain(args.router, args.node, undrain=args.cmd == "undrain",
                                 reason=getattr(args, "reason", ""),
                                 wait_s=getattr(args, "wait", 0.0), as_json=args.json,
                                 timeout_s=args.timeout, tls=_client_security(args)[0],
                                 api_key=_client_security(args)[1]))


def _cmd_demo(args: argparse.Namespace) -> int:
    from gpumesh.demo import run_demo

    return asyncio.run(run_demo(args))


def _client_security(args: argparse.Namespace):
    """(ClientTls or None, API key) from --tls-* and --api-key / GPUMESH_API_KEY."""
    from gpumesh.security.client import ClientTls

    tls = None
    if args.tls_ca or args.tls_cert:
        tls = ClientTls(args.tls_ca or "", args.tls_cert or "", args.tls_key or "",
                        args.tls_server_name or "")
    return tls, args.api_key or os.environ.get("GPUMESH_API_KEY", "")


def _add_client_security(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-ca", help="CA (PEM) that verifies the server; turns TLS on")
    parser.add_argument("--tls-cert", help="client certificate (PEM) for mutual TLS")
    parser.add_argument("--tls-key", help="its private key (PEM)")
    parser.add_argument("--tls-server-name", help="name to verify instead of the target's host")
    parser.add_argument("--api-key", help="API key (better: the GPUMESH_API_KEY environment)")


def _cmd_certs(args: argparse.Namespace) -> int:
    from gpumesh.security.certs import make_mesh_certs

    made = make_mesh_certs(args.dir, router_id=args.router_id, node_ids=args.node or ["node"],
                           hosts=args.host or (), days=args.days)
    for stem in made:
        print(f"{args.dir}/{stem}.pem")
    return 0


def _cmd_apikey(args: argparse.Namespace) -> int:
    from gpumesh.router.auth.keys import entry_toml, new_key

    key = new_key()
    print(f"# API key for {args.name} (shown once; give it to the client, keep only the hash):",
          file=sys.stderr)
    print(f"# {key}", file=sys.stderr)
    print(entry_toml(args.name, key, args.role, tuple(args.model or ())))
    return 0


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from gpumesh.tiny_model import build_tiny_model

    print(build_tiny_model(args.dir, seed=args.seed))
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from gpumesh.config import ConfigError
    from gpumesh.node.calibrate_command import PlatformMismatch, prepare, profile_table, run
    from gpumesh.node.engines.base import EngineError
    from gpumesh.node.engines.vllm.calibrate import CalibrationError

    try:
        job = prepare(args)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"gpumesh calibrate: {exc}", file=sys.stderr)
        return 2
    try:
        profile = asyncio.run(run(job))
    except PlatformMismatch as exc:
        print(f"gpumesh calibrate: {exc}", file=sys.stderr)
        return 2
    except (EngineError, CalibrationError, ValueError, OSError) as exc:  # ValueError: the fit
        print(f"gpumesh calibrate: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {job.out}")
    print(profile_table(profile))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpumesh", description=__doc__)
    p.add_argument("--log-level", default=os.environ.get("GPUMESH_LOG_LEVEL", "info"))
    sub = p.add_subparsers(dest="cmd", required=True)

    n = sub.add_parser("node", help="serve one engine (vLLM or the simulator) over gRPC",
                       usage="gpumesh node [--config FILE] [--SECTION.KEY VALUE ...] "
                             "[--model M --router HOST:PORT ...]",
                       description="Every configuration key has a flag --SECTION.KEY; the "
                                   "common ones also a short one (--model, --router, --port). "
                                   "Layers: defaults < --config file < GPUMESH_NODE_SECTION__KEY "
                                   "< flags (docs/configuration.md).")
    from gpumesh.config import add_cli
    from gpumesh.node.config import NodeConfig

    n.set_defaults(func=_cmd_node, node_cli=add_cli(n, NodeConfig))

    r = sub.add_parser("router", help="serve the router",
                       usage="gpumesh router [--config FILE] [--SECTION.KEY VALUE ...] "
                             "[--port P --policy P ...] [--workers N]",
                       description="Every configuration key has a flag --SECTION.KEY; the "
                                   "common ones also a short one (--port, --host, --policy). "
                                   "Layers: defaults < --config file < "
                                   "GPUMESH_ROUTER_SECTION__KEY < flags "
                                   "(docs/configuration.md).")
    from gpumesh.router.config import add_arguments as add_router_arguments

    add_router_arguments(r)
    r.add_argument("--workers", type=int, default=1,
                   help="router processes sharing the port (SO_REUSEPORT)")
    r.set_defaults(func=_cmd_router)

    g = sub.add_parser("generate", help="send one request to a router or a node")
    g.add_argument("--target", default="127.0.0.1:50050")
    g.add_argument("--model")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stream", action="store_true")
    g.add_argument("--lookaside", action="store_true", help="pick via the router, stream from the node")
    g.add_argument("--trace", action="store_true", help="start a trace and print its id")
    g.add_argument("--timeout", type=float, default=120.0)
    _add_client_security(g)
    g.add_argument("prompt")
    g.set_defaults(func=_cmd_generate)

    s = sub.add_parser("status", help="print the fleet as the router sees it",
                       description="Exit codes: 0 ok, 1 router unreachable or refused, "
                                   "4 --check found a node not healthy (or none).")
    s.add_argument("--router", default="127.0.0.1:50050")
    s.add_argument("--json", action="store_true", help="JSON (schema gpumesh.status.v1)")
    s.add_argument("--watch", type=float, nargs="?", const=2.0, default=0.0, metavar="S",
                   help="print again every S seconds (default 2); JSON: one line each")
    s.add_argument("--count", type=int, default=0, help="with --watch: stop after N prints")
    s.add_argument("--check", action="store_true",
                   help="exit 4 unless every node is healthy and there is at least one")
    s.add_argument("--timeout", type=float, default=10.0, help="per-call deadline, seconds")
    _add_client_security(s)
    s.set_defaults(func=_cmd_status)

    h = sub.add_parser("health", help="one grpc.health.v1 check (exit 0 if SERVING)",
                       description="Exit codes: 0 SERVING, 1 anything else.")
    h.add_argument("target", help="host:port of a router or node")
    h.add_argument("--service", default="", help='"" (ready), "liveness" or a service name')
    h.add_argument("--timeout", type=float, default=5.0)
    _add_client_security(h)
    h.set_defaults(func=_cmd_health)

    for name, text in (("drain", "stop routing to a node and order it to drain"),
                       ("undrain", "undo a drain: the node serves again")):
        dr = sub.add_parser(name, help=text,
                            description="Exit codes: 0 ok, 1 router unreachable or refused, "
                                        "3 no such node, 5 drain --wait timed out.")
        dr.add_argument("node", help="node id (as gpumesh status lists it)")
        dr.add_argument("--router", default="127.0.0.1:50050")
        dr.add_argument("--json", action="store_true", help="print the node as JSON")
        dr.add_argument("--timeout", type=float, default=10.0, help="per-call deadline, s")
        _add_client_security(dr)
        if name == "drain":
            dr.add_argument("--reason", default="", help="shown in the node's state reason")
            dr.add_argument("--wait", type=float, nargs="?", const=600.0, default=0.0,
                            metavar="S", help="wait up to S seconds (default 600) until the "
                                              "node holds no request; exit 5 on timeout")
        dr.set_defaults(func=_cmd_drain)

    d = sub.add_parser("demo", help="router + two CPU vLLM nodes on the tiny model, one answer")
    d.add_argument("--model-dir", default=os.environ.get("GPUMESH_TINY_MODEL", "models/tiny"))
    d.add_argument("--engine", choices=["vllm", "sim"], default="vllm")
    d.add_argument("--prompt", default="Tell me about the mesh.")
    d.add_argument("--port", type=int, default=50050)
    d.add_argument("--plaintext", action="store_true",
                   help="no TLS (default: mutual TLS on every hop with gpumesh certs)")
    d.set_defaults(func=_cmd_demo)

    c = sub.add_parser("certs", help="make a private CA and router/node/client/operator "
                                     "certificates (docs/security.md)")
    c.add_argument("dir")
    c.add_argument("--node", action="append", help="node id (repeat; default: node)")
    c.add_argument("--router-id", default="router")
    c.add_argument("--host", action="append", help="extra DNS name or IP in every certificate")
    c.add_argument("--days", type=int, default=365)
    c.set_defaults(func=_cmd_certs)

    k = sub.add_parser("apikey", help="make an API key: prints its api_keys_file entry "
                                      "(the key itself goes to stderr, once)")
    k.add_argument("name")
    k.add_argument("--role", choices=["client", "operator"], default="client")
    k.add_argument("--model", action="append", help="allowed model (repeat; default: all)")
    k.set_defaults(func=_cmd_apikey)

    t = sub.add_parser("make-tiny-model", help="build a random-weight Qwen2-shaped model")
    t.add_argument("dir")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=_cmd_make_tiny_model)

    cal = sub.add_parser(
        "calibrate", help="measure an engine profile from a real vLLM engine",
        description="Starts the engine as `gpumesh node` would (same flags, same --config "
                    "file), measures decode steps and prefill times, fits the step model and "
                    "writes the profile (docs/simulator.md, \"Engine profiles\"). Exit codes: "
                    "0 written, 1 the engine failed, 2 bad arguments.")
    from gpumesh.node.calibrate_command import add_arguments as add_calibrate_arguments

    add_calibrate_arguments(cal)
    cal.set_defaults(func=_cmd_calibrate)

    _add_plugin_commands(sub)
    return p


def _add_plugin_commands(sub: argparse._SubParsersAction) -> None:
    """Adds the commands other installed distributions register under the ``gpumesh.commands``
    entry-point group (``gpumesh bench`` comes from the separate ``gpumesh-bench`` package).
    Each entry point is a callable ``register(subparsers)``; one that fails to load is skipped
    with a warning so that the product's own commands keep working."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="gpumesh.commands"):
        try:
            ep.load()(sub)
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break the CLI
            logging.getLogger(__name__).warning("gpumesh command %r not loaded: %s", ep.name, exc)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
