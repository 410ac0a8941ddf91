import json

import yaml

from moeadapt.cli import main
from tests.conftest import micro_spec


def test_info_json(capsys):
    assert main(["info", "--model", "hybrid-2.8t", "--json"]) == 0
    c = json.loads(capsys.readouterr().out)
    assert 2.7e12 < c["total"] < 2.9e12 and c["active_per_token"] < 1e11


def test_user_errors_exit_2_without_traceback(tmp_path, capsys):
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "does not exist" in err and "Traceback" not in err
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"model": "tiny"}))
    assert main(["train", str(p), "--set", "train.stepz=3"]) == 2
    assert "train.stepz: unknown key" in capsys.readouterr().err
    assert main(["eval", "--model", str(tmp_path), "--data", "builtin:recall_qa"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_cli_finetune_export_eval(tmp_path, capsys):
    spec = micro_spec().model_dump()
    base_cfg = tmp_path / "base.yaml"
    base_cfg.write_text(yaml.safe_dump({"model": spec, "train": {
        "steps": 2, "micro_batch_size": 2, "seq_len": 32, "eval_batches": 1, "output_dir": str(tmp_path / "base")},
        "data": {"train": "builtin:tinystories", "eval_fraction": 0.01}}))
    assert main(["train", str(base_cfg)]) == 0
    ft = tmp_path / "ft.yaml"
    ft.write_text(yaml.safe_dump({"model": spec, "train": {
        "steps": 2, "micro_batch_size": 2, "seq_len": 32, "eval_batches": 1, "save_every": 2,
        "init_from": str(tmp_path / "base" / "model"), "output_dir": str(tmp_path / "ft")},
        "data": {"train": "builtin:recall_qa", "eval_fraction": 0.01}}))
    assert main(["finetune", str(ft)]) == 0
    assert main(["export-adapter", str(tmp_path / "ft"), "--out", str(tmp_path / "ad")]) == 0
    assert (tmp_path / "ad" / "adapter_config.json").is_file()
    capsys.readouterr()
    assert main(["eval", "--model", str(tmp_path / "base" / "model"), "--adapter", str(tmp_path / "ad"),
                 "--data", "builtin:recall_qa", "--seq-len", "32", "--batches", "1"]) == 0
    assert "perplexity" in capsys.readouterr().out
