"""KB encoding as users run it: all-MiniLM-L6-v2 over real passages, this project vs transformers + torch.

The workload every user pays (and ANCE pays again each episode): the first N passages of a passage
store, "{title}: {text}", at most 256 tokens, mean pooling + L2 normalisation. Ours is the path
`t5r encode` takes (`load_encoder` on a MiniLM model directory -> `encode_passages`: native
WordPiece, length-sorted batches cut to their longest row); theirs is the sentence-transformers
recipe with `transformers` (fast tokenizer, texts sorted by length, batches of 64, masked mean
pooling, L2 under `torch.inference_mode()`). Both load the same installed weights; embeddings are
compared. Each of our batch sizes is a candidate; candidates run interleaved, and speed-ups are
ratios from the same run. Compilation is done before timing and reported.

    .venv/bin/python benchmarks/bench_encode_kb.py [--kb_dir=DATA_DIR/kb] [--passages 512] [--batch_sizes 16 32 64]
"""

from __future__ import annotations

import common

ORIGINAL_BLAS_ENV = common.reexec_without_env()

import argparse  # noqa: E402
import itertools  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from t5_retrieval.data.stores.kb import PassageStore, build_kb  # noqa: E402
from t5_retrieval.data.text import format_passage  # noqa: E402
from t5_retrieval.inference import load_encoder  # noqa: E402
from t5_retrieval.models.pretrained import minilm_l6_dir  # noqa: E402
from t5_retrieval.results.minilm_rows import write_minilm_model_dir  # noqa: E402

TEMPLATE = "{title}: {text}"
MAX_LENGTH = 256
REFERENCE_BATCH = 64
TARGET_SPEEDUP = 1.5


def sentence_transformers_encoder(model_dir: str, threads: int):
    """The sentence-transformers recipe with transformers + torch: texts -> [n, 384] L2-normalised."""
    torch.set_num_threads(threads)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir).eval()

    def encode(texts: list[str]) -> np.ndarray:
        order = np.argsort([-len(t) for t in texts], kind="stable")  # sentence-transformers sorts by length
        out = np.empty((len(texts), model.config.hidden_size), np.float32)
        with torch.inference_mode():
            for start in range(0, len(texts), REFERENCE_BATCH):
                rows = order[start:start + REFERENCE_BATCH]
                batch = tokenizer([texts[i] for i in rows], padding=True, truncation=True, max_length=MAX_LENGTH,
                                  return_tensors="pt")
                hidden = model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out[rows] = torch.nn.functional.normalize(pooled, p=2, dim=1).numpy()
        return out

    return encode


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kb_dir", default=None,
                        help="a passage store (`t5r data kb` output); default: the shipped demo slice's KB")
    parser.add_argument("--passages", type=int, default=512, help="the first N passages of the store")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[16, 32, 64],
                        help="our per-call batch sizes to compare (the default of load_encoder is 64)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    parser.add_argument("--out", default=None, help="results path (default benchmarks/results/encode_kb.json)")
    args = parser.parse_args(argv)

    if args.kb_dir is None:
        args.kb_dir = os.path.join(common.RESULTS_DIR, "data", "demo_slice_kb")
        if not os.path.exists(args.kb_dir):
            build_kb(os.path.join(common.demo_slice(), "kb", "passages.jsonl"), args.kb_dir)
    passages = list(itertools.islice(PassageStore.open(args.kb_dir), args.passages))
    texts = [format_passage(p.title, p.text, TEMPLATE) for p in passages]
    theirs = sentence_transformers_encoder(minilm_l6_dir(), args.threads)
    candidates, compile_s, embeddings = {}, {}, {}
    with tempfile.TemporaryDirectory() as model_dir:
        write_minilm_model_dir(model_dir)
        for batch in args.batch_sizes:
            encoder = load_encoder(model_dir, batch_size=batch)
            start = time.perf_counter()
            embeddings[f"ours_batch_{batch}"] = encoder.encode_passages(passages)  # compiles every bucket width
            compile_s[f"ours_batch_{batch}"] = time.perf_counter() - start
            candidates[f"ours_batch_{batch}"] = lambda encoder=encoder: encoder.encode_passages(passages)
    embeddings["transformers"] = theirs(texts)
    candidates["transformers"] = lambda: theirs(texts)
    times = common.interleaved_times(candidates, args.repeats)

    reference = embeddings["transformers"]
    rows = {}
    for name, seconds in times.items():
        rows[name] = {**common.summarize(seconds), "passages_per_s": len(passages) / float(np.median(seconds)),
                      "max_abs_diff_to_transformers": float(np.max(np.abs(embeddings[name] - reference)))}
        if name != "transformers":
            rows[name]["speedup"] = common.speedup(times, name, "transformers")
            rows[name]["first_call_s_incl_compile"] = compile_s[name]
    best = max((n for n in rows if n != "transformers"), key=lambda n: rows[n]["speedup"]["ratio_of_medians"])
    result = {
        "what": f"passages/s, all-MiniLM-L6-v2, first {len(passages)} passages of {args.kb_dir}, "
                f"'{TEMPLATE}', max {MAX_LENGTH} tokens, mean pooling + L2",
        "machine": common.machine_info(jax=jax.__version__, jax_backend=jax.default_backend(),
                                       jax_devices=jax.device_count(), torch=torch.__version__,
                                       transformers=transformers.__version__, torch_threads=args.threads,
                                       torch_cpu_capability=torch.backends.cpu.get_cpu_capability()),
        "blas_env_at_start": ORIGINAL_BLAS_ENV, "args": vars(args), "by_candidate": rows,
        "best": best, "target_speedup": TARGET_SPEEDUP,
        "target_met": rows[best]["speedup"]["ratio_of_medians"] >= TARGET_SPEEDUP,
    }
    summary = (f"{len(passages)} passages: transformers+torch {rows['transformers']['passages_per_s']:.1f}/s; "
               + ", ".join(f"{n} {r['passages_per_s']:.1f}/s (x{r['speedup']['ratio_of_medians']:.2f}, "
                           f"max |diff| {r['max_abs_diff_to_transformers']:.1e})"
                           for n, r in rows.items() if n != "transformers")
               + f"; target x{TARGET_SPEEDUP} {'met' if result['target_met'] else 'MISSED'}")
    common.write_results("encode_kb", result, summary, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
