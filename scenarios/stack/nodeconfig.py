"""What a live node process is started with: its config from a scenario's node spec (with the reference
execution times the speed emulation stretches by), and how many node processes this machine holds."""

from __future__ import annotations

import json
import os
from typing import Any

from scenarios.sim.profile import DEFAULT_PROFILE
from scenarios.spec.schema import ModelEntry, NodeSpec

NODE_PROCESS_MB = 150  # one live node process with a few zoo models (about 100 MB measured with one)


def live_node_limit() -> tuple[int, str]:
    """How many node processes a live stack may start here, and why: `EDGEROUTE_MAX_LIVE_NODES`, else
    the memory available (Linux) over `NODE_PROCESS_MB`, at least 4 (64 where it cannot be read)."""
    env = os.environ.get("EDGEROUTE_MAX_LIVE_NODES", "").strip()
    if env.isdigit():
        return int(env), "EDGEROUTE_MAX_LIVE_NODES"
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        available_mb = int(fields["MemAvailable"].split()[0]) // 1024
    except (OSError, KeyError, ValueError):
        return 64, "memory unknown"
    return max(4, available_mb // NODE_PROCESS_MB), f"{available_mb:,} MB available, ~{NODE_PROCESS_MB} MB a node"


def profile_baselines() -> dict[str, dict[int, float]]:
    """Per-model reference execution times by batch size from the default profile (idle medians)."""
    try:
        doc = json.loads(DEFAULT_PROFILE.read_text())
        return {m: {int(b): float(q[50]) for b, q in e["exec_ms"].items()} for m, e in doc["models"].items()}
    except (OSError, ValueError, KeyError):
        return {}


def _model_config(
    spec: NodeSpec, model: str, seed: int, baselines: dict[str, Any] | None, entry: ModelEntry | None
) -> dict[str, Any]:
    out: dict[str, Any] = {"name": model, "seed": seed}
    if entry is not None:
        out.update(entry.node_fields())
    curve = (baselines or {}).get(out.get("zoo", model))
    if curve:
        slower = entry.slower if entry is not None else 1.0  # (a slower version: its reference times stretched)
        out["baseline_ms"] = curve[1] * slower
        out["baseline_ms_by_batch"] = {b: ms * slower for b, ms in curve.items() if b != 1}
    batch = spec.batching.get(model)
    if batch is not None:
        out.update(
            max_batch=batch.max_batch, max_queue_delay_ms=batch.max_queue_delay_ms, preferred_batch=batch.preferred
        )
    return out


def node_config(
    spec: NodeSpec,
    port: int,
    kafka: str,
    seed: int,
    extra: dict[str, Any] | None = None,
    baselines: dict[str, dict[int, float]] | None = None,
    catalogue: dict[str, ModelEntry] | None = None,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "node_id": spec.id,
        "partition": spec.partition,
        "tier": spec.tier,
        "port": port,
        "device": spec.device,
        "slots": spec.slots,
        "max_queue": spec.max_queue,
        "speed": spec.speed,
        "inline_max_ms": spec.inline_max_ms,
        "memory_budget_bytes": spec.memory_budget_mb << 20,
        "kafka": kafka,
        "scheduler": spec.scheduler,
        "change_threshold": spec.change_threshold,
        "high_priority_min": spec.high_priority_min,
        "max_block_ms": spec.max_block_ms,
        "queue_limits": spec.queue_limits,
        "admit_by_deadline": spec.admit_by_deadline,
        "queue_target_ms": spec.queue_target_ms,
        "queue_interval_ms": spec.queue_interval_ms,
        "models": [_model_config(spec, m, seed, baselines, (catalogue or {}).get(m)) for m in spec.models],
    }
    if spec.model_repository is not None:  # the node serves the names it holds from there (nodes.repository)
        cfg["model_repository"] = spec.model_repository
    cfg.update(extra or {})
    return cfg


__all__ = ["NODE_PROCESS_MB", "live_node_limit", "node_config", "profile_baselines"]
