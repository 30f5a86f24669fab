"""`t5r plan`: the real train and encode steps of a tiny T5 compiled for TPU topologies by libtpu.

Two demo tasks of one query length keep each TPU compile to seconds. Per-device bytes are checked
against a count made here from the parameters' logical axes and the layout's rules.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re

import jax
import numpy as np
import pytest
from conftest import run_plan

libtpu = pytest.importorskip("libtpu", reason="t5r plan compiles with libtpu (pip install -r requirements-dev.txt)")

TINY = ["--gin_file=models/t5_tiny.gin", "--gin_file=runs/base.gin",
        "--gin.MIXTURE_OR_TASK_NAME=['demo_fever', 'demo_trex']", "--gin.QUERY_LEN=16", "--gin.PASSAGE_LEN=32",
        "--gin.VOCAB_SIZE=512", "--gin.D_MODEL=32", "--gin.D_FF=64", "--gin.NUM_LAYERS=1", "--gin.NUM_NEGATIVES=1",
        "--gin.PER_DEVICE_BATCH=2",
        "--gin.T5Config.scan_layers=False",  # one layer: nothing to scan (test_a_scanned_step_... scans)
        # Dropout's random bits are half of a tiny step's program and of its TPU compile (14.5 s
        # against 7.1 s); what these tests check does not depend on them.
        "--gin.DROPOUT=0.0"]
TACO = ["--gin_file=runs/taco.gin", "--gin.MIXTURE_OR_TASK_NAME=['demo_fever', 'demo_trex']"]
REPORT_KEYS = {"topology", "num_slices", "devices", "mesh", "layout", "chip", "tasks", "per_device_batch",
               "passage_len", "num_negatives", "multitask", "steps", "replicated_params", "problems",
               "steps_per_epoch", "estimated_epoch_seconds", "gathered_copy_bytes", "host_peak_bytes", "compiler"}
STEP_KEYS = {"lower_seconds", "compile_seconds", "hlo_bytes", "memory_per_device", "peak_breakdown", "fits",
             "compiler_refused",
             "compiler_flops_per_device", "model_matmul_flops", "peak_bf16_flops", "estimated_step_seconds",
             "compiler_optimal_seconds", "compiler_seconds", "custom_kernels", "kernel_seconds", "estimate_source",
             "loop_free_estimate",
             "hlo_unreadable", "collectives", "items_per_step"}
MEMORY_KEYS = {"params", "optimizer", "multitask", "batch", "arguments", "outputs_not_donated", "temporaries",
               "code", "peak", "hbm", "margin"}


@pytest.fixture(scope="module", autouse=True)
def compile_each_program_once():
    """The TPU compiler is deterministic and each compile here takes seconds to a minute, so a program
    this module has compiled already (for the same devices) is not compiled again: a plan rerun at
    the batch another advised, or a test's own compile of the program a plan timed. What a
    compile returned is returned again, its time included. Every program is compiled with its peak
    breakdown, which a caller that did not ask for it does not get: the advice's compile of a batch
    then serves the plan rerun at that batch, whose train step asks for it."""
    from t5_retrieval.plan import planner, programs

    compile_timed, compiled = planner.compile_timed, {}

    def once(lowered: jax.stages.Lowered, *, peak_breakdown: bool = False):
        key = (lowered.as_text(), tuple(programs.program_devices(lowered)))
        if key not in compiled:
            compiled[key] = compile_timed(lowered, peak_breakdown=True)
        return compiled[key] if peak_breakdown else dataclasses.replace(compiled[key], peak=[])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planner, "compile_timed", once)
        yield


def libtpu_version() -> str:
    import importlib.metadata
    return importlib.metadata.version("libtpu")


@functools.cache
def _plan_json(argv: tuple[str, ...]) -> dict:
    """One compile per configuration for the whole module (each is tens of seconds on a loaded CPU)."""
    code, out, err = run_plan(*argv, "--json")
    assert code == 0, err
    return json.loads(out)


def plan_json(topology: str, layout: str, *extra: str) -> dict:
    return _plan_json(("--topology", topology, *TINY, f"--gin_file=sharding/{layout}.gin", *extra))


def expected_param_bytes(layout: str, mesh: dict[str, int]) -> int:
    """Per-device parameter bytes counted from each parameter's logical axes: a dimension is split
    by the size of the mesh axis the layout's first matching rule names, unless an earlier
    dimension of the same parameter took that mesh axis."""
    import flax.linen as nn
    import gin

    from t5_retrieval import gin_utils, sharding
    from t5_retrieval.models.build import build_model, model_config

    gin.clear_config()
    try:
        gin_utils.parse_gin(["models/t5_tiny.gin"], ["VOCAB_SIZE = 512", "D_MODEL = 32", "D_FF = 64", "NUM_LAYERS = 1"])
        model = build_model(model_config())
    finally:
        gin.clear_config()
    boxed = jax.eval_shape(lambda k: model.init({"params": k}, np.ones((1, 4), np.int32))["params"],
                           jax.random.PRNGKey(0))
    first = {}
    for name, axis in sharding.LAYOUTS[layout]:
        first.setdefault(name, axis)
    total = 0
    for box in jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)):
        used, elements = set(), 1
        for size, name in zip(box.value.shape, box.names):
            axis = first.get(name)
            split = mesh[axis] if axis is not None and axis not in used else 1
            used.add(axis)
            elements *= size // split
        total += elements * np.dtype(box.value.dtype).itemsize
    return total


WITH_DROPOUT = ("--gin.DROPOUT=0.1",)  # the step users train


@pytest.mark.parametrize("layout,extra", [("data_parallel", WITH_DROPOUT), ("fsdp", TACO),
                                          ("tensor_parallel", ()), ("fsdp_tensor_parallel", ())])
def test_tiny_t5_compiles_for_v5e_with_per_device_state_as_counted(layout, extra):
    report = plan_json("v5e:2x2", layout, *extra)
    train = report["steps"]["train"]
    mem = train["memory_per_device"]
    assert report["devices"] == 4 and report["layout"] == layout
    assert train["fits"] and report["steps"]["encode"]["fits"], report["problems"]
    params = expected_param_bytes(layout, report["mesh"])
    assert mem["params"] == params, f"{layout}: {mem['params']} parameter bytes per device, counted {params}"
    # AdamW: two moments shaped like the parameters, plus scalar counts.
    assert 2 * params <= mem["optimizer"] <= 2 * params + 64, (mem["optimizer"], params)
    if extra == TACO:  # one EMA per task, [K, *param], the task axis never sharded
        assert report["multitask"] == "taco"
        # its two same-shaped tasks share one loop, priced once: the time is the sum of its parts
        assert train["estimate_source"] == "sum of 2 task passes, and the update", train["loop_free_estimate"]
        assert set(train["loop_free_estimate"]["seconds"]) == {"demo_fever and 1 alike (x2)", "update"}
        assert 2 * params <= mem["multitask"] <= 2 * params + 64, (mem["multitask"], params)
    else:
        assert mem["multitask"] == 0
    assert train["estimated_step_seconds"] and train["estimated_step_seconds"] > 0
    assert train["collectives"], f"{layout}: a 4-device step without collectives"
    if extra == TACO:  # each task pass gathers the FSDP-sharded weights: the plan names the option
        assert report["problems"] == [
            "train step: each of the 2 task passes gathers every layer's weights, which layout fsdp shards; "
            "--gin.train.gather_params_once=True gathers them once per step, for a copy of "
            f"{report['gathered_copy_bytes'] / 2 ** 20:,.1f} MiB per device"]
        assert report["gathered_copy_bytes"] == expected_param_bytes("data_parallel", report["mesh"]), (
            "float32 compute: a float32 copy of all the parameters")
    else:
        assert report["problems"] == []


def test_v4_is_planned_as_jax_runs_it_one_megacore_device_per_chip():
    """JAX runs a v4 chip as one device (both TensorCores, the chip's 32 GiB); libtpu's default chip
    configuration would describe two devices of 16 GiB."""
    report = plan_json("v4:2x2x1", "fsdp")
    assert report["devices"] == 4 and report["mesh"]["data"] * report["mesh"]["model"] == 4, report["mesh"]
    assert report["chip"]["chip_config"] == "megacore" and report["chip"]["devices_per_chip"] == 1
    assert report["chip"]["hbm_bytes_per_device"] == 32 * 1024 ** 3
    assert report["chip"]["peak_bf16_flops_per_device"] == 275e12
    assert report["steps"]["train"]["peak_bf16_flops"] == 4 * 275e12
    assert report["steps"]["train"]["memory_per_device"]["params"] == expected_param_bytes("fsdp", report["mesh"])
    assert report["steps"]["train"]["fits"] and report["steps"]["train"]["estimated_step_seconds"]


def test_v4_per_tensorcore_plans_two_devices_per_chip():
    report = plan_json("v4:2x2x1", "fsdp", "--per_tensorcore")
    assert report["devices"] == 8
    assert report["chip"]["chip_config"] == "per_tensorcore" and report["chip"]["devices_per_chip"] == 2
    assert report["chip"]["hbm_bytes_per_device"] == 16 * 1024 ** 3
    assert report["chip"]["peak_bf16_flops_per_device"] == 275e12 / 2
    # MFU divides by the peak of all 4 chips
    assert report["steps"]["train"]["peak_bf16_flops"] == 4 * 275e12
    assert report["steps"]["train"]["memory_per_device"]["params"] == expected_param_bytes("fsdp", report["mesh"])


def test_per_tensorcore_is_refused_for_chips_libtpu_describes_as_one_device():
    code, out, err = run_plan("--topology", "v5e:2x2", *TINY, "--per_tensorcore")
    assert code == 2 and out == ""
    assert err.strip() == ("t5r plan: error: --per_tensorcore: only v4 chips can be planned per TensorCore "
                           "(libtpu describes a v5e chip as one device); drop the flag for --topology=v5e:2x2"), err


def test_parameters_a_rule_set_leaves_unsharded_are_reported():
    from jax.sharding import Mesh

    from t5_retrieval import sharding
    from t5_retrieval.models.dual_encoder import DualEncoder
    from t5_retrieval.models.t5 import T5Config
    from t5_retrieval.plan import planner
    from t5_retrieval.plan.steps import abstract_params

    model = DualEncoder(T5Config(vocab_size=512, d_model=32, d_ff=64, num_heads=4, d_kv=16, num_encoder_layers=1,
                                 num_decoder_layers=1))
    # fsdp that forgot to map "embed" (its only parameter axis) to the data axis
    wrong = tuple((name, None if name == "embed" else axis) for name, axis in sharding.LAYOUTS["fsdp"])
    devices = planner.describe_topology("v5e:2x2", 1).devices
    mesh = Mesh(np.array(devices).reshape(4, 1), ("data", "model"))
    params, shardings = abstract_params(model, mesh, wrong)
    found = [p["param"] for p in planner.replicated_params(params, shardings, threshold_bytes=1024)]
    assert found[0] == "t5/token_embedder/embedding" and len(found) > 5, found
    right = planner.replicated_params(*abstract_params(model, mesh, sharding.LAYOUTS["fsdp"]), threshold_bytes=1024)
    assert right == [], right


def test_json_report_schema():
    report = plan_json("v5e:2x2", "data_parallel", *WITH_DROPOUT)  # the plan of the first test, cached
    assert set(report) == REPORT_KEYS
    assert report["chip"]["chip_config"] == "default" and report["chip"]["devices_per_chip"] == 1
    assert report["compiler"] == {"jax": jax.__version__, "libtpu": libtpu_version()}
    for name in ("train", "encode"):
        step = report["steps"][name]
        assert STEP_KEYS <= set(step) and set(step["memory_per_device"]) == MEMORY_KEYS, (name, sorted(step))
        assert all(set(c) == {"count", "bytes"} for c in step["collectives"].values())
        memory = step["memory_per_device"]
        assert memory["peak"] + memory["margin"] == report["chip"]["hbm_bytes_per_device"]
        # XLA's own account of the buffers live at the peak: largest first, the rest summed last
        parts = step["peak_breakdown"]
        assert parts and all(set(p) == {"what", "bytes"} and p["bytes"] > 0 for p in parts), parts
        ranked = [p["bytes"] for p in parts if p["what"] != "other"]
        assert ranked == sorted(ranked, reverse=True) and len(ranked) <= 8, parts
    assert "argument state" in [p["what"] for p in report["steps"]["train"]["peak_breakdown"]]
    assert report["tasks"] == [{"name": "demo_fever", "per_device_rows": 1, "query_len": 16, "train_examples": 160},
                               {"name": "demo_trex", "per_device_rows": 1, "query_len": 16, "train_examples": 160}]
    # an epoch is a pass over the largest task: 160 examples, 1 row on each of 4 data shards per step
    assert report["steps_per_epoch"] == 40
    seconds = report["steps"]["train"]["estimated_step_seconds"]
    assert report["estimated_epoch_seconds"] == pytest.approx(40 * seconds)
    # in bytes: more than jax with libtpu loaded alone holds, less than the machine has
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 200 * 2 ** 20 < report["host_peak_bytes"] <= physical
    json.dumps(report)


def test_a_step_that_cannot_fit_exits_2_with_one_line_and_counts_its_arguments_once():
    """40M x 32 float32 token embeddings (5 GB) with AdamW's two moments: 15 GB per device replicated.
    The total the compiler's out-of-HBM message names ("HLO temporaries") is its buffer assignment's,
    these arguments included: the step's peak is that total, and its temporaries what is left of it."""
    from t5_retrieval.plan import planner

    argv = ("--topology", "v5e:2x2", *TINY, "--gin.VOCAB_SIZE=40000000", "--gin_file=sharding/data_parallel.gin")
    code, out, err = run_plan(*argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("t5r plan: error: train step: needs"), err
    assert "fsdp" in lines[0], f"expected the layout that would fit: {lines[0]}"
    assert "DOES NOT FIT" in out
    assert f"compiled by libtpu {libtpu_version()} for jax {jax.__version__}" in out
    code, out, _ = run_plan(*argv, "--json")  # the same programs again
    assert code == 2
    train = json.loads(out)["steps"]["train"]
    mem = train["memory_per_device"]
    total = planner.refused_total(train["compiler_refused"])
    state = mem["params"] + mem["optimizer"] + mem["multitask"]
    assert state > 14e9 and total > state, (state, total)
    assert mem["arguments"] == state + mem["batch"]
    assert mem["peak"] == total and mem["temporaries"] == total - mem["arguments"]


def test_the_peak_breakdown_groups_operations_instructions_and_arguments(tmp_path):
    """XLA's live-range dump names each buffer live at the peak by the JAX operation, the XLA
    instruction or the argument (its pytree path) that made it; arguments are grouped by their root."""
    from t5_retrieval.plan import peak

    entries = [("jit(train_step)/jvp(DualEncoder)/t5.encode/encoder/while{2}", 9_000),
               ("state.opt_state[1][0].mu['t5']['token_embedder']['embedding']", 300),
               ("state.params['t5']['token_embedder']['embedding']", 200),
               ("convert_dynamic-update-slice_fusion.184", 250), ("and_select_fusion", 40), ("copy.2868", 16)]
    children = "\n".join(f"      ├── {name} (1.0%, total: {n:,} bytes, current: 0 bytes, remaining: 0 bytes)"
                         .replace(f"{n:,}", f"{n:,}".replace(",", " ")) for name, n in entries)
    (tmp_path / "module_0001.jit_train_step.after_optimizations-live-range.txt").write_text(
        "  Stack trace breakdown for peak usage: 9 806 bytes\n    jit_train_step (100.0%, total: 9 806 bytes)\n"
        + children + "\n")
    assert peak.read(str(tmp_path)) == [
        {"what": "jvp(DualEncoder)/t5.encode/encoder/while", "bytes": 9_000},
        {"what": "argument state", "bytes": 500},
        {"what": "convert_dynamic-update-slice_fusion.184", "bytes": 250},
        {"what": "and_select_fusion", "bytes": 40}, {"what": "copy.2868", "bytes": 16}]


def test_both_forms_of_the_compilers_out_of_hbm_message_are_read():
    """The second form (libtpu 0.0.52, T5-XXL at 8 queries per device on v5e:4x4, 114 MB over) had
    been read as nothing at all, so the plan said that step needed only its state."""
    from t5_retrieval.plan import planner

    first = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required "
             "for HLO temporaries (16.51G) exceeds available HBM (15.75G). HLO module: jit_train_step.")
    second = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran out of memory in "
              "memory space hbm. Used 15.86G of 15.75G hbm. Exceeded hbm capacity by 114.22M. Total hbm usage >= "
              "16.11G: reserved 258.01M program 8.17G arguments 7.69G Output size 7.69G; shares 7.69G with arguments.")
    assert planner.refused_total(first) == int(16.51 * 1024 ** 3)
    assert planner.refused_total(second) == int(15.86 * 1024 ** 3)
    assert planner.refused_total("RESOURCE_EXHAUSTED: something else") == 0


