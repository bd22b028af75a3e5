"""What a partition did to each site: a replay's figures for every link cut that lasts a while.

For each `cut_link` fault with a duration, per site: the requests that arrived during the cut, split by
whether the site's own nodes serve their model (`local`: a site cut off from the rest can still serve
them, and must) or not (`remote`: they need the WAN), each with its share answered within its deadline;
and after the heal, how soon a request that needs the WAN was answered in time again from each site
that was cut off (`spill_back_s`: seconds from the heal to the first such answer, by arrival).
"""

from __future__ import annotations

from typing import Any

from scenarios.spec.schema import Scenario
from scenarios.spec.workload import Result

AFTER_HEAL_S = 30.0  # how long after a heal the spill across the WAN is looked for


def _in_time(r: Result) -> bool:
    return r.status == 200 and r.latency_ms <= r.arrival.deadline_ms


def partitions(results: list[Result], scenario: Scenario) -> list[dict[str, Any]]:
    """One row per cut (see the module docstring); none for a scenario without cuts."""
    served: dict[str, set[str]] = {}
    for node in scenario.topology.nodes:
        served.setdefault(node.partition, set()).update(node.models)
    cuts = [f for f in scenario.faults if f.kind == "cut_link" and f.link is not None and f.duration_s]
    out = []
    for f in cuts:
        assert f.link is not None and f.duration_s is not None
        start, end = f.at_s, f.at_s + f.duration_s
        sites: dict[str, dict[str, Any]] = {}
        for site in scenario.topology.partitions:
            own = served.get(site, set())
            during = [r for r in results if r.arrival.site == site and start <= r.arrival.at_s < end]
            local = [r for r in during if r.arrival.model in own]
            remote = [r for r in during if r.arrival.model not in own]
            row: dict[str, Any] = {}
            for name, rs in (("local", local), ("remote", remote)):
                ok = sum(1 for r in rs if _in_time(r))
                row[name] = {"requests": len(rs), "in_time": round(ok / len(rs), 4) if rs else None}
            row["lost"] = sum(1 for r in during if r.status is None)
            if site in f.link:  # a site this cut separated from another: when does the WAN serve it again
                after = sorted(
                    (r.arrival.at_s for r in results
                     if r.arrival.site == site and r.arrival.model not in own
                     and end <= r.arrival.at_s < end + AFTER_HEAL_S and _in_time(r)),
                )  # fmt: skip
                row["spill_back_s"] = round(after[0] - end, 3) if after else None
            sites[site] = row
        out.append({"link": list(f.link), "from_s": start, "to_s": end, "sites": sites})
    return out
