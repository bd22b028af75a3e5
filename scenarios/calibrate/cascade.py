"""What a cascade's first model makes of the payloads a replay sends it: which of them it is unsure of,
read by running the model (ONNX Runtime, the zoo's file with the weights the live nodes build) on the
very tensors the live load sends
(scenarios.stack.loadgen.example_arrays, the same seeds), and their size on the wire. The simulator
then escalates the same requests the live router does (scenarios.sim.cascades.CascadeProfile)."""

from __future__ import annotations

import logging
from typing import Any

from scenarios.sim.cascades import CascadeProfile
from scenarios.spec.schema import Scenario
from scenarios.stack.loadgen import CASCADE_VARIANTS, example_arrays, example_payload
from telemetry.oip import wire

log = logging.getLogger("edgeroute.replay")


def _metadata(session: Any) -> dict[str, Any]:
    """A model's OIP metadata as a node would answer it, from its ONNX Runtime session."""
    return {
        "inputs": [
            {
                "name": i.name,
                "datatype": wire.ORT_TO_OIP.get(i.type, "FP32"),
                "shape": [d if isinstance(d, int) and d > 0 else -1 for d in i.shape],
            }
            for i in session.get_inputs()
        ]
    }


def cascade_profiles(scenario: Scenario) -> dict[str, CascadeProfile]:
    """Each cascade's profile (scenario.seed + k for the k-th payload, as the live load's); a cascade
    whose first model is not a zoo model, or where ONNX Runtime is missing, keeps the simulator's
    default (every second request unsure), said in the log."""
    out: dict[str, CascadeProfile] = {}
    specs = scenario.cascade_specs()
    if not specs:
        return out
    try:
        import onnxruntime as ort

        from nodes import zoo
    except ImportError:
        log.warning("cascades: ONNX Runtime is not installed; the simulator guesses every second answer unsure")
        return out
    for spec in specs:
        arch = scenario.architecture(spec.first)
        if arch not in zoo.ZOO:
            log.warning("cascade %s: %s is not a zoo model; the simulator guesses", spec.name, spec.first)
            continue
        entry = scenario.models.get(spec.first)  # the weights the live nodes build (their seed: the scenario's)
        seed = entry.seed if entry is not None and entry.seed is not None else scenario.seed
        session = ort.InferenceSession(str(zoo.ensure(arch, seed)), providers=["CPUExecutionProvider"])
        meta = _metadata(session)
        names = [o.name for o in session.get_outputs()]
        if spec.rule.output not in names:
            log.warning("cascade %s: %s has no output %s", spec.name, spec.first, spec.rule.output)
            continue
        unsure = []
        sizes = []
        for k in range(CASCADE_VARIANTS):
            arrays = example_arrays(meta, scenario.seed + k)
            got = dict(zip(names, session.run(None, arrays), strict=True))[spec.rule.output]
            unsure.append(spec.rule.unsure([float(v) for v in got.reshape(got.shape[0], -1)[0]]))
            sizes.append(len(example_payload(meta, scenario.seed + k).body))
        out[spec.name] = CascadeProfile(tuple(unsure), round(sum(sizes) / len(sizes)))
    return out


__all__ = ["cascade_profiles"]
