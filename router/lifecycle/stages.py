"""Workflow stages: their config (`workflows:` of the router config) and, as the router and the simulator
both plan and run them, which stages may start (`StageProgress`: each as soon as its own inputs are
ready), which later stages take a stage's output (and how many bytes of crops), and a stage's expected
time from telemetry (for the SLO split)."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies.budgets import WorkflowError, split_budget
from telemetry.cluster.view import ClusterView


class CropSpec(BaseModel):
    """A model input made of crops of an image around detected boxes (normalised x1, y1, x2, y2)."""

    model_config = ConfigDict(extra="forbid")

    crop: str = Field(description="the image: a workflow input or STAGE.OUTPUT, shape [1, C, H, W]")
    boxes: str = Field(description="STAGE.OUTPUT of shape [1, K, 4]")
    scores: str = Field(description="STAGE.OUTPUT of shape [1, K]")
    min_score: float = Field(0.5, ge=0, le=1)
    max_crops: int = Field(8, ge=1, le=256)
    size: int = Field(64, ge=1, le=4096)

    @property
    def refs(self) -> list[str]:
        return [self.crop, self.boxes, self.scores]

    def crop_bytes(self, pixel_bytes: int = 12) -> int:
        """Bytes of the batch of crops at most: `max_crops` of `size` x `size` pixels (12: 3 x FP32)."""
        return self.max_crops * self.size * self.size * pixel_bytes


class StageSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_\-]+$")
    model: str = Field(min_length=1)
    inputs: dict[str, str | CropSpec] = Field(min_length=1, description="model input -> source")

    def refs(self) -> list[str]:
        out: list[str] = []
        for src in self.inputs.values():
            out.extend(src.refs if isinstance(src, CropSpec) else [src])
        return out


class WorkflowSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    slo_ms: float = Field(gt=0, description="deadline of a job that gives none")
    inputs: list[str] = Field(min_length=1)
    stages: list[StageSpec] = Field(min_length=1)
    outputs: list[str] | None = None

    @model_validator(mode="after")
    def _check(self) -> WorkflowSpec:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError("stage names must be unique")
        if set(names) & set(self.inputs):
            raise ValueError("a stage and a workflow input share a name")
        for stage in self.stages:
            for ref in stage.refs():
                _check_ref(ref, self.inputs, names, f"stage {stage.name}")
        for ref in self.outputs or []:
            if ref.split(".", 1)[0] not in names or "." not in ref:
                raise ValueError(f"output {ref!r} must be STAGE.OUTPUT of a stage of this workflow")
        try:
            split_budget(self.slo_ms, {n: 1.0 for n in names}, self.edges())
        except WorkflowError as exc:
            raise ValueError(str(exc)) from None
        return self

    def edges(self) -> list[tuple[str, str]]:
        return sorted({(ref.split(".", 1)[0], s.name) for s in self.stages for ref in s.refs() if "." in ref})

    def sinks(self) -> list[str]:
        feeding = {a for a, _ in self.edges()}
        return [s.name for s in self.stages if s.name not in feeding]


def _check_ref(ref: str, inputs: list[str], stages: list[str], where: str) -> None:
    if "." in ref:
        stage = ref.split(".", 1)[0]
        if stage not in stages:
            raise ValueError(f"{where}: {ref!r} names no stage of this workflow")
    elif ref not in inputs:
        raise ValueError(f"{where}: {ref!r} is neither a workflow input nor STAGE.OUTPUT")


def downstream(
    spec: WorkflowSpec, stage: str, pixel_bytes: Callable[[str], int] = lambda ref: 12
) -> tuple[tuple[str, ...], int]:
    """The models of the stages that take `stage`'s output, and the bytes of crops they will take from
    it (`max_crops` crops of `size` x `size` pixels of `pixel_bytes(image ref)` bytes each; other
    tensors are not known before the stage runs)."""
    models: list[str] = []
    nbytes = 0
    for st in spec.stages:
        uses = False
        for src in st.inputs.values():
            refs = src.refs if isinstance(src, CropSpec) else [src]
            if any(r.split(".", 1)[0] == stage for r in refs if "." in r):
                uses = True
                if isinstance(src, CropSpec):
                    nbytes += src.crop_bytes(pixel_bytes(src.crop))
        if uses:
            models.append(st.model)
    return tuple(models), nbytes


class StageProgress:
    """One workflow job's stages as a DAG, as the router and the simulator both run it: a stage starts as
    soon as its own predecessors have answered (not when a whole wave of stages has), and the job ends at
    its first failed stage or when its last stage answers. `preds`: each stage's predecessors (what
    `WorkflowSpec.edges` gives), computed once per workflow."""

    __slots__ = ("answered_ok", "failed", "pending", "preds", "running", "stages")

    def __init__(self, spec: WorkflowSpec, preds: dict[str, set[str]]) -> None:
        self.stages = spec.stages
        self.preds = preds
        self.pending = {st.name for st in spec.stages}
        self.running = 0
        self.answered_ok: set[str] = set()
        self.failed = False

    def startable(self) -> list[StageSpec]:
        """The stages that may start now (their predecessors all answered), in the workflow's order;
        each is counted as running from here."""
        if self.failed:
            return []
        ready = [st for st in self.stages if st.name in self.pending and self.preds[st.name] <= self.answered_ok]
        for st in ready:
            self.pending.discard(st.name)
        self.running += len(ready)
        return ready

    def answered(self, stage: str, ok: bool) -> None:
        """A stage's answer came: a success lets its successors start; a failure ends the job."""
        self.running -= 1
        if ok:
            self.answered_ok.add(stage)
        else:
            self.failed = True

    @property
    def finished(self) -> bool:
        return self.failed or (not self.pending and self.running == 0)


def stage_predecessors(spec: WorkflowSpec) -> dict[str, set[str]]:
    """Each stage's predecessors (the stages whose outputs it takes)."""
    edges = spec.edges()
    return {st.name: {a for a, b in edges if b == st.name} for st in spec.stages}


def expected_stage_ms(view: ClusterView, model: str, default_ms: float = 5.0) -> float:
    """The median of the serving nodes' EWMA at batch 1 (telemetry), else `default_ms`."""
    seen = sorted(
        ms
        for n in view.serving(model)
        if (m := n.model(model)) is not None and (ms := m.ewma_ms(1)) is not None and ms > 0
    )
    return seen[len(seen) // 2] if seen else default_ms
