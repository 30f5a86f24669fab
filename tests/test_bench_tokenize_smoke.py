"""`benchmarks/bench_tokenize.py` runs end to end on a few passages and writes complete results
(so it can't rot). Speed is not judged here; what must hold is that every candidate was timed and
that ours produced exactly the rows of the former paths."""

import os

import seqio
from conftest import mini_kilt
from test_benchmarks_smoke import assert_positive_timing, run_benchmark

SPM = os.path.join(os.path.dirname(seqio.__file__), "test_data", "sentencepiece", "sentencepiece.model")


def test_tokenize_benchmark_times_every_candidate_and_ours_equals_the_former_paths(tmp_path):
    result, summary = run_benchmark("tokenize", ["--passages", "16", "--length", "32", "--repeats", "2",
                                                 "--spm_model", SPM, "--kb", mini_kilt("kb", "passages.jsonl")],
                                    str(tmp_path / "tokenize.json"))
    assert result["passages"] == 16 and result["length"] == 32, result
    families = {"bert": ("ours", "hf_fast", "python_reference"), "t5": ("ours", "hf_fast", "seqio_per_string")}
    for family, names in families.items():
        for name in names:
            assert_positive_timing(result[family][name], "texts_per_s", f"{family}.{name}")
            assert result[family][name]["repeats"] == 2, f"{family}.{name}: expected 2 interleaved repeats"
    assert result["bert"]["rows_differing_from_ours"]["python_reference"] == 0, summary
    assert result["t5"]["rows_differing_from_ours"]["seqio_per_string"] == 0, summary
    assert result["t5"]["rows_differing_from_ours"]["hf_fast"] == 0, "HF's T5 tokenizer from the same model file"
