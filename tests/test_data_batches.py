"""Per-task batches on the demo data: layout, exact save/restore, host sharding, seqio agreement."""

import json
import os

import numpy as np
import pytest
import seqio

from t5_retrieval.data import layout
from t5_retrieval.data.batching.batches import choose_negatives, make_train_iterator
from t5_retrieval.data.kilt.prepare import prepare_kb, prepare_negatives, prepare_tasks
from t5_retrieval.data.kilt.synthetic import TASKS, write_demo
from t5_retrieval.data.records import DataError, Negatives, read_examples, read_negatives, write_negatives
from t5_retrieval.data.stores.kb import PassageStore, passage_text
from t5_retrieval.data.tasks import retrieval_tasks
from t5_retrieval.data.tasks.task_spec import TaskSpec
from t5_retrieval.data.text import format_query
from t5_retrieval.data.tokenizers.tokenize import encode_with_eos_markers, to_fixed_length, tokenize
from t5_retrieval.errors import UserError
from t5_retrieval.retrieval.index import build_bm25_index_for_kb

SPM = os.path.join(os.path.dirname(seqio.__file__), "test_data", "sentencepiece", "sentencepiece.model")
QLEN, PLEN, NNEG = 24, 48, 2


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    write_demo(str(root / "raw"), num_pages=60, train_per_task=24, dev_per_task=4)
    out = str(root / "data")
    prepare_kb(str(root / "raw" / "kb" / "pages.jsonl"), out)
    prepare_tasks(str(root / "raw"), out, TASKS, ("train",))
    prepare_negatives(out, TASKS, top_k=20, index=build_bm25_index_for_kb(layout.kb_dir(out)))
    return out


@pytest.fixture(scope="module")
def vocab():
    return seqio.SentencePieceVocabulary(SPM, extra_ids=100)


def _iterator(data_dir, vocab, names=("demo_trex", "demo_hotpotqa", "demo_wow"), **kw):
    args = dict(negatives=None, vocabulary=vocab, query_len=QLEN, passage_len=PLEN, num_negatives=NNEG,
                per_device_batch=6, local_data_devices=2, seed=1)
    args.update(kw)
    return make_train_iterator(list(names), data_dir, **args)


def test_batch_layout_is_positive_then_negatives_per_query(data_dir, vocab):
    it = _iterator(data_dir, vocab)
    store = PassageStore.open(os.path.join(data_dir, "kb"))
    batch = next(it)
    assert list(batch) == ["demo_trex", "demo_hotpotqa", "demo_wow"] == it.task_names
    for t, (name, sub) in enumerate(batch.items()):
        spec = retrieval_tasks.describe(seqio.get_mixture_or_task(name))
        b = it.subbatch_sizes[t]
        assert sub["query_tokens"].shape == (b, QLEN) and sub["query_tokens"].dtype == np.int32
        assert sub["passage_tokens"].shape == (b * (1 + NNEG), PLEN)
        assert (sub["task_ids"] == t).all()
        for rows in (sub["query_tokens"], sub["passage_tokens"]):
            lengths = (rows != 0).sum(1)
            assert (rows[np.arange(len(rows)), lengths - 1] == 1).all(), "every row must end with EOS then pads"
        examples = read_examples(layout.examples_path(data_dir, spec.dataset, "train"))
        by_query = {}
        for e in examples:
            key = tokenize(vocab, [format_query(e.query, spec.prefix)], QLEN)[0].tobytes()
            by_query.setdefault(key, []).append(e)
        for i, q in enumerate(sub["query_tokens"]):
            candidates = by_query[q.tobytes()]
            pos_row = sub["passage_tokens"][i * (1 + NNEG)]
            expected = [to_fixed_length(encode_with_eos_markers(vocab, passage_text(store.get(e.positive_passages[0]))),
                                        PLEN) for e in candidates]
            assert any((pos_row == x).all() for x in expected), f"row {i * (1 + NNEG)} is not query {i}'s positive"


