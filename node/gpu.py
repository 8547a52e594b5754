"""GPU utilisation and memory through NVML (pynvml), for the node's heartbeats.

``GpuSampler`` reads the GPUs this node may use (``CUDA_VISIBLE_DEVICES``, as CUDA interprets
it) and never blocks the event loop: every NVML call runs in ``asyncio.to_thread``. On a
machine without an NVIDIA driver (CPU nodes, laptops, CI) NVML fails to initialise; the sampler
logs that once at debug level and returns ``()`` from then on.

Typical wiring (node/app.py): ``task = asyncio.create_task(sampler.run(1.0))``; the heartbeat
loop reads ``sampler.latest`` (free) and the engine's ``load()`` includes it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from gpumesh.types import GpuSample

__all__ = ["GpuSampler", "visible_device_ids"]

logger = logging.getLogger(__name__)


def visible_device_ids(environ: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES``, or None when it is unset (all GPUs visible).

    Parsed as CUDA does: comma separated, whitespace ignored, and the list ends at the first
    entry that is neither an integer nor a ``GPU-``/``MIG-`` UUID. ``""`` means no GPU.
    """
    env = os.environ if environ is None else environ
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    ids: list[str] = []
    for part in raw.split(","):
        item = part.strip()
        if item.lstrip("-").isdigit():
            if int(item) < 0:
                break  # CUDA treats a negative index as the end of the list
            ids.append(str(int(item)))
        elif item.startswith(("GPU-", "MIG-")):
            ids.append(item)
        else:
            break
    return tuple(ids)


class GpuSampler:
    """Samples the node's GPUs through NVML.

    ``sample()`` takes one fresh reading; ``run(interval_s)`` keeps ``latest`` fresh in the
    background. ``GpuSample.index`` is the NVML (physical, nvidia-smi) index, so operators can
    match it with ``nvidia-smi`` even when ``CUDA_VISIBLE_DEVICES`` renumbers the devices.
    Not thread-safe for concurrent ``sample()`` calls from several event loops (one node, one
    loop).
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._visible = visible_device_ids(environ)
        self._nvml: Any = None  # the pynvml module once initialised
        self._handles: tuple[Any, ...] | None = None
        self._unavailable = False
        self._lock = threading.Lock()  # NVML init/shutdown vs. sampling in worker threads
        self._latest: tuple[GpuSample, ...] = ()
        self._device_name = ""

    @property
    def device_name(self) -> str:
        """NVML name of the first visible GPU (e.g. "NVIDIA H200"); "" before the first
        sample or without NVML. The node registers it as its ``gpu_model``."""
        return self._device_name

    @property
    def available(self) -> bool:
        """False once NVML failed to initialise (no driver): sampling is then a no-op."""
        return not self._unavailable

    @property
    def latest(self) -> tuple[GpuSample, ...]:
        """The most recent sample taken by ``sample()`` or ``run()``; ``()`` before the first."""
        return self._latest

    async def sample(self) -> tuple[GpuSample, ...]:
        """One reading of every visible GPU (``()`` without NVML). Never raises NVML errors."""
        if self._unavailable:
            return ()
        samples = await asyncio.to_thread(self._sample_blocking)
        self._latest = samples
        return samples

    async def run(self, interval_s: float = 1.0) -> None:
        """Sample every ``interval_s`` seconds until cancelled; returns at once without NVML."""
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        try:
            while True:
                await self.sample()
                if self._unavailable:
                    return
                await asyncio.sleep(interval_s)
        finally:
            await asyncio.to_thread(self._shutdown_blocking)

    async def close(self) -> None:
        """Release NVML (idempotent). A later ``sample()`` initialises it again."""
        await asyncio.to_thread(self._shutdown_blocking)

    # -- blocking parts, run in worker threads --------------------------------------------

    def _init_blocking(self) -> bool:
        if self._handles is not None:
            return True
        if self._unavailable:
            return False
        try:
            import pynvml
        except ImportError:
            logger.debug("pynvml not installed: no GPU samples")
            self._unavailable = True
            return False
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            logger.debug("NVML unavailable (%s): no GPU samples", e)
            self._unavailable = True
            return False
        try:
            self._handles = self._resolve_handles(pynvml)
        except pynvml.NVMLError as e:
            logger.warning("NVML device lookup failed (%s): no GPU samples", e)
            self._unavailable = True
            pynvml.nvmlShutdown()
            return False
        self._nvml = pynvml
        if self._handles:
            try:
                name = pynvml.nvmlDeviceGetName(self._handles[0])
                self._device_name = name.decode() if isinstance(name, bytes) else str(name)
            except pynvml.NVMLError as e:
                logger.debug("NVML device name unavailable: %s", e)
        return True

    def _resolve_handles(self, pynvml: Any) -> tuple[Any, ...]:
        if self._visible is None:
            return tuple(
                pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
            )
        handles = []
        for dev in self._visible:
            if dev.isdigit():
                handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(dev)))
            else:
                handles.append(pynvml.nvmlDeviceGetHandleByUUID(dev))
        return tuple(handles)

    def _sample_blocking(self) -> tuple[GpuSample, ...]:
        with self._lock:
            if not self._init_blocking():
                return ()
            nvml = self._nvml
            out: list[GpuSample] = []
            for pos, handle in enumerate(self._handles or ()):
                try:
                    util = nvml.nvmlDeviceGetUtilizationRates(handle)
                    mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                    try:
                        index = int(nvml.nvmlDeviceGetIndex(handle))
                    except nvml.NVMLError:  # MIG handles have no index of their own
                        index = pos
                except nvml.NVMLError as e:
                    # One flaky device (e.g. fallen off the bus) must not hide the others.
                    logger.debug("NVML sample of GPU %d failed: %s", pos, e)
                    continue
                out.append(
                    GpuSample(
                        index=index,
                        utilization=min(max(float(util.gpu) / 100.0, 0.0), 1.0),
                        memory_used_bytes=int(mem.used),
                        memory_total_bytes=int(mem.total),
                    )
                )
            return tuple(out)

    def _shutdown_blocking(self) -> None:
        with self._lock:
            if self._nvml is None:
                return
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError as e:
                logger.debug("nvmlShutdown failed: %s", e)
            self._nvml = None
            self._handles = None
