"""Host CPU placement for the GPU bench: which CPUs each process tree may run on.

A vLLM node is two busy processes: the front end (AsyncLLM's output handling and our gRPC
servicer, one Python thread) and the engine core (scheduler + model runner, a busy loop). On
a shared host the kernel may put either next to a router worker or a load-generator process,
on the same physical core (hyperthread siblings) or on the other socket from its GPU. A
``Placement`` gives each node whole physical cores of its own, preferring the cores local to
its GPUs (NVML's CPU affinity), and everything else (routers, load generator, bench driver)
the remaining CPUs; ``applied()`` pins the live process trees for one bench and restores the
full set afterwards, so pinned and unpinned runs interleave on the same processes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

_SYS = Path("/sys/devices/system/cpu")


def _parse_list(text: str) -> set[int]:
    """Kernel CPU list syntax: ``0-3,8,10-11``."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def physical_cores(allowed: set[int] | None = None) -> list[tuple[int, ...]]:
    """The host's physical cores as tuples of their hyperthread siblings (sorted by first CPU),
    restricted to ``allowed`` (default: this process's affinity)."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    seen: set[int] = set()
    cores: list[tuple[int, ...]] = []
    for cpu in sorted(allowed):
        if cpu in seen:
            continue
        try:
            sib = _parse_list((_SYS / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text())
        except OSError:
            sib = {cpu}
        sib = (sib & allowed) | {cpu}
        seen |= sib
        cores.append(tuple(sorted(sib)))
    return cores


def gpu_local_cpus(index: int) -> set[int]:
    """CPUs NVML reports as local to GPU ``index`` (its NUMA node); empty when unknown."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            n = os.cpu_count() or 1
            words = pynvml.nvmlDeviceGetCpuAffinity(pynvml.nvmlDeviceGetHandleByIndex(index),
                                                    (n + 63) // 64)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML, no GPU: no preference
        return set()
    return {w * 64 + b for w, word in enumerate(words) for b in range(64) if word >> b & 1}


def set_tree_affinity(pid: int, cpus: set[int], *, descendants: bool = True) -> int:
    """Every thread of ``pid`` (and of all its descendants) may run only on ``cpus``; returns
    the number of threads changed (a thread that ends meanwhile is skipped)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *(root.children(recursive=True) if descendants else [])]
    except psutil.Error:
        return 0
    n = 0
    for p in procs:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{p.pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), cpus)
                    n += 1
    return n


@dataclass
class Placement:
    """Exclusive CPU sets for node process trees, the rest for everything else."""

    nodes: dict[int, set[int]]          # node pid -> its CPUs
    rest: set[int]                      # routers, load generator, bench driver
    others: list[int] = field(default_factory=list)   # pids that get ``rest`` (routers)
    all_cpus: set[int] = field(default_factory=set)

    @classmethod
    def plan(cls, nodes: Mapping[int, Sequence[int]], others: Sequence[int], *,
             cores_per_node: int = 2, cores: list[tuple[int, ...]] | None = None,
             local: Mapping[int, set[int]] | None = None) -> Placement:
        """``nodes``: node pid -> its GPU indices. Each node takes ``cores_per_node`` physical
        cores per GPU (all their siblings), from its GPUs' local CPUs first. Refuses a plan
        that would leave fewer than two physical cores for the rest."""
        cores = physical_cores() if cores is None else cores
        all_cpus = {c for core in cores for c in core}
        free = list(cores)
        out: dict[int, set[int]] = {}
        for pid, gpus in nodes.items():
            want = cores_per_node * max(1, len(gpus))
            near: set[int] = set()
            for g in gpus:
                near |= (local or {}).get(g, set()) if local is not None else gpu_local_cpus(g)
            ranked = sorted(free, key=lambda core: (not set(core) <= near, core))
            take = ranked[:want]
            if len(take) < want:
                raise ValueError(f"not enough physical cores: node {pid} wants {want}, "
                                 f"{len(take)} free")
            for core in take:
                free.remove(core)
            out[pid] = {c for core in take for c in core}
        if len(free) < 2:
            raise ValueError(f"pinning {len(nodes)} nodes leaves {len(free)} physical cores "
                             "for routers and load")
        return cls(out, {c for core in free for c in core}, list(others), all_cpus)

    def describe(self) -> dict[str, str]:
        def fmt(s: set[int]) -> str:
            return ",".join(map(str, sorted(s)))
        return {**{f"node pid {p}": fmt(s) for p, s in self.nodes.items()},
                "rest": fmt(self.rest)}

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Pin the node trees, the other trees and this process (its later children inherit
        it) for the ``with`` body; every tree gets all CPUs back afterwards."""
        trees = [*self.nodes.items(), *((p, self.rest) for p in self.others)]
        me = os.getpid()   # its own threads only: the nodes and routers are its children
        try:
            for pid, cpus in trees:
                set_tree_affinity(pid, cpus)
            set_tree_affinity(me, self.rest, descendants=False)
            yield
        finally:
            for pid, _ in trees:
                set_tree_affinity(pid, self.all_cpus)
            set_tree_affinity(me, self.all_cpus, descendants=False)
