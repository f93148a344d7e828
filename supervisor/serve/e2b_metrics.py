"""E2B's ``SandboxMetric`` (``GET /sandboxes/{id}/metrics``) from a sample of the
supervisor's metrics: CPU as the supervisor measures the VM, memory and disk as the
guest reports them (``memCache`` is not measured: 0)."""

from __future__ import annotations

import datetime
from typing import Any


def e2b_metrics(sample: Any, cpu_count: int) -> dict[str, Any]:
    """``sample``: the supervisor's MetricsResponse (its timestamp in unix ns)."""
    seconds = sample.timestamp // 1_000_000_000
    stamp = datetime.datetime.fromtimestamp(sample.timestamp / 1e9, datetime.UTC)
    total = int(sample.memory_total_bytes)
    return {
        "timestamp": stamp.isoformat().replace("+00:00", "Z"),
        "timestampUnix": seconds,
        "cpuCount": cpu_count,
        "cpuUsedPct": round(float(sample.cpu_percent), 2),
        "memUsed": max(total - int(sample.memory_available_bytes), 0),
        "memTotal": total,
        "memCache": 0,
        "diskUsed": int(sample.root_used_bytes),
        "diskTotal": int(sample.root_used_bytes) + int(sample.root_free_bytes),
    }
