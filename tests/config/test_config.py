import pytest
import yaml

from moeadapt.config import (
    ConfigError,
    LoRASpec,
    ModelSpec,
    ParallelSpec,
    TrainSpec,
    get_preset,
    load_run_config,
)


def write(tmp_path, obj):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(obj))
    return p


def test_preset_and_overrides(tmp_path):
    cfg = load_run_config(write(tmp_path, {"model": {"preset": "tiny", "n_layers": 8}, "lora": True}))
    assert cfg.model.n_layers == 8 and cfg.model.hidden_size == get_preset("tiny").hidden_size
    assert cfg.lora is not None and cfg.lora.rank == 16
    assert cfg.model.resolved_layer_types() == ["kda", "kda", "kda", "dsa"] * 2


@pytest.mark.parametrize("raw, needle", [
    ({"model": "tiny", "train": {"stepz": 3}}, "train.stepz: unknown key"),
    ({"model": "tiny", "train": {"lr": -1}}, "train.lr"),
    ({"model": "nope"}, "neither a preset"),
    ({"train": {}}, "missing 'model'"),
    ({"model": {"preset": "tiny", "n_experts_per_tok": 9}}, "n_experts_per_tok=9 exceeds n_routed_experts=8"),
    ({"model": {"preset": "tiny", "n_group": 3}}, "n_group=3 does not divide n_routed_experts=8"),
    ({"model": {"preset": "tiny", "layer_types": ["kda"]}}, "layer_types has 1 entries but n_layers=4"),
    ({"model": "tiny", "parallel": {"ep": 3, "dp_shard": 3}}, "ep=3 does not divide n_routed_experts=8"),
    ({"model": "tiny", "parallel": {"ep": 4, "dp_shard": 2}}, "ep=4 does not divide dp_shard*cp=2"),
    ({"model": "tiny", "train": {"steps": 5, "warmup_steps": 10}}, "warmup_steps=10 exceeds steps=5"),
    ({"model": "tiny", "lora": {"targets": []}}, "targets is empty"),
])
def test_validation_messages_name_field_and_fix(tmp_path, raw, needle):
    with pytest.raises(ConfigError) as e:
        load_run_config(write(tmp_path, raw))
    assert needle in str(e.value)


def test_bad_yaml_and_missing_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_run_config(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config(tmp_path / "nope.yaml")


def test_ep_message_lists_valid_choices():
    with pytest.raises(ValueError) as e:
        ParallelSpec(ep=6, dp_shard=12).validate_for(get_preset("hybrid-2.8t"))
    assert "ep=6 does not divide n_routed_experts=896; choose ep in {1, 2, 4}" in str(e.value)
    with pytest.raises(ValueError, match="world size 3"):
        ParallelSpec(dp_shard=2).validate_for(get_preset("tiny"), world_size=3)


def test_direct_spec_errors():
    with pytest.raises(ValueError, match="qk_rope_head_dim=5 must be even"):
        ModelSpec(vocab_size=10, hidden_size=8, n_layers=1, qk_rope_head_dim=5)
    assert LoRASpec(rank=4, alpha=8).scaling == 2.0
    assert TrainSpec().steps > 0


def test_config_imports_nothing_of_moeadapt_outside_config():
    """config/ is the root of the imports: a model directory is read by onboard/ through `from_dir`."""
    import ast
    from pathlib import Path

    import moeadapt.config

    for f in Path(moeadapt.config.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1, f"{f.name} imports {'.' * node.level}{node.module or ''}"
            if isinstance(node, ast.ImportFrom) and not node.level or isinstance(node, ast.Import):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert not any(n and n.split(".")[0] == "moeadapt" for n in names), f"{f.name} imports {names}"


def test_model_directory_needs_a_reader(tmp_path):
    from moeadapt.config import resolve_model

    (tmp_path / "m").mkdir()
    with pytest.raises(ConfigError, match="is a directory; read it with moeadapt.onboard.resolve_model"):
        resolve_model(str(tmp_path / "m"))
    assert resolve_model(str(tmp_path / "m"), from_dir=lambda p: get_preset("tiny")) == get_preset("tiny")


@pytest.mark.parametrize("bad", [0, -1.5, float("nan"), float("inf")])
def test_ep_capacity_factor_must_be_positive_and_finite(tmp_path, bad):
    with pytest.raises(ConfigError) as e:
        load_run_config(write(tmp_path, {"model": "tiny", "parallel": {"ep": 2, "dp_shard": 2,
                                                                        "ep_capacity_factor": bad}}))
    assert "parallel.ep_capacity_factor=" in str(e.value) and "must be a finite number > 0" in str(e.value)
    assert ParallelSpec(ep_capacity_factor=2.0).ep_capacity_factor == 2.0 and ParallelSpec().ep_capacity_factor == 1.5