def test_no_batch_fits_says_when_the_least_one_is_within_the_hbm_but_refused(monkeypatch):
    """T5-XXL on v5e:4x4 at one query per task needs 16,241 MiB: under the device's 16,384 MiB but over
    what the compiler leaves a program (15.75 GiB), which the advice says instead of a figure that
    reads as fitting. (That compile takes 11 minutes here; its result stands in for it.)"""
    from t5_retrieval.models.build import build_model
    from t5_retrieval.plan import planner
    from t5_retrieval.plan.steps import TrainSettings

    mesh, config = _t5_base_mesh_and_config("VOCAB_SIZE = 512", "D_MODEL = 32", "D_FF = 64", "NUM_LAYERS = 1")
    mib, hbm = planner.MIB, 16_384 * planner.MIB
    # the step as planned: its state and temporaries far over the HBM under any layout
    report = {"memory_per_device": {"params": 1, "optimizer": 2, "multitask": 0, "batch": 0, "code": 0,
                                    "outputs_not_donated": 0, "temporaries": 40_000 * mib, "hbm": hbm}}
    settings = TrainSettings(mixture=["demo_fever", "demo_trex"], query_len=16, passage_len=32, num_negatives=1,
                             per_device_batch=64, multitask=None, num_steps=10)
    for need, expected in [(16_241, "needs 16,241 MiB of the 16,384, more than the compiler leaves a program)"),
                           (20_000, "needs 20,000 MiB)")]:
        least = {"peak": need * mib, "hbm": hbm, "margin": hbm - need * mib}
        monkeypatch.setattr(planner, "train_step_memory", lambda *args, least=least: (False, least))
        advice = planner.fit_advice(build_model(config), config, settings, mesh, "fsdp", report, num_tasks=2)
        assert advice == (f"no batch of one query per task fits either (PER_DEVICE_BATCH=2 {expected}, nor another "
                          "layout of this mesh: use more or larger chips"), advice


