"""`t5r data download-kilt`: fetch official KILT files with HTTP Range resume and sha256 checks.

A download goes to `{name}.part`, resumes from its size with a Range request, and is renamed to
its final name only when complete (and its checksum matches when one is known), so a partial file
is never mistaken for a finished one. Checksums of finished files are recorded in `SHA256SUMS`.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

from t5_retrieval.checksums import sha256_file
from t5_retrieval.data.records import DataError, write_text_atomic
from t5_retrieval.errors import UserError

KILT_BASE_URL = "http://dl.fbaipublicfiles.com/KILT/"
SUMS_FILE = "SHA256SUMS"
_CHUNK = 1 << 20


class DownloadError(UserError):
    """A file that could not be fetched: the URL and why."""


def _read_sums(out_dir: str) -> dict[str, str]:
    path = os.path.join(out_dir, SUMS_FILE)
    if not os.path.exists(path):
        return {}
    sums = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            digest, _, name = line.strip().partition("  ")
            if name:
                sums[name] = digest
    return sums


def _write_sums(out_dir: str, sums: Mapping[str, str]) -> None:
    write_text_atomic(os.path.join(out_dir, SUMS_FILE), "".join(f"{sums[name]}  {name}\n" for name in sorted(sums)))


def fetch(url: str, dest: str, expected_sha256: str | None = None, timeout: float = 60.0) -> str:
    """Downloads url to dest, resuming `dest.part`; returns the sha256. Raises on checksum mismatch."""
    part = f"{dest}.part"
    have = os.path.getsize(part) if os.path.exists(part) else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code != 416:  # 416: nothing left to fetch, the part file is already complete
            raise DownloadError(f"{url}: HTTP {e.code} {e.reason}; check the file name and the base URL") from None
        response = None
    except urllib.error.URLError as e:
        raise DownloadError(f"{url}: cannot download ({e.reason}); check the base URL and the network, then run "
                            "again (a partial download resumes)") from None
    if response is not None:
        with response:
            # A server that ignores Range answers 200 with the whole body: start over.
            mode = "ab" if have and response.status == 206 else "wb"
            with open(part, mode) as f:
                for block in iter(lambda: response.read(_CHUNK), b""):
                    f.write(block)
    digest = sha256_file(part)
    if expected_sha256 and digest != expected_sha256:
        os.remove(part)
        raise DataError(f"{url}: sha256 {digest} does not match the expected {expected_sha256}; "
                        f"the partial file was removed, run again to re-download")
    os.replace(part, dest)
    return digest


def download_kilt(names: Sequence[str], out_dir: str, base_url: str = KILT_BASE_URL,
                  checksums: Mapping[str, str] | None = None) -> dict[str, str]:
    """Downloads KILT files by name (e.g. `fever-train-kilt.jsonl`, `kilt_knowledgesource.json`).

    Files already present are verified against the recorded checksum instead of re-fetched.
    Returns name -> sha256.
    """
    os.makedirs(out_dir, exist_ok=True)
    sums = _read_sums(out_dir)
    known = {**sums, **(checksums or {})}
    for name in names:
        dest = os.path.join(out_dir, name)
        if os.path.exists(dest):
            digest = sha256_file(dest)
            if name in known and digest != known[name]:
                raise DataError(f"{dest}: sha256 {digest} does not match the recorded {known[name]}; "
                                "delete it to download again")
        else:
            digest = fetch(base_url.rstrip("/") + "/" + name, dest, known.get(name))
        sums[name] = digest
        _write_sums(out_dir, sums)
    return {name: sums[name] for name in names}
