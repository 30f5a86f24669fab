"""Sharded training on 8 forced CPU devices equals the single-device computation, per layout.

The multi-device part runs in a subprocess so that XLA_FLAGS never leaks into other tests.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from process_harness import jax_env

from t5_retrieval import sharding

SCRIPT = os.path.join(os.path.dirname(__file__), "multidevice", "sharding_check.py")


@pytest.fixture(scope="module")
def report():
    proc = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, env=jax_env(8), timeout=900)
    assert proc.returncode == 0, f"8-device check failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


@pytest.mark.parametrize("layout", sorted(sharding.LAYOUTS))
def test_sharded_train_step_equals_single_device(report, layout):
    r = report[layout]
    np.testing.assert_allclose(r["losses"], r["ref_losses"], rtol=1e-5,
                               err_msg=f"{layout}: per-task losses (cross-device in-batch negatives) differ "
                                       f"from the 1-device computation")
    assert r["param_max_abs_diff_after_step"] <= 1e-5, (
        f"{layout}: one SGD step (= the gradient) differs from 1-device by {r['param_max_abs_diff_after_step']:.3g}")
    assert r["param_sharding_kept"], f"{layout}: the train step changed a parameter's sharding"


def test_short_attention_kernels_sharded_over_batch_and_heads_equal_the_single_device_xla_step(report):
    """'pallas_tpu_short' on 8 devices (batch over 'data', heads over 'model'; the kernels in
    interpret mode, each on its shard) gives the update of the 1-device step on the XLA path: the
    relative position bias's gradient is summed over the batch's shards."""
    r = report["fsdp_tensor_parallel"]  # sharding_check.SHORT_ATTENTION_LAYOUT
    np.testing.assert_allclose(r["short_attention_losses"], r["ref_losses"], rtol=1e-5)
    assert r["short_attention_param_max_abs_diff_after_step"] <= 1e-5, r["short_attention_param_max_abs_diff_after_step"]


@pytest.mark.parametrize("layout", ["data_parallel", "fsdp_tensor_parallel"])  # sharding_check.PER_TASK_LAYOUTS
def test_sharded_per_task_step_equals_single_device_naive_step(report, layout):
    r = report[layout]
    np.testing.assert_allclose(r["per_task_losses"], r["ref_losses"], rtol=1e-5,
                               err_msg=f"{layout}: the per-task (scanned) losses differ from the 1-device ones")
    assert r["per_task_param_max_abs_diff_after_step"] <= 1e-5, (
        f"{layout}: the summed per-task gradients differ from the 1-device gradient by "
        f"{r['per_task_param_max_abs_diff_after_step']:.3g}")


def test_a_per_task_step_can_gather_the_parameters_once(report):
    """`gathered_passes` under FSDP: the same step (losses, update, shardings), with the parameters
    gathered once instead of in every task's forward and backward pass."""
    r = report["fsdp"]
    np.testing.assert_allclose(r["gathered_losses"], r["ref_losses"], rtol=1e-5)
    assert r["gathered_param_max_abs_diff_after_step"] <= 1e-5, r["gathered_param_max_abs_diff_after_step"]
    assert r["gathered_sharding_kept"]
    gathers = r["all_gathers"]
    assert 0 < gathers["once"] < gathers["per_pass"], gathers


def test_under_bfloat16_compute_the_gathered_copy_is_bfloat16(report):
    """With bfloat16 activations the passes read the bfloat16 copy the network computes with, and
    the step is the one whose passes gather the float32 weights themselves, up to bfloat16 rounding;
    the parameters stay float32. (XLA:CPU gathers bfloat16 as float32; test_plan checks the bytes
    for TPU.)"""
    r = report["fsdp"]
    np.testing.assert_allclose(r["bf16_losses"]["once"], r["bf16_losses"]["per_pass"], rtol=1e-2)
    assert r["bf16_gathered_vs_per_pass_max_abs_diff"] <= 1e-2, r["bf16_gathered_vs_per_pass_max_abs_diff"]
    assert r["gathered_dtypes_kept"]


EXPECTED_SPECS = {
    # name: (embedding [vocab, embed], wi_0 [embed, mlp], query [embed, heads, kv])
    # (PartitionSpecs without trailing Nones)
    "data_parallel": ([], [], []),
    "fsdp": ([None, "data"], ["data"], ["data"]),
    "tensor_parallel": (["model"], [None, "model"], [None, "model"]),
    "fsdp_tensor_parallel": (["model", "data"], ["data", "model"], ["data", "model"]),
}


@pytest.mark.parametrize("layout", sorted(EXPECTED_SPECS))
def test_parameters_and_batches_land_with_the_layouts_shardings(report, layout):
    specs = report[layout]["specs"]
    embedding, wi_0, query = EXPECTED_SPECS[layout]
    got = (specs["embedding"], specs["wi_0"], specs["query"])
    assert got == (embedding, wi_0, query), f"{layout}: expected {(embedding, wi_0, query)}, got {got}"
    assert specs["batch"][0] == "data", f"{layout}: batch not sharded over 'data': {specs['batch']}"
    assert report[layout]["momentum_spec"] == wi_0, (
        f"{layout}: optimiser moments should be sharded like their parameter {wi_0}, got {report[layout]['momentum_spec']}")
