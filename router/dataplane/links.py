"""Emulated WAN links in the native data plane: the proxy waits out the link from the request's site
on the answer of a node across it, as the router's own emulation would have (router.lifecycle.links:
each way `rtt_ms / 2` plus |N(0, jitter_ms / 2)|, and with probability `loss` a retransmission of
`max(200 ms, 2 x rtt)`), with HAProxy's Lua: the doors take the request's site as the router's intake
does (`txn.lsite`: named, else the key's, else the router's own), the backends look `<site>|<server>`
up in `links.map` (router.dataplane.runtime.link_map) and the action below sleeps, yielding, for both
ways. The router sends the request at once and the delay falls on the answer, so the node sees it a
one-way delay earlier than through the router; the simulator models the proxy the same way. Nodes
across a cut link from a site router's own site are out of rotation; a central router's requests from
a site at an end of a cut link go to the router (router.dataplane.plan)."""

from __future__ import annotations

__all__ = ["LINK_ACTION", "LINK_LUA"]

LINK_ACTION = "edgeroute_link"

LINK_LUA = """-- edgeroute: an emulated WAN link's delay on the answer of a node across it (router.dataplane.links)
local function way(rtt, jitter, loss)
  local d = rtt / 2
  if jitter > 0 then
    local u1, u2 = math.random(), math.random()
    if u1 < 1e-12 then u1 = 1e-12 end
    d = d + math.abs(math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)) * jitter / 2
  end
  if loss > 0 and math.random() < loss then d = d + math.max(200, 2 * rtt) end
  return d
end

core.register_action("edgeroute_link", { "http-res" }, function(txn)
  local v = txn:get_var("txn.lk")
  if v == nil then return end
  local rtt, jitter, loss = string.match(v, "^([%d.e+-]+),([%d.e+-]+),([%d.e+-]+)$")
  rtt, jitter, loss = tonumber(rtt), tonumber(jitter), tonumber(loss)
  if rtt == nil or jitter == nil or loss == nil or rtt < 0 or rtt > 60000 then return end
  local ms = way(rtt, jitter, loss) + way(rtt, jitter, loss)
  if ms >= 1 then core.msleep(math.floor(ms + 0.5)) end
end)
"""
