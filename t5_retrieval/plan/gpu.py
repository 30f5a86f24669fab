"""GPU slices for `t5r plan`: the chips, the target description XLA's GPU compiler takes, and a roofline time.

A GPU slice is written `<gpu>:<GPUs per host>[x<hosts>]`: `h100:8` is one host of eight H100s,
`h100:8x4` four such hosts (32 devices, one per GPU); `--num_slices` repeats it. jax's CUDA plugin
describes such a slice without a GPU (`jax.experimental.topologies.get_topology_desc(platform="cuda")`)
from a `GpuTargetConfigProto` (`target_config`), and XLA's GPU compiler then compiles for it on any
host, given `ptxas` (PTX to GPU code; the `nvidia-cuda-nvcc-cu12` wheel has it). The compiled
program's memory analysis is the compiler's own; its time is not: XLA:GPU gives no cost analysis of
a compiled program (`Compiled.cost_analysis()` is None), so `roofline` prices it from its FLOPs and
bytes at the chip's peak bf16 rate and HBM bandwidth.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import math
import os
import re
import shutil
import subprocess
from typing import Any

import jax

from t5_retrieval.errors import ConfigError, UserError
from t5_retrieval.plan.chips import GIB, Chip

MIB = 1024 ** 2
PLUGIN = "jax-cuda12-plugin"
PTXAS_WHEEL = "nvidia-cuda-nvcc-cu12==12.9.86"  # the ptxas the GPU plans were compiled with
# JAX on a GPU preallocates this fraction of the device's memory for its programs unless
# XLA_PYTHON_CLIENT_MEM_FRACTION (or XLA_PYTHON_CLIENT_PREALLOCATE=false) says otherwise.
JAX_DEFAULT_MEM_FRACTION = 0.75
ESTIMATE = ("roofline: the compiled program's FLOPs at the GPU's peak bf16 rate or its bytes at HBM bandwidth, "
            "whichever is longer (XLA's GPU compiler gives no estimate); collectives unpriced")


@dataclasses.dataclass(frozen=True)
class Gpu:
    """A GPU as `t5r plan` describes it to XLA, and what it is judged against."""

    name: str                   # the device kind JAX reports for a described device
    memory_bytes: int           # the device memory CUDA reports for the card
    peak_bf16_flops: float      # dense (no sparsity) bf16 tensor-core FLOP/s
    hbm_bytes_per_second: float
    sms: int
    boost_ghz: float
    l2_bytes: int
    shared_per_sm: int          # bytes of shared memory per SM; a block may opt into 1 KiB less
    fp32_per_sm: int
    compute_capability: tuple[int, int]
    source: str

    def chip(self) -> Chip:
        return Chip(self.name, self.memory_bytes, self.peak_bf16_flops, self.source, accelerator_type="")


# The SXM parts. FLOP/s, bandwidth, SMs, clocks and L2 from NVIDIA's data sheets (H100 and H200
# Tensor Core GPU data sheets, A100 80GB data sheet) and the Hopper and Ampere architecture white
# papers; shared memory, registers and thread limits from the CUDA C++ Programming Guide's table of
# compute capabilities 8.0 and 9.0; memory as CUDA reports it for the card (nvidia-smi: 81,559 MiB for
# the H100 80GB, 143,771 MiB for the H200, 81,920 MiB for the A100 80GB).
GPUS: dict[str, Gpu] = {
    "h100": Gpu("NVIDIA H100 80GB HBM3", 81_559 * MIB, 989.4e12, 3.35e12, 132, 1.98, 50 * MIB, 228 * 1024, 128,
                (9, 0), "NVIDIA H100 Tensor Core GPU data sheet (SXM5)"),
    "h200": Gpu("NVIDIA H200", 143_771 * MIB, 989.4e12, 4.8e12, 132, 1.98, 50 * MIB, 228 * 1024, 128, (9, 0),
                "NVIDIA H200 Tensor Core GPU data sheet (SXM)"),
    "a100": Gpu("NVIDIA A100-SXM4-80GB", 81_920 * MIB, 312e12, 2.039e12, 108, 1.41, 40 * MIB, 164 * 1024, 64, (8, 0),
                "NVIDIA A100 80GB PCIe/SXM data sheet (SXM4)"),
}
# The cuDNN and CUDA runtime the description claims: the oldest cuDNN jax's CUDA plugin accepts, and
# the CUDA of PTXAS_WHEEL.
CUDNN = (9, 8, 0)
CUDA_RUNTIME = (12, 9, 0)


def target_config(gpu: Gpu) -> str:
    """`gpu` as XLA's `stream_executor.GpuTargetConfigProto`, in protobuf text format."""
    major, minor = gpu.compute_capability
    device = {
        "threads_per_block_limit": 1024, "threads_per_warp": 32, "shared_memory_per_block": 48 * 1024,
        "shared_memory_per_core": gpu.shared_per_sm, "threads_per_core_limit": 2048, "core_count": gpu.sms,
        "fpus_per_core": gpu.fp32_per_sm, "block_dim_limit_x": 2 ** 31 - 1, "block_dim_limit_y": 65535,
        "block_dim_limit_z": 65535, "memory_bandwidth": int(gpu.hbm_bytes_per_second), "l2_cache_size": gpu.l2_bytes,
        "clock_rate_ghz": gpu.boost_ghz, "device_memory_size": gpu.memory_bytes,
        "shared_memory_per_block_optin": gpu.shared_per_sm - 1024, "registers_per_core_limit": 65536,
        "registers_per_block_limit": 65536,
    }
    lines = ["gpu_device_info {", *(f"  {k}: {v}" for k, v in device.items()),
             f"  cuda_compute_capability {{ major: {major} minor: {minor} }}", "}",
             'platform_name: "CUDA"',
             "dnn_version_info {{ major: {} minor: {} patch: {} }}".format(*CUDNN),
             "runtime_version {{ major: {} minor: {} patch: {} }}".format(*CUDA_RUNTIME),
             f'device_description_str: "{gpu.name}"']
    return "\n".join(lines) + "\n"


