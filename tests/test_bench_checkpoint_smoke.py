"""benchmarks/bench_checkpoint.py runs end to end at tiny sizes and writes complete results.

Timings are not judged (they are not tests); what must hold: every size restored equal to what was
saved, every field exists, and each kill of the training run was followed by a resume that repeated
no more steps than lie between two checkpoints.
"""

from test_benchmarks_smoke import assert_positive_timing, run_benchmark


def test_checkpoint_benchmark_times_save_restore_and_counts_steps_repeated_after_kills(tmp_path):
    result, line = run_benchmark("checkpoint", ["--sizes_mb", "0.25", "1", "--repeats", "2", "--kills", "2",
                                                "--checkpoint_every", "4", "--steps", "16"],
                                 str(tmp_path / "checkpoint.json"))
    for size, row in result["save_restore_by_param_mb"].items():
        assert row["restored_equal"], f"{size} MB: restored state differs from the saved one"
        assert row["state_bytes"] >= 3 * row["param_bytes"], f"{size} MB: params + two Adam moments expected"
        assert_positive_timing(row["save"], "mb_per_s", f"{size}.save")
        assert_positive_timing(row["restore"], "mb_per_s", f"{size}.restore")
    resume = result["resume"]
    assert resume["finished"], f"the killed run should finish after its restarts: {resume}"
    assert len(resume["kills"]) == 2, resume["kills"]
    for kill in resume["kills"]:
        # The checkpoint of the last logged step may be incomplete at the kill; the one before exists.
        assert 0 <= kill["steps_repeated"] <= 4, f"a resume repeats at most one checkpoint interval (4): {kill}"
    assert "steps repeated" in line, line
