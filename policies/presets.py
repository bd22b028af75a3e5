"""Named pipelines. Each is a plain spec; `build_policy` turns it into objects.

| preset            | pipeline (after healthy, has_model, not_tried)       | idea |
|-------------------|------------------------------------------------------|------|
| round_robin       | picker round_robin                                   | even spread, blind to load |
| random            | picker random                                        | baseline |
| least_outstanding | scorer queue -> picker max                           | join the shortest queue |
| p2c               | filter sample(k=2) -> scorer queue -> picker max     | power of two choices |
| least_latency     | scorer latency -> picker max                         | earliest predicted completion |
| slo_priority      | deadline_filter, priority_headroom -> completion -> max | deadlines, priorities first |
| edge_first        | locality, delay_spill -> completion -> max           | own site first, hold, spill |
| compass           | warm_model -> max                                    | earliest finish, loads and moves counted |
| esg               | stage_budget -> warm_model -> max                    | each stage within its share of the SLO |
"""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.spec import PluginSpec


@dataclass(frozen=True)
class Preset:
    description: str
    picker: PluginSpec
    filters: list[PluginSpec] = field(default_factory=list)
    scorers: list[PluginSpec] = field(default_factory=list)


PRESETS: dict[str, Preset] = {
    "round_robin": Preset("cycle through capable nodes", PluginSpec(type="round_robin")),
    "random": Preset("uniform over capable nodes", PluginSpec(type="random")),
    "least_outstanding": Preset(
        "fewest outstanding requests per slot", PluginSpec(type="max"), scorers=[PluginSpec(type="queue")]
    ),
    "p2c": Preset(
        "power of two choices on queue plus in-flight",
        PluginSpec(type="max"),
        filters=[PluginSpec(type="sample", k=2)],
        scorers=[PluginSpec(type="queue")],
    ),
    "slo_priority": Preset(
        "deadline- and priority-aware: drop nodes predicted to miss the deadline at the request's priority "
        "(refusing low priority early with 429 when none fits; an optional load cap keeps it off busy nodes), "
        "then the earliest predicted completion at that priority, network RTT included",
        PluginSpec(type="max"),
        filters=[PluginSpec(type="deadline_filter"), PluginSpec(type="priority_headroom")],
        scorers=[PluginSpec(type="completion")],
    ),
    "edge_first": Preset(
        "the request's own site while it has room; when it has none, hold the request for a tuned delay "
        "for a local slot, then spill to the earliest predicted completion with the link RTT (at once if "
        "the site cannot meet the deadline)",
        PluginSpec(type="max"),
        filters=[PluginSpec(type="locality"), PluginSpec(type="delay_spill")],
        scorers=[PluginSpec(type="completion")],
    ),
    "compass": Preset(
        "earliest predicted finish with the model's load time counted where it is not resident "
        "(network RTT and the wait at the request's priority included) and the input's move where a "
        "workflow's previous stage ran elsewhere, so work goes where the model is warm and stages stay together",
        PluginSpec(type="max"),
        scorers=[PluginSpec(type="warm_model")],
    ),
    "esg": Preset(
        "workflow stages each placed within their own share of the end-to-end SLO (split along the "
        "critical path by the router): nodes predicted to finish the stage in its budget, load and input "
        "move counted, then the earliest finish among them; the best estimate when none fits",
        PluginSpec(type="max"),
        filters=[PluginSpec(type="stage_budget")],
        scorers=[PluginSpec(type="warm_model")],
    ),
    "least_latency": Preset(
        "earliest predicted completion from queue, EWMA and in-flight",
        PluginSpec(type="max"),
        scorers=[PluginSpec(type="latency")],
    ),
}