def is_gpu_topology(name: str) -> bool:
    return name.partition(":")[0] in GPUS


def parse_topology(name: str) -> tuple[Gpu, int, int]:
    """'h100:8x2' -> (the H100, 8 GPUs per host, 2 hosts); a ConfigError naming the form otherwise."""
    kind, _, dims = name.partition(":")
    sizes = dims.split("x") if dims else []
    if kind not in GPUS or not 1 <= len(sizes) <= 2 or not all(s.isdigit() and int(s) > 0 for s in sizes):
        raise ConfigError(f"--topology={name!r}: a GPU slice is <gpu>:<GPUs per host>[x<hosts>] with a gpu of "
                          f"{sorted(GPUS)}, e.g. h100:8 (one host of 8) or h100:8x2 (2 hosts of 8)")
    per_host, hosts = int(sizes[0]), int(sizes[1]) if len(sizes) > 1 else 1
    return GPUS[kind], per_host, hosts


def install_command() -> str:
    return f'pip install "{PLUGIN}=={jax.__version__}" "{PTXAS_WHEEL}"'


def _installed(module: str) -> bool:
    """Whether `module` ('package.sub') can be imported, without importing it."""
    parent = module.rpartition(".")[0]
    return (not parent or _installed(parent)) and importlib.util.find_spec(module) is not None


def has_cuda_plugin() -> bool:
    return _installed("jax_plugins.xla_cuda12")


def _has_ptxas() -> bool:
    """Whether XLA will find a ptxas: the nvcc wheel's, one on PATH or CUDA's default install."""
    return (_installed("nvidia.cuda_nvcc") or shutil.which("ptxas") is not None
            or os.path.exists("/usr/local/cuda/bin/ptxas"))


