"""The foundation benchmarks run end to end at tiny sizes and write complete results (so they can't rot).

Each runs as a script in its own subprocess, exactly as documented, writing to a temporary file
instead of benchmarks/results/. The speed numbers are not judged here (timings are not tests);
what must hold is that every field exists, times are positive, and both sides of each comparison
computed the same thing.
"""

import json
import os
import subprocess
import sys

import pytest
from process_harness import REPO, jax_env


def run_benchmark(name: str, args: list[str], out: str, extra_env: dict[str, str] | None = None) -> tuple[dict, str]:
    env = dict(jax_env(1), **(extra_env or {}))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", f"bench_{name}.py"), *args,
                           "--out", out], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"bench_{name}.py failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"bench_{name}: "), \
        f"expected one summary line 'bench_{name}: ...', got {lines}"
    with open(out) as f:
        return json.load(f), lines[0]


def assert_positive_timing(section: dict, rate_key: str, where: str) -> None:
    for key in ("median_s", "min_s", "max_s", rate_key):
        assert section.get(key, 0) > 0, f"{where}.{key}: expected a positive number, got {section.get(key)}"


def test_encode_benchmark_writes_throughputs_of_matching_embeddings_and_profiles(tmp_path):
    result, _ = run_benchmark("encode", ["--sizes", "tiny", "--batch", "2", "--length", "8", "--repeats", "2",
                                         "--profile"], str(tmp_path / "encode.json"))
    row = result["by_size"]["tiny"]
    assert_positive_timing(row["ours"], "texts_per_s", "ours")
    assert_positive_timing(row["transformers"], "texts_per_s", "transformers")
    assert row["compile_s"] > 0 and row["speedup"]["ratio_of_medians"] > 0, row
    assert row["ours"]["repeats"] == row["transformers"]["repeats"] == 2, "expected 2 interleaved repeats each"
    assert row["embeddings_match"], f"ours and transformers embed differently: max diff {row['embeddings_max_abs_diff']}"
    assert result["torch"]["threads"] >= 1 and result["torch"]["blas_info"], result["torch"]
    ours_profile = row["time_breakdown"]["ours_xla_op_time"]
    assert 0 < ours_profile["matmul_share"] <= 1, f"profile found no matmul time: {ours_profile}"
    assert any(part.startswith("encoder/") for part in ours_profile["top"]), ours_profile["top"]
    torch_profile = row["time_breakdown"]["transformers_aten_self_time"]
    assert torch_profile and all(op.startswith("aten::") for op in torch_profile), torch_profile
    assert 0 < sum(torch_profile.values()) <= 1 + 1e-6, f"shares of total time must sum to <= 1: {torch_profile}"


def test_kb_encode_benchmark_compares_minilm_with_the_sentence_transformers_recipe(tmp_path):
    from t5_retrieval.data.kilt.prepare import prepare_kb
    from t5_retrieval.data.kilt.synthetic import write_demo

    write_demo(str(tmp_path / "raw"), num_pages=12, train_per_task=1, dev_per_task=1)
    prepare_kb(str(tmp_path / "raw" / "kb" / "pages.jsonl"), str(tmp_path / "data"))
    result, summary = run_benchmark("encode_kb", ["--kb_dir", str(tmp_path / "data" / "kb"), "--passages", "10",
                                                  "--batch_sizes", "4", "--repeats", "2"], str(tmp_path / "kb.json"))
    ours, theirs = result["by_candidate"]["ours_batch_4"], result["by_candidate"]["transformers"]
    assert_positive_timing(ours, "passages_per_s", "ours_batch_4")
    assert_positive_timing(theirs, "passages_per_s", "transformers")
    assert ours["repeats"] == theirs["repeats"] == 2 and ours["speedup"]["ratio_of_medians"] > 0, ours
    assert ours["max_abs_diff_to_transformers"] < 1e-5, "MiniLM embeds differently here and in transformers"
    assert result["machine"]["cpu"]["model"], result["machine"]
    assert "10 passages" in summary


def test_train_step_benchmark_writes_step_times_with_equal_first_losses(tmp_path):
    result, _ = run_benchmark("train_step", ["--sizes", "tiny", "--queries", "2", "--tasks", "2",
                                             "--query_len", "8", "--passage_len", "8", "--repeats", "1"],
                              str(tmp_path / "train_step.json"))
    row = result["by_size"]["tiny"]
    assert_positive_timing(row["ours"], "steps_per_s", "ours")
    assert_positive_timing(row["transformers"], "steps_per_s", "transformers")
    assert row["batch"]["queries_per_task"] == [1, 1], f"2 queries over 2 tasks, got {row['batch']}"
    loss = row["first_step_loss"]
    assert loss["match"] and loss["ours"] > 0, f"same weights and batch must give the same loss: {loss}"
    assert row["compile_s"] > 0 and row["speedup"]["ratio_of_medians"] > 0, row