def test_a_batch_that_cannot_fit_gets_the_largest_batch_a_compile_found_to_fit():
    """1024-token passages: 384 queries per device need ~28 GB of temporaries, more than any layout
    frees. The advice is a batch the plan compiled, found by the line through the step's
    temporaries at 384 and at one query per task; planned again at that batch, the step fits."""
    long = [a for a in TINY if "PASSAGE_LEN" not in a and "PER_DEVICE_BATCH" not in a]
    long += ["--gin.PASSAGE_LEN=1024", "--gin_file=sharding/fsdp.gin"]
    code, out, err = run_plan("--topology", "v5e:2x2", *long, "--gin.PER_DEVICE_BATCH=384")
    assert code == 2
    # why, from the refused compile's own buffer assignment: the attention scores of 1024-token passages
    at_peak = re.search(r"^train step:.*?\n  at the peak, [^:]*: ([^\n]*)", out, re.S | re.M)
    assert at_peak, out
    largest = re.fullmatch(r"(\S+) ([\d,.]+) MiB", at_peak[1].split("; ")[0])
    assert largest and "/attention/" in largest[1] and float(largest[2].replace(",", "")) > 8_000, at_peak[1]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "PER_DEVICE_BATCH=384" in lines[0], err
    advised = re.search(r"; --gin\.PER_DEVICE_BATCH=(\d+) fits \(compiled: ([\d,]+) of 16,384 MiB per device\)$",
                        lines[0])
    assert advised, f"expected a compiled batch that fits: {lines[0]}"
    batch = int(advised[1])
    assert 2 < batch < 384, batch
    code, out, err = run_plan("--topology", "v5e:2x2", *long, f"--gin.PER_DEVICE_BATCH={batch}")
    assert code == 0, err
    peak = re.search(r"train step:.*?peak ([\d,.]+) MiB of 16,384.0 MiB", out, re.S)
    assert peak and float(peak[1].replace(",", "")) == pytest.approx(int(advised[2].replace(",", "")), abs=1), out


