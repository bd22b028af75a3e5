"""`edgeroute bench overload`: the router itself the bottleneck, offered more than it can process
(twice its capacity by default, `--offer`).

A stack whose nodes have room (two nodes of the trivial `echo` model, two slots each) and one router
with its saturation rule on (router.lifecycle.saturation). For each door (HTTP; MQTT through Mosquitto
where it is installed), a load generator of its own process (scenarios.bench.loadgen: one event loop
that spends a tenth of what a stock client does per request, so that on a small machine the router, not
the generator, is what runs out of CPU) first finds the router's capacity: a closed loop of critical
requests (never shed for the router's lag) at concurrency 32; the answers a second are the capacity,
the router's CPU over them its cost a request. Then it offers `offer` times that capacity, open loop at
random (Poisson) moments, a mix of critical, bulk and sheddable requests (`MIX`) with one deadline, and
counts per class what was answered in time, refused, answered late and lost (no answer `GRACE_S` past
the deadline). Over HTTP the devices hold `CONNECTIONS` keep-alive connections, one request at a time
each; a request that never got one is counted apart as unsent. Over HTTP the same offer also goes to a
second router of this checkout with the rule off, beside it: what the rule buys.

The simulator runs the same offers with the router as one core (scenarios.sim.routercpu): a request
takes the time the live router took one at its capacity, a refusal the fraction of it that the
router's CPU under the offer says. Goodput is the requests answered in time a second, against the
measured capacity. A refusal still costs the router its door's work (reading the request, writing
the 503): with a refusal costing a fraction `f` of a routed request, at `offer` times the capacity
at most `(1 - offer f) / (1 - f)` of it can be answered, which the table gives beside the figures.
Everything shares one machine, so the figures are ratios within the run, and whether a run measured
the router at all is said beside it: the cores the router and the load generator used while the offer
ran (`router_cores`, `loadgen_cores`) and how far the generator fell behind its schedule. A run where
the generator used `LOADGEN_BOUND` of a core or more, or fell more than a deadline behind at p99, was
bound by the generator (one Python process: a stock client spends about what the router does on each
request), and its figures say nothing of the router. A benchmark: it prints and writes JSON, and
asserts nothing.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from scenarios.bench.common import process_cpu_s, result, save
from scenarios.bench.router import _baseline_router
from scenarios.spec.schema import Scenario
from scenarios.stack.broker import terminate
from scenarios.stack.launcher import Stack
from scenarios.stack.mosquitto import Mosquitto, mosquitto_binary

MIX = {2: 0.1, 0: 0.3, -1: 0.6}  # priority -> share of the offer: critical, bulk, sheddable
DEADLINE_MS = 200.0
GRACE_S = 5.0  # past its deadline, a request with no answer is lost
CONCURRENCY = 32  # the capacity's closed loop
DEVICES = 8  # MQTT clients of the load generator (one connection each)
LOADGEN_BOUND = 0.75  # of a core: a run whose load generator used more was bound by it
CONNECTIONS = 256  # HTTP: the devices' keep-alive connections (a request waits for its device's to be free)
BODY = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]}]})


def _children_cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _load(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run the load generator with `cfg`; its summary, with the CPU it used (`cpu_s`)."""
    limit = cfg["seconds"] + cfg["deadline_ms"] / 1000.0 + cfg["grace_s"] + 60
    cpu0 = _children_cpu_s()
    proc = subprocess.run(
        [sys.executable, "-m", "scenarios.bench.loadgen", json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=limit,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        summary: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(f"the load generator failed: {proc.stderr[-800:]}") from None
    summary["cpu_s"] = _children_cpu_s() - cpu0
    return summary


def _cores(cpu_s: float, load: dict[str, Any]) -> float:
    """Cores used over the load's sending (CPU seconds over its wall time)."""
    return round(cpu_s / load["wall_s"], 2) if load.get("wall_s") else 0.0


def _scenario(router: dict[str, Any], rate: float = 1.0, seconds: float = 20.0, cpu: Any = None) -> Scenario:
    """The stack (and, with `cpu` = (us per routed, us per refused), the simulated run)."""
    topology: dict[str, Any] = {
        "partitions": ["edge-a"],
        "nodes": [
            {"id": f"room-{i}", "partition": "edge-a", "slots": 2, "max_queue": 1024, "models": ["echo"]}
            for i in range(2)
        ],
    }
    if cpu is not None:
        topology["routers"] = [{"id": "router", "cpu_us_per_request": cpu[0], "cpu_us_per_refusal": cpu[1]}]
    site = {"site": "edge-a", "rate_rps": rate, "models": {"echo": 1}, "priorities": MIX,
            "deadline_ms": dict.fromkeys(MIX, DEADLINE_MS)}  # fmt: skip
    return Scenario.model_validate(
        {
            "name": "bench-overload",
            "topology": topology,
            "workload": {"duration_s": seconds, "max_requests": 2_000_000, "sites": [site]},
            "router": router,
            "policies": ["p2c"],
        }
    )


def _figures(load: dict[str, Any], capacity: float, seconds: float) -> dict[str, Any]:
    """Per class and over all: in time, refused, late, lost; goodput against the capacity."""
    classes, in_time, sent, lost, unsent = {}, 0, 0, 0, 0
    for prio, t in load["classes"].items():
        ok = t["statuses"].get("200", 0)
        classes[prio] = {
            "sent": t["sent"],
            "in_time_pct": round(100.0 * t["in_time"] / t["sent"], 2) if t["sent"] else None,
            "refused": sum(n for s, n in t["statuses"].items() if s != "200"),
            "late": ok - t["in_time"],
            "lost": t["lost"],
            "unsent": t.get("unsent", 0),
            "p50_ms": t.get("p50_ms"),
            "p99_ms": t.get("p99_ms"),
        }
        in_time, sent, lost = in_time + t["in_time"], sent + t["sent"], lost + t["lost"]
        unsent += t.get("unsent", 0)
    goodput = in_time / seconds
    return {
        "classes": classes,
        "sent": sent,
        "lost": lost,
        "unsent": unsent,
        "goodput_rps": round(goodput, 1),
        "goodput_vs_capacity": round(goodput / capacity, 3) if capacity else None,
        "critical_in_time_pct": classes[str(max(MIX))]["in_time_pct"],
        "behind_p99_ms": round(load.get("behind_p99_ms", 0.0), 1),
    }


def _rule_counts(stack: Stack) -> tuple[int, int] | None:
    """The stack's router's saturation refusals so far, and those of them made early (router.early),
    from its admin view; None where it cannot be read."""
    request = urllib.request.Request(f"{stack.router_url}/admin/view", headers=stack.admin_headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            rule = json.loads(answer.read())["overload"]["saturation"]
        return int(rule["refused"]), int(rule.get("refused_early", 0))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _simulated(
    router: dict[str, Any], capacity: float, seconds: float, cpu: tuple[float, float], offer: float
) -> dict[str, Any]:
    """`offer` times `capacity` offered in the simulator, the router one core at the measured CPU."""
    from scenarios.sim import DEFAULT_PROFILE, Profile, simulate
    from scenarios.spec.workload import build_schedule

    scenario = _scenario(router, offer * capacity, seconds, cpu)
    schedule = build_schedule(scenario.workload, 1)
    profile = Profile.from_json(json.loads(DEFAULT_PROFILE.read_text()))
    results = simulate(scenario, scenario.policies, profile, schedule)["p2c"][0]
    tally: dict[str, dict[str, Any]] = {str(p): {"sent": 0, "in_time": 0, "statuses": {}, "lost": 0} for p in MIX}
    for r in results:
        t = tally[str(r.arrival.priority)]
        t["sent"] += 1
        t["statuses"][str(r.status)] = t["statuses"].get(str(r.status), 0) + 1
        t["in_time"] += r.status == 200 and r.latency_ms <= r.arrival.deadline_ms
    return _figures({"classes": tally}, capacity, seconds)


def bench_overload(
    out_dir: Path, seconds: float = 20.0, capacity_s: float = 8.0, kafka: str | None = None, offer: float = 2.0
) -> dict[str, Any]:
    """Each door's capacity, then `offer` times it offered, live and simulated (module docstring)."""
    broker = Mosquitto(devices={f"load-{i}": f"pw-{i}-{time.monotonic_ns()}" for i in range(DEVICES)}).start() \
        if mosquitto_binary() is not None else None  # fmt: skip
    router: dict[str, Any] = {"default_deadline_ms": DEADLINE_MS}
    if broker is not None:
        router["mqtt"] = broker.router_config()
    doors: list[dict[str, Any]] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with Stack(_scenario(router), kafka=kafka) as stack:
            assert stack.router is not None
            here = Path(__file__).resolve().parents[2]
            off_proc, off_url = _baseline_router(stack, here, {"saturation": {"enabled": False}, "mqtt": None}, "off")
            procs.append(off_proc)
            base: dict[str, Any] = {"mix": MIX, "deadline_ms": DEADLINE_MS, "grace_s": GRACE_S, "body": BODY,
                                    "connections": CONNECTIONS}  # fmt: skip
            targets: list[tuple[str, dict[str, Any], int]] = [
                ("http", {"door": "http", "url": stack.router_url}, stack.router.popen.pid)
            ]
            if broker is not None:
                host, port = broker.url.split("://")[1].split(":")
                mq = {"host": host, "port": int(port), "prefix": "edgeroute", "accounts": list(broker.devices.items())}
                targets.append(("mqtt", {"door": "mqtt", "mqtt": mq}, stack.router.popen.pid))
                time.sleep(2.0)  # (the door subscribed)
            for door, where, pid in targets:
                cap_cfg = {**base, **where, "mode": "closed", "concurrency": CONCURRENCY, "seconds": capacity_s,
                           "rate": 1.0, "seed": 1, "mix": {2: 1.0}}  # fmt: skip
                cpu0 = process_cpu_s(pid) or 0.0
                cap = _load(cap_cfg)
                cpu_cap = (process_cpu_s(pid) or 0.0) - cpu0
                answered = sum(t["statuses"].get("200", 0) for t in cap["classes"].values())
                capacity = answered / cap["wall_s"]
                per_routed = cpu_cap * 1e6 / max(1, answered)
                row: dict[str, Any] = {"door": door, "capacity_rps": round(capacity, 1),
                                       "cpu_us_per_routed": round(per_routed, 1),
                                       "capacity_router_cores": _cores(cpu_cap, cap),
                                       "capacity_loadgen_cores": _cores(cap["cpu_s"], cap)}  # fmt: skip
                print(f"  {door}: capacity {capacity:.0f} req/s at {per_routed:.0f} us of router CPU each (router "
                      f"{row['capacity_router_cores']} of a core, load generator {row['capacity_loadgen_cores']})",
                      flush=True)  # fmt: skip
                runs = [("on", where, pid)]
                if door == "http":
                    runs.append(("off", {"door": "http", "url": off_url}, off_proc.pid))
                for name, to, run_pid in runs:
                    time.sleep(1.0)
                    cfg = {**base, **to, "mode": "open", "rate": offer * capacity, "seconds": seconds, "seed": 7}
                    cpu0 = process_cpu_s(run_pid) or 0.0
                    rule0 = _rule_counts(stack) if name == "on" else None
                    load = _load(cfg)
                    spent = (process_cpu_s(run_pid) or 0.0) - cpu0
                    fig = _figures(load, capacity, seconds)
                    rule1 = _rule_counts(stack) if name == "on" else None
                    if rule0 is not None and rule1 is not None:  # the rule's refusals, and those made early
                        fig["rule_refused"] = rule1[0] - rule0[0]
                        fig["rule_refused_early"] = rule1[1] - rule0[1]
                    fig["router_cores"], fig["loadgen_cores"] = _cores(spent, load), _cores(load["cpu_s"], load)
                    fig["loadgen_bound"] = fig["loadgen_cores"] >= LOADGEN_BOUND or fig["behind_p99_ms"] > DEADLINE_MS
                    routed = sum(t["statuses"].get("200", 0) for t in load["classes"].values())
                    refused = fig["sent"] - routed - fig["lost"] - fig["unsent"]
                    if refused > 0:
                        fig["cpu_us_per_refusal"] = round(max(1.0, spent * 1e6 - routed * per_routed) / refused, 1)
                    row[f"live_{name}"] = fig
                    early = (f", the rule refused {fig['rule_refused']}, {fig['rule_refused_early']} of them early"
                             if "rule_refused" in fig else "")  # fmt: skip
                    print(f"    live, rule {name}: critical {fig['critical_in_time_pct']}% in time, goodput "
                          f"{fig['goodput_vs_capacity']}x capacity, lost {fig['lost']} (router {fig['router_cores']} "
                          f"of a core, load generator {fig['loadgen_cores']}){early}", flush=True)  # fmt: skip
                doors.append(row)
    finally:
        for proc in procs:
            terminate(proc)
        if broker is not None:
            broker.stop()
    for row in doors:
        refusal = row["live_on"].get("cpu_us_per_refusal")
        # nothing refused, nothing to measure a refusal by: the sim takes one as a third of a request (the
        # closed-loop 404s measured 0.33-0.47), and the row says it was assumed
        row["refusal_assumed"] = refusal is None
        refusal = refusal or row["cpu_us_per_routed"] / 3
        f = refusal / row["cpu_us_per_routed"]
        row["refusal_vs_routed_cpu"] = round(f, 3)
        # serving A and refusing the rest of `offer` x C: A + f (offer C - A) <= C
        row["goodput_bound_vs_capacity"] = round(min(1.0, max(0.0, (1 - offer * f) / (1 - f))), 3) if f < 1 else 0.0
        # the simulated router's core: the time the live router took a request at its capacity (with its
        # share of a machine it shares with the nodes and the load: on a small box less than a core),
        # and a refusal the fraction of that its CPU says
        per = 1e6 / row["capacity_rps"] if row["capacity_rps"] else row["cpu_us_per_routed"]
        cpu = (per, per * f)
        row["sim_us_per_routed"], row["sim_us_per_refusal"] = round(cpu[0], 1), round(cpu[1], 1)
        capacity = row["capacity_rps"]  # the same offer as live, against the same capacity
        row["sim_on"] = _simulated({"default_deadline_ms": DEADLINE_MS}, capacity, seconds, cpu, offer)
        if "live_off" in row:
            row["sim_off"] = _simulated({"default_deadline_ms": DEADLINE_MS, "saturation": {"enabled": False}},
                                        capacity, seconds, cpu, offer)  # fmt: skip
    doc = result("overload", offer=offer, mix=MIX, deadline_ms=DEADLINE_MS, seconds=seconds, doors=doors)
    lines = [f"{offer:g}x the router's capacity for {seconds:g} s, critical {MIX[2]:.0%} / bulk {MIX[0]:.0%} / "
             f"sheddable {MIX[-1]:.0%}, deadline {DEADLINE_MS:g} ms:"]  # fmt: skip
    head = ("door", "run", "critical", "bulk", "shed", "goodput", "lost", "unsent")
    lines.append("  {:<5} {:<9} {:>9} {:>7} {:>7} {:>8} {:>5} {:>6}".format(*head))
    for row in doors:
        for key in ("live_on", "sim_on", "live_off", "sim_off"):
            if key not in row:
                continue
            fig = row[key]
            c = fig["classes"]
            lines.append(
                f"  {row['door']:<5} {key.replace('_', ' '):<9} {c['2']['in_time_pct']:>8}% "
                f"{c['0']['in_time_pct']:>6}% {c['-1']['in_time_pct']:>6}% {fig['goodput_vs_capacity']:>7}x "
                f"{fig['lost']:>5} {fig['unsent']:>6}"
            )
        lines.append(
            f"  {row['door']}: capacity {row['capacity_rps']} req/s; router CPU {row['cpu_us_per_routed']} us a routed "
            f"request, a refusal {row['refusal_vs_routed_cpu']}x that"
            f"{' (assumed: nothing was refused)' if row['refusal_assumed'] else ''}: at {offer:g}x at most "
            f"{row['goodput_bound_vs_capacity']}x the capacity can be answered"
        )
        for key in ("live_on", "live_off"):
            run = row.get(key)
            if run is not None and run["loadgen_bound"]:
                lines.append(
                    f"  {row['door']} {key.replace('_', ' ')}: bound by the load generator, which used "
                    f"{run['loadgen_cores']} of a core and fell {run['behind_p99_ms']} ms behind its schedule "
                    f"at p99 (the router {run['router_cores']}): these figures say nothing of the router"
                )
    if broker is None:
        lines.append("  mqtt: not measured (Mosquitto is not installed: apt install mosquitto)")
    save(out_dir, doc, lines)
    return doc