def describe(name: str, num_slices: int, per_tensorcore: bool = False) -> tuple[Chip, list[Any], int]:
    """(the chip, the devices of `num_slices` copies of GPU slice `name` as jax's CUDA plugin describes
    them without a GPU, the number of GPUs)."""
    gpu, per_host, hosts = parse_topology(name)
    if num_slices < 1:
        raise ConfigError(f"--num_slices={num_slices}: must be >= 1")
    if per_tensorcore:
        raise ConfigError(f"--per_tensorcore: only v4 chips can be planned per TensorCore; drop the flag for "
                          f"--topology={name}")
    if not has_cuda_plugin() or not _has_ptxas():
        missing = "jax's CUDA plugin" if not has_cuda_plugin() else "ptxas"
        raise UserError(f"--topology={name}: planning for GPUs compiles with {missing}, which is not installed: "
                        f"{install_command()}")
    # On a host without a GPU the plugin's check of the CUDA libraries against the driver fails
    # (cuInit error 303), and then it describes no topology; t5r's JAX_PLATFORMS=cpu skips the check,
    # and so does this, for a process whose JAX has not started its backends yet.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=target_config(gpu),
                                                topology=f"{num_slices}x{hosts}x{per_host}")
    except Exception as e:  # the plugin's error, e.g. when it failed to start
        reason = " ".join(str(e).split())[:200]
        raise UserError(f"--topology={name}: jax's CUDA plugin cannot describe it ({reason})") from None
    return gpu.chip(), list(topology.devices), per_host * hosts * num_slices


def gpu_of(compiled: jax.stages.Compiled) -> Gpu | None:
    """The GPU of `GPUS` a compiled program is for (by its devices' kind), else None."""
    for sharding in jax.tree.leaves(compiled.output_shardings) + jax.tree.leaves(compiled.input_shardings):
        for device in getattr(sharding, "device_set", ()):
            return next((g for g in GPUS.values() if g.name == device.device_kind), None)
    return None


# `%name = <result> custom-call(...), custom_call_target="__cudnn$fmha...", operand_layout_constraints={<operand
# shapes>}`: cuDNN's fused attention (jax.nn.dot_product_attention with implementation="cudnn"), its
# q and k first, [batch, length, heads, head dim]
_CUDNN_ATTENTION = re.compile(r'custom_call_target="__cudnn\$fmha(?P<kind>\w*)", '
                              r"operand_layout_constraints=\{(?P<operands>(?:[^{}]|\{[^{}]*\})*)\}")
_ARRAY = re.compile(r"[a-z]+[0-9]*\[(?P<dims>[0-9,]*)\]")
# matmuls of [q length, head dim] x [head dim, k length] size per kernel: the forward's q k^T and p v;
# the backward's recomputed q k^T, dv = p^T do, dp = do v^T, dq = ds k and dk = ds^T q
CUDNN_MATMULS = {"forward": 2, "backward": 5}


def cudnn_attention_flops(hlo_text: str) -> float:
    """FLOPs of the cuDNN fused-attention kernels of a compiled program (one in a loop body once),
    which XLA's cost analysis counts as none: 2 b h sq sk d per matmul of `CUDNN_MATMULS`."""
    flops = 0.0
    for kernel in _CUDNN_ATTENTION.finditer(hlo_text):
        shapes = [[int(d) for d in m["dims"].split(",") if d] for m in _ARRAY.finditer(kernel["operands"])]
        if len(shapes) < 2 or len(shapes[0]) != 4 or len(shapes[1]) != 4:
            continue
        matmuls = CUDNN_MATMULS["backward" if "Backward" in kernel["kind"] else "forward"]
        flops += matmuls * 2.0 * math.prod(shapes[0]) * shapes[1][1]
    return flops


