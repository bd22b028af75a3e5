"""Shape-stable batching (issue: CUDA runs whose batch differs from the last one's are slow): a batch
runs padded with zero rows to its bucket, and the real rows' outputs are those of the unpadded run.
On the CPU (these tests) the same code runs with buckets set explicitly; by default the CPU keeps
exact sizes and CUDA uses powers of two up to max_batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from nodes.config import ModelSpec
from nodes.runtime import load_model

FP32_ZOO = ["echo", "sensor_mlp", "mobilenet_s", "resnet_s", "tiny_transformer", "detector_head"]


def test_default_buckets_are_powers_of_two_on_cuda_and_exact_sizes_on_the_cpu() -> None:
    spec = ModelSpec(name="m", max_batch=12)
    assert spec.buckets_for("cuda") == (1, 2, 4, 8, 12)
    assert spec.buckets_for("cpu") == ()
    assert ModelSpec(name="m", max_batch=1).buckets_for("cuda") == ()
    assert ModelSpec(name="m", max_batch=8, batch_buckets=[]).buckets_for("cuda") == ()
    assert ModelSpec(name="m", max_batch=8, batch_buckets=[4, 8]).buckets_for("cpu") == (4, 8)
    for bad in ([8, 4], [0, 8], [4, 4, 8], [2, 4]):  # unordered, zero, repeated, not holding max_batch
        with pytest.raises(ValidationError, match="batch_buckets"):
            ModelSpec(name="m", max_batch=8, batch_buckets=bad)


@pytest.mark.parametrize("name", FP32_ZOO)
def test_padded_runs_answer_the_real_rows_as_unpadded_runs_do(name: str, tmp_path: Path) -> None:
    exact = load_model(ModelSpec(name=name, max_batch=8, batch_buckets=[]), ["CPUExecutionProvider"], 1, str(tmp_path))
    padded = load_model(
        ModelSpec(name=name, max_batch=8, batch_buckets=[1, 4, 8]), ["CPUExecutionProvider"], 1, str(tmp_path)
    )
    assert exact.buckets == () and padded.buckets == (1, 4, 8)
    assert set(padded.ewma_ms) >= {1, 4, 8}, "every bucket warmed and timed at load"
    rng = np.random.default_rng(7)
    for rows in (1, 2, 3, 5, 8):
        feeds = {
            s.name: rng.random([rows if i == 0 else d for i, d in enumerate(s.shape)]).astype(np.float32)
            for s in exact.inputs.values()
        }
        want, _ = exact.run(feeds, 1.0, rows)
        got, _ = padded.run(feeds, 1.0, rows)
        assert set(got) == set(want)
        for k in want:
            assert got[k].shape == want[k].shape, (k, rows)
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=f"{name} {k} at {rows} rows")
    assert padded.bucket(3) == 4 and padded.bucket(8) == 8 and padded.bucket(9) == 9, "past the largest: exact"
    assert padded.predicted_ms(3, 1.0) == padded.predicted_ms(4, 1.0), "three rows cost what four do"
