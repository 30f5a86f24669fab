"""The issue's scenario end to end: replacing a trained model's vocabulary file must stop `t5r eval`
(it used to run and report R-precision 0.000), naming the digest recorded at training and the new one."""

import os
import shutil

from t5_retrieval import checkpoint, cli
from t5_retrieval.data import layout
from t5_retrieval.data.tokenizers.tokenize import vocabulary_digest
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
