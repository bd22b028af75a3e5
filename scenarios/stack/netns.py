"""Real partitions on one machine: a network namespace per site, joined by veth links.

Each site of a scenario gets a namespace with its own address (on its loopback: 10.78.R.i), a veth
pair to every other site (the WAN: a /30 each, from 10.77.R.0/24, with a route to the other site's
address), and an access link from the machine itself (10.79.R.4i/30), which the site's clients (the
replay's load generator) and the stack's own calls use and no WAN cut touches. A cut takes the WAN pair
between two sites down: packets are dropped, so connects and requests time out as across a real
partition, for every protocol (HTTP, gRPC, Kafka) alike; a heal brings it up and puts the routes back.

Needs root and iproute2 (`available()` says why not, in one line). Names and addresses derive from the
process id and a free /24 of this machine; `destroy()` deletes every namespace it made (its veths go
with them), also after a failure. Link delay and jitter stay emulated by the routers: these machines
have no `tc netem`.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from itertools import combinations

log = logging.getLogger("edgeroute.netns")

IP = "ip"


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([IP, *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip() or out.returncode}")
    return out


def available() -> str | None:
    """None where namespaces can be made here; else why not, in one line."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which(IP) is None:
        return "no iproute2 (ip)"
    name = f"erprobe{os.getpid()}"
    made = _run("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()[:200]}"
    _run("netns", "del", name, check=False)
    return None


def _free_block() -> int:
    """R in 20..219 such that this machine holds no address in 10.79.R.0/24 (another run's)."""
    used = _run("-4", "-o", "addr", "show").stdout
    start = 20 + os.getpid() % 200
    for k in range(200):
        r = 20 + (start - 20 + k) % 200
        if f" 10.79.{r}." not in used:
            return r
    raise RuntimeError("no free address block for the site namespaces")


class SiteNetwork:
    """The namespaces, links and addresses of one stack's sites (see the module docstring)."""

    def __init__(self, sites: list[str]) -> None:
        if len(sites) > 60:
            raise ValueError("at most 60 sites in namespaces")
        self.sites = list(sites)
        self.pid = os.getpid()
        self.block = _free_block()
        self.made: list[str] = []
        self._pairs = list(combinations(range(len(self.sites)), 2))
        self._cut: set[frozenset[str]] = set()

    def namespace(self, site: str) -> str:
        return f"er{self.pid}-{self.sites.index(site)}"

    def address(self, site: str) -> str:
        """The site's own address (its processes bind it; others reach it across the WAN)."""
        return f"10.78.{self.block}.{self.sites.index(site) + 1}"

    def exec_prefix(self, site: str) -> list[str]:
        """The command prefix that runs a program in the site's namespace."""
        return [IP, "netns", "exec", self.namespace(site)]

    def _wan(self, i: int, j: int) -> tuple[str, str]:
        """The addresses of the i-j WAN link: i's end, j's end (a /30 each, from 10.77.R.0/24)."""
        k = self._pairs.index((min(i, j), max(i, j)))
        lo, hi = f"10.77.{self.block}.{4 * k + 1}", f"10.77.{self.block}.{4 * k + 2}"
        return (lo, hi) if i < j else (hi, lo)

    def create(self) -> SiteNetwork:
        try:
            for i, site in enumerate(self.sites):
                ns = self.namespace(site)
                _run("netns", "del", ns, check=False)  # a leftover of a run that died with this pid
                _run("netns", "add", ns)
                self.made.append(ns)
                _run("-n", ns, "link", "set", "lo", "up")
                _run("-n", ns, "addr", "add", f"{self.address(site)}/32", "dev", "lo")
                # the access link from this machine: the site's clients and the stack's own calls
                host_end = self._host_end(i)
                _run("link", "del", host_end, check=False)  # (as the namespace above)
                _run("link", "add", host_end, "type", "veth", "peer", "name", "acc", "netns", ns)
                _run("addr", "add", f"10.79.{self.block}.{4 * i + 1}/30", "dev", host_end)
                _run("link", "set", host_end, "up")
                _run("-n", ns, "addr", "add", f"10.79.{self.block}.{4 * i + 2}/30", "dev", "acc")
                _run("-n", ns, "link", "set", "acc", "up")
                _run("route", "add", f"{self.address(site)}/32", "via", f"10.79.{self.block}.{4 * i + 2}")
            for i, j in self._pairs:
                a, b = self.namespace(self.sites[i]), self.namespace(self.sites[j])
                _run("-n", a, "link", "add", f"wan{j}", "type", "veth", "peer", "name", f"wan{i}", "netns", b)
                ai, bj = self._wan(i, j)
                _run("-n", a, "addr", "add", f"{ai}/30", "dev", f"wan{j}")
                _run("-n", b, "addr", "add", f"{bj}/30", "dev", f"wan{i}")
                _run("-n", a, "link", "set", f"wan{j}", "up")
                _run("-n", b, "link", "set", f"wan{i}", "up")
                self._routes(i, j)
        except BaseException:
            self.destroy()
            raise
        return self

    def _routes(self, i: int, j: int) -> None:
        """Each end's route to the other site's address over their WAN link (put back after a heal)."""
        for x, y in ((i, j), (j, i)):
            _, there = self._wan(x, y)
            ns = self.namespace(self.sites[x])
            src = self.address(self.sites[x])
            _run("-n", ns, "route", "replace", f"{self.address(self.sites[y])}/32", "via", there, "src", src)

    def cut(self, a: str, b: str, cut: bool) -> None:
        """Cut (or heal) the WAN link between sites `a` and `b`."""
        i, j = self.sites.index(a), self.sites.index(b)
        ns = self.namespace(self.sites[j])
        _run("-n", ns, "link", "set", f"wan{i}", "down" if cut else "up")
        pair = frozenset((a, b))
        if cut:
            self._cut.add(pair)
        else:
            self._cut.discard(pair)
            self._routes(min(i, j), max(i, j))  # (the end set down lost its route)

    def heal_all(self) -> None:
        for pair in list(self._cut):
            a, b = sorted(pair)
            self.cut(a, b, False)

    def _host_end(self, i: int) -> str:
        """The machine's end of site i's access link."""
        return f"era{self.pid % 100000}x{i}"

    def destroy(self) -> None:
        """Delete every namespace made and the machine's ends of their access links (the kernel drops
        those with their namespace, but not before the next stack of this process may want the names)."""
        for i in range(len(self.made)):
            _run("link", "del", self._host_end(i), check=False)
        for ns in self.made:
            out = _run("netns", "del", ns, check=False)
            if out.returncode != 0:
                log.warning("could not delete namespace %s: %s", ns, out.stderr.strip())
        self.made = []
