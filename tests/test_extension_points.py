"""docs/architecture.md, "Where to change what", holds: each common change touches only the files it names.

Each test makes the change the page describes in a copy of the library (new modules and edits to the
named files only), runs what a user then runs with it, in a fresh process on that copy, and checks
that every file it changed is one the page names for that change.
"""

from __future__ import annotations

import filecmp
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.tiny_model import TASKS, _bindings, build_tiny_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = "t5_retrieval"


def named_files(change: str) -> list[str]:
    """The files docs/architecture.md names for `change` (its bullet under "Where to change what"):
    every backticked path (a placeholder such as `<name>` stands for the new thing's name)."""
    with open(os.path.join(REPO, "docs", "architecture.md"), encoding="utf-8") as f:
        page = f.read()
    bullet = re.search(rf"^- \*\*{re.escape(change)}\*\*(.*?)(?=^- |^#|\Z)", page, re.S | re.M)
    assert bullet, f"docs/architecture.md has no bullet '- **{change}**'"
    return [p for p in re.findall(r"`([^`\s]+)`", bullet.group(1)) if p.endswith((".py", ".gin", ".md"))]


def changed_files(original: str, copy: str) -> list[str]:
    """Paths (relative to the library's parent) of the files that differ between the two trees or are new."""
    out = []
    for root, dirs, files in os.walk(copy):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, os.path.dirname(copy))
            before = os.path.join(os.path.dirname(original), relative)
            if not os.path.exists(before) or not filecmp.cmp(before, path, shallow=False):
                out.append(relative)
    return sorted(out)


def assert_only_named(changed: list[str], change: str, name: str) -> None:
    named = [re.sub(r"<[^>]+>", name, p) for p in named_files(change)]  # `<name>`, `<family>`: the new one's name
    # a `*` in a named path stands for any part of a name (`<name>_*.gin`: the new family's sizes)
    unnamed = [c for c in changed if not any(fnmatch.fnmatch(c, n) or fnmatch.fnmatch(c, "*/" + n) for n in named)]
    assert not unnamed, f"the change '{change}' touched {unnamed}, which docs/architecture.md does not name ({named})"


