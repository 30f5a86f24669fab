"""A new user's path: README's "Stage by stage" commands, run as written, in order, on a tiny model
trained by `t5r train`, with every stage's outputs checked; then docs/retrieval.md's `Searcher`
example on what they wrote.

The `t5r` commands run in-process through `cli.main` (as `launch/run.py` runs them), except
`t5r serve` and `curl`, which run as the processes a user starts: the server on a free loopback port
instead of README's 8080.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request

import gin
import pytest

from t5_retrieval import cli
from t5_retrieval.data import layout
from t5_retrieval.data.records import read_examples, read_negatives
from t5_retrieval.data.stores.kb import PassageStore

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_PORT = "8080"


def code_block(path: str, heading: str, language: str) -> str:
    """The first ```language block after `heading` in a markdown file."""
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        section = f.read().split(heading, 1)[1]
    return section.split(f"```{language}\n", 1)[1].split("```", 1)[0]


def readme_commands() -> list[str]:
    """README's stage commands, one per line (continuation lines joined)."""
    return [line for line in code_block("README.md", "## Stage by stage", "bash").replace("\\\n", " ").splitlines()
            if line.strip()]


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def t5r(line: str) -> None:
    argv = shlex.split(line)
    assert argv[0] == "t5r", line
    try:
        assert cli.main(argv[1:]) == 0, f"failed: {line}"
    finally:
        gin.clear_config()


def start_server(line: str, port: int, cwd: str) -> subprocess.Popen:
    """README's `t5r serve ... &` as a process of the venv's `t5r`, once /health answers."""
    argv = shlex.split(line.replace(f"--port={README_PORT}", f"--port={port}").rstrip("& "))
    argv[0] = os.path.join(os.path.dirname(sys.executable), "t5r")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    server = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    while time.time() < deadline:
        assert server.poll() is None, f"t5r serve exited with {server.returncode}: {server.stdout.read()}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                health = json.load(reply)
            assert health["tasks"] == ["demo_fever", "demo_nq"], health
            return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise AssertionError("t5r serve did not answer /health within 180 s")


def check_metrics(tables: dict, tasks: list[str]) -> None:
    assert list(tables) == tasks, f"expected tables {tasks}, got {list(tables)}"
    for task, table in tables.items():
        assert table["n"] == 8, (task, table)
        for name, value in table.items():
            assert name.startswith("n") or 0.0 <= value <= 1.0, f"{task} {name} = {value}, expected in [0, 1]"


def check_trec_run(eval_dir: str, task: str) -> None:
    """Each query's run lists passages with ranks 1..n and non-increasing scores, and maps to the
    pages of the KILT predictions beside it, in order."""
    store = PassageStore.open(layout.kb_dir("data"))
    with open(os.path.join(eval_dir, "predictions", f"{task}.jsonl")) as f:
        pages = {row["id"]: [p["wikipedia_id"] for p in row["output"][0]["provenance"]] for row in map(json.loads, f)}
    runs: dict[str, list[tuple[str, int, float]]] = {}
    with open(os.path.join(eval_dir, "predictions", f"{task}.trec")) as f:
        for line in f:
            qid, q0, pid, rank, score, tag = line.split()
            assert (q0, tag) == ("Q0", "t5r"), line
            runs.setdefault(qid, []).append((pid, int(rank), float(score)))
    assert set(runs) == set(pages), "one run per predicted query"
    for qid, rows in runs.items():
        assert [r for _, r, _ in rows] == list(range(1, len(rows) + 1)), f"{qid}: ranks must count from 1"
        scores = [s for _, _, s in rows]
        assert all(math.isfinite(s) for s in scores) and scores == sorted(scores, reverse=True), qid
        ranked_pages = list(dict.fromkeys(store.page_of(pid) for pid, _, _ in rows))
        assert ranked_pages == pages[qid], f"{qid}: the run's pages must be the predictions' pages"


def test_readme_stage_commands_run_in_order_and_produce_every_stage_output(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    commands = readme_commands()
    assert [c.split()[:2] for c in commands if c.startswith("t5r")][-1] == ["t5r", "export"]
    port, server = free_port(), None
    for line in commands:
        if line.startswith("t5r serve"):
            server = start_server(line, port, str(tmp_path))
        elif line.startswith("until "):  # README's wait for the server, run as pasted (on the test's port)
            assert server is not None, "README waits for t5r serve after starting it"
            subprocess.run(["bash", "-c", line.replace(f":{README_PORT}/", f":{port}/")], timeout=60, check=True)
        elif line.startswith("curl"):
            assert server is not None, "README must start t5r serve before searching it"
            reply = subprocess.run(shlex.split(line.replace(f":{README_PORT}/", f":{port}/")), capture_output=True,
                                   text=True, timeout=60, check=True).stdout
            answer = json.loads(reply)
            hits = answer["results"]
            assert answer["task"] == "demo_fever", "the request named the task by its dataset"
            assert [h["rank"] for h in hits] == [1, 2, 3, 4, 5], answer
            assert all(h["passage_id"].startswith(h["wikipedia_id"]) and h["title"] for h in hits), hits
            assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True), hits
        elif line == "kill %1":
            server.terminate()
            assert server.wait(timeout=30) is not None
        else:
            t5r(line)

    # data + vocab
    assert os.path.exists("data/spm.model")
    for dataset in ("fever", "nq"):
        assert len(read_examples(layout.examples_path("data", dataset, "dev"))) == 8
    # train: the model knows its tasks by registered name and dataset
    with open("run/model/model_config.json") as f:
        tasks = json.load(f)["features"]["tasks"]
    assert {t: s["dataset"] for t, s in tasks.items()} == {"demo_fever": "fever", "demo_nq": "nq"}
    with open("run/model/metrics.jsonl") as f:
        assert all(math.isfinite(json.loads(line).get("loss", 0.0)) for line in f), "training losses must be finite"
    # encode + index
    with open("run/index/index.json") as f:
        assert json.load(f)["num_passages"] == len(PassageStore.open("data/kb").ids())
    # eval: keyed by the model's task names, also when --tasks names a task by its dataset; same numbers
    with open("run/eval/results.json") as f:
        default = json.load(f)
    with open("run/eval_fever/results.json") as f:
        named = json.load(f)
    check_metrics(default, ["demo_fever", "demo_nq"])
    check_metrics(named, ["demo_fever"])
    assert named["demo_fever"] == default["demo_fever"], "naming the task must not change its scores"
    for task in ("demo_fever", "demo_nq"):
        check_trec_run("run/eval", task)
    # mine: negatives named by dataset, one row per train query, none on a gold page
    store = PassageStore.open("data/kb")
    for dataset in ("fever", "nq"):
        examples = {e.id: e for e in read_examples(layout.examples_path("data", dataset, "train"))}
        mined = read_negatives(f"data/negatives/ance-1/{dataset}-train.jsonl")
        assert set(mined) == set(examples) and len(mined) == 16, (dataset, len(mined))
        for qid, negatives in mined.items():
            gold = {p for s in examples[qid].gold_pages for p in s}
            assert negatives and not {store.page_of(pid) for pid in negatives} & gold, (qid, negatives)
    # export
    assert os.path.exists("run/export/1/saved_model.pb") and os.path.isdir("run/export/1/variables")

    # docs/retrieval.md's Searcher example, as written, on these files
    capsys.readouterr()
    exec(compile(code_block("docs/retrieval.md", "## Python: `Searcher`", "python"), "docs/retrieval.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 5 and all(" page demo" in line for line in printed), printed

    # Either name of a task gives the same hits; an unknown one names both forms of the model's tasks.
    from t5_retrieval.searcher import Searcher

    searcher = Searcher.open("run/model", "run/index", "data/kb")
    queries = [e.query for e in read_examples(layout.examples_path("data", "nq", "dev"))[:3]]
    by_dataset, by_name = searcher.search(queries, task="nq", k=4), searcher.search(queries, task="demo_nq", k=4)
    assert by_dataset == by_name and all(len(hits) == 4 for hits in by_dataset), by_dataset
    with pytest.raises(ValueError, match=r"unknown task 'wow'.*demo_fever \(dataset fever\), demo_nq \(dataset nq\)"):
        searcher.search(queries, task="wow")

    # t5r mine by registered name writes the dataset's file, as by dataset; an unknown task is a clear error.
    t5r("t5r mine --checkpoint_dir=run/model --index_dir=run/index --data_dir=data --tasks=demo_nq --source=named")
    assert read_negatives("data/negatives/named/nq-train.jsonl") == read_negatives("data/negatives/ance-1/nq-train.jsonl")
    capsys.readouterr()
    assert cli.main(["eval", "--checkpoint_dir=run/model", "--index_dir=run/index", "--data_dir=data",
                     "--tasks=wow", "--output_dir=run/eval_wow"]) == 2
    assert "unknown task 'wow'; this model was trained on: demo_fever (dataset fever), demo_nq (dataset nq)" in \
        capsys.readouterr().err