def program_costs(compiled: jax.stages.Compiled) -> dict[str, float]:
    """FLOPs and bytes accessed per device of a compiled program: XLA's HloCostAnalysis of the
    optimised (partitioned) module, run by the CPU client, as jax's own `Lowered.cost_analysis` runs
    it. It counts the dots inside XLA:GPU's GEMM fusions and every elementwise operation, and bytes
    as each top-level operation's operands and results, and a loop's body once; a custom call counts
    no FLOPs, so cuDNN's attention kernels are added (`cudnn_attention_flops`)."""
    from jax._src.lib import _jax  # the binding `Lowered.cost_analysis` uses

    client = jax.devices("cpu")[0].client
    executable = compiled.runtime_executable()
    flops = accessed = 0.0
    for module in executable.hlo_modules() if executable is not None else []:
        costs = _jax.hlo_module_cost_analysis(client, module)
        flops += float(costs.get("flops", 0.0)) + cudnn_attention_flops(module.to_string())
        accessed += float(costs.get("bytes accessed", 0.0))
    return {"flops": flops, "bytes accessed": accessed}


def roofline(compiled: jax.stages.Compiled, gpu: Gpu) -> dict[str, Any]:
    """A cost analysis for a GPU program in the keys the planner reads: `program_costs`, and as
    `optimal_seconds` the longer of its FLOPs at `gpu`'s peak and its bytes at HBM bandwidth."""
    costs = program_costs(compiled)
    compute_s, memory_s = costs["flops"] / gpu.peak_bf16_flops, costs["bytes accessed"] / gpu.hbm_bytes_per_second
    return {**costs, "optimal_seconds": max(compute_s, memory_s), "roofline_bound": "compute" if compute_s >= memory_s
            else "memory"}


def cost_analysis(compiled: jax.stages.Compiled) -> dict[str, Any] | None:
    """The roofline of a program compiled for a GPU of `GPUS`; None for any other."""
    gpu = gpu_of(compiled)
    return None if gpu is None else roofline(compiled, gpu)


def compiler_versions() -> dict[str, str]:
    """What compiled a GPU plan: jax, its CUDA plugin, the ptxas XLA ran, and how times are estimated."""
    versions = {"jax": jax.__version__, PLUGIN: importlib.metadata.version(PLUGIN), "ptxas": "unknown",
                "estimate": ESTIMATE}
    try:
        nvcc = importlib.metadata.version("nvidia-cuda-nvcc-cu12")
        versions["ptxas"] = f"nvidia-cuda-nvcc-cu12 {nvcc}"
    except importlib.metadata.PackageNotFoundError:
        ptxas = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
        try:
            out = subprocess.run([ptxas, "--version"], capture_output=True, text=True, timeout=30).stdout
            versions["ptxas"] = f"{ptxas} {out.split()[-1] if out.split() else ''}".strip()
        except OSError:
            pass
    return versions


def is_gpu_report(report: dict[str, Any]) -> bool:
    return PLUGIN in report["compiler"]


def mem_fraction() -> float:
    """The fraction of a GPU's memory JAX gives its programs in this environment's settings."""
    if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() == "false":
        return 1.0
    try:
        return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_DEFAULT_MEM_FRACTION))
    except ValueError:
        return JAX_DEFAULT_MEM_FRACTION


def problems(report: dict[str, Any]) -> list[str]:
    """A step that fits the GPU's memory but not the part JAX's allocator takes of it by default."""
    lines = []
    fraction = mem_fraction()
    for name, step in report["steps"].items():
        mem = step["memory_per_device"]
        if step["fits"] and mem["peak"] > fraction * mem["hbm"]:
            lines.append(f"{name} step: needs {mem['peak'] / GIB:,.1f} GiB per device, more than the "
                         f"{fraction:.0%} of {mem['hbm'] / GIB:,.1f} GiB JAX preallocates by default: run it with "
                         f"XLA_PYTHON_CLIENT_MEM_FRACTION={min(0.95, mem['peak'] / mem['hbm'] + 0.02):.2f}")
    return lines


def compiler_line(versions: dict[str, str]) -> str:
    """The text report's line on what compiled a GPU plan and what its times are."""
    return (f"compiled by XLA:GPU ({PLUGIN} {versions[PLUGIN]}, ptxas {versions['ptxas']}) for jax "
            f"{versions['jax']}; every time below is a {versions['estimate']}")


def relabel(lines: list[str]) -> list[str]:
    """The planner's text lines with its times called what they are for a GPU plan."""
    return [line.replace("compiler's estimate", "roofline estimate") for line in lines]
