"""Encode throughput: our jitted ST5-EncDec DualEncoder vs transformers' PyTorch T5, float32 on CPU.

Both do the same work on the same random weights (copied from the PyTorch model into ours, and the
embeddings compared): the encoder over a [batch, length] token batch with ragged padding, then one
decoder step from start token 0 cross-attending to it; the embedding is the decoder's final-norm
state. PyTorch runs under `torch.inference_mode()` with as many threads as XLA uses (all cores).
Compile time is reported separately; repeats are interleaved (ours, theirs, ours, ...) and the
speed-up is a ratio from the same run. Sizes are the project's gin files (models/t5_<size>.gin).

    .venv/bin/python benchmarks/bench_encode.py [--sizes small base] [--batch 32] [--length 128]
"""

from __future__ import annotations

import common

ORIGINAL_BLAS_ENV = common.reexec_without_env()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import gin  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from t5_retrieval import gin_utils  # noqa: E402
from t5_retrieval.models import hf_import  # noqa: E402
from t5_retrieval.models.dual_encoder import DualEncoder  # noqa: E402
from t5_retrieval.models.t5 import T5Config, abstract_params  # noqa: E402

TARGET_SPEEDUP = 1.5


def t5_config(size: str) -> T5Config:
    """The project's T5 v1.1 config of a size (gin_configs/models/t5_<size>.gin), float32, no dropout,
    layers unrolled: the profile attributes time to each layer's ops and bench_flops compares with
    XLA's FLOP count, and a scanned stack hides both (XLA counts a loop body once, under `while`)."""
    gin.clear_config()
    gin_utils.parse_gin([f"models/t5_{size}.gin"], [])
    cfg = T5Config()
    gin.clear_config()
    return dataclasses.replace(cfg, dropout_rate=0.0, dtype="float32", scan_layers=False)


def hf_t5(cfg: T5Config, seed: int = 0) -> transformers.T5Model:
    """A randomly initialised transformers T5Model (encoder + decoder, no LM head) of the same shape."""
    torch.manual_seed(seed)
    config = transformers.T5Config(
        vocab_size=cfg.vocab_size, d_model=cfg.d_model, d_kv=cfg.d_kv, d_ff=cfg.d_ff,
        num_layers=cfg.num_encoder_layers, num_decoder_layers=cfg.num_decoder_layers,
        num_heads=cfg.num_heads, relative_attention_num_buckets=cfg.relative_attention_num_buckets,
        relative_attention_max_distance=cfg.relative_attention_max_distance, dropout_rate=0.0,
        layer_norm_epsilon=cfg.layer_norm_epsilon, feed_forward_proj=cfg.mlp_activation,
        tie_word_embeddings=cfg.tie_word_embeddings, decoder_start_token_id=0, pad_token_id=0,
        use_cache=False)
    return transformers.T5Model(config).eval()


def ours_from_hf(cfg: T5Config, hf: transformers.T5Model) -> tuple[DualEncoder, dict]:
    """Our DualEncoder and its variables, holding the PyTorch model's weights, so both sides compute the same function."""
    model = DualEncoder(cfg)
    target = abstract_params(model, jnp.ones((1, 4), jnp.int32))
    tensors = {name: t.detach().numpy() for name, t in hf.state_dict().items()}
    params = {"t5": hf_import.convert(tensors, cfg, target["t5"], source="transformers.T5Model")}
    return model, jax.device_put({"params": params})