def test_restored_iterator_reproduces_the_following_batches(data_dir, vocab):
    it = _iterator(data_dir, vocab)
    for _ in range(7):
        next(it)
    state = json.loads(json.dumps(it.state()))
    expected = [next(it) for _ in range(12)]
    fresh = _iterator(data_dir, vocab)
    fresh.restore(state)
    for want, got in zip(expected, (next(fresh) for _ in range(12))):
        for name in want:
            for key in want[name]:
                np.testing.assert_array_equal(got[name][key], want[name][key], err_msg=f"{name}/{key} differs")
    with pytest.raises(ValueError, match="seed"):
        _iterator(data_dir, vocab, seed=2).restore(state)


def test_an_epoch_over_all_hosts_visits_every_example_of_the_largest_task_exactly_once(data_dir, vocab):
    from collections import Counter

    seen = Counter()
    for host in range(2):
        it = _iterator(data_dir, vocab, names=("demo_trex",), per_device_batch=3, local_data_devices=1,
                       host_index=host, host_count=2)
        assert it.steps_per_epoch == 12 // 3, "24 examples over 2 hosts at 3 per step"
        for _ in range(it.steps_per_epoch):
            seen.update(r.tobytes() for r in next(it)["demo_trex"]["query_tokens"])
    examples = read_examples(layout.examples_path(data_dir, "trex", "train"))
    want = Counter(r.tobytes() for r in tokenize(vocab, [format_query(e.query, "TREX") for e in examples], QLEN))
    assert seen == want, "hosts must partition the examples and one epoch must visit each once"


def test_missing_hard_negatives_are_filled_with_random_non_gold_passages(data_dir, vocab, tmp_path):
    examples = read_examples(layout.examples_path(data_dir, "trex", "train"))
    write_negatives(tmp_path / "trex-train.jsonl", [Negatives(e.id, ()) for e in examples])
    it = _iterator(data_dir, vocab, names=("demo_trex",), negatives=str(tmp_path))
    a = next(it)["demo_trex"]["passage_tokens"]
    again = next(_iterator(data_dir, vocab, names=("demo_trex",), negatives=str(tmp_path)))["demo_trex"]["passage_tokens"]
    np.testing.assert_array_equal(a, again, err_msg="random fills must be deterministic for a seed")
    for i in range(0, len(a), 1 + NNEG):
        negs = a[i + 1:i + 1 + NNEG]
        assert not any((n == a[i]).all() for n in negs), "a random negative repeated the positive"


def test_seqio_task_tokenizes_queries_like_the_batcher(data_dir, vocab, monkeypatch):
    retrieval_tasks.set_data_dir(data_dir)
    retrieval_tasks.use_vocabulary(SPM)
    task = seqio.get_mixture_or_task("demo_trex")
    ds = task.get_dataset({"query": QLEN}, split="train", shuffle=False)
    got = [ex["query"] for ex in ds.as_numpy_iterator()]
    examples = read_examples(layout.examples_path(data_dir, "trex", "train"))
    want = tokenize(vocab, [format_query(e.query, "TREX") for e in examples], QLEN)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w[: len(g)], err_msg="seqio Task and batcher disagree on a query")
        assert 1 in g[:-1], "[SEP] must become an EOS id inside the query"


def test_mixtures_and_unknown_names(data_dir, vocab):
    import t5_retrieval.tasks  # noqa: F401  (registers the mixtures)

    def described(name):
        return retrieval_tasks.describe(seqio.get_mixture_or_task(name))

    assert [t.name for t, _ in retrieval_tasks.resolve("mini_kilt")][4] == "mini_kilt_entityquestions", \
        "a Mixture's Tasks in the order it declares them (seqio sorts them by name)"
    assert described("mini_kilt_entityquestions") == TaskSpec(
        "mini_kilt_entityquestions", "entityquestions", "ZSRE", 25, "beginning")
    assert described("mini_kilt_entity_linking_typed") == TaskSpec(
        "mini_kilt_entity_linking_typed", "entity_linking", "EL", 109, "mention"), "every variant reads the same"
    assert described("kilt_wow").query_len == 256, "KILT's Tasks read TACO's Table 5 lengths"
    assert described("kilt_nq_noprefix").prefix is None
    assert seqio.get_mixture_or_task("kilt").get_rate(seqio.get_mixture_or_task("kilt_trex")) == pytest.approx(
        2_284_168 ** 0.25)
    with pytest.raises(KeyError, match="unknown seqio Task or Mixture 'demo_nope' .did you mean demo_"):
        _iterator(data_dir, vocab, names=("demo_nope",))


