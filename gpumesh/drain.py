"""`gpumesh drain NODE` / `gpumesh undrain NODE`: the router's operator API (Router.DrainNode
/ UndrainNode) from the command line.

``drain`` stops the router's routing to the node at once and orders the node to drain: it
turns NOT_SERVING on its gRPC health and reports draining to every router, while its
in-flight streams finish. ``--wait S`` then polls the router until the node holds no request
(its report says draining with nothing in flight, or it left the fleet) and fails with
``Exit.DRAIN_TIMEOUT`` after S seconds. ``undrain`` reverses a drain that the node has not
turned into a shutdown. Exit codes: ``gpumesh.status.Exit``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import TextIO

import grpc

from gpumesh.security.client import ClientTls, bearer_interceptors, open_channel
from gpumesh.status import Exit, get_fleet, node_json, reason_of, rpc_error, state_name
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import control_pb2_grpc as cpb_grpc


def drained(node: cpb.NodeStatus | None, ordered: bool) -> bool:
    """The node holds none of its requests any more (None: it left the fleet). A node that got
    the order must also have reported draining, so that an older report's count is not taken
    for the drained one."""
    if node is None:
        return True
    if node.router_in_flight:
        return False
    return not ordered or (node.load.draining and node.load.in_flight == 0)


def _say(node: cpb.NodeStatus, ordered: bool, verb: str, as_json: bool, out: TextIO) -> None:
    if as_json:
        print(json.dumps({"node": node_json(node), "ordered": ordered}), file=out, flush=True)
        return
    why = reason_of(node)
    told = ("the node was told" if ordered
            else "the node has no control stream to this router: only this router stops")
    print(f"node {node.node_id}: {verb} -> {state_name(node.state)}"
          + (f" ({why})" if why else "") + f"; {told}", file=out, flush=True)


async def run_drain(router: str, node_id: str, *, undrain: bool = False, reason: str = "",
                    wait_s: float = 0.0, as_json: bool = False, timeout_s: float = 10.0,
                    poll_s: float = 0.5, out: TextIO | None = None,
                    tls: ClientTls | None = None, api_key: str = "") -> int:
    """Drains (or undrains) ``node_id`` through ``router``; returns an ``Exit`` code."""
    out = out or sys.stdout
    # tls / api_key: an operator certificate or key (gpumesh.security.client)
    async with open_channel(router, (), tls, bearer_interceptors(api_key)) as channel:
        stub = cpb_grpc.RouterStub(channel)
        try:
            if undrain:
                resp = await stub.UndrainNode(cpb.UndrainNodeRequest(node_id=node_id),
                                              timeout=timeout_s)
                _say(resp.node, resp.ordered, "undrain", as_json, out)
                return Exit.OK
            resp = await stub.DrainNode(cpb.DrainNodeRequest(node_id=node_id, reason=reason),
                                        timeout=timeout_s)
            _say(resp.node, resp.ordered, "drain", as_json, out)
            if not wait_s:
                return Exit.OK
            deadline = time.monotonic() + wait_s
            while True:
                fleet = await get_fleet(stub, timeout_s)
                node = next((n for n in fleet.nodes if n.node_id == node_id), None)
                if drained(node, resp.ordered):
                    msg = (f"node {node_id}: drained (no request in flight)" if node is not None
                           else f"node {node_id}: drained and left the fleet")
                    print(json.dumps({"node_id": node_id, "drained": True}) if as_json else msg,
                          file=out, flush=True)
                    return Exit.OK
                if time.monotonic() >= deadline:
                    assert node is not None
                    print(f"node {node_id}: still {node.load.in_flight} requests in flight "
                          f"(this router's: {node.router_in_flight}) after {wait_s:g}s",
                          file=sys.stderr)
                    return Exit.DRAIN_TIMEOUT
                await asyncio.sleep(poll_s)
        except grpc.aio.AioRpcError as exc:
            return rpc_error(exc)
