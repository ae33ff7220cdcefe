"""GPU telemetry: NVML figures per device when NVML is present, CPU/memory figures otherwise.

Pure module (no Django): the worker daemon samples it into heartbeats, the bench prints it. It never
raises: a machine without NVML (or without a GPU) gets `{"nvml": False, "reason": ...}` plus
psutil's CPU and memory figures.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class DeviceSample:
    index: int
    name: str
    utilization_pct: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    power_w: float | None
    temperature_c: float | None


def _host_figures() -> dict[str, Any]:
    try:
        import psutil

        memory = psutil.virtual_memory()
        return {
            "cpu_count": psutil.cpu_count(logical=True),
            "cpu_percent": psutil.cpu_percent(interval=None),
            "load_average": list(psutil.getloadavg()),
            "memory_used_bytes": int(memory.total - memory.available),
            "memory_total_bytes": int(memory.total),
        }
    except Exception as exc:  # psutil missing or a restricted /proc: still report something
        return {"error": f"{type(exc).__name__}: {exc}"}


def _nvml_devices(pynvml: Any) -> list[DeviceSample]:
    def read(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except pynvml.NVMLError:
            return None  # this counter is not supported on this device (e.g. power on some SKUs)

    samples = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = read(pynvml.nvmlDeviceGetName, handle)
        util = read(pynvml.nvmlDeviceGetUtilizationRates, handle)
        memory = read(pynvml.nvmlDeviceGetMemoryInfo, handle)
        power_mw = read(pynvml.nvmlDeviceGetPowerUsage, handle)
        temperature = read(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU)
        samples.append(
            DeviceSample(
                index=index,
                name=name.decode() if isinstance(name, bytes) else str(name),
                utilization_pct=float(util.gpu) if util is not None else None,
                memory_used_bytes=int(memory.used) if memory is not None else None,
                memory_total_bytes=int(memory.total) if memory is not None else None,
                power_w=power_mw / 1000.0 if power_mw is not None else None,
                temperature_c=float(temperature) if temperature is not None else None,
            )
        )
    return samples


def sample() -> dict[str, Any]:
    """One telemetry sample: {"nvml": bool, "devices": [...], "host": {...}, "reason"?: str, "at": epoch s}."""
    result: dict[str, Any] = {"at": time.time(), "host": _host_figures(), "devices": []}
    try:
        import pynvml
    except Exception as exc:
        result.update(nvml=False, reason=f"nvidia-ml-py is not importable: {exc}")
        return result
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        result.update(nvml=False, reason=f"NVML did not initialise (no NVIDIA driver/GPU?): {exc}")
        return result
    try:
        result["devices"] = [asdict(d) for d in _nvml_devices(pynvml)]
        result["nvml"] = True
    except Exception as exc:
        result.update(nvml=False, reason=f"NVML query failed: {exc}")
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return result
