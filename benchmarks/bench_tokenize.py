"""Tokenisation throughput of `data.tokenize.tokenize` (both families) against Hugging Face's fast tokenizers.

The first N mini-KILT passages (default 1,024; `--passages 0` for all) to fixed-length rows
(default 256), as the batcher and the KB encoder need them. Per family, timed round-robin in the
same run (`common.interleaved_times`):

- BERT (all-MiniLM-L6-v2's `vocab.txt`, passages as `"{title}: {text}"`): ours (C string operations +
  Rust WordPiece, one batch call); `AutoTokenizer.from_pretrained(model_dir)` (HF's fast tokenizer,
  Rust) with `max_length`, truncation, `padding="max_length"`, NumPy output; and the project's former
  pure-Python tokenizer (`tests/wordpiece_reference.py`, its word cache warm after the first call).
- T5 (a sentencepiece model, passages as `"Title: {title} Text: {text}"`): ours (sentencepiece's
  C++ batch encoder, one call); the former path (seqio's `encode` string by string); HF's T5
  tokenizer built offline from the same `.model` file (a directory with `spiece.model`).

Without `--spm_model`, a unigram model with T5's conventions (as `t5r vocab train` makes) is first
trained on the KB passages (~1 min; not timed). Every candidate's ids are compared with ours and
the counts of differing rows recorded: ours must equal the former paths exactly; HF's BERT
normaliser may differ on rare characters (it lower-cases without final sigma).

    .venv/bin/python benchmarks/bench_tokenize.py [--passages 1024] [--length 256] [--repeats 5]
        [--spm_model PATH]
"""

from __future__ import annotations

import common

ORIGINAL_BLAS_ENV = common.reexec_without_env()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))  # the former pure-Python tokenizer, kept as the tests' oracle


def read_passages(path: str, count: int) -> list[dict[str, str]]:
    """The first `count` passages of a KB jsonl (all if `count` is 0)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if count and len(out) == count:
                break
            out.append(json.loads(line))
    return out


def train_spm(path: str, out_prefix: str) -> str:
    """A unigram model with T5's conventions on every KB passage, as `t5r vocab train` trains one."""
    import sentencepiece as spm

    from t5_retrieval.data.text import format_passage

    texts = (format_passage(p["title"], p["text"]) for p in read_passages(path, 0))
    spm.SentencePieceTrainer.train(
        sentence_iterator=texts, model_prefix=out_prefix, vocab_size=8000, model_type="unigram", pad_id=0,
        eos_id=1, unk_id=2, bos_id=-1, character_coverage=1.0, hard_vocab_limit=False, minloglevel=2)
    return f"{out_prefix}.model"


def hf_t5_tokenizer(spm_model: str, tmp: str):
    """HF's T5 tokenizer from the sentencepiece file alone, offline (`T5Tokenizer(vocab_file=...)` in
    transformers 5 silently builds an empty vocabulary; loading a directory works)."""
    from transformers import AutoTokenizer

    directory = os.path.join(tmp, "hf_t5")
    os.makedirs(directory)
    shutil.copy(spm_model, os.path.join(directory, "spiece.model"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "T5Tokenizer", "extra_ids": 100}, f)
    return AutoTokenizer.from_pretrained(directory)


def fixed_rows(encode: Callable[[str], list[int]], texts: list[str], length: int, start: tuple[int, ...],
               end: int) -> np.ndarray:
    """The former row assembly: one text at a time (none of these passages holds a literal `</s>`)."""
    from t5_retrieval.data.tokenizers.conventions import TokenConventions
    from t5_retrieval.data.tokenizers.tokenize import to_fixed_length

    conventions = TokenConventions(start_ids=start, end_id=end, separator_id=end)
    return np.stack([to_fixed_length(encode(text), length, conventions) for text in texts])


