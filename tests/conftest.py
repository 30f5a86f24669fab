"""Shared test setup: a persistent XLA compilation cache so identical tiny steps compile once."""

import os

import jax
import pytest

import t5_retrieval.tasks  # noqa: F401  (registers the tasks and mixtures, as `t5r train` does)

CACHE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "xla")
jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.path.join(os.path.dirname(REPO), "shared", "data", "mini_kilt")


# The slowest modules, longest first (their compiles and subprocesses: 1-5 minutes each). With
# `--dist loadfile` xdist hands out whole files in collection order (the Makefile turns off its
# own reordering by test count, which put these few-test files last), so these start first and no
# worker ends the run alone on one of them.
SLOWEST_MODULES = ("test_plan.py", "test_preemption.py", "test_multihost.py", "test_sharding.py",
                   "test_multihost_ance.py", "test_scan_layers.py", "test_seqio_path.py", "test_ance.py",
                   "test_export.py", "test_bench_checkpoint_smoke.py", "test_gdmtl.py", "test_user_path.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Runs SLOWEST_MODULES first, in that order; the other modules keep theirs."""
    rank = {name: i for i, name in enumerate(SLOWEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture
def clean_gin():
    """Gin bindings are global: give each test that parses gin a clean slate."""
    import gin
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture
def artefact(tmp_path) -> str:
    """A small artefact directory (a binary file and a text file in a subdirectory) with its checksum
    record, for the tests of checksum records."""
    from t5_retrieval import checksums

    directory = tmp_path / "artefact"
    (directory / "sub").mkdir(parents=True)
    (directory / "a.bin").write_bytes(os.urandom(5000))
    (directory / "sub" / "b.txt").write_text("hello")
    checksums.record(str(directory))
    return str(directory)


def flip_byte(path: str, offset: int = -1) -> None:
    """Flips one bit of the byte at `offset` (from the end when negative): what a damaged disk does."""
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END if offset < 0 else os.SEEK_SET)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


def prepare_small_demo(root, tasks) -> str:
    """A 30-page synthetic KB with 8 train queries per task and BM25 negatives, prepared as
    `t5r data` would (`<root>/data`), for the tests that train a tiny model on real files."""
    from t5_retrieval.data.kilt.prepare import prepare_kb, prepare_negatives, prepare_tasks
    from t5_retrieval.data.kilt.synthetic import write_demo

    write_demo(str(root / "raw"), num_pages=30, train_per_task=8, dev_per_task=2)
    out = str(root / "data")
    prepare_kb(str(root / "raw" / "kb" / "pages.jsonl"), out)
    prepare_tasks(str(root / "raw"), out, list(tasks), ("train",))
    prepare_negatives(out, list(tasks), top_k=5)
    return out
