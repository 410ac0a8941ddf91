"""Bad input answered with one line naming the problem and the fix (exit 2), never a traceback or a silent
success; the matching unit checks for config / data / io / lora where the bad value enters."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from moeadapt.cli import main, user_error
from moeadapt.config.load import ConfigError, load_run_config, resolve_model
from tests.conftest import micro_spec


def _cfg(tmp_path, text: str | None = None, **raw) -> str:
    p = tmp_path / "c.yaml"
    p.write_text(text if text is not None else yaml.safe_dump(
        {"model": micro_spec().model_dump(), "train": {"steps": 1, "output_dir": str(tmp_path / "run")}, **raw}))
    return str(p)


CASES = [  # (argv builder, words the one-line message must hold)
    (lambda t: ["train", _cfg(t, "model: tiny\ntrain:\n  lr: 1.0e-3\n  lr: 300\n")], ["'lr' appears twice", "line 4"]),
    (lambda t: ["train", _cfg(t), "--set", "train.lr.x=1"], ["train.lr"]),
    (lambda t: ["train", _cfg(t), "--set", "train.betas=[0.9"], ["--set", "not valid yaml"]),
    (lambda t: ["train", _cfg(t), "--set", "train.betas=[1.5,0.9]"], ["betas", "[0, 1)"]),
    (lambda t: ["train", _cfg(t), "--set", "train.lr="], ["no value"]),
    (lambda t: ["train", _cfg(t, parallel={"dp_shard": 2})], ["torchrun --nproc_per_node 2"]),
    (lambda t: ["train", _cfg(t), "--set", f"train.output_dir={t / 'c.yaml'}"], ["output_dir", "is a file"]),
    (lambda t: ["train", _cfg(t), "--set", f"train.init_from={t}"], ["init_from", "no config.json"]),
    (lambda t: ["train", _cfg(t), "--set", f"data.train={t}"], ["is a directory"]),
    (lambda t: ["train", _cfg(t), "--set", f"data.tokenizer={t / 'tok'}"], ["tokenizer", "does not exist"]),
    (lambda t: ["train", _cfg(t, lora={"targets": ["attn.q_proj", "attn.nope"]})], ["attn.nope", "match no module"]),
    (lambda t: ["generate", "--model", "tiny", "--prompt", "x", "--max-new-tokens", "-5"], ["--max-new-tokens", ">= 1"]),
    (lambda t: ["generate", "--model", "tiny", "--prompt", "x", "--temperature", "-1"], ["--temperature", ">= 0"]),
    (lambda t: ["generate", "--model", "tiny", "--prompt", ""], ["--prompt", "empty"]),
    (lambda t: ["eval", "--model", "tiny", "--data", "builtin:recall_qa", "--seq-len", "0"], ["--seq-len", ">= 2"]),
    (lambda t: ["plan", "--model", "tiny", "--gpus", "0"], ["--gpus", ">= 1"]),
    (lambda t: ["simulate-routing", "--ep", "0"], ["--ep", ">= 1"]),
    (lambda t: ["simulate-routing", "--experts", "8", "--top-k", "20", "--ep", "2"], ["--top-k 20 exceeds"]),
    (lambda t: ["merge-adapter", "--model", "tiny", "--adapter", str(t), "--out", _cfg(t)], ["existing file"]),
]


def _call(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse rejects a bad argument value this way
        return e.code


@pytest.mark.parametrize("case", range(len(CASES)))
def test_bad_input_is_one_clear_line(tmp_path, capsys, case):
    build, words = CASES[case]
    rc = _call(build(tmp_path))
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith(("usage:", " "))]
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w.lower() in lines[0].lower(), (w, lines[0])


def test_config_units(tmp_path):
    # model: {preset, name} is an override, not a clash with get_preset's argument
    assert resolve_model({"preset": "tiny", "name": "mine"}).name == "mine"
    # --set through a preset string overrides the preset's fields
    p = tmp_path / "c.yaml"
    p.write_text("model: tiny\n")
    assert load_run_config(p, {"model.n_layers": 2}).model.n_layers == 2
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("[1, 2]")
    from moeadapt.onboard import resolve_model as resolve_model_or_dir  # model directories are onboard's

    with pytest.raises(ConfigError, match="config.json holds a list"):
        resolve_model_or_dir(str(d))


def test_data_units(tmp_path):
    from moeadapt.data.dataset import read_jsonl

    bad = {
        '{"text": 12345}': "'text' is a int, not a string",
        '{"messages": "hi"}': "'messages' must be a non-empty list",
        '{"messages": [{"role": "user"}]}': "messages\\[0\\] needs a string 'role' and a string 'content'",
        '{"messages": [{"role": "bot", "content": "x"}]}': "messages\\[0\\] has role 'bot'",
    }
    for line, msg in bad.items():
        f = tmp_path / "d.jsonl"
        f.write_text('{"text": "fine"}\n' + line + "\n")
        with pytest.raises(ValueError, match=f"d.jsonl:2: {msg}"):
            read_jsonl(str(f))
    f.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match="d.jsonl:2: not UTF-8 text"):
        read_jsonl(str(f))


def test_integer_tensor_is_never_cast(tmp_path):
    from moeadapt.io import load_state_into
    from moeadapt.models.model import build_model, materialize

    m = materialize(build_model(micro_spec(), "meta"), "cpu")
    state = {k: v.clone() for k, v in m.state_dict().items() if not k.endswith("tokens_per_expert")}
    load_state_into(m, state, "ok.safetensors")  # the right weights load
    state["embed.weight"] = state["embed.weight"].round().to(torch.int64)
    with pytest.raises(ValueError, match="embed.weight is torch.int64 but the model holds torch.float32"):
        load_state_into(m, state, "bad.safetensors")


def test_adapter_config_errors_name_the_file(tmp_path):
    from moeadapt.lora.peft import read_adapter_config

    f = tmp_path / "adapter_config.json"
    for text, msg in (("{oops", "not valid JSON"), ("[]", "holds a list"),
                      (json.dumps({"lora_alpha": 8, "target_modules": ["q"]}), "lacks \\['r'\\]")):
        f.write_text(text)
        with pytest.raises(ValueError, match=f"adapter_config.json.*{msg}"):
            read_adapter_config(tmp_path)


def test_lost_rank_is_one_line_naming_the_rank(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    msg = user_error(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:2345"))
    assert msg.startswith("rank 1: lost contact with another rank") and "train.resume=true" in msg
    assert user_error(RuntimeError("some internal bug")) is None  # a bug stays a traceback