def test_flops_benchmark_counts_what_xla_counts_and_records_cleared_blas_env(tmp_path):
    result, line = run_benchmark("flops", ["--size", "tiny", "--batch", "2", "--length", "8", "--gemm", "64",
                                           "--repeats", "2"], str(tmp_path / "flops.json"),
                                 extra_env={"OPENBLAS_CORETYPE": "Haswell"})
    assert result["blas_env_at_start"]["OPENBLAS_CORETYPE"] == "Haswell", result["blas_env_at_start"]
    for part in ("encoder", "gemm", "torch_gemm"):
        assert result[part]["flops_per_s"] > 0, f"{part}.flops_per_s: expected > 0, got {result[part]}"
    assert result["fraction_of_gemm"] > 0 and "of GEMM" in line, line
    analytic, xla = result["encoder_flops"]["total"], result["xla_cost_analysis_flops"]
    # XLA also counts norms, softmax and activations, so it is a little above the matmul count.
    assert analytic <= xla <= 1.2 * analytic, f"analytic matmul FLOPs {analytic} vs XLA's {xla}: count is off"



def test_attention_benchmark_compiles_each_tpu_core_and_counts_the_short_kernels_flops(tmp_path):
    """One attention block compiled for a v5e device under each TPU implementation; the short
    kernels carry their cost estimate and the report counts their matmuls (2 forward, 5 backward)."""
    result, summary = run_benchmark("attention", ["--batch", "8", "--length", "24"], str(tmp_path / "attention.json"))
    costs = result["implementations"]
    assert set(costs) == {"xla", "pallas_tpu", "pallas_tpu_short"} and all(c["seconds"] > 0 for c in costs.values())
    assert set(costs["pallas_tpu"]["kernels"]) == {"flash_forward", "flash_dq", "flash_dkv"}
    short = costs["pallas_tpu_short"]["kernels"]
    matmul = 2 * 8 * 12 * 24 * 24 * 64  # one matmul of a row: [24, 64] x [64, 24] per head
    assert short["short_forward"]["flops"] == 2 * matmul and short["short_backward"]["flops"] == 5 * matmul, short
    assert all(k["with_cost_estimate"] == k["count"] == 1 for k in short.values()), short
    assert costs["pallas_tpu_short"]["unpriced_kernel_seconds"] == 0 and "pallas_tpu_short" in summary


def test_encode_devices_benchmark_runs_each_device_count_in_its_own_process(tmp_path):
    result, line = run_benchmark("encode_devices", ["--devices", "1,2", "--passages", "16", "--length", "8",
                                                    "--batch", "8", "--repeats", "1"], str(tmp_path / "dev.json"))
    assert sorted(result["runs"]) == ["1", "2"], result["runs"].keys()
    assert [result["runs"][n]["devices"] for n in ("1", "2")] == [1, 2], "XLA_FLAGS did not reach the workers"
    assert all(r["passages_per_s"] > 0 for r in result["runs"].values())
    assert result["efficiency_vs_1_device"]["1"] == 1.0 and "2 dev" in line


def test_seqio_path_benchmark_materialises_reads_back_and_batches_every_example(tmp_path):
    result, summary = run_benchmark("seqio_path", ["--examples", "800", "--batching_steps", "2"],
                                    str(tmp_path / "r.json"))
    assert result["examples"] == 800, "8 Tasks x 100 examples, each read through seqio and back from the cache"
    assert result["cache_bytes"] > 0 and result["batching_examples_per_s"] > 0
    assert result["reference"]["step_queries_per_s_per_device"] == pytest.approx(349.6, rel=0.01)
    assert "seqio path, 800 examples" in summary


def test_scann_scale_benchmark_measures_each_layout_in_its_own_process(tmp_path):
    result, summary = run_benchmark("scann_scale", ["--n", "4000", "--queries", "50", "--layouts", "ah4+int8", "ah1",
                                                    "--leaves_to_search", "10", "--reorder_depths", "300"],
                                    str(tmp_path / "r.json"))
    for name in ("ah4+int8", "ah1"):
        layout = result["layouts"][name]
        assert layout["resident_bytes_per_vector"] > 0 and layout["serialized_bytes_per_vector"] > 0, layout
        assert 0 < layout["sweep"][0]["recall"] <= 1 and layout["sweep"][0]["qps"] > 0
    assert result["layouts"]["ah4+int8"]["sweep"][0]["reorder_depth"] == 300
    assert summary.startswith("bench_scann_scale: ScaNN 4,000 x 768")
