"""HTTP search API, exercised with urllib against a running server on 127.0.0.1 (OS-assigned port)."""

import http.client
import json
import threading
import urllib.error
import urllib.request

import pytest

from t5_retrieval.data.records import Passage
from t5_retrieval.data import embedding_store
from t5_retrieval.retrieval import index, serve
from t5_retrieval.retrieval.encoder import HashedBagOfWordsEncoder
from t5_retrieval.data.passages import PassageTable

KB = [
    Passage("paris_0", "paris", "Paris", "Paris is the capital and largest city of France."),
    Passage("berlin_0", "berlin", "Berlin", "Berlin is the capital of Germany."),
    Passage("nile_0", "nile", "Nile", "The Nile is a major river in northeastern Africa."),
    Passage("everest_0", "everest", "Mount Everest", "Mount Everest is Earth's highest mountain."),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    encoder = HashedBagOfWordsEncoder(dim=256)
    directory = str(tmp_path_factory.mktemp("emb"))
    embedding_store.write_embeddings(encoder, KB, [p.id for p in KB], directory, progress=False)
    idx = index.build_index(directory, index.ScannConfig(mode="brute_force"))
    limits = serve.ServeLimits(max_k=3, default_k=2, max_queries=2, max_query_chars=50, max_body_bytes=2000)
    service = serve.SearchService(encoder, idx, PassageTable(KB), ["nq", "fever"], limits)
    httpd = serve.make_server(service, "127.0.0.1", 0)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def post(url: str, body: bytes | dict, path: str = "/search") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_server_binds_loopback_and_reports_health(server):
    assert server.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(server + "/health", timeout=10) as response:
        health = json.loads(response.read())
    assert health["status"] == "ok" and health["passages"] == 4 and health["tasks"] == ["nq", "fever"]


def test_single_query_returns_ranked_passages_with_ids_titles_and_scores(server):
    status, reply = post(server, {"task": "nq", "query": "capital of Germany", "k": 2})
    assert status == 200, reply
    hits = reply["results"]
    assert [h["rank"] for h in hits] == [1, 2] and hits[0]["passage_id"] == "berlin_0", hits
    assert hits[0]["wikipedia_id"] == "berlin" and hits[0]["title"] == "Berlin"
    assert hits[0]["score"] >= hits[1]["score"]


def test_batched_queries_return_one_ranking_each_with_default_k(server):
    status, reply = post(server, {"task": "fever", "queries": ["highest mountain", "river in Africa"]})
    assert status == 200, reply
    assert [r[0]["passage_id"] for r in reply["results"]] == ["everest_0", "nile_0"]
    assert all(len(r) == 2 for r in reply["results"]), "without k, default_k (2) applies"


def test_inconsistent_limits_are_refused():
    with pytest.raises(ValueError, match="default_k=10 must be in \\[1, max_k=3\\]"):
        serve.ServeLimits(max_k=3)


@pytest.mark.parametrize("body, fragment", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    ({"task": "zsre", "query": "x"}, "unknown task 'zsre'"),
    ({"query": "x"}, "field 'task' is required"),
    ({"task": "nq", "query": "   "}, "field 'query' is empty"),
    ({"task": "nq", "query": "x" * 51}, "has 51 characters, more than 50"),
    ({"task": "nq", "queries": ["ok", ""]}, "field 'queries[1]' is empty"),
    ({"task": "nq", "queries": ["a", "b", "c"]}, "3 entries, more than 2"),
    ({"task": "nq", "queries": []}, "non-empty list"),
    ({"task": "nq", "query": "x", "queries": ["y"]}, "exactly one of"),
    ({"task": "nq", "query": "x", "k": 0}, "field 'k' must be an integer in [1, 3]"),
    ({"task": "nq", "query": "x", "k": 4}, "field 'k' must be an integer in [1, 3]"),
    ({"task": "nq", "query": "x", "k": True}, "field 'k'"),
    ({"task": "nq", "query": "x", "topk": 3}, "unknown field(s) ['topk']"),
])
def test_bad_requests_get_400_with_a_json_message(server, body, fragment):
    status, reply = post(server, body)
    assert status == 400 and fragment in reply["error"], (status, reply)


def test_oversized_body_and_unknown_paths_are_refused_and_the_server_lives_on(server):
    status, reply = post(server, {"task": "nq", "query": "x", "pad": "y" * 3000})
    assert status == 413 and "limit is 2000" in reply["error"], reply
    status, reply = post(server, {"task": "nq", "query": "x"}, path="/other")
    assert status == 404
    host, port = server[len("http://"):].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.putrequest("POST", "/search")
    conn.endheaders()  # No Content-Length at all.
    response = conn.getresponse()
    assert response.status == 411 and "Content-Length" in json.loads(response.read())["error"]
    conn.close()
    assert post(server, {"task": "nq", "query": "capital of France", "k": 1})[1]["results"][0]["title"] == "Paris"


def test_service_refuses_an_index_built_by_another_model(tmp_path):
    directory = str(tmp_path / "emb")
    embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=64), KB, [p.id for p in KB], directory, progress=False)
    idx = index.build_index(directory, index.ScannConfig(mode="brute_force"))
    with pytest.raises(index.IndexMismatchError, match="fingerprint"):
        serve.SearchService(HashedBagOfWordsEncoder(dim=128), idx, PassageTable(KB), ["nq"])


def test_cli_refuses_to_serve_an_index_of_another_model(tmp_path, capsys):
    from t5_retrieval.data.kb import write_passage_store

    kb_dir, emb_dir, idx_dir = (str(tmp_path / d) for d in ("kb", "emb", "idx"))
    write_passage_store(((p, None) for p in KB), kb_dir)
    embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=64), KB, [p.id for p in KB], emb_dir, progress=False)
    index.build_index(emb_dir, index.ScannConfig(mode="brute_force")).save(idx_dir)
    code = serve.main(["--lexical_baseline_dim", "32", "--index_dir", idx_dir, "--kb_dir", kb_dir, "--tasks", "nq"])
    assert code == 2 and "hashed-bow-v2-dim64" in capsys.readouterr().err
