"""Logits validation against transformers (float32, reference ops) and the CLI."""

import pytest
import transformers
import yaml

from moeadapt.cli import main
from moeadapt.onboard import names as names_mod
from moeadapt.onboard import read_family
from moeadapt.onboard.validate import TOL, validate_family


@pytest.mark.parametrize("cls", [transformers.Qwen3MoeConfig, transformers.DeepseekV3Config,
                                 transformers.DeepseekV32Config])
def test_logits_match_transformers(cls):
    v = validate_family(read_family(cls().to_dict()))
    print(v)
    assert v["passed"] and v["max_abs_diff"] <= TOL and v["max_abs_logit"] > 0.5


def test_rope_interleave_permutation_is_what_makes_deepseek_match(monkeypatch):
    fam = read_family(transformers.DeepseekV3Config().to_dict())
    monkeypatch.setattr(names_mod, "_rope_rows", lambda heads, head, nope, rope: __import__("torch").arange(heads * head))
    v = validate_family(fam)
    assert not v["passed"] and v["max_abs_diff"] > 100 * TOL


def test_cli_onboard_validate_and_write_config(qwen_dir, tmp_path, capsys):
    out = tmp_path / "run.yaml"
    assert main(["onboard", str(qwen_dir), "--validate", "--write-config", str(out)]) == 0
    text = capsys.readouterr().out
    assert "operator mapping" in text and "PASS" in text and "gqa" in text
    cfg = yaml.safe_load(out.read_text())
    assert cfg["model"]["layer_types"] == ["gqa", "gqa"] and cfg["train"]["init_from"]
    assert main(["onboard", str(tmp_path)]) == 2  # no config.json: one message, exit 2
