"""docs/cli.md and docs/gin.md are what `python -m t5_retrieval.commands.reference docs` writes from
the parsers and gin files as they are now; docs/pods_table.md opens as benchmarks/bench_plan.py
writes it."""

import argparse
import ast
import glob
import os
import re
import subprocess
import sys

import pytest

from t5_retrieval import cli
from t5_retrieval.commands import reference

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REGENERATE = f"cd {REPO} && .venv/bin/{reference.REGENERATE}"


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return reference.pages(cli.COMMANDS)


@pytest.mark.parametrize("name", ["cli.md", "gin.md"])
def test_committed_reference_is_what_the_generator_writes(pages, name):
    with open(os.path.join(REPO, "docs", name), encoding="utf-8") as f:
        committed = f.read()
    assert committed == pages[name], f"docs/{name} is out of date; regenerate it: {REGENERATE}"


def test_cli_reference_lists_every_command_and_every_flag_its_parser_has(pages):
    text = pages["cli.md"]
    for name, (target, _) in cli.COMMANDS.items():
        section = text.split(f"\n## t5r {name}\n", 1)[1].split("\n## ", 1)[0]
        parser = reference.command_parser(target)
        for action in parser._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction) \
                    and action.dest not in ("gin_file", "gin_search_paths"):
                assert f"`{action.option_strings[0]}`" in section, f"t5r {name}: {action.option_strings[0]} missing"


def flags_without_help(parser: argparse.ArgumentParser) -> list[str]:
    return [(action.option_strings or [action.dest])[0] for action in parser._actions
            if not isinstance(action, argparse._HelpAction) and action.help != argparse.SUPPRESS
            and not (action.help or "").strip()]


def test_every_flag_of_every_command_has_help():
    gin_parser = argparse.ArgumentParser(prog="t5r COMMAND")
    reference.add_gin_flags(gin_parser)
    missing = {"(gin flags)": flags_without_help(gin_parser)}
    missing.update({f"t5r {name}": flags_without_help(reference.command_parser(target))
                    for name, (target, _) in cli.COMMANDS.items()})
    missing = {name: flags for name, flags in missing.items() if flags}
    assert not missing, f"flags with no help= (docs/cli.md shows an empty row for each): {missing}"


def test_cli_reference_shows_defaults_and_required_flags(pages):
    serve = pages["cli.md"].split("\n## t5r serve\n", 1)[1].split("\n## ", 1)[0]
    assert "| `--port` | `PORT` | `8080` |" in serve
    assert re.search(r"\| `--index_dir` \| `INDEX_DIR` \| required \|", serve)
    assert "| `--verify` | `stamp` \\| `full` | `stamp` |" in serve


def test_capturing_a_parser_does_not_run_the_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parse = argparse.ArgumentParser.parse_known_args
    parser = reference.command_parser(cli.COMMANDS["demo"][0])  # `main` would run the demo into ./demo_out
    assert parser.prog == "t5r demo" and os.listdir(tmp_path) == []
    assert argparse.ArgumentParser.parse_known_args is parse, "argparse's parsing was not put back"


def test_gin_reference_gives_each_macro_its_files_values_and_readers(pages):
    rows = {line.split(" | ")[0].strip("| `"): line for line in pages["gin.md"].splitlines()
            if line.startswith("| `") and line.split(" | ")[0].strip("| `").isupper()}
    assert "`768` (models/t5_base.gin)" in rows["D_MODEL"] and "`4096` (models/t5_xxl.gin)" in rows["D_MODEL"]
    assert "`T5Config.d_model`" in rows["D_MODEL"]
    assert "command line only" in rows["DATA_DIR"] and "`make_train_iterator.data_dir`" in rows["DATA_DIR"]
    assert "`%gin.REQUIRED` (runs/base.gin)" in rows["TRAIN_STEPS"]
    assert "`None` (runs/base.gin: directory of negatives files" in rows["NEGATIVES"]  # with its comment
    assert "MODEL_DIR" in rows  # a launch macro no file reads


def test_the_generator_writes_both_pages(tmp_path):
    subprocess.run([sys.executable, "-m", "t5_retrieval.commands.reference", str(tmp_path)], check=True,
                   capture_output=True, cwd=REPO, timeout=600)
    for name in ("cli.md", "gin.md"):
        assert open(tmp_path / name, encoding="utf-8").read() == open(os.path.join(REPO, "docs", name),
                                                                      encoding="utf-8").read()


def bench_plan_constant(name: str) -> str:
    """A string constant of benchmarks/bench_plan.py, read without importing it (importing a benchmark
    may re-execute the process without some BLAS variables)."""
    tree = ast.parse(open(os.path.join(REPO, "benchmarks", "bench_plan.py"), encoding="utf-8").read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"benchmarks/bench_plan.py defines no {name}")


def test_pods_table_page_opens_as_bench_plan_writes_it():
    page = open(os.path.join(REPO, "docs", "pods_table.md"), encoding="utf-8").read()
    assert page.startswith(bench_plan_constant("PAGE_HEAD")), \
        "docs/pods_table.md: its head differs from bench_plan.PAGE_HEAD; rewrite it with " \
        ".venv/bin/python benchmarks/bench_plan.py --no_compile --table docs/pods_table.md"
    assert bench_plan_constant("TABLE_HEAD") in page


DOCS = sorted(glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))


def heading_anchors(path: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but `-` and `_` dropped,
    spaces as `-`, a repeated heading numbered."""
    text = re.sub(r"```.*?```", "", open(path, encoding="utf-8").read(), flags=re.S)
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        number = 0
        while (candidate := slug if number == 0 else f"{slug}-{number}") in anchors:
            number += 1
        anchors.add(candidate)
    return anchors


def relative_links(path: str) -> list[str]:
    text = re.sub(r"```.*?```", "", open(path, encoding="utf-8").read(), flags=re.S)
    return [link for link in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", link)]


def test_the_docs_index_links_every_page():
    index = os.path.join(REPO, "docs", "README.md")
    linked = {os.path.normpath(os.path.join(REPO, "docs", link.partition("#")[0])) for link in relative_links(index)}
    unlinked = [os.path.relpath(p, REPO) for p in DOCS
                if p != index and p not in linked and os.path.dirname(p) != os.path.join(REPO, "docs", "run_records")]
    assert not unlinked, f"docs/README.md links no guide, reference or record to {unlinked}"
    assert "docs/README.md" in {link.partition("#")[0] for link in relative_links(os.path.join(REPO, "README.md"))}


@pytest.mark.parametrize("path", [os.path.join(REPO, "README.md"), *DOCS], ids=lambda p: os.path.relpath(p, REPO))
def test_every_relative_link_of_the_docs_resolves(path):
    for link in relative_links(path):
        target, _, anchor = link.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
        assert os.path.exists(resolved), f"{os.path.relpath(path, REPO)}: ({link}) names no file"
        if anchor and resolved.endswith(".md"):
            assert anchor in heading_anchors(resolved), f"{os.path.relpath(path, REPO)}: ({link}) names no heading"
