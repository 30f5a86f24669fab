"""Collectives of a compiled (partitioned) XLA program, by type and bytes, read from its HLO text.

Each instruction is counted once where it is written: an all-reduce inside a `lax.scan` body runs
once per iteration but appears once. Asynchronous pairs count at their `-start`. XLA:TPU writes a
reduce-scatter it made from an all-reduce and a slice as a fusion computation named
`all-reduce-scatter` (an all-reduce whose result is sliced): counted as a reduce-scatter of the
computation's result.

Custom TPU kernels (Pallas, lowered by Mosaic to `tpu_custom_call`) are read the same way:
`tpu_kernels` lists each one as written, with its operand and result shapes and whether it carries
a cost estimate (Pallas attaches one where the kernel's author gave it).
"""

from __future__ import annotations

import math
import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# `%name = <shape or tuple of shapes> <op>(` where op is a collective, optionally its async -start.
_INSTRUCTION = re.compile(r"=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
# `%all-reduce-scatter.3 (input: f32[128,32]) -> f32[32,32] {`: the header of such a fusion computation
_FUSED_REDUCE_SCATTER = re.compile(r"^%all-reduce-scatter[\w.]*\s*\(.*\)\s*->\s*(?P<shape>.*\S)\s*\{$")
_ARRAY = re.compile(r"(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\]")
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64,
         "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "f8e4m3fn": 8, "f8e5m2": 8}


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string ('f32[8,4]{1,0}' or a tuple of them); token and opaque shapes count 0."""
    return sum(math.prod(int(d) for d in m["dims"].split(",") if d) * _BITS.get(m["dtype"], 0) // 8
               for m in _ARRAY.finditer(shape))


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """{op: {"count", "bytes"}} over the program's collectives (output shapes; async starts include
    their operands in the tuple, so an async op's bytes count its buffers as XLA allocates them)."""
    out: dict[str, dict[str, int]] = {}
    fused_result: str | None = None  # inside an all-reduce-scatter computation: its result shape
    for line in hlo_text.splitlines():
        header = _FUSED_REDUCE_SCATTER.match(line)
        if header is not None or line.startswith("}"):
            fused_result = header["shape"] if header is not None else None
            continue
        found = _INSTRUCTION.search(line)
        if found is None:
            continue
        op, shape = ("reduce-scatter", fused_result) if fused_result else (found["op"], found["shape"])
        entry = out.setdefault(op, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += shape_bytes(shape)
    return out


def program_size(hlo_text: str) -> dict[str, int]:
    """Instructions, fusions and convolutions (TPU matmuls) of a compiled program: what its compile
    time grows with."""
    lines = [line for line in hlo_text.splitlines() if " = " in line]
    return {"instructions": len(lines), "fusions": sum(" fusion(" in line for line in lines),
            "convolutions": sum(" convolution(" in line for line in lines)}


# `%name = <result shape or tuple> custom-call(...), custom_call_target="tpu_custom_call",
# operand_layout_constraints={<operand shapes>}, ...`: a Mosaic (Pallas) kernel of a compiled TPU program
_TPU_KERNEL = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>\S+)\s*=\s*(?P<shape>\(.*?\)|\S+)\s+custom-call\(.*?"
                         r'custom_call_target="tpu_custom_call", '
                         r"operand_layout_constraints=\{(?P<operands>(?:[^{}]|\{[^{}]*\})*)\}")
# The attention kernels by the names jax gives them: Pallas flash attention's ("flash_attention"
# forward, its residual-saving "jvp" form included; "flash_mha_bwd_dkv_..." and
# "flash_mha_bwd_dq_..." backward) and `models.short_attention`'s forward and backward.
ATTENTION_KERNELS = (("bwd_dkv", "flash_dkv"), ("bwd_dq", "flash_dq"), ("flash_attention", "flash_forward"),
                     ("short_attention_forward", "short_forward"), ("short_attention_backward", "short_backward"))


def _dims(shape: str) -> list[int]:
    found = _ARRAY.search(shape)
    return [int(d) for d in found["dims"].split(",") if d] if found else []


def tpu_kernels(hlo_text: str) -> list[dict[str, object]]:
    """Each custom TPU kernel of a compiled program as written (one in a loop body once): its
    instruction name, kind (`ATTENTION_KERNELS`, else "other"), the shapes of its first two operands
    (the attention kernels' q and k, [b, heads, length, head dim]), operand and result bytes, and whether
    it carries a cost estimate."""
    found = []
    for line in hlo_text.splitlines():
        kernel = _TPU_KERNEL.match(line)
        if kernel is None:
            continue
        operands = [m.group(0) for m in _ARRAY.finditer(kernel["operands"])]
        kind = next((k for marker, k in ATTENTION_KERNELS if marker in kernel["name"]), "other")
        found.append({"name": kernel["name"], "kind": kind,
                      "q": _dims(operands[0]) if operands else [], "k": _dims(operands[1]) if len(operands) > 1 else [],
                      "bytes": sum(shape_bytes(o) for o in operands) + shape_bytes(kernel["shape"]),
                      "cost_estimate": '"cost_estimate"' in line})
    return found