def test_a_step_within_the_hbm_that_the_compiler_refused_is_not_said_to_need_more_than_the_chip():
    """XLA keeps part of the HBM for itself (v5e: 15.75 of 16 GiB usable), so a refused step can
    need less than the chip has: its problem line says so instead of "needs 16,196 of 16,384"."""
    from t5_retrieval.plan import planner
    from t5_retrieval.plan import text as plan_text

    step = {"fits": False, "hlo_unreadable": None, "compiler_refused": "RESOURCE_EXHAUSTED: ...",
            "memory_per_device": {"peak": 16_196 * planner.MIB, "hbm": 16_384 * planner.MIB,
                                  "margin": 188 * planner.MIB}}
    report = {"steps": {"train": step}, "chip": {"name": "v5e"}, "layout": "fsdp", "per_device_batch": 3072,
              "replicated_params": [], "gathered_copy_bytes": None}
    assert plan_text.problems(report) == [
        "train step: needs 16,196.0 MiB per device, within the v5e device's 16,384.0 MiB, but the compiler, which "
        "keeps part of it for itself, refused it (layout fsdp, PER_DEVICE_BATCH=3072)"]
    step["memory_per_device"].update(peak=20_000 * planner.MIB, margin=-3_616 * planner.MIB)
    assert plan_text.problems(report)[0].startswith("train step: needs 20,000.0 MiB per device, the v5e device has "
                                                  "16,384.0 MiB (layout fsdp")


def test_collectives_are_counted_by_type_and_bytes():
    from t5_retrieval.plan import hlo

    text = """
  %all-reduce.1 = f32[64,32]{1,0} all-reduce(f32[64,32]{1,0} %p), replica_groups={{0,1,2,3}}, to_apply=%add
  %all-gather-start.2 = (bf16[8,32]{1,0}, bf16[32,32]{1,0}) all-gather-start(bf16[8,32]{1,0} %q), dimensions={0}
  %all-gather-done.2 = bf16[32,32]{1,0} all-gather-done((bf16[8,32]{1,0}, bf16[32,32]{1,0}) %all-gather-start.2)
  %fusion.3 = f32[64,32]{1,0} fusion(f32[64,32]{1,0} %all-reduce.1), kind=kLoop, calls=%fused_computation
  %all-reduce.4 = (f32[], s32[2]{0}) all-reduce(f32[] %a, s32[2]{0} %b), to_apply=%add
"""
    assert hlo.collectives(text) == {"all-reduce": {"count": 2, "bytes": 64 * 32 * 4 + 4 + 8},
                                     "all-gather": {"count": 1, "bytes": (8 * 32 + 32 * 32) * 2}}
    assert hlo.program_size(text) == {"instructions": 5, "fusions": 1, "convolutions": 0}
    # XLA:TPU's reduce-scatter written as a fusion of an all-reduce and a slice (as compiled for v5e)
    fused = """
%all-reduce-scatter (input: f32[128,32]) -> f32[32,32] {
  %input = f32[128,32]{1,0} parameter(0)
  %all-reduce.120 = f32[128,32]{1,0:T(8,128)} all-reduce(%input), channel_id=10, replica_groups={{0,1,2,3}}
  ROOT %dynamic-slice.216 = f32[32,32]{1,0:T(8,128)} dynamic-slice(%all-reduce.120, %m, %c), dynamic_slice_sizes={32,32}
}

ENTRY %main {
""" + text
    assert hlo.collectives(fused) == {**hlo.collectives(text), "reduce-scatter": {"count": 1, "bytes": 32 * 32 * 4}}


def kernel_line(name: str, results: list[str], operands: list[str], cost_estimate: str = "") -> str:
    """A custom TPU kernel as libtpu 0.0.42.1 writes it in a compiled program (its body cut short)."""
    shapes = [f"{shape}{{3,2,1,0:T(8,128)(2,1)S(1)}}" for shape in results]
    result = shapes[0] if len(shapes) == 1 else f"({', '.join(shapes)})"
    estimate = f',"cost_estimate":{{"flops":"{cost_estimate}"}}' if cost_estimate else ""
    return (f"  %{name} = {result} custom-call(%bitcast.14, %pad_bitcast_fusion.1), "
            f'custom_call_target="tpu_custom_call", operand_layout_constraints={{'
            + ", ".join(f"{shape}{{3,2,1,0}}" for shape in operands)
            + f'}}, frontend_attributes={{kernel_metadata={{}}}}, backend_config={{"custom_call_config":'
              f'{{"body":"TUzvUgFN"{estimate}}}}}')


def flash_kernels_hlo(b: int, h: int, q: int, k: int, d: int, bias: bool, block: int) -> str:
    """Pallas flash attention's forward (with its residuals) and backward kernels as compiled for a v5e
    (jax 0.10.2): q [b, h, q, d], k and v [b, h, k, d], a float32 bias [b, h, q, k] or none, softmax
    statistics 128 wide (as wide as a key block in the dq kernel's), blocks of `block`."""
    qs, ks, ab = f"bf16[{b},{h},{q},{d}]", f"bf16[{b},{h},{k},{d}]", [f"f32[{b},{h},{q},{k}]"] * bias
    stats, wide = f"f32[{b},{h},{q},128]", f"f32[{b},{h},{q},{block}]"
    backward = [qs, ks, ks, *ab, stats, stats, qs]
    return "\n".join([
        kernel_line("jvp_jit_flash_attention__.1", [qs, stats, stats], [qs, ks, ks, *ab], cost_estimate="1006632960"),
        kernel_line(f"flash_mha_bwd_dq_block_q_major_{block}_block_k_major_{block}_block_k_{block}.1", [qs, *ab],
                    [*backward, wide]),
        kernel_line(f"flash_mha_bwd_dkv_block_q_major_{block}_block_q_{block}_block_k_major_{block}_block_k_{block}.1",
                    [ks, ks],
                    [*backward, stats]),
        '  %custom-call.1 = bf16[8,160,12,64]{1,3,2,0:T(8,128)(2,1)S(1)} custom-call(%slice-done.4), '
        'custom_call_target="ConcatBitcast"'])


# a T5 shape (8 rows, 12 heads, 160 queries, keys padded to 256, head dimension 64) and another kernel
KERNELS_HLO = "\n".join([flash_kernels_hlo(8, 12, 160, 256, 64, bias=True, block=256),
                         kernel_line("my_kernel.3", ["f32[64,128]"], ["f32[64,128]"])])
# without a bias, over 2048 positions, 8 heads of 128: compute-bound
LONG_KERNELS_HLO = flash_kernels_hlo(1, 8, 2048, 2048, 128, bias=False, block=128)


