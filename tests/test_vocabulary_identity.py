"""The issue's scenario end to end: replacing a trained model's vocabulary file must stop `t5r eval`
(it used to run and report R-precision 0.000), naming the digest recorded at training and the new one."""

import os
import shutil

from t5_retrieval import checkpoint, cli
from t5_retrieval.data import layout
from t5_retrieval.data.tokenizers.tokenize import load_vocabulary, vocabulary_digest
from t5_retrieval.data.tokenizers.train_sentencepiece import train_vocabulary
from tests.tiny_model import build_tiny_run


def test_eval_refuses_a_model_whose_vocabulary_file_was_replaced(tmp_path, capsys):
    run = build_tiny_run(str(tmp_path))
    args = ["eval", "--checkpoint_dir", run.model_dirs[0], "--index_dir", run.index_dirs[0], "--data_dir",
            run.data_dir, "--tasks", "demo_fever", "--split", "dev", "--output_dir", str(tmp_path / "eval")]
    assert cli.main(args) == 0, "precondition: the untouched model evaluates"
    # The model's own copy of its vocabulary (the file it reads) gets another vocabulary written over it.
    copy = checkpoint.vocabulary_file(run.model_dirs[0], checkpoint.read_config(run.model_dirs[0])["features"])
    trained = vocabulary_digest(copy)
    other = train_vocabulary(layout.kb_dir(run.data_dir), str(tmp_path / "other"), vocab_size=300)
    shutil.copyfile(other, copy)
    replaced = vocabulary_digest(copy)
    assert replaced != trained, "precondition: the file now holds another vocabulary"
    capsys.readouterr()
    assert cli.main([*args[:-1], str(tmp_path / "eval2")]) == 2
    err = capsys.readouterr().err
    assert f"content digest {replaced}" in err and f"trained with digest {trained}" in err, err
    assert not os.path.exists(tmp_path / "eval2" / "results.json"), "no results may be written"


def test_train_refuses_a_vocabulary_larger_than_vocab_size_naming_the_size_that_fits(tmp_path, capsys):
    """Sentencepiece pieces + T5's 100 sentinels are more than VOCAB_SIZE=256 ids: every id from 256 would
    have no embedding row (every step non-finite), so the run stops before its first step and names the
    multiple of 128 that fits (512, which test_own_task_path's model trains with on such a vocabulary)."""
    from conftest import prepare_small_demo

    data_dir = prepare_small_demo(tmp_path, ("fever",))
    vocabulary = train_vocabulary(layout.kb_dir(data_dir), os.path.join(data_dir, "spm"), vocab_size=400)
    model_dir = str(tmp_path / "model")
    argv = ["train", f"--model_dir={model_dir}", "--gin_file=models/t5_tiny.gin", "--gin_file=runs/base.gin",
            "--gin.D_MODEL=32", "--gin.D_FF=64", "--gin.NUM_LAYERS=1", "--gin.NUM_NEGATIVES=1", "--gin.QUERY_LEN=24",
            "--gin.PASSAGE_LEN=32", "--gin.PER_DEVICE_BATCH=4", "--gin.MIXTURE_OR_TASK_NAME='demo_fever'",
            f"--gin.DATA_DIR='{data_dir}'", f"--gin.VOCABULARY='{vocabulary}'", "--gin.TRAIN_STEPS=1",
            "--gin.VOCAB_SIZE=256"]
    ids = load_vocabulary(vocabulary).vocab_size  # up to 400 pieces (a small KB gives fewer) + 100 sentinels
    assert 256 < ids <= 512, ids
    assert cli.main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (f"t5r train: error: VOCAB_SIZE=256 (T5Config.vocab_size) is below the {ids} token ids of the "
                    f"vocabulary {vocabulary} ({ids - 100} pieces + 100 sentinels): pass --gin.VOCAB_SIZE=512"), line
    assert not os.path.exists(os.path.join(model_dir, "model_config.json")), "refused before anything is written"