def time_family(candidates: dict[str, Callable[[], np.ndarray]], repeats: int, texts: int) -> dict[str, Any]:
    """First calls (setup, warm-up) untimed but recorded; then interleaved repeats; rows compared to ours."""
    first_call_s, rows = {}, {}
    for name, fn in candidates.items():
        start = time.perf_counter()
        rows[name] = fn()
        first_call_s[name] = time.perf_counter() - start
    times = common.interleaved_times(candidates, repeats)
    out: dict[str, Any] = {"first_call_s": first_call_s, "rows_differing_from_ours": {
        name: int((r != rows["ours"]).any(axis=1).sum()) for name, r in rows.items() if name != "ours"}}
    for name, ts in times.items():
        out[name] = {**common.summarize(ts), "texts_per_s": texts / statistics.median(ts)}
    out["speedup_vs"] = {name: common.speedup(times, "ours", name) for name in candidates if name != "ours"}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--passages", type=int, default=1024, help="first N KB passages; 0 = all")
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kb", default=None, help="KB passages jsonl (id, title, text), e.g. mini-KILT's "
                   "kb/passages.jsonl; default: the shipped demo slice's")
    p.add_argument("--spm_model", help="T5 sentencepiece model; default: train one on the KB first")
    p.add_argument("--out")
    a = p.parse_args()

    import seqio
    import tokenizers
    import transformers
    from transformers import AutoTokenizer
    from wordpiece_reference import encoder

    from t5_retrieval.data.text import format_passage
    from t5_retrieval.data.tokenizers.tokenize import tokenize
    from t5_retrieval.data.tokenizers.wordpiece import WordPieceVocabulary
    from t5_retrieval.models.pretrained import minilm_l6_dir

    a.kb = a.kb or os.path.join(common.demo_slice(), "kb", "passages.jsonl")
    passages = read_passages(a.kb, a.passages)
    bert_texts = [format_passage(p["title"], p["text"], "{title}: {text}") for p in passages]
    t5_texts = [format_passage(p["title"], p["text"]) for p in passages]
    n, length = len(passages), a.length
    with tempfile.TemporaryDirectory() as tmp:
        spm_model = a.spm_model or train_spm(a.kb, os.path.join(tmp, "spm"))
        minilm = WordPieceVocabulary.from_path(minilm_l6_dir())
        hf_bert = AutoTokenizer.from_pretrained(minilm_l6_dir())
        python_bert = encoder(minilm)
        t5 = seqio.SentencePieceVocabulary(spm_model, extra_ids=100)
        hf_t5 = hf_t5_tokenizer(spm_model, tmp)

        def hf(tokenizer, texts):
            return lambda: tokenizer(texts, max_length=length, truncation=True, padding="max_length",
                                     return_tensors="np")["input_ids"].astype(np.int32)

        bert = time_family({
            "ours": lambda: tokenize(minilm, bert_texts, length),
            "hf_fast": hf(hf_bert, bert_texts),
            "python_reference": lambda: fixed_rows(python_bert, bert_texts, length, (minilm.cls_id,), minilm.sep_id),
        }, a.repeats, n)
        t5_result = time_family({
            "ours": lambda: tokenize(t5, t5_texts, length),
            "hf_fast": hf(hf_t5, t5_texts),
            "seqio_per_string": lambda: fixed_rows(lambda s: list(t5.encode(s)), t5_texts, length, (), 1),
        }, a.repeats, n)
        mean_tokens = {"bert": statistics.mean(map(len, minilm.encode_batch(bert_texts))),
                       "t5": statistics.mean(map(len, t5.tokenizer.encode(t5_texts)))}

    result = {"passages": n, "length": length, "repeats": a.repeats, "kb": a.kb,
              "spm_model": a.spm_model or "trained on the KB (8000 pieces, unigram)",
              "mean_tokens_per_passage_untruncated": mean_tokens,
              "bert": bert, "t5": t5_result,
              "versions": {"tokenizers": tokenizers.__version__, "transformers": transformers.__version__},
              "machine": common.machine_info(blas_env_at_start=ORIGINAL_BLAS_ENV)}
    def ms(family: dict[str, Any], name: str) -> str:
        return f"{family[name]['median_s'] * 1e3:.0f} ms"

    def vs(family: dict[str, Any], name: str) -> str:
        return f"{family['speedup_vs'][name]['ratio_of_medians']:.2f}x"

    summary = (f"{n} passages x {length}: BERT ours {ms(bert, 'ours')} vs HF fast {ms(bert, 'hf_fast')} "
               f"({vs(bert, 'hf_fast')}), former Python {ms(bert, 'python_reference')}; T5 ours "
               f"{ms(t5_result, 'ours')} vs HF fast {ms(t5_result, 'hf_fast')} ({vs(t5_result, 'hf_fast')}), "
               f"per-string seqio {ms(t5_result, 'seqio_per_string')}; rows differing from the former paths: "
               f"BERT {bert['rows_differing_from_ours']['python_reference']}, "
               f"T5 {t5_result['rows_differing_from_ours']['seqio_per_string']}")
    common.write_results("tokenize", result, summary, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