def test_each_task_reads_its_own_query_length_unless_query_len_sets_it(data_dir, vocab):
    def widths(query_len):
        it = _iterator(data_dir, vocab, names=("demo_trex", "demo_wow"), query_len=query_len)
        batch = next(it)
        assert {t: spec["query_len"] for t, spec in it.features["tasks"].items()} == \
            {t: sub["query_tokens"].shape[1] for t, sub in batch.items()}, "the features record what was read"
        return [batch[t]["query_tokens"].shape[1] for t in ("demo_trex", "demo_wow")]

    assert widths(None) == [32, 256], "TACO's Table 5: slot filling 32, dialogue 256"
    assert widths(20) == [20, 20]
    assert widths({"wow": 40}) == [32, 40], "a dict sets the named tasks (by dataset or name) only"
    assert widths({"demo_trex": 12}) == [12, 256]
    with pytest.raises(UserError, match=r"QUERY_LEN names \['nq'\], which are not among this run's tasks"):
        widths({"nq": 40})
    with pytest.raises(UserError, match="task demo_aidayago2: query length 7: .* cannot hold the entity markers"):
        _iterator(data_dir, vocab, names=("demo_aidayago2",), query_len=7)  # 6 ids before EOS: 3 of prefix, 4 of markers


def test_few_shot_subset_is_fixed_across_seeds_and_split_between_hosts(data_dir, vocab):
    def queries(**kw) -> set[bytes]:
        it = _iterator(data_dir, vocab, names=("demo_trex",), per_device_batch=2, local_data_devices=1,
                       max_examples_per_task=8, **kw)
        assert it.steps_per_epoch == 8 // 2 // kw.get("host_count", 1), "an epoch is a pass over the subset"
        return {r.tobytes() for _ in range(it.steps_per_epoch) for r in next(it)["demo_trex"]["query_tokens"]}

    one_host = queries(seed=1)
    assert len(one_host) == 8, f"expected the 8 subset examples in one epoch, saw {len(one_host)} distinct"
    assert queries(seed=5) == one_host, "the subset must not depend on the run seed"
    per_host = [queries(seed=1, host_index=h, host_count=2) for h in range(2)]
    assert per_host[0] | per_host[1] == one_host and not per_host[0] & per_host[1], \
        "hosts must partition the same subset"


def test_passage_template_is_recorded_and_used_for_passage_tokens(data_dir, vocab):
    template = "{title}: {text}"
    it = _iterator(data_dir, vocab, names=("demo_trex",), per_device_batch=2, local_data_devices=1,
                   passage_template=template)
    assert it.features["passage_template"] == template, "inference must learn the template from the features"
    store = PassageStore.open(os.path.join(data_dir, "kb"))
    every_passage = {to_fixed_length(encode_with_eos_markers(vocab, passage_text(p, template)), PLEN).tobytes()
                     for p in store}
    rows = next(it)["demo_trex"]["passage_tokens"]
    assert all(r.tobytes() in every_passage for r in rows), "passages must be tokenised as '{title}: {text}'"
    with pytest.raises(ValueError, match="passage template"):
        passage_text(store.get(store.ids()[0]), "{text} ({title})")


def test_the_vocabulary_content_digest_is_recorded_with_its_path(data_dir):
    import hashlib

    features = _iterator(data_dir, SPM).features
    with open(SPM, "rb") as f:
        content = hashlib.sha256(f.read()).hexdigest()[:16]
    assert features["vocabulary"] == os.path.abspath(SPM)
    assert features["vocabulary_digest"] == content, "the digest must be of the file's bytes, not of its path"


