"""The GPU bench's CPU placement: the plan on a given topology, and pinning a live process tree."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gpumesh_bench.gpu.affinity import (
    Placement,
    _parse_list,
    physical_cores,
    set_tree_affinity,
)

# 8 physical cores, hyperthread pairs (c, c + 8), GPU 0 local to cores 0-3, GPU 1 to 4-7
CORES = [(c, c + 8) for c in range(8)]
LOCAL = {0: {0, 1, 2, 3, 8, 9, 10, 11}, 1: {4, 5, 6, 7, 12, 13, 14, 15}}


def test_parse_kernel_cpu_lists() -> None:
    assert _parse_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert _parse_list("5") == {5}


def test_physical_cores_cover_this_process_cpus() -> None:
    cores = physical_cores()
    flat = [c for core in cores for c in core]
    assert sorted(flat) == sorted(os.sched_getaffinity(0))
    assert len(flat) == len(set(flat))


def test_plan_gives_each_node_whole_local_cores_and_the_rest_to_others() -> None:
    pl = Placement.plan({100: [1], 200: [0]}, [300], cores=CORES, local=LOCAL)
    assert pl.nodes[100] == {4, 5, 12, 13}           # GPU 1's side, both siblings
    assert pl.nodes[200] == {0, 1, 8, 9}             # GPU 0's side
    assert pl.rest == {2, 3, 6, 7, 10, 11, 14, 15}
    assert not (pl.nodes[100] & pl.nodes[200]) and not (pl.rest & pl.nodes[100])
    assert pl.all_cpus == set(range(16)) and pl.others == [300]


def test_plan_scales_with_gpus_and_refuses_to_starve_the_rest() -> None:
    pl = Placement.plan({1: [0, 1]}, [], cores=CORES, local=LOCAL, cores_per_node=2)
    assert len(pl.nodes[1]) == 8                       # TP over 2 GPUs: 4 physical cores
    with pytest.raises(ValueError, match="leaves 0 physical cores"):
        Placement.plan({1: [0], 2: [1]}, [], cores=CORES, local=LOCAL, cores_per_node=4)
    with pytest.raises(ValueError, match="not enough physical cores"):
        Placement.plan({1: [0], 2: [1]}, [], cores=CORES, local=LOCAL, cores_per_node=5)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_applied_pins_a_live_tree_with_its_threads_and_children_then_restores() -> None:
    # a parent with a thread and a child process, both alive while we look
    code = ("import subprocess, sys, threading, time; "
            "threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
            "print('up', flush=True); time.sleep(30)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "up"
        import psutil

        deadline = time.monotonic() + 10
        while not psutil.Process(p.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        child = psutil.Process(p.pid).children()[0].pid
        cpus = sorted(os.sched_getaffinity(0))
        one, rest = {cpus[0]}, set(cpus[1:])
        pl = Placement({p.pid: one}, rest, [], set(cpus))
        with pl.applied():
            tids = [int(t) for t in os.listdir(f"/proc/{p.pid}/task")]
            assert len(tids) >= 2
            assert all(os.sched_getaffinity(t) == one for t in tids)
            assert os.sched_getaffinity(child) == one
            assert os.sched_getaffinity(0) == rest      # the driver: load processes inherit
        assert os.sched_getaffinity(p.pid) == set(cpus)
        assert os.sched_getaffinity(child) == set(cpus)
        assert os.sched_getaffinity(0) == set(cpus)
        assert set_tree_affinity(2**22 + 12345, one) == 0  # no such process: nothing, no error
    finally:
        for c in psutil.Process(p.pid).children(recursive=True):
            c.kill()
        p.kill()
        p.wait()
