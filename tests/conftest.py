"""Shared test setup: every JAX of the suite, in this process and in the subprocesses it starts,
compiles fast and shares one persistent XLA compilation cache (`process_harness.use_test_settings`)."""

import os

from process_harness import use_test_settings

use_test_settings(os.environ)  # before JAX is imported: it reads these at import

import pytest  # noqa: E402

import t5_retrieval.tasks  # noqa: E402,F401  (tests that ask seqio itself for a project Task, as a seqio user would)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.path.join(os.path.dirname(REPO), "shared", "data", "mini_kilt")


def mini_kilt(*parts: str) -> str:
    """A path in the mini-KILT data, which stands beside the repository (`../shared/data/mini_kilt`,
    as CI checks it out). Missing, the test fails rather than skips: a skip would hide the tests
    that compare with the data's own references."""
    if not os.path.isdir(SHARED_DATA):
        pytest.fail(f"mini-KILT data not found at {SHARED_DATA}: the tests that read it expect ../shared/data/mini_kilt "
                    "beside the repository", pytrace=False)
    return os.path.join(SHARED_DATA, *parts)


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


@pytest.fixture(scope="module")
def cli_dirs(tmp_path_factory) -> tuple[str, str]:
    """A passage store of test_retrieval_serve's KB and a brute-force index over its lexical
    embeddings, as `t5r serve --kb_dir --index_dir` reads them (the serve tests' command lines)."""
    from test_retrieval_serve import KB

    from t5_retrieval.data.stores import embedding_store
    from t5_retrieval.data.stores.kb import write_passage_store
    from t5_retrieval.retrieval import scann_index
    from t5_retrieval.retrieval.encoder import HashedBagOfWordsEncoder

    root = tmp_path_factory.mktemp("cli")
    kb_dir, emb_dir, idx_dir = (str(root / d) for d in ("kb", "emb", "idx"))
    write_passage_store(((p, None) for p in KB), kb_dir)
    embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=64), KB, [p.id for p in KB], emb_dir, progress=False)
    scann_index.build_scann_index(emb_dir, scann_index.ScannConfig(mode="brute_force")).save(idx_dir)
    return kb_dir, idx_dir


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
    from t5_retrieval.data import layout
    from t5_retrieval.data.kilt.prepare import prepare_kb, prepare_negatives, prepare_tasks
    from t5_retrieval.data.kilt.synthetic import write_demo
    from t5_retrieval.retrieval.index import build_bm25_index_for_kb

    write_demo(str(root / "raw"), num_pages=30, train_per_task=8, dev_per_task=2)
    out = str(root / "data")
    prepare_kb(str(root / "raw" / "kb" / "pages.jsonl"), out)
    prepare_tasks(str(root / "raw"), out, list(tasks), ("train",))
    prepare_negatives(out, list(tasks), top_k=5, index=build_bm25_index_for_kb(layout.kb_dir(out)))
    return out


def run_plan(*argv: str) -> tuple[int, str, str]:
    """`t5r plan` as a user runs it, exit 2 included: (code, stdout, stderr), gin cleared before and after."""
    import contextlib
    import io

    import gin

    from t5_retrieval import cli

    gin.clear_config()
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(["plan", *argv])
    finally:
        gin.clear_config()
    return code, out.getvalue(), err.getvalue()
