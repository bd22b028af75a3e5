"""Workflow stages: their config (`workflows:` of the router config) and, as the router and the simulator
both plan them, which later stages take a stage's
output (and how many bytes of crops), and a stage's expected time from telemetry (for the SLO split)."""

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


def expected_stage_ms(view: ClusterView, model: str, default_ms: float = 5.0) -> float:
    """The median of the serving nodes' EWMA at batch 1 (telemetry), else `default_ms`."""
    seen = sorted(
        ms
        for n in view.serving(model)
        if (m := n.model(model)) is not None and (ms := m.ewma_ms(1)) is not None and ms > 0
    )
    return seen[len(seen) // 2] if seen else default_ms