def test_custom_kernels_are_read_with_their_flops_and_bytes_and_priced_where_the_cost_model_does_not():
    """libtpu's cost model prices a kernel from the cost estimate it carries (flash attention's
    forward) and one without (the backward kernels) by its bytes alone: each of those adds its
    roofline (FLOPs at peak or bytes at HBM bandwidth, the larger) less its bytes' time."""
    from t5_retrieval.models import attention
    from t5_retrieval.plan import hlo, planner
    from t5_retrieval.plan.chips import parse_topology

    kernels = hlo.tpu_kernels(KERNELS_HLO)
    assert [(k["kind"], k["cost_estimate"]) for k in kernels] == [
        ("flash_forward", True), ("flash_dq", False), ("flash_dkv", False), ("other", False)]
    assert kernels[0]["q"] == [8, 12, 160, 64] and kernels[0]["k"] == [8, 12, 256, 64]
    q, kv, bias, stats = (8 * 12 * n for n in (160 * 64 * 2, 256 * 64 * 2, 160 * 256 * 4, 160 * 128 * 4))
    assert kernels[0]["bytes"] == q + 2 * kv + bias + q + 2 * stats  # operands, then the result and its residuals
    assert kernels[1]["bytes"] == q + 2 * kv + bias + 2 * stats + q + bias + q + bias  # di as wide as the keys
    assert kernels[3]["bytes"] == 2 * 64 * 128 * 4

    chip = parse_topology("v5e:2x2")[0]
    target = planner.Target(chip, devices=[None] * 4, chips=4)
    peak, bandwidth = chip.peak_bf16_flops, 819e9
    costs = planner.kernel_costs(KERNELS_HLO, target)
    kinds = costs["kinds"]
    matmul = 2 * 8 * 12 * 160 * 256 * 64
    # the same FLOPs as attention.flash_cost's forward and backward at this shape
    assert kinds["flash_forward"]["flops"] == attention.flash_cost(8, 12, 160, 160, 64, 2, True)["flops"] == 2 * matmul
    assert kinds["flash_dkv"]["flops"] + kinds["flash_dq"]["flops"] == attention.flash_cost(
        8, 12, 160, 160, 64, 2, True, backward=True)["flops"]
    assert kinds["other"] == {"count": 1, "flops": None, "bytes": 2 * 64 * 128 * 4,
                              "roofline_seconds": pytest.approx(2 * 64 * 128 * 4 / bandwidth), "with_cost_estimate": 0}
    for kind in ("flash_forward", "flash_dq", "flash_dkv"):
        k = kinds[kind]
        assert k["roofline_seconds"] == pytest.approx(max(k["flops"] / peak, k["bytes"] / bandwidth)), kind
    # T5's float32 bias makes every kernel memory-bound at this shape: nothing is left unpriced
    assert costs["unpriced_seconds"] == 0.0
    # without a bias over long sequences the backward kernels are compute-bound: what their FLOPs take
    # beyond their bytes is added. (Compiled alone for one v5e device, this gradient's cost-model time
    # is 224.6 us: its forward's FLOPs at peak, 87.5 us, and the backward kernels' bytes, 117.8 us,
    # with the rest of the program; their 60 GFLOP, 305 us at peak, are missing.)
    light = LONG_KERNELS_HLO
    costs = planner.kernel_costs(light, target)
    assert costs["kinds"]["flash_dkv"]["flops"] + costs["kinds"]["flash_dq"]["flops"] == 7 * 2 * 8 * 2048 ** 2 * 128
    unpriced = [k["flops"] / peak - k["bytes"] / bandwidth for name, k in costs["kinds"].items()
                if name in ("flash_dq", "flash_dkv")]
    assert min(unpriced) > 0 and costs["unpriced_seconds"] == pytest.approx(sum(unpriced))
    assert costs["unpriced_seconds"] == pytest.approx(305e-6 - 117.8e-6, rel=0.01)
    # a device that is half a chip (v4 per TensorCore) has half the peak and half the bandwidth
    v4 = parse_topology("v4:2x2x1")[0]
    halves = planner.kernel_costs(light, planner.Target(v4, devices=[None] * 8, chips=4, chip_config="per_tensorcore"))
    whole = planner.kernel_costs(light, planner.Target(v4, devices=[None] * 4, chips=4, chip_config="megacore"))
    assert halves["unpriced_seconds"] == pytest.approx(2 * whole["unpriced_seconds"])


def test_a_compiler_estimate_that_is_no_time_is_reported_as_none():
    from t5_retrieval.plan.planner import usable_estimate

    assert usable_estimate(0.0012) == 0.0012
    assert usable_estimate(0.0) is None
    assert usable_estimate(-47.952) is None, "libtpu's estimate for a scanned T5-base train step"
    assert usable_estimate(float("nan")) is None


def _t5_base_mesh_and_config(*bindings: str, base: bool = False) -> tuple[object, dict]:
    """T5-base's gin file (`base`) on v4's TensorCores, or the tiny T5's on v5e:2x2, with `bindings`."""
    import gin
    from jax.sharding import Mesh

    from t5_retrieval import gin_utils
    from t5_retrieval.models.build import model_config
    from t5_retrieval.plan import planner

    gin.clear_config()
    try:
        gin_utils.parse_gin(["models/t5_base.gin" if base else "models/t5_tiny.gin"], list(bindings))
        config = model_config()
    finally:
        gin.clear_config()
    # T5-base on v4's TensorCores: the programs these tests' figures were read from
    target = planner.describe_topology("v4:2x2x1", 1, per_tensorcore=True) if base else \
        planner.describe_topology("v5e:2x2", 1)
    devices = target.devices
    return Mesh(np.array(devices).reshape(len(devices), 1), ("data", "model")), config


def _encode_lowering(mesh, passage_len: int):
    from t5_retrieval import sharding
    from t5_retrieval.models.build import build_model
    from t5_retrieval.plan.steps import lower_encode_step

    return lambda c: lower_encode_step(build_model(c), c, passage_len, mesh, sharding.LAYOUTS["fsdp"]).lowered


def test_depth_extrapolation_matches_the_compiler_on_the_unrolled_step():
    """A step of identical layers is affine in depth: from the compiler's estimates at 1 and 2 unrolled
    layers, the extrapolation to 4 gives what the compiler says of the unrolled 4-layer step."""
    from t5_retrieval.plan import planner

    mesh, config = _t5_base_mesh_and_config("VOCAB_SIZE = 512", "D_MODEL = 32", "D_FF = 64", "NUM_LAYERS = 4",
                                            "T5Config.scan_layers = True")
    assert planner.scanned_depth(config) == 4
    lower = _encode_lowering(mesh, 32)
    estimate = planner.loop_free_estimate(lower, config, 4)
    assert estimate["seconds"]["2 layers"] > estimate["seconds"]["1 layer"] > 0, estimate
    program = planner.compile_timed(lower(planner.timing_config(config, 4))).program
    direct = planner.usable_estimate(planner.compiler_seconds(program)[0])
    assert direct is not None
    np.testing.assert_allclose(estimate["estimated_step_seconds"], direct, rtol=0.01)