def train_to_eval(model_gin: str, gin_flags: list[str], model: object, out: object, data_dir: str, tasks: str) -> str:
    """A script running what a user runs with a new model or tasks: `t5r train` (two steps), encode,
    index and eval."""
    return textwrap.dedent(f"""
        assert cli.main(["train", "--model_dir={model}", "--gin_file={model_gin}", "--gin_file=runs/base.gin",
                         *{gin_flags!r}]) == 0
        assert cli.main(["encode", "--checkpoint_dir={model}", "--kb_dir={data_dir}/kb",
                         "--output_dir={out}/emb"]) == 0
        assert cli.main(["index", "--embeddings_dir={out}/emb", "--output_dir={out}/index", "--backend=exact"]) == 0
        assert cli.main(["eval", "--checkpoint_dir={model}", "--index_dir={out}/index", "--data_dir={data_dir}",
                         "--tasks={tasks}", "--split=dev", "--output_dir={out}/eval"]) == 0
    """)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_run(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def library_copy(tmp_path):
    """A copy of the library beside nothing else: a process with it first on its path imports it."""
    copy = tmp_path / "src" / LIBRARY
    shutil.copytree(os.path.join(REPO, LIBRARY), copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def run_on_copy(copy, script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy.parent), REPO]), "JAX_PLATFORMS": "cpu"}
    prologue = (f"import t5_retrieval\nassert t5_retrieval.__file__.startswith({str(copy)!r}), "
                "t5_retrieval.__file__\nfrom t5_retrieval import cli\n")
    result = subprocess.run([sys.executable, "-c", prologue + textwrap.dedent(script)], env=env, cwd=copy.parent,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


TOY_INDEX = '''\
"""A toy backend: brute-force inner products in float64, its vectors in one .npy file."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from t5_retrieval.data.stores import embedding_store
from t5_retrieval.retrieval.stored_index import StoredIndex, read_complete_store


class ToyIndex(StoredIndex):
    backend = "toy"

    def __init__(self, vectors, passage_ids, fingerprint, source="", meta=None, embeddings_dir=""):
        super().__init__(passage_ids, fingerprint, vectors.shape[1], source, meta, embeddings_dir)
        self.vectors = np.asarray(vectors, np.float64)

    def search(self, query_embeddings, k):
        queries = self._queries(query_embeddings, k).astype(np.float64)
        scores = queries @ self.vectors.T
        rows = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        return list(rows), list(np.take_along_axis(scores, rows, axis=1).astype(np.float32))

    def _write_assets(self, directory):
        np.save(os.path.join(directory, "toy.npy"), self.vectors)

    def _parameters(self) -> dict[str, Any]:
        return {"toy": {"vectors": "toy.npy"}}

    @classmethod
    def _load(cls, directory, record, passage_ids):
        return cls(np.load(os.path.join(directory, "toy.npy")), passage_ids, record["fingerprint"],
                   source=directory, meta=record.get("meta", {}), embeddings_dir=record.get("embeddings_dir", ""))


def build_toy_index(embeddings_dir: str) -> ToyIndex:
    manifest, ids = read_complete_store(embeddings_dir)
    return ToyIndex(embedding_store.load_matrix(embeddings_dir), ids, manifest.fingerprint, source=embeddings_dir,
                    meta=manifest.meta, embeddings_dir=os.path.abspath(embeddings_dir))
'''

REGISTER_TOY_INDEX = '''
from t5_retrieval.retrieval.toy_index import ToyIndex, build_toy_index  # noqa: E402

BACKENDS["toy"] = ToyIndex
BUILDERS["toy"] = lambda embeddings_dir, staging_dir: build_toy_index(embeddings_dir)
'''


def test_a_new_index_backend_touches_only_the_files_the_page_names(tiny, library_copy, tmp_path):
    (library_copy / "retrieval" / "toy_index.py").write_text(TOY_INDEX)
    with open(library_copy / "retrieval" / "index.py", "a") as f:
        f.write(REGISTER_TOY_INDEX)

    root, out = os.path.dirname(tiny.data_dir), tmp_path / "out"
    run_on_copy(library_copy, f"""
        for backend in ("toy", "exact"):
            assert cli.main(["index", "--embeddings_dir={root}/emb_0", f"--output_dir={out}/index_{{backend}}",
                             f"--backend={{backend}}"]) == 0
            assert cli.main(["eval", "--checkpoint_dir={root}/model_0", f"--index_dir={out}/index_{{backend}}",
                             "--data_dir={tiny.data_dir}", "--tasks=demo_fever,demo_trex", "--split=dev",
                             f"--output_dir={out}/eval_{{backend}}"]) == 0
    """)
    toy, exact = (json.load(open(out / f"eval_{b}" / "results.json")) for b in ("toy", "exact"))
    assert json.load(open(out / "index_toy" / "index.json"))["backend"] == "toy"
    assert toy == exact, "a correct brute-force backend scores as the exact one does"
    assert_only_named(changed_files(os.path.join(REPO, LIBRARY), str(library_copy)), "A new index backend", "toy")


TOY_FAMILY = """\
TOY = [Dataset(dataset_task("fever", "FEVER", 12), "FC", 8, 4), Dataset(dataset_task("trex", "TREX", 10), "SF", 8, 4)]

"""


def test_a_new_task_family_touches_only_the_files_the_page_names(tiny, library_copy, tmp_path):
    families = library_copy / "data" / "tasks" / "shipped.py"
    text = families.read_text()
    table = 'FAMILIES: dict[str, list[Dataset]] = {"kilt": KILT, "mini_kilt": MINI_KILT, "demo": DEMO}'
    assert table in text
    families.write_text(text.replace(table, TOY_FAMILY + table.replace("}", ', "toy": TOY}')))

    # The family's own query lengths, not the tiny run's one QUERY_LEN for every task.
    bindings = [b for b in _bindings(tiny.data_dir, tiny.vocabulary) if not b.startswith(("MIXTURE", "QUERY_LEN"))]
    gin_flags = [f"--gin.{b.replace(' = ', '=')}" for b in [*bindings, "MIXTURE_OR_TASK_NAME = 'toy'", "TRAIN_STEPS = 2"]]
    model, out = tmp_path / "model", tmp_path / "out"
    run_on_copy(library_copy, train_to_eval("models/t5_tiny.gin", gin_flags, model, out, tiny.data_dir, "toy"))
    results = json.load(open(out / "eval" / "results.json"))
    assert sorted(results) == sorted(f"toy_{t}" for t in TASKS), results
    assert json.load(open(model / "model_config.json"))["features"]["tasks"]["toy_trex"]["query_len"] == 10
    assert_only_named(changed_files(os.path.join(REPO, LIBRARY), str(library_copy)), "A new retrieval dataset", "toy")


TOY_MODEL = '''\
"""A toy model family: the mean of a text's token embeddings through one dense layer."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import gin
import jax

from t5_retrieval.models.dual_encoder import QueryTowers, mean_pool
from t5_retrieval.models.families import ModelFamily, register_family


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ToyConfig:
    vocab_size: int = 512
    dim: int = 16


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ToyDualEncoderConfig(QueryTowers):
    logit_scale: float = 1.0
    query_towers: int = 0
    separate_query_encoder: bool = False

    @property
    def query_generation(self) -> bool:
        return False


class EmbeddingBag(nn.Module):
    config: ToyConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embedded = nn.Embed(self.config.vocab_size, self.config.dim)(tokens)
        return nn.Dense(self.config.dim)(mean_pool(embedded, tokens != 0))


class ToyDualEncoder(nn.Module):
    toy_config: ToyConfig
    config: ToyDualEncoderConfig = ToyDualEncoderConfig()

    def setup(self) -> None:
        self.toy = EmbeddingBag(self.toy_config)
        self.query_toy = [EmbeddingBag(self.toy_config, name=f"query_toy_{k}")
                          for k in range(self.config.num_query_towers)]

    @property
    def embedding_dim(self) -> int:
        return self.toy_config.dim

    def __call__(self, tokens: jax.Array, deterministic: bool = True, tower: int | None = None) -> jax.Array:
        if self.is_initializing() and tower is None:
            for k in range(self.config.num_query_towers):
                self(tokens, deterministic, tower=k)
        return (self.toy if tower is None else self.query_toy[tower])(tokens)

    def embed_groups(self, tokens, deterministic: bool = True, tower: int | None = None) -> tuple:
        return tuple(self(group, deterministic, tower) for group in tokens)


def toy_forward_flops(config: dict[str, Any], rows: int, length: int) -> float:
    return float(2 * rows * config["toy"]["dim"] ** 2)


register_family(ModelFamily(name="toy", network=ToyConfig, head=ToyDualEncoderConfig, module=ToyDualEncoder,
                            depth_keys=(), forward_flops=toy_forward_flops))
'''

TOY_SIZE = """\
model_config.family = "toy"
ToyConfig.vocab_size = %VOCAB_SIZE
ToyConfig.dim = %D_MODEL
"""

FAMILY_IMPORTS = "    pretrained,  # gin: @minilm_l6_dir\n"


def test_a_new_model_family_touches_only_the_named_files(tiny, library_copy, tmp_path):
    (library_copy / "models" / "toy.py").write_text(TOY_MODEL)
    (library_copy / "gin_configs" / "models" / "toy_tiny.gin").write_text(TOY_SIZE)
    build = library_copy / "models" / "build.py"
    text = build.read_text()
    assert FAMILY_IMPORTS in text
    build.write_text(text.replace(FAMILY_IMPORTS, FAMILY_IMPORTS + "    toy,\n"))

    # The tiny run's sizes but the T5-only ones (t5r train refuses a macro no gin file reads).
    bindings = [b for b in _bindings(tiny.data_dir, tiny.vocabulary) if not b.startswith(("D_FF", "NUM_LAYERS"))]
    gin_flags = [f"--gin.{b.replace(' = ', '=')}" for b in [*bindings, "TRAIN_STEPS = 2"]]
    model, out = tmp_path / "model", tmp_path / "out"
    ran = run_on_copy(library_copy, train_to_eval("models/toy_tiny.gin", gin_flags, model, out, tiny.data_dir,
                                                  "demo_fever,demo_trex") + textwrap.dedent(f"""
        assert cli.main(["export-hf", "--checkpoint_dir={model}", "--output_dir={out}/hf"]) == 2
    """))
    # A family that is not exported touches no export file: t5r export-hf refuses it, saying why.
    assert "family='toy': Hugging Face export writes" in ran.stderr, ran.stderr[-2000:]
    config = json.load(open(model / "model_config.json"))
    assert (config["family"], config["toy"]) == ("toy", {"vocab_size": 512, "dim": 32}), config
    results = json.load(open(out / "eval" / "results.json"))
    assert sorted(results) == sorted(f"demo_{t}" for t in TASKS), results
    assert_only_named(changed_files(os.path.join(REPO, LIBRARY), str(library_copy)), "A new model family", "toy")
