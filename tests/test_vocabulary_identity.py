"""The issue's scenario end to end: replacing a trained model's vocabulary file must stop `t5r eval`
(it used to run and report R-precision 0.000), naming the digest recorded at training and the new one."""

import os

from t5_retrieval import cli
from t5_retrieval.data import layout
from t5_retrieval.data.tokenizers.tokenize import vocabulary_digest
from t5_retrieval.data.tokenizers.train_sentencepiece import train_vocabulary
from tests.tiny_model import build_tiny_run


def test_eval_refuses_a_model_whose_vocabulary_file_was_replaced(tmp_path, capsys):
    run = build_tiny_run(str(tmp_path))
    args = ["eval", "--checkpoint_dir", run.model_dirs[0], "--index_dir", run.index_dirs[0], "--data_dir",
            run.data_dir, "--tasks", "demo_fever", "--split", "dev", "--output_dir", str(tmp_path / "eval")]
    assert cli.main(args) == 0, "precondition: the untouched model evaluates"
    trained = vocabulary_digest(run.vocabulary)
    prefix = run.vocabulary[:-len(".model")]
    assert train_vocabulary(layout.kb_dir(run.data_dir), prefix, vocab_size=300) == run.vocabulary
    replaced = vocabulary_digest(run.vocabulary)
    assert replaced != trained, "precondition: the file now holds another vocabulary"
    capsys.readouterr()
    assert cli.main([*args[:-1], str(tmp_path / "eval2")]) == 2
    err = capsys.readouterr().err
    assert f"content digest {replaced}" in err and f"trained with digest {trained}" in err, err
    assert not os.path.exists(tmp_path / "eval2" / "results.json"), "no results may be written"