def test_timing_programs_are_unrolled_and_without_dropout():
    """The programs the plan reads step times from: the requested depth, unrolled, dropout 0 (its
    random bits multiplied compile memory); the config's own depth when none is requested."""
    from t5_retrieval.plan import planner

    _, config = _t5_base_mesh_and_config("NUM_LAYERS = 3", "T5Config.scan_layers = True", "DROPOUT = 0.1")
    timed = planner.timing_config(config, 2)
    assert (timed["t5"]["num_encoder_layers"], timed["t5"]["num_decoder_layers"]) == (2, 2)
    assert timed["t5"]["scan_layers"] is False and timed["t5"]["dropout_rate"] == 0.0
    own = planner.timing_config(config, None)
    assert own["t5"] == {**config["t5"], "dropout_rate": 0.0}
    assert config["t5"]["dropout_rate"] == 0.1  # the real program keeps it


def test_a_task_pass_is_timed_unrolled_at_full_depth():
    """Per-task parts are small enough to compile with every layer unrolled: their time is the
    compiler's estimate of that program, not an extrapolation (which reads gradient passes high)."""
    from t5_retrieval.plan import planner

    mesh, config = _t5_base_mesh_and_config("VOCAB_SIZE = 512", "D_MODEL = 32", "D_FF = 64", "NUM_LAYERS = 3",
                                            "T5Config.scan_layers = True")
    lower = _encode_lowering(mesh, 32)
    part = planner.loop_free_estimate(lower, config, 3, full_depth=True)
    assert part["method"] == "unrolled at 3 layers" and list(part["seconds"]) == ["3 layers"], part
    program = planner.compile_timed(lower(planner.timing_config(config, 3))).program
    assert part["estimated_step_seconds"] == pytest.approx(planner.compiler_seconds(program)[0], rel=1e-6)
    step = planner.per_task_estimate([("a", 2, lower), ("b", 1, lower)], [("update", lower)], config, 3)
    assert step["method"] == "sum of 3 task passes, each unrolled at 3 layers, and the update", step
    parts = step["seconds"]
    assert step["estimated_step_seconds"] == pytest.approx(2 * parts["a (x2)"] + parts["b (x1)"] + parts["update"])


def test_unpriced_custom_calls_are_counted_free_not_minus_one_second():
    """libtpu prices each ConcatBitcast custom call at -1 s: T5-base's encode step at 160 tokens reads
    negative from 2 layers on. Counted free, the estimates grow by about one layer's time per layer.
    The custom calls come from T5-base's attention (12 heads of 64 over 160 tokens), which is kept;
    its vocabulary, width and feed-forward are cut to a tiny model's (ConcatBitcast calls still, at
    half the compile's CPU time)."""
    from t5_retrieval.plan import planner

    mesh, config = _t5_base_mesh_and_config("VOCAB_SIZE = 512", "D_MODEL = 64", "D_FF = 128", base=True)
    lower = _encode_lowering(mesh, 160)
    raw, corrected = [], []
    for layers in (1, 2, 3):
        program = planner.compile_timed(lower(planner.timing_config(config, layers))).program
        raw.append(program.cost["optimal_seconds"])
        corrected.append(planner.compiler_seconds(program)[0])
    assert min(raw) < 0, f"libtpu priced every program: {raw} (the correction may be obsolete)"
    assert all(0 < t < 1 for t in corrected), corrected
    # affine in depth (to within how the compiler schedules each program: 3.3% at 3 layers here)
    np.testing.assert_allclose(2 * corrected[1] - corrected[0], corrected[2], rtol=0.05)


class _TextUnreadable:
    """A compiled program whose HLO text cannot be read back, as jax 0.10.2 fails on some of libtpu
    0.0.52's v5p programs; everything else is the real compiled program's."""

    def __init__(self, compiled):
        self._compiled = compiled

    def __getattr__(self, name):
        return getattr(self._compiled, name)

    def as_text(self):
        raise jax.errors.JaxRuntimeError("INTERNAL: RET_CHECK failure (external/xla/xla/hlo/ir/hlo_instruction.cc:390) "
                                         "proto.operand_ids_size() == *arity async-update instruction should have "
                                         "1 operands but sees 3")


def _lowered_encode_step():
    """A tiny T5's encode step lowered for `v5e:2x2` under fsdp: a program that compiles in seconds."""
    from t5_retrieval import sharding
    from t5_retrieval.models.build import build_model
    from t5_retrieval.plan.steps import lower_encode_step

    mesh, config = _t5_base_mesh_and_config("VOCAB_SIZE = 512", "D_MODEL = 32", "D_FF = 64", "NUM_LAYERS = 1")
    return lower_encode_step(build_model(config), config, 32, mesh, sharding.LAYOUTS["fsdp"])


def test_a_program_whose_text_cannot_be_read_keeps_its_memory_and_has_no_time():
    """The plan goes on without the program's text: memory from the buffer assignment as before, no
    collectives and no time (its unpriced custom calls could not be counted), and one problem line."""
    from t5_retrieval.plan import planner, programs
    from t5_retrieval.plan import text as plan_text

    step = _lowered_encode_step()
    with planner._not_cached():  # a TPU program kept out of the suite's persistent cache, as the planner keeps it
        compiled = step.lowered.compile()
    read, text_unreadable = programs.CompiledProgram.read(compiled), programs.CompiledProgram.read(_TextUnreadable(compiled))
    assert text_unreadable.text is None and text_unreadable.memory == read.memory and text_unreadable.cost == read.cost
    parts = {"params": 0, "optimizer": 0, "multitask": 0, "batch": 0}
    args = (0.0, parts, planner.describe_topology("v5e:2x2", 1), 1e9, {"passages": 8})
    readable = planner.step_report(step, programs.Result(read, 1.0, None, []), *args)
    unreadable = planner.step_report(step, programs.Result(text_unreadable, 1.0, None, []), *args)
    assert readable["hlo_unreadable"] is None and readable["estimated_step_seconds"] and readable["program"]
    assert "async-update instruction" in unreadable["hlo_unreadable"]
    assert unreadable["memory_per_device"] == readable["memory_per_device"] and unreadable["fits"]
    assert unreadable["estimated_step_seconds"] is None and unreadable["collectives"] == {} == unreadable["program"]
    assert planner.compiler_seconds(text_unreadable) == (0.0, 0.0)
    report = {"steps": {"encode": unreadable}, "replicated_params": [], "gathered_copy_bytes": None,
              "compiler": {"jax": jax.__version__, "libtpu": "0.0.52"}}
    (line,) = plan_text.problems(report)
    assert line.startswith(f"encode step: jax {jax.__version__} cannot read back what libtpu 0.0.52 compiled "
                           "(INTERNAL: RET_CHECK"), line
    assert "and it has no time estimate" in line
    # the hint names the pinned libtpu, and only when another one compiled the plan
    assert line.endswith(f"pip install libtpu=={planner.PINNED_LIBTPU} (with no other libtpu ahead of it on "
                         "PYTHONPATH)"), line
    report["compiler"]["libtpu"] = planner.PINNED_LIBTPU
    (line,) = plan_text.problems(report)
    assert line.endswith("and it has no time estimate"), line


