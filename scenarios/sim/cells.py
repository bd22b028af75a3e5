"""Where a batch of independent simulations runs ("cells": a sweep's (count, seed, policy), a search's
configurations, a replay's candidate policies): in this process, on a local process pool, or as Ray
tasks on a cluster.

Every cell is a seeded simulation that depends on nothing but its arguments, so where it runs changes
nothing in its result: the results come back in the cells' order, the same bit for bit whichever
runner ran them (tests/unit/test_cells.py runs one sweep on all three). With Ray, cells are submitted
as tasks (`num_cpus=1` each) and their results taken as they finish (`ray.wait`), each finished one
counted on a progress line, so a long sweep shows where it is; a cell that raises fails the batch with
its error, after the cells still running are cancelled.

`ray`: None (local), `"local"` (a Ray instance started here with `jobs` CPUs, or every core, stopped
after the batch), `"auto"` (the running cluster `ray start` made on this machine, else a local
instance as with `"local"`), or a cluster's address (`HOST:PORT`, `ray://HOST:10001`), to which this
checkout's packages are shipped (`runtime_env.py_modules`) so its workers run the same code. Ray is an
optional extra (`pip install 'edgeroute[ray]'`); asking for it without it installed is a one-line
error (`RayMissing`).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

C = TypeVar("C")
R = TypeVar("R")

PACKAGES = ("policies", "router", "nodes", "scenarios", "telemetry")  # what a remote cluster's workers need


class RayMissing(RuntimeError):
    """Ray was asked for but is not installed."""


def run_cells(
    fn: Callable[[C], R],
    cells: Sequence[C],
    jobs: int = 0,
    ray: str | None = None,
    label: str = "cells",
    chunksize: int = 1,
) -> list[R]:
    """`fn(cell)` for every cell, in the cells' order: on Ray when `ray` says where (module docstring),
    else serially with `jobs` 1, else on a pool of `jobs` processes (0: one per core). `fn` must be a
    module-level function (it is pickled by reference). Pool workers are spawned, never forked, so no
    lock or thread of this process is copied into them."""
    if ray is not None:
        return _on_ray(fn, cells, jobs, ray, label)
    workers = min(len(cells), jobs if jobs > 0 else (os.cpu_count() or 1))
    if workers <= 1:
        return [fn(c) for c in cells]
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(fn, cells, chunksize=chunksize))


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RayMissing("Ray is not installed: pip install 'edgeroute[ray]' (or run without --ray)") from None
    return ray


def _connect(ray: Any, where: str, jobs: int) -> bool:
    """Connect to (or start) the cluster `where` names; True when this call started it (stop it after)."""
    if ray.is_initialized():
        return False
    quiet = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    cpus = jobs if jobs > 0 else (os.cpu_count() or 1)
    if where == "local":
        ray.init(num_cpus=cpus, **quiet)
        return True
    if where == "auto":
        try:
            ray.init(address="auto", **quiet)
        except ConnectionError:  # (no cluster running on this machine: start one, as "local" does)
            ray.init(num_cpus=cpus, **quiet)
        return True
    here = Path(__file__).resolve().parents[2]
    modules = [str(here / p) for p in PACKAGES if (here / p).is_dir()]
    ray.init(address=where, runtime_env={"py_modules": modules}, **quiet)
    return True


def _on_ray(fn: Callable[[C], R], cells: Sequence[C], jobs: int, where: str, label: str) -> list[R]:
    ray = _import_ray()
    started = _connect(ray, where, jobs)
    try:
        task = ray.remote(num_cpus=1, max_retries=0)(fn)
        refs = [task.remote(c) for c in cells]
        index = {ref: i for i, ref in enumerate(refs)}
        out: list[Any] = [None] * len(refs)
        pending = list(refs)
        t0 = time.monotonic()
        done = 0
        try:
            while pending:
                finished, pending = ray.wait(pending, num_returns=1, timeout=None)
                for ref in finished:
                    out[index[ref]] = ray.get(ref)
                    done += 1
                _progress(label, done, len(refs), time.monotonic() - t0)
        except BaseException:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
        finally:
            if refs and sys.stderr.isatty():
                print(file=sys.stderr)
        return out
    finally:
        if started:
            ray.shutdown()


def _progress(label: str, done: int, total: int, elapsed_s: float) -> None:
    """One line that says how far the batch is (rewritten in place on a terminal, a line per tenth
    elsewhere)."""
    width = 30
    filled = int(width * done / total) if total else width
    line = f"{label}: [{'#' * filled}{'.' * (width - filled)}] {done}/{total} on Ray, {elapsed_s:.0f} s"
    if sys.stderr.isatty():
        print(f"\r{line}", end="", file=sys.stderr, flush=True)
    elif done == total or done % max(1, total // 10) == 0:
        print(line, file=sys.stderr, flush=True)
