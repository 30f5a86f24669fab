"""KILT download: Range resume and checksums, against a local HTTP server (never the network)."""

import hashlib
import http.server
import os
import threading

import pytest

from t5_retrieval.data.kilt.download import download_kilt

BODY = bytes(range(256)) * 400


class _RangeHandler(http.server.BaseHTTPRequestHandler):
    requests: list = []

    def do_GET(self):
        if self.path != "/KILT/fever-dev-kilt.jsonl":
            self.send_error(404)
            return
        rng = self.headers.get("Range")
        start = int(rng.split("=")[1].rstrip("-")) if rng else 0
        type(self).requests.append(start)
        self.send_response(206 if rng else 200)
        self.send_header("Content-Length", str(len(BODY) - start))
        self.end_headers()
        self.wfile.write(BODY[start:])

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RangeHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    _RangeHandler.requests = []
    yield f"http://127.0.0.1:{httpd.server_address[1]}/KILT/"
    httpd.shutdown()


def test_resumes_a_partial_download_with_a_range_request(server, tmp_path):
    (tmp_path / "fever-dev-kilt.jsonl.part").write_bytes(BODY[:1000])
    sums = download_kilt(["fever-dev-kilt.jsonl"], str(tmp_path), base_url=server)
    assert _RangeHandler.requests == [1000], "must ask only for the missing bytes"
    assert (tmp_path / "fever-dev-kilt.jsonl").read_bytes() == BODY
    assert sums["fever-dev-kilt.jsonl"] == hashlib.sha256(BODY).hexdigest()
    assert "fever-dev-kilt.jsonl" in (tmp_path / "SHA256SUMS").read_text()
    assert not os.path.exists(tmp_path / "fever-dev-kilt.jsonl.part")


def test_checksum_mismatch_fails_and_leaves_no_final_file(server, tmp_path):
    with pytest.raises(ValueError, match="does not match the expected"):
        download_kilt(["fever-dev-kilt.jsonl"], str(tmp_path), base_url=server,
                      checksums={"fever-dev-kilt.jsonl": "0" * 64})
    assert not os.path.exists(tmp_path / "fever-dev-kilt.jsonl")


def test_a_corrupted_existing_file_is_detected_from_the_recorded_checksum(server, tmp_path):
    download_kilt(["fever-dev-kilt.jsonl"], str(tmp_path), base_url=server)
    (tmp_path / "fever-dev-kilt.jsonl").write_bytes(b"truncated")
    with pytest.raises(ValueError, match="does not match the recorded"):
        download_kilt(["fever-dev-kilt.jsonl"], str(tmp_path), base_url=server)