def test_the_plan_names_the_pinned_libtpu_that_requirements_dev_installs():
    from process_harness import REPO

    from t5_retrieval.plan import planner

    with open(os.path.join(REPO, "requirements-dev.txt")) as f:
        pins = [line.split("==")[1].strip() for line in f if line.startswith("libtpu==")]
    assert pins == [planner.PINNED_LIBTPU]


def test_a_scanned_rematerialised_step_with_pallas_attention_compiles_and_is_timed_by_its_unrolled_programs():
    """The T5 files' stack (scanned layers, each recomputed in the backward pass) with Pallas flash
    attention compiles for the TPU: the kernels run inside the scan's body, once per device shard.
    The step's time comes from the 1- and 2-layer unrolled programs, the kernels' unpriced FLOPs
    (`kernel_costs`) extrapolated with it."""
    from t5_retrieval.models import attention
    from t5_retrieval.plan import text as plan_text

    report = plan_json("v5e:2x2", "data_parallel", "--gin.NUM_LAYERS=3", "--gin.T5Config.scan_layers=True",
                       "--gin.T5Config.remat=True", "--gin.ATTENTION_IMPL='pallas_tpu'")
    for name in ("train", "encode"):
        step = report["steps"][name]
        assert step["fits"], report["problems"]
        points = step["loop_free_estimate"]["seconds"]
        assert step["estimate_source"] == "extrapolated to 3 layers", step["loop_free_estimate"]
        assert step["estimated_step_seconds"] == pytest.approx(2 * points["2 layers"] - points["1 layer"])
        assert step["kernel_seconds"] == step["loop_free_estimate"]["kernel_seconds"] >= 0
    train, encode = (report["steps"][name]["custom_kernels"] for name in ("train", "encode"))
    # the scanned program as written: the encoder's layer body holds the forward kernel (the one
    # decoder step stays on XLA); training adds the backward kernels and, with remat, the forward again
    assert set(encode) == {"flash_forward"} and encode["flash_forward"]["with_cost_estimate"] >= 1, encode
    assert set(train) == {"flash_forward", "flash_dkv", "flash_dq"}, train
    assert train["flash_dkv"]["count"] == train["flash_dq"]["count"] >= 1
    assert train["flash_forward"]["count"] > train["flash_dkv"]["count"], "remat recomputes the forward kernel"
    assert train["flash_dkv"]["with_cost_estimate"] == train["flash_dq"]["with_cost_estimate"] == 0
    # on each device's shard: 64 passages per data shard at 4 heads, 32 positions (keys padded to 128),
    # head dimension 16, float32 compute; the kernel once in the scanned body
    rows = 64
    assert encode["flash_forward"]["count"] == 1
    assert encode["flash_forward"]["flops"] == attention.flash_cost(rows, 4, 32, 32, 16, 4, True)["flops"], encode
    # the text report lists them, and labels the parts of an estimate that has kernel FLOPs added
    step = report["steps"]["train"]
    seconds = step["estimated_step_seconds"]
    text = plan_text.render({**report, "steps": {"train": {**step, "kernel_seconds": seconds / 4}}})
    assert "custom kernels (each priced by the cost model from the cost estimate it carries, else by its bytes " \
           "alone; a kernel in a loop body counted once): flash_forward x" in text, text
    assert (f"extrapolated to 3 layers: {seconds * 1e3:,.3f} ms per step ({seconds * 0.75e3:,.3f} ms the cost "
            f"model's + {seconds * 0.25e3:,.3f} ms of kernel FLOPs it leaves unpriced)") in text, text


def test_the_short_attention_kernels_compile_for_the_tpu_and_are_priced_with_their_flops():
    """'pallas_tpu_short' in the train and encode steps: Mosaic compiles both kernels for v5e, each
    carries its cost estimate (so the cost model prices it and the plan adds nothing), and the
    report counts the FLOPs the kernels do on each device's shard: 2 matmuls forward, 5 backward."""
    from t5_retrieval.inference import ACCELERATOR_ENCODE_BATCH_PER_SHARD
    from t5_retrieval.models import short_attention

    report = plan_json("v5e:2x2", "data_parallel", "--gin.ATTENTION_IMPL='pallas_tpu_short'")
    train, encode = (report["steps"][name] for name in ("train", "encode"))
    assert train["fits"] and encode["fits"], report["problems"]
    assert train["kernel_seconds"] == encode["kernel_seconds"] == 0, "every kernel carries its cost estimate"
    kernels = train["custom_kernels"]
    assert set(kernels) == {"short_forward", "short_backward"}, kernels
    assert all(k["with_cost_estimate"] == k["count"] for k in kernels.values()), kernels
    # one layer, unrolled: each group of texts (the queries, the passages) once through the encoder's
    # self-attention; 2 rows per device at 16-token queries, 4 passages (1 negative each) at 32, 4 heads of 16
    matmul = {"queries": 2 * 2 * 4 * 16 * 16 * 16, "passages": 2 * 4 * 4 * 32 * 32 * 16}
    assert kernels["short_forward"]["count"] == kernels["short_backward"]["count"] == 2, kernels
    assert kernels["short_forward"]["flops"] == short_attention.FORWARD_MATMULS * sum(matmul.values())
    assert kernels["short_backward"]["flops"] == short_attention.BACKWARD_MATMULS * sum(matmul.values())
    passages = ACCELERATOR_ENCODE_BATCH_PER_SHARD  # the encode step's rows on each data shard
    assert encode["custom_kernels"]["short_forward"]["flops"] == \
        short_attention.FORWARD_MATMULS * 2 * passages * 4 * 32 * 32 * 16


def test_a_per_task_step_is_timed_as_the_sum_of_its_task_passes_and_update():
    """TACO's step timed from its parts compiled alone (each task's gradient pass, the update, and
    with `gather_params_once` the parameters' gather) agrees with the compiler's estimate of the
    whole step where that one is right: tasks of different query lengths (no task loop) and one
    layer (a loop of one iteration)."""
    report = plan_json("v5e:2x2", "fsdp", *TACO, "--gin.QUERY_LEN={'demo_fever': 16, 'demo_trex': 8}",
                       "--gin.T5Config.scan_layers=True", "--gin.train.gather_params_once=True")
    train = report["steps"]["train"]
    parts = train["loop_free_estimate"]["seconds"]
    assert [t["query_len"] for t in report["tasks"]] == [16, 8]
    assert train["estimate_source"] == ("sum of 2 task passes, each unrolled at 1 layer, and the update and the "
                                        "parameter gather")
    assert set(parts) == {"demo_fever (x1)", "demo_trex (x1)", "update", "parameter gather"}, parts
    assert all(parts.values()), parts
    assert train["estimated_step_seconds"] == pytest.approx(sum(parts.values()))
    # below the whole step (5.7% here, 3.2% without the gather): the parts leave out stacking the K
    # gradients and splitting the keys
    np.testing.assert_allclose(train["estimated_step_seconds"], train["compiler_seconds"], rtol=0.08)
    # the passes read the parameters gathered once: the step's all-gathers are not per layer and pass
    assert train["collectives"]["all-gather"]["count"] < 100, train["collectives"]
    assert report["gathered_copy_bytes"] is None and report["problems"] == [], report["problems"]


