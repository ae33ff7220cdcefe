from __future__ import annotations

import json
import sys
import types

from gpu import telemetry


def test_without_nvml_reports_host_figures_and_a_reason(monkeypatch):
    fake = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def fail():
        raise NVMLError("Driver Not Loaded")

    fake.NVMLError = NVMLError
    fake.nvmlInit = fail
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    result = telemetry.sample()
    assert result["nvml"] is False
    assert "Driver Not Loaded" in result["reason"]
    assert result["devices"] == []
    assert result["host"]["memory_total_bytes"] > 0
    json.dumps(result)


def test_with_nvml_reports_each_device_and_tolerates_missing_counters(monkeypatch):
    fake = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def unsupported(handle):
        raise NVMLError("Not Supported")

    fake.NVMLError = NVMLError
    fake.NVML_TEMPERATURE_GPU = 0
    fake.nvmlInit = lambda: None
    fake.nvmlShutdown = lambda: None
    fake.nvmlDeviceGetCount = lambda: 2
    fake.nvmlDeviceGetHandleByIndex = lambda i: i
    fake.nvmlDeviceGetName = lambda h: b"NVIDIA H100"
    fake.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=40 + h)
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=10, total=80)
    fake.nvmlDeviceGetPowerUsage = unsupported
    fake.nvmlDeviceGetTemperature = lambda h, kind: 61
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    result = telemetry.sample()
    assert result["nvml"] is True
    assert [d["utilization_pct"] for d in result["devices"]] == [40.0, 41.0]
    assert result["devices"][0]["name"] == "NVIDIA H100"
    assert result["devices"][0]["power_w"] is None
    assert result["devices"][1]["temperature_c"] == 61.0


def test_real_sample_never_raises():
    result = telemetry.sample()
    assert isinstance(result["nvml"], bool)
    assert result["nvml"] or result["reason"]


def test_an_nvml_query_failure_is_reported_not_raised(monkeypatch):
    fake = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def lost():
        raise NVMLError("GPU is lost")

    fake.NVMLError = NVMLError
    fake.nvmlInit = lambda: None
    fake.nvmlShutdown = lambda: None
    fake.nvmlDeviceGetCount = lost
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    result = telemetry.sample()
    assert result["nvml"] is False and "GPU is lost" in result["reason"]