def test_sampled_hard_negatives_are_a_seeded_uniform_draw_from_the_whole_list():
    mined = [f"p{rank}" for rank in range(100)]  # one example's list, best first (top-k minus gold)
    assert choose_negatives(mined, 2, "first", 0, "q1") == ["p0", "p1"]
    draws = {i: choose_negatives(mined, 2, "sampled", 0, f"q{i}") for i in range(3000)}
    assert draws[7] == choose_negatives(mined, 2, "sampled", 0, "q7"), "the draw is fixed by (seed, example id)"
    assert any(draws[i] != choose_negatives(mined, 2, "sampled", 1, f"q{i}") for i in range(10)), "seed changes it"
    for pair in draws.values():
        assert len(set(pair)) == 2 and mined.index(pair[0]) < mined.index(pair[1]), pair  # distinct, list order
    ranks = np.bincount([mined.index(p) for pair in draws.values() for p in pair], minlength=100)
    assert ranks.min() > 30 and ranks.max() < 95, f"every rank is drawn about 60 times: {ranks.min()}..{ranks.max()}"
    assert choose_negatives(mined[:2], 2, "sampled", 0, "q1") == ["p0", "p1"], "a short list is used whole"


def test_the_iterator_trains_on_sampled_hard_negatives_when_asked(data_dir, vocab):
    first = next(_iterator(data_dir, vocab, names=("demo_trex",)))["demo_trex"]["passage_tokens"]
    sampled_it = _iterator(data_dir, vocab, names=("demo_trex",), hard_negatives="sampled")
    sampled = next(sampled_it)["demo_trex"]["passage_tokens"]
    positives = slice(0, None, 1 + NNEG)
    np.testing.assert_array_equal(first[positives], sampled[positives], err_msg="only the negatives change")
    assert not np.array_equal(first, sampled), "negatives drawn from 20 BM25 ranks differ from the top 2"
    with pytest.raises(ValueError, match="hard_negatives must be one of"):
        _iterator(data_dir, vocab, names=("demo_trex",), hard_negatives="random")


