"""A plan in words: its problems, one line each, and the whole report as a person reads it.

`planner.plan` builds the report (a dict, `t5r plan --json` prints it as it is); this module only
reads it, so the wording of a plan changes here and nowhere else.
"""

from __future__ import annotations

from typing import Any

from t5_retrieval.plan import gpu
from t5_retrieval.plan.chips import MIB, PINNED_LIBTPU


def problems(report: dict[str, Any]) -> list[str]:
    """One line per problem: a step that does not fit, a parameter the layout leaves replicated, a
    program jax cannot read back, an estimate faster than the chips can be, a gather TACO repeats."""
    lines = []
    for name, step in report["steps"].items():
        mem = step["memory_per_device"]
        if not step["fits"]:
            device = f"the {report['chip']['name']} device"
            against = (f"{device} has {mem['hbm'] / MIB:,.1f} MiB" if mem["margin"] < 0 else
                       f"within {device}'s {mem['hbm'] / MIB:,.1f} MiB, but the compiler, which keeps part of it "
                       "for itself, refused it")
            needs = "needs an estimated" if step.get("memory_source") == "parts" else "needs"
            lines.append(f"{name} step: {needs} {mem['peak'] / MIB:,.1f} MiB per device, {against} "
                         f"(layout {report['layout']}, PER_DEVICE_BATCH={report['per_device_batch']})")
    for p in report["replicated_params"]:
        lines.append(f"parameter {p['param']} {p['shape']} ({p['bytes'] / MIB:,.2f} MiB) is replicated on every "
                     f"device under layout {report['layout']}: its logical axes map to no mesh axis")
    for name, step in report["steps"].items():
        if step["hlo_unreadable"]:
            versions = report["compiler"]
            hint = ("" if versions["libtpu"] == PINNED_LIBTPU else
                    f"; libtpu {PINNED_LIBTPU}, which this project pins for this jax, reads back its own "
                    f"programs: pip install libtpu=={PINNED_LIBTPU} (with no other libtpu ahead of it on PYTHONPATH)")
            lines.append(f"{name} step: jax {versions['jax']} cannot read back what libtpu {versions['libtpu']} "
                         f"compiled ({step['hlo_unreadable']}), so its collectives and unpriced custom calls are "
                         "not counted" + ("" if step["estimated_step_seconds"] else " and it has no time estimate")
                         + hint)
    for name, step in report["steps"].items():
        if step.get("estimated_mfu", 0) > 1:
            lines.append(f"{name} step: the estimate of {step['estimated_step_seconds'] * 1e3:,.1f} ms "
                         f"({step['estimate_source']}) would run the model's matmuls at {step['estimated_mfu']:.0%} "
                         "of the chips' peak, which no step can: the cost model under-prices this program, so its "
                         "time and rates are not a plan")
    if report["gathered_copy_bytes"]:
        lines.append(f"train step: each of the {len(report['tasks'])} task passes gathers every layer's weights, "
                     f"which layout {report['layout']} shards; --gin.train.gather_params_once=True gathers them "
                     f"once per step, for a copy of {report['gathered_copy_bytes'] / MIB:,.1f} MiB per device")
    return lines


PEAK_LINE_PARTS = 4  # of a step's peak breakdown, in the text report (--json has them all)


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:,.1f} h" if seconds >= 3600 else f"{seconds:,.1f} s"


def _mib(n: float) -> str:
    return f"{n / MIB:,.1f} MiB"


def _kernel_line(kind: str, kernel: dict[str, Any]) -> str:
    flops = ("FLOPs unknown, so only its bytes are priced here" if kernel["flops"] is None
             else f"{kernel['flops'] / 1e9:,.2f} GFLOP")
    return (f"{kind} x{kernel['count']} ({kernel['with_cost_estimate']} with a cost estimate): {flops}, "
            f"{kernel['bytes'] / 1e6:,.1f} MB, roofline {kernel['roofline_seconds'] * 1e3:,.3f} ms per device")


