"""`t5r plan` for GPU slices: the tiny T5 compiled for H100s by XLA's GPU compiler on this CPU host.

The project's environment has no CUDA plugin, so here the GPU slice notation, the target
description, the roofline and the refusal that names the install command are checked; the plan
itself runs in a subprocess of an environment that has the plugin (`GPU_PLAN_PYTHON`, by default
`../venvs/gpuplan` beside the repository, built as docs/pods.md says), and is skipped without one.
"""

from __future__ import annotations

import json
import os
import subprocess

import jax
import jax.numpy as jnp
import pytest
from conftest import run_plan

from t5_retrieval.errors import ConfigError
from t5_retrieval.plan import chips, gpu, programs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_PLAN_PYTHON = os.environ.get("GPU_PLAN_PYTHON",
                                 os.path.join(os.path.dirname(REPO), "venvs", "gpuplan", "bin", "python"))
TINY = ["--gin_file=models/t5_tiny.gin", "--gin_file=runs/base.gin",
        "--gin.MIXTURE_OR_TASK_NAME=['demo_fever', 'demo_trex']", "--gin.QUERY_LEN=16", "--gin.PASSAGE_LEN=32",
        "--gin.VOCAB_SIZE=512", "--gin.D_MODEL=32", "--gin.D_FF=64", "--gin.NUM_LAYERS=1", "--gin.NUM_NEGATIVES=1",
        "--gin.PER_DEVICE_BATCH=2", "--gin.T5Config.scan_layers=False", "--gin.DROPOUT=0.0",
        "--gin_file=sharding/fsdp.gin"]
CUDNN = ["--gin.ATTENTION_IMPL='cudnn'", "--gin.DTYPE='bfloat16'"]  # cuDNN's fused attention takes bf16


def test_a_gpu_slice_is_gpus_per_host_times_hosts():
    assert gpu.parse_topology("h100:8x2") == (gpu.GPUS["h100"], 8, 2)
    assert gpu.parse_topology("a100:4") == (gpu.GPUS["a100"], 4, 1)
    assert gpu.is_gpu_topology("h200:8") and not gpu.is_gpu_topology("v5e:2x2")
    for bad in ("h100:", "h100:0", "h100:8x2x1", "h100:x8", "h100:eight"):
        with pytest.raises(ConfigError, match=r"<gpu>:<GPUs per host>\[x<hosts>\] .* e\.g\. h100:8") as e:
            gpu.parse_topology(bad)
        assert "\n" not in str(e.value)


def test_an_unknown_topology_names_the_tpu_and_the_gpu_forms():
    with pytest.raises(ConfigError) as e:
        chips.parse_topology("b200:8")
    for name in [*chips.CHIPS, *gpu.GPUS]:
        assert name in str(e.value), f"{name} missing from: {e.value}"


def test_the_target_description_states_the_chip_to_xla():
    h100 = gpu.target_config(gpu.GPUS["h100"])
    fields = dict(line.strip().split(": ", 1) for line in h100.splitlines() if ": " in line and "{" not in line)
    assert fields["core_count"] == "132" and fields["clock_rate_ghz"] == "1.98"
    assert fields["memory_bandwidth"] == str(3_350_000_000_000)
    assert fields["device_memory_size"] == str(81_559 * 1024 ** 2)
    assert fields["device_description_str"] == '"NVIDIA H100 80GB HBM3"' and fields["platform_name"] == '"CUDA"'
    assert "cuda_compute_capability { major: 9 minor: 0 }" in h100
    assert "cuda_compute_capability { major: 8 minor: 0 }" in gpu.target_config(gpu.GPUS["a100"])
    assert h100.count("{") == h100.count("}")


@pytest.mark.skipif(gpu.has_cuda_plugin(),
                    reason="this environment has jax's CUDA plugin")
def test_without_the_cuda_plugin_a_gpu_plan_is_refused_with_the_install_command():
    code, out, err = run_plan("--topology=h100:8", *TINY)
    assert code == 2 and out == ""
    assert err.strip() == ("t5r plan: error: --topology=h100:8: planning for GPUs compiles with jax's CUDA plugin, "
                           f'which is not installed: pip install "jax-cuda12-plugin=={jax.__version__}" '
                           '"nvidia-cuda-nvcc-cu12==12.9.86"'), err


def test_the_roofline_is_the_programs_flops_at_peak_or_its_bytes_at_bandwidth():
    m, k, n = 256, 512, 128
    compiled = jax.jit(lambda a, b: a @ b).lower(jax.ShapeDtypeStruct((m, k), jnp.float32),
                                                 jax.ShapeDtypeStruct((k, n), jnp.float32)).compile()
    costs = gpu.program_costs(compiled)
    assert costs["flops"] == 2 * m * k * n, costs
    assert costs["bytes accessed"] == 4 * (m * k + k * n + m * n), costs
    h100 = gpu.GPUS["h100"]
    roofline = gpu.roofline(compiled, h100)
    assert roofline["optimal_seconds"] == pytest.approx(costs["bytes accessed"] / 3.35e12)  # 64 FLOP/byte < 295
    assert roofline["roofline_bound"] == "memory"
    assert gpu.cost_analysis(compiled) is None, "a CPU program is no GPU's"
    assert programs.CompiledProgram.read(compiled).cost == (compiled.cost_analysis() or {}), "the CPU's own analysis stays"