@pytest.mark.parametrize("positive_passages", ["first", "cycle"])
def test_cycled_positives_train_on_each_gold_page_in_turn_one_per_pass(data_dir, vocab, positive_passages):
    """HotpotQA's questions have a positive passage on each of their two gold pages: "first" trains on
    the first only (the default), "cycle" on the next one on every pass over the task."""
    store = PassageStore.open(os.path.join(data_dir, "kb"))
    spec = retrieval_tasks.describe(seqio.get_mixture_or_task("demo_hotpotqa"))
    examples = read_examples(layout.examples_path(data_dir, spec.dataset, "train"))  # the iterator's rows, in order
    two_pages = {e.id for e in examples if len(e.positive_passages) > 1}
    assert two_pages, "the demo's HotpotQA has two-page questions"
    it = _iterator(data_dir, vocab, names=("demo_hotpotqa",), local_data_devices=1,
                   positive_passages=positive_passages)
    size, n = it.subbatch_sizes[0], len(examples)
    trained: dict[str, set[str]] = {}
    for step in range(3 * n // size):
        sub = next(it)["demo_hotpotqa"]
        rows = it._rows(0, step)[0]  # which example each query of the step is
        for i, row in enumerate(rows):
            example = examples[row]
            cycle = (step * size + i) // n
            turn = cycle % len(example.positive_passages) if positive_passages == "cycle" else 0
            expected = example.positive_passages[turn]
            want = to_fixed_length(encode_with_eos_markers(vocab, passage_text(store.get(expected))), PLEN)
            np.testing.assert_array_equal(sub["passage_tokens"][i * (1 + NNEG)], want, err_msg=f"{step} {i} {example.id}")
            trained.setdefault(example.id, set()).add(expected)
    both = [e for e in examples if e.id in two_pages and trained[e.id] == set(e.positive_passages)]
    assert len(both) == (len(two_pages) if positive_passages == "cycle" else 0), (len(both), len(two_pages))
    with pytest.raises(ValueError, match="positive_passages must be one of"):
        _iterator(data_dir, vocab, names=("demo_hotpotqa",), positive_passages="all")


def test_each_gold_page_trains_once_per_pass_with_its_own_passage_as_the_positive(data_dir, vocab):
    """positive_passages={'hotpotqa': 'each'}: every (question, positive passage) pair of HotpotQA is one
    row, trained once in a pass over the task, with that passage as its positive and the question's
    query; a row's "query_groups" names its question. The other task keeps one row per question
    (its first positive) and no "query_groups"."""
    store = PassageStore.open(os.path.join(data_dir, "kb"))
    examples = read_examples(layout.examples_path(data_dir, "hotpotqa", "train"))
    pairs = sorted((q, p) for q, e in enumerate(examples) for p in e.positive_passages)
    assert len(pairs) > len(examples), "the demo's HotpotQA has questions with two gold pages"
    it = _iterator(data_dir, vocab, names=("demo_trex", "demo_hotpotqa"), local_data_devices=1,
                   positive_passages={"hotpotqa": "each"})
    first = _iterator(data_dir, vocab, names=("demo_trex", "demo_hotpotqa"), local_data_devices=1)
    size = it.subbatch_sizes[1]
    trained, queries = [], {}
    for step in range(-(-len(pairs) // size)):
        batch, plain = next(it), next(first)
        assert "query_groups" not in batch["demo_trex"]
        np.testing.assert_array_equal(batch["demo_trex"]["passage_tokens"], plain["demo_trex"]["passage_tokens"])
        sub = batch["demo_hotpotqa"]
        for i, question in enumerate(sub["query_groups"]):
            if step * size + i >= len(pairs):
                break
            positive = sub["passage_tokens"][i * (1 + NNEG)]
            (passage,) = [p for p in examples[question].positive_passages
                          if np.array_equal(positive, to_fixed_length(encode_with_eos_markers(
                              vocab, passage_text(store.get(p))), PLEN))]
            trained.append((int(question), passage))
            queries.setdefault(int(question), []).append(sub["query_tokens"][i])
    assert sorted(trained) == pairs, "each gold page's passage is one row of its question, once per pass"
    for question, rows in queries.items():
        assert all(np.array_equal(r, rows[0]) for r in rows), f"question {question}: its rows read one query"
    with pytest.raises(UserError, match="positive_passages names \\['nq'\\]"):
        _iterator(data_dir, vocab, names=("demo_hotpotqa",), positive_passages={"nq": "each"})


def test_task_negatives_give_the_named_task_negatives_from_their_own_directory(data_dir, vocab, tmp_path):
    """task_negatives={'wow': <dir>}: WoW trains on the negatives of <dir> (the recipe's warm-up on
    negatives its zero-shot model mined), the other tasks on the default directory's (BM25)."""
    store = PassageStore.open(os.path.join(data_dir, "kb"))
    examples = read_examples(layout.examples_path(data_dir, "wow", "train"))
    bm25 = read_negatives(layout.negatives_path(layout.negatives_dir(data_dir, "bm25"), "wow", "train"))
    # "mined": each example's BM25 list from its far end, so the top 2 differ from BM25's
    mined = {e.id: tuple(reversed(bm25[e.id])) for e in examples}
    assert any(mined[i][:NNEG] != bm25[i][:NNEG] for i in mined)
    write_negatives(layout.negatives_path(str(tmp_path), "wow", "train"),
                    [Negatives(i, ids) for i, ids in mined.items()])
    own = _iterator(data_dir, vocab, names=("demo_trex", "demo_wow"), local_data_devices=1,
                    task_negatives={"wow": str(tmp_path)})
    default = _iterator(data_dir, vocab, names=("demo_trex", "demo_wow"), local_data_devices=1)
    a, b = next(own), next(default)
    np.testing.assert_array_equal(a["demo_trex"]["passage_tokens"], b["demo_trex"]["passage_tokens"])
    rows = own._rows(1, 0)[0]
    for i, row in enumerate(rows):
        for k in range(NNEG):
            want = to_fixed_length(encode_with_eos_markers(
                vocab, passage_text(store.get(mined[examples[row].id][k]))), PLEN)
            np.testing.assert_array_equal(a["demo_wow"]["passage_tokens"][i * (1 + NNEG) + 1 + k], want)
    with pytest.raises(DataError, match="task_negatives: .* has no negatives file for task demo_trex"):
        _iterator(data_dir, vocab, names=("demo_trex",), task_negatives={"trex": str(tmp_path)})