def render(report: dict[str, Any]) -> str:
    """The report as a person reads it: a block per step, then the problems, one per line."""
    chip = report["chip"]
    lines = [f"{report['topology']} x {report['num_slices']} slice(s): {report['devices']} devices "
             f"({chip['devices_per_chip']:g} per chip, chip configuration {chip['chip_config']}), mesh "
             f"{report['mesh']}, layout {report['layout']}; per device {_mib(chip['hbm_bytes_per_device'])} HBM, "
             f"{chip['peak_bf16_flops_per_device'] / 1e12:,.1f} TFLOP/s bf16 peak ({chip['source']})",
             gpu.compiler_line(report["compiler"]) if gpu.is_gpu_report(report) else
             "compiled by libtpu {libtpu} for jax {jax}; every time below is an estimate of its cost model".format(
                 **report["compiler"]),
             "tasks (per-device rows x query length): " + ", ".join(
                 f"{t['name']} {t['per_device_rows']}x{t['query_len']}" for t in report["tasks"])
             + f"; passages {report['passage_len']} tokens, {report['num_negatives']} negatives; "
               f"multi-task: {report['multitask'] or 'none (summed losses)'}"]
    for name, step in report["steps"].items():
        mem = step["memory_per_device"]
        lines.append(f"{name} step: lowered in {step['lower_seconds']:.1f} s, "
                     f"compiled in {step['compile_seconds']:.1f} s "
                     f"({step['hlo_bytes'] / 1e6:.2f} MB StableHLO"
                     + "".join(f", {n:,} {what}" for what, n in step["program"].items()) + " compiled)")
        if step["memory_source"] == "parts":
            spent = step["parts_memory"]["compile_seconds"]
            lines.append(f"  not compiled whole (--from_parts): its memory is estimated from its task passes and "
                         f"update, each compiled alone in {spent:.1f} s; its time from its parts' loop-free programs")
        lines.append(f"  per device: params {_mib(mem['params'])}, optimiser {_mib(mem['optimizer'])}, multi-task "
                     f"{_mib(mem['multitask'])}, batch {_mib(mem['batch'])}, temporaries {_mib(mem['temporaries'])}, "
                     f"outputs {_mib(mem['outputs_not_donated'])}, code {_mib(mem['code'])}")
        if step["compiler_refused"]:
            lines.append(f"  the TPU compiler refused it: {step['compiler_refused'][:300]}")
        lines.append(f"  peak {_mib(mem['peak'])} of {_mib(mem['hbm'])}: "
                     + (f"fits, margin {_mib(mem['margin'])}" if step["fits"]
                        else f"DOES NOT FIT by {_mib(-mem['margin'])}" if mem["margin"] < 0
                        else "DOES NOT FIT: the compiler keeps part of the HBM for itself"))
        if step["peak_breakdown"]:
            lines.append("  at the peak, the compiler's largest buffers by the operation that made them: " + "; ".join(
                f"{part['what']} {_mib(part['bytes'])}" for part in step["peak_breakdown"][:PEAK_LINE_PARTS]))
        loop_free = step["loop_free_estimate"]
        if loop_free:
            lines.append(f"  the compiler prices a loop's body once: its estimate for this program "
                         f"({step['compiler_seconds'] * 1e3:,.3f} ms) is replaced by loop-free programs': "
                         + ", ".join(f"{k} " + ("none" if v is None else f"{v * 1e3:,.3f} ms")
                                     for k, v in loop_free["seconds"].items())
                         + f" (compiled in {loop_free['compile_seconds']:.1f} s)")
        if step["estimated_step_seconds"]:
            label = "compiler's estimate" if step["estimate_source"] == "compiler" else \
                f"compiler's estimate, {step['estimate_source']}"
            rates = ", ".join(f"{n:,.0f} {what}/s" for what, n in step["estimated_per_second"].items())
            seconds, kernel_s = step["estimated_step_seconds"], step["kernel_seconds"]
            parts = (f" ({(seconds - kernel_s) * 1e3:,.3f} ms the cost model's + {kernel_s * 1e3:,.3f} ms of kernel "
                     "FLOPs it leaves unpriced)" if kernel_s else "")
            lines.append(f"  {label}: {seconds * 1e3:,.3f} ms per step{parts}, {rates}, "
                         f"MFU {step['estimated_mfu']:.1%} ({step['model_matmul_flops'] / 1e12:,.3f} TFLOP matmuls)")
        elif step["compiler_optimal_seconds"]:
            lines.append(f"  compiler's estimate: unusable ({step['compiler_seconds']:.4g} s, not a time)")
        else:
            lines.append("  compiler's estimate: none given for this program")
        if step["custom_kernels"]:
            lines.append("  custom kernels (each priced by the cost model from the cost estimate it carries, else by its "
                         "bytes alone; a kernel in a loop body counted once): " + "; ".join(
                             _kernel_line(kind, k) for kind, k in step["custom_kernels"].items()))
        collectives = step["collectives"]
        lines.append("  collectives: " + ("unknown (the program cannot be read back)" if step["hlo_unreadable"] else
                                           "not counted (the step was not compiled whole)"
                                           if step["memory_source"] == "parts" else
                                           ", ".join(f"{op} x{c['count']} ({_mib(c['bytes'])})"
                                                     for op, c in sorted(collectives.items())) or "none"))
    if report["steps_per_epoch"]:
        largest = max(report["tasks"], key=lambda t: t["train_examples"])
        epoch = report["estimated_epoch_seconds"]
        lines.append(f"epoch (one pass over {largest['name']}, {largest['train_examples']:,} examples): "
                     f"{report['steps_per_epoch']:,} steps"
                     + (f", estimated {_duration(epoch)}" if epoch else ""))
    if "programs" in report:
        kept = report["programs"]
        lines.append(f"programs: {kept['compiled']:,} compiled, {kept['reused']:,} read back from {kept['cache_dir']} "
                     "(a compile time above is that of the program's first compile)")
    lines.append(f"host memory: {report['host_peak_bytes'] / 1024 ** 3:,.1f} GiB at its peak (this plan's compiles)")
    if "advice" in report:
        lines.append(f"advice: {report['advice']}")
    lines += [f"problem: {line}" for line in report["problems"]]
    return "\n".join(gpu.relabel(lines) if gpu.is_gpu_report(report) else lines)