def random_tokens(rng: np.random.Generator, rows: int, length: int, vocab_size: int) -> np.ndarray:
    """Token ids in [2, vocab) with ragged lengths in [length/2, length], EOS (1) last, 0 = padding."""
    tokens = rng.integers(2, vocab_size, size=(rows, length), dtype=np.int32)
    lengths = rng.integers(max(1, length // 2), length + 1, size=rows)
    tokens[np.arange(length)[None, :] >= lengths[:, None]] = 0
    tokens[np.arange(rows), lengths - 1] = 1
    return tokens


def hf_embed(hf: transformers.T5Model, tokens: torch.Tensor) -> torch.Tensor:
    """ST5-EncDec with transformers: encoder, then one decoder step from token 0."""
    start = torch.zeros((tokens.shape[0], 1), dtype=torch.long)
    out = hf(input_ids=tokens, attention_mask=tokens != 0, decoder_input_ids=start, use_cache=False)
    return out.last_hidden_state[:, 0]


def torch_info(threads: int) -> dict:
    """Which BLAS torch runs on (build config and the libraries mapped into this process)."""
    config = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", config)
    with open("/proc/self/maps") as f:
        libs = sorted({os.path.basename(line.split()[-1]) for line in f
                       if any(k in line for k in ("blas", "mkl", "dnnl", "gomp", "iomp"))})
    return {"torch": torch.__version__, "transformers": transformers.__version__, "threads": threads,
            "blas_info": blas.group(1) if blas else "unknown", "mkl_available": torch.backends.mkl.is_available(),
            "mkldnn_available": torch.backends.mkldnn.is_available(), "loaded_blas_libs": libs,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def _computations(hlo: str) -> dict[str, str]:
    """Bodies of the computations in an HLO module's text, by name."""
    bodies = {}
    for block in re.split(r"\n(?=%|ENTRY )", hlo):
        header = re.match(r"(?:ENTRY )?%?([\w.-]+) ", block)
        if header:
            bodies[header.group(1)] = block
    return bodies


def xla_time_breakdown(compiled: jax.stages.Compiled, run: Callable[[], Any], top: int = 12) -> dict[str, float]:
    """Share of traced XLA op time per model part, from one profiled call.

    Each executed HLO instruction is labelled by where it comes from in the model (stack/sub-layer
    from its op_name metadata) and whether it is (or fuses) a matmul.
    """
    bodies = _computations(compiled.as_text())
    entry = next(body for body in bodies.values() if body.startswith("ENTRY"))
    labels = {}
    for line in entry.splitlines():
        match = re.match(r"\s*%?([\w.-]+) = .*?op_name=\"([^\"]+)\"", line)
        if not match:
            continue
        name, op_name = match.groups()
        callee = re.search(r"calls=%([\w.-]+)", line)
        callee = callee.group(1) if callee else None
        is_matmul = " dot(" in line or (callee is not None and " dot(" in bodies.get(callee, ""))
        where = re.search(r"(encoder|decoder)/(?:layers_\d+/)?(\w+)", op_name)
        part = "/".join(where.groups()) if where else "outside the model (loss, optimiser, ...)"
        direction = "backward " if "transpose(" in op_name else ""
        labels[name] = f"{direction}{part} {'matmul' if is_matmul else 'other'}"
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            run()
        path = next(os.path.join(root, f) for root, _, files in os.walk(directory)
                    for f in files if f.endswith(".xplane.pb"))
        profile = jax.profiler.ProfileData.from_file(path)
    totals: dict[str, float] = {}
    for plane in profile.planes:
        for line in plane.lines:
            for event in line.events:
                if event.name in labels:
                    totals[labels[event.name]] = totals.get(labels[event.name], 0.0) + event.duration_ns
    overall = sum(totals.values()) or 1.0
    shares = {k: v / overall for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    matmul = sum(v for k, v in shares.items() if k.endswith("matmul"))
    return {"matmul_share": matmul, "top": dict(list(shares.items())[:top])}


def torch_time_breakdown(run: Callable[[], Any], top: int = 8) -> dict[str, float]:
    """Share of self CPU time of transformers' top aten ops, from one profiled call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    overall = sum(e.self_cpu_time_total for e in events) or 1.0
    return {e.key: e.self_cpu_time_total / overall for e in events[:top]}


def bench_size(size: str, batch: int, length: int, repeats: int, seed: int, profile: bool) -> dict:
    cfg = t5_config(size)
    hf = hf_t5(cfg, seed)
    model, variables = ours_from_hf(cfg, hf)
    tokens = random_tokens(np.random.default_rng(seed), batch, length, cfg.vocab_size)
    jax_tokens, torch_tokens = jnp.asarray(tokens), torch.from_numpy(tokens).long()

    start = time.perf_counter()
    encode = jax.jit(model.apply).lower(variables, jax_tokens).compile()
    compile_s = time.perf_counter() - start
    with torch.inference_mode():
        ours_first = np.asarray(encode(variables, jax_tokens))  # warm-up
        theirs_first = hf_embed(hf, torch_tokens).numpy()  # warm-up
        max_abs_diff = float(np.max(np.abs(ours_first - theirs_first)))
        scale = float(np.max(np.abs(theirs_first)))
        times = common.interleaved_times({
            "ours": lambda: jax.block_until_ready(encode(variables, jax_tokens)),
            "transformers": lambda: hf_embed(hf, torch_tokens),
        }, repeats)
        breakdown = {
            "ours_xla_op_time": xla_time_breakdown(encode, lambda: jax.block_until_ready(encode(variables, jax_tokens))),
            "transformers_aten_self_time": torch_time_breakdown(lambda: hf_embed(hf, torch_tokens)),
        } if profile else None
    speed = common.speedup(times, "ours", "transformers")
    return {
        "config": dataclasses.asdict(cfg), "batch": batch, "length": length,
        "non_padding_fraction": float(np.mean(tokens != 0)),
        "compile_s": compile_s,
        "embeddings_max_abs_diff": max_abs_diff, "embeddings_max_abs": scale,
        "embeddings_match": max_abs_diff <= 1e-3 * max(scale, 1.0),
        "ours": {**common.summarize(times["ours"]), "texts_per_s": batch / np.median(times["ours"])},
        "transformers": {**common.summarize(times["transformers"]),
                         "texts_per_s": batch / np.median(times["transformers"])},
        "speedup": speed, "target_speedup": TARGET_SPEEDUP,
        "target_met": speed["ratio_of_medians"] >= TARGET_SPEEDUP,
        "time_breakdown": breakdown,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["small", "base"],
                        help="model sizes: gin_configs/models/t5_<size>.gin (tiny for smoke tests)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch intra-op threads (XLA's CPU backend uses all cores)")
    parser.add_argument("--profile", action="store_true",
                        help="also record where each side spends its time (one extra profiled call each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="results path (default benchmarks/results/encode.json)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    by_size = {size: bench_size(size, args.batch, args.length, args.repeats, args.seed, args.profile) for size in args.sizes}
    result = {
        "what": "texts/s of one ST5-EncDec embedding pass (encoder + 1 decoder step), float32",
        "machine": common.machine_info(jax=jax.__version__, jax_backend=jax.default_backend(),
                                       jax_devices=jax.device_count()),
        "blas_env_at_start": ORIGINAL_BLAS_ENV, "blas_env_for_run": "unset",
        "torch": torch_info(args.threads), "args": vars(args), "by_size": by_size,
    }
    summary = "; ".join(
        f"{size} {args.batch}x{args.length}: ours {r['ours']['texts_per_s']:.1f} texts/s vs transformers "
        f"{r['transformers']['texts_per_s']:.1f} (x{r['speedup']['ratio_of_medians']:.2f}, "
        f"target x{TARGET_SPEEDUP} {'met' if r['target_met'] else 'MISSED'}, compile {r['compile_s']:.1f}s)"
        for size, r in by_size.items())
    common.write_results("encode", result, summary, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