def test_cudnn_attention_kernels_are_priced_by_their_matmuls():
    # as XLA:GPU compiles T5's encoder attention over [64, 32, 4, 16] queries and keys (operands abridged)
    forward = ('%fwd.4 = (bf16[64,4,32,16]{3,1,2,0}, u8[0]{0}) custom-call(%b.20, %b.21, %b.22, %f.1), '
               'custom_call_target="__cudnn$fmhaScaleBiasSoftmax", operand_layout_constraints={bf16[64,32,4,16]'
               '{3,2,1,0}, bf16[64,32,4,16]{3,2,1,0}, bf16[64,32,4,16]{3,2,1,0}, bf16[64,4,32,32]{3,2,1,0}}, '
               'api_version=API_VERSION_STATUS_RETURNING')
    backward = forward.replace("fmhaScaleBiasSoftmax", "fmhaScaleBiasSoftmaxBackward")
    matmul = 2.0 * 64 * 32 * 4 * 16 * 32
    assert gpu.cudnn_attention_flops(forward) == 2 * matmul
    assert gpu.cudnn_attention_flops(f"{forward}\n{backward}") == 7 * matmul


def test_a_step_beyond_what_jax_preallocates_names_the_fraction_that_fits(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    hbm = gpu.GPUS["h100"].memory_bytes
    report = {"steps": {"train": {"fits": True, "memory_per_device": {"peak": int(0.85 * hbm), "hbm": hbm}},
                        "encode": {"fits": True, "memory_per_device": {"peak": int(0.5 * hbm), "hbm": hbm}}}}
    (line,) = gpu.problems(report)
    assert line.startswith("train step: needs 67.7 GiB per device, more than the 75% of 79.6 GiB JAX preallocates")
    assert line.endswith("XLA_PYTHON_CLIENT_MEM_FRACTION=0.87"), line
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert gpu.problems(report) == []


@pytest.fixture(scope="module")
def h100_plan() -> dict:
    """The tiny T5, with cuDNN's fused attention, planned for two hosts of two H100s by the environment
    with the CUDA plugin (and cuDNN, which jax's cuDNN attention asks for its version)."""
    if not os.path.exists(GPU_PLAN_PYTHON):
        pytest.skip(f"no environment with jax's CUDA plugin at {GPU_PLAN_PYTHON} (docs/pods.md: GPU slices)")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    proc = subprocess.run([GPU_PLAN_PYTHON, "-m", "t5_retrieval.cli", "plan", "--topology=h100:2x2", *TINY,
                           *CUDNN, "--json"], capture_output=True, text=True, cwd=REPO, env=env, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_the_tiny_t5_plans_for_h100_hosts_with_memory_against_hbm_and_a_roofline_time(h100_plan):
    assert h100_plan["devices"] == 4 and h100_plan["mesh"] == {"data": 4, "model": 1}
    assert h100_plan["chip"]["name"] == "NVIDIA H100 80GB HBM3"
    assert h100_plan["chip"]["hbm_bytes_per_device"] == gpu.GPUS["h100"].memory_bytes
    assert h100_plan["compiler"]["jax-cuda12-plugin"] == jax.__version__
    assert h100_plan["compiler"]["estimate"] == gpu.ESTIMATE
    for name, step in h100_plan["steps"].items():
        memory = step["memory_per_device"]
        assert step["fits"] and 0 < memory["peak"] < memory["hbm"] == gpu.GPUS["h100"].memory_bytes, (name, memory)
        assert memory["params"] > 0 and memory["temporaries"] > 0, (name, memory)
        flops, seconds = step["compiler_flops_per_device"], step["estimated_step_seconds"]
        # the roofline's time is at least the program's FLOPs at peak, and the program does the model's matmuls
        assert seconds >= flops / gpu.GPUS["h100"].peak_bf16_flops > 0, (name, step)
        # the program's FLOPs are the model's matmuls and its elementwise work, the attention kernels' included
        # (XLA's count without them: 0.70 of the model's matmuls in the encode step)
        ratio = flops * h100_plan["devices"] / step["model_matmul_flops"]
        assert 0.8 < ratio < 1.25, (name, flops, step["model_matmul_flops"])
    train = h100_plan["steps"]["train"]
    assert train["collectives"].get("all-gather", {}).get("count", 0) > 0, "fsdp gathers the parameters"