def test_memory_from_parts_is_the_larger_of_the_last_task_pass_and_the_update():
    from t5_retrieval.plan.parts import memory_from_parts

    arguments = {"params": 100, "optimizer": 200, "multitask": 300, "batch": 10}
    task_pass = {"arguments": 120, "outputs_not_donated": 100, "temporaries": 1_000, "code": 5}
    update = {"arguments": 900, "outputs_not_donated": 0, "temporaries": 400, "code": 7}
    # the last of 3 passes: state 600 + batch 10 + 2 earlier gradients 200 + its temporaries and gradient 1,100
    memory = memory_from_parts(arguments, 100, 3, [task_pass], update, 0, hbm=5_000)
    assert memory == {**arguments, "arguments": 610, "outputs_not_donated": 0, "temporaries": 1_300, "code": 12,
                      "peak": 1_922, "hbm": 5_000, "margin": 3_078}
    # a pass reading the parameters gathered whole holds them too; a large update wins
    assert memory_from_parts(arguments, 100, 3, [task_pass], update, 50, hbm=5_000)["peak"] == 1_972
    update = {**update, "temporaries": 2_000}
    assert memory_from_parts(arguments, 100, 3, [task_pass], update, 0, hbm=2_000)["peak"] == 10 + 900 + 2_000 + 12


def test_from_parts_plans_a_per_task_step_without_compiling_it_whole():
    """`--from_parts`: TACO's step is not compiled whole (the compile that outgrew a 23 GiB host for
    T5-base); its memory comes from its task passes and update compiled alone, its time, as always,
    from their loop-free programs: the same time as the plan that also compiles the whole step."""
    config = (*TACO, "--gin.QUERY_LEN={'demo_fever': 16, 'demo_trex': 8}", "--gin.T5Config.scan_layers=True",
              "--gin.train.gather_params_once=True")
    from t5_retrieval.plan import text as plan_text

    whole = plan_json("v5e:2x2", "fsdp", *config)["steps"]["train"]
    report = plan_json("v5e:2x2", "fsdp", *config, "--from_parts")
    text = plan_text.render(report)
    assert "not compiled whole (--from_parts)" in text and "collectives: not counted" in text, text
    train = report["steps"]["train"]
    assert whole["memory_source"] == "program" and train["memory_source"] == "parts"
    assert train["compile_seconds"] == 0 and train["parts_memory"]["compile_seconds"] > 0
    assert len(train["parts_memory"]["passes"]) == 2, train["parts_memory"]  # two query lengths: two passes
    assert train["estimate_source"] == whole["estimate_source"]
    assert train["estimated_step_seconds"] == pytest.approx(whole["estimated_step_seconds"], rel=1e-6)
    memory = train["memory_per_device"]
    for what in ("params", "optimizer", "multitask", "batch"):
        assert memory[what] == whole["memory_per_device"][what], what
    # state, batch, the other task's gradient and the gathered copy at least, and every part's code
    assert memory["peak"] >= memory["params"] * 2 + memory["optimizer"] + memory["multitask"] + memory["batch"]
    assert memory["code"] > 0 and memory["peak"] + memory["margin"] == memory["hbm"]


def test_from_parts_is_refused_for_a_step_that_is_one_program():
    code, _, err = run_plan("--topology", "v5e:2x2", *TINY, "--gin_file=sharding/fsdp.gin", "--from_parts")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "plan it without --from_parts" in err, err


def test_the_parameter_gather_is_of_the_copy_the_network_reads():
    """With `gather_params_once` and bfloat16 compute the gathered copy is the bfloat16 one the
    network reads (all but its norm scales and position biases): about half the float32 bytes, in
    the gathered buffers and in the all-gathers (TPU pads small dimensions, so not exactly half)."""
    from t5_retrieval import sharding
    from t5_retrieval.models.build import build_model
    from t5_retrieval.plan import hlo
    from t5_retrieval.plan.steps import lower_param_gather

    def gathered_bytes(dtype: str) -> tuple[int, int]:
        mesh, config = _t5_base_mesh_and_config(f"DTYPE = '{dtype}'")
        compiled = lower_param_gather(build_model(config), config, mesh, sharding.LAYOUTS["fsdp"]).compile()
        return (compiled.memory_analysis().output_size_in_bytes,
                hlo.collectives(compiled.as_text())["all-gather"]["bytes"])

    (bf16_out, bf16_gathered), (f32_out, f32_gathered) = gathered_bytes("bfloat16"), gathered_bytes("float32")
    assert 0.45 * f32_out < bf16_out < 0.6 * f32_out, (bf16_out, f32_out)
    assert 0.45 * f32_gathered < bf16_gathered < 0.6 * f32_gathered, (bf16_gathered, f32_gathered)


def test_a_plan_writes_no_tpu_program_into_the_persistent_cache(tmp_path):
    """JAX cannot load a TPU program compiled for a described topology back from its cache, so a
    plan must not write one there, also in a process whose cache is in use (as the tests' is). In a
    process of its own, with a cache of its own: the suite's cache is shared with other workers."""
    import subprocess
    import sys

    from process_harness import REPO

    script = """
import os
import jax, numpy as np
from jax.sharding import Mesh
from t5_retrieval import gin_utils, sharding
from t5_retrieval.models.build import build_model, model_config
from t5_retrieval.plan import planner
from t5_retrieval.plan.steps import lower_encode_step

gin_utils.parse_gin(["models/t5_tiny.gin"], ["VOCAB_SIZE = 512", "D_MODEL = 32", "D_FF = 64", "NUM_LAYERS = 1"])
config = model_config()
mesh = Mesh(np.array(planner.describe_topology("v5e:2x2", 1).devices).reshape(4, 1), ("data", "model"))
step = lower_encode_step(build_model(config), config, 24, mesh, sharding.LAYOUTS["fsdp"])
jax.jit(lambda x: x * 3 + 1)(np.arange(7.0))  # the cache is in use in this process (CPU programs)
cache = os.environ["JAX_COMPILATION_CACHE_DIR"]
before = set(os.listdir(cache))
assert before, "the CPU programs should have been cached"
compiled = planner.compile_timed(step.lowered)
assert compiled.program is not None
print(sorted(set(os.listdir(cache)) - before))
"""
    # every compile is cached, however fast (the suite's threshold is 0.5 s)
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", f"written into the cache: {proc.stdout.strip()}"
