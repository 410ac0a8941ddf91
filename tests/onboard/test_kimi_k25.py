"""kimi_k25 (MoonViT + projector + deepseek_v3 text): `onboard --validate` on a tiny random checkpoint written by
transformers (shapes and weights from the `seed` fixture) passes at 1e-4 in float32 on image + text documents;
a copy with one vision tensor perturbed FAILS naming the vision part; the vision RoPE row map is what makes
q / k match; the config reader names what it cannot map."""

import json
import random
import shutil

import pytest
import torch
from onboard_helpers import _random_cfg, perturb, random_adapters, save_tiny
from safetensors.torch import load_file, save_file

from moeadapt.cli import main
from moeadapt.onboard import OnboardError, onboard, read_family, read_family_dir
from moeadapt.onboard import names as names_mod
from moeadapt.onboard.validate import TOL, validate_checkpoint


def _ckpt(tmp_path, seed):
    return save_tiny("kimi_k25", tmp_path / "ckpt", seed=seed)


def test_kimi_k25_validates_against_transformers(seed, tmp_path):
    d = _ckpt(tmp_path, seed)
    cfg = json.loads((d / "config.json").read_text())
    res = onboard(d, validate=True, seed=seed)
    v, s = res["validation"], res["spec"]
    print({k: v[k] for k in ("max_abs_diff", "max_abs_logit", "lengths", "vision_parts", "per_layer")})
    assert v["passed"], v["where"]
    assert v["logit_rel_diff"] <= TOL and v["max_abs_logit"] > 0.1
    vc = cfg["vision_config"]
    labels = [p[0] for p in v["vision_parts"]]
    assert labels == (["patch embedding + position table"] + [f"block {i}" for i in range(vc["num_hidden_layers"])]
                      + ["final norm", "merger + projector"])
    assert all(m > 0.1 for _, _, m in v["vision_parts"])  # every part really carried image features
    vs = s.vision
    assert vs.pos_embed_grid == (vc["pos_emb_height"], vc["pos_emb_width"]) and vs.patch_embed_conv
    assert vs.mlp_act == ("gelu" if vc["hidden_act"] == "gelu" else "gelu_tanh")
    assert vs.merger_norm_eps == cfg["projection_layer_norm_eps"] and vs.image_token_id == cfg["image_token_id"]
    assert s.tie_word_embeddings == cfg["tie_word_embeddings"]
    assert res["check"]["mapped"] == res["check"]["tensors"]
    v = validate_checkpoint(d, read_family_dir(d), layers=1, seed=seed)  # the first text block, the whole tower
    assert v["passed"] and v["layers"] == 1 and len(v["vision_parts"]) == len(labels), v["where"]


def test_broken_vision_copy_fails_naming_the_part(seed, tmp_path):
    """Our copy of the weights with one vision tensor perturbed: FAIL, naming that part of the tower."""
    d = _ckpt(tmp_path, seed)
    fam = read_family_dir(d)
    last = fam.spec.vision.n_layers - 1
    for name, part in [(f"vision.tower.blocks.{last}.fc1.weight", f"block {last}"),
                       ("vision.tower.pos_embed", "patch embedding + position table"),
                       ("vision.projector.fc1.weight", "merger + projector")]:
        v = validate_checkpoint(d, fam, tamper=perturb(name))
        assert not v["passed"] and v["first_bad_part"] == part, (name, v["where"])
        assert v["where"].startswith(f"the vision {part} is the first part to diverge")
        ok = [p for p in v["vision_parts"] if p[0] != part][:[p[0] for p in v["vision_parts"]].index(part)]
        assert all(dh / max(1, h) <= TOL for _, dh, h in ok)  # the parts before it still agree


def test_vision_rope_row_map_is_what_makes_qk_match(seed, tmp_path, monkeypatch, capsys):
    d = _ckpt(tmp_path, seed)
    monkeypatch.setattr(names_mod, "_vision_rope_rows", lambda heads, head: torch.arange(heads * head))
    v = validate_checkpoint(d, read_family_dir(d))
    assert not v["passed"] and v["first_bad_part"] == "block 0", v["where"]
    assert main(["onboard", str(d), "--validate"]) == 2  # the CLI: FAIL, one message naming the part, exit 2
    out = capsys.readouterr()
    assert "FAIL" in out.out and "validation failed" in out.err
    assert "the vision block 0 is the first part to diverge" in out.err


def test_moonshot_spelling_maps_too(seed, tmp_path):
    """Moonshot's own checkpoints spell three prefixes differently from transformers' save_pretrained."""
    d = _ckpt(tmp_path, seed)
    out = tmp_path / "moonshot"
    shutil.copytree(d, out)
    t = load_file(str(out / "model.safetensors"))
    ren = {"language_model.model.blocks.": "language_model.model.layers.",
           "vision_tower.encoder.patch_embed.proj.": "vision_tower.patch_embed.proj.",
           "model.mm_projector.pre_norm.": "mm_projector.pre_norm."}
    moved = {}
    for k, x in t.items():
        for a, b in ren.items():
            k = b + k[len(a):] if k.startswith(a) else k
        moved[k] = x
    assert set(moved) != set(t)
    save_file(moved, str(out / "model.safetensors"), metadata={"format": "pt"})
    c = onboard(out)["check"]
    assert c["mapped"] == c["tensors"] == len(moved)


def test_config_reader_names_what_it_cannot_map(seed):
    cfg = _random_cfg("kimi_k25", random.Random(seed)).to_dict()
    assert read_family(cfg).spec.vision is not None
    for change, needle in [
        (lambda c: c["vision_config"].update(pos_emb_width=c["vision_config"]["pos_emb_height"] + 2), "pos_emb_height"),
        (lambda c: c["vision_config"].update(merge_kernel_size=[1, 1]), "merge_kernel_size"),
        (lambda c: c["vision_config"].update(hidden_act="relu"), "hidden_act='relu'"),
        (lambda c: c["vision_config"].update(window_size=4), "vision_config.window_size (not understood)"),
        (lambda c: c["text_config"].update(hidden_act="gelu"), "text_config.hidden_act"),
        (lambda c: c.update(projection_hidden_size=c["vision_config"]["hidden_size"] * 2), "projection_hidden_size"),
    ]:
        bad = json.loads(json.dumps(cfg))
        change(bad)
        with pytest.raises(OnboardError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            read_family(bad)


def test_sliced_reads_match_the_whole_load(seed, tmp_path):
    """FSDP's boxes of the vision tensors (RoPE-permuted qkv rows, the Conv2d-shaped patch kernel, the position
    table) and of the text tensors under language_model. equal the whole-tensor load."""
    from test_sliced_read import _check_all_boxes

    src = _check_all_boxes(_ckpt(tmp_path, seed), seed)
    assert src.loader.rule("vision.tower.blocks.0.attn.qkv.weight").row_perm is not None


@pytest.mark.slow  # ~10 s on 2 cores: a training run
def test_lora_finetune_from_the_checkpoint(seed, tmp_path):
    """A vision-language LoRA run (vision-tower LoRA, projector trained fully) initialised from the kimi_k25
    checkpoint through the name map; the adapter on the same checkpoint reproduces the run's eval."""
    from moeadapt import api
    from moeadapt.config import build_run_config
    from moeadapt.data import shapes
    from moeadapt.onboard import model_spec_from_dir

    # the byte tokenizer's vocabulary and image placeholder (263)
    d = save_tiny("kimi_k25", tmp_path / "ckpt", seed=seed, image_token_id=263, video_token_id=262,
                  vision_start_token_id=260, vision_end_token_id=261, text_config={"vocab_size": 264})
    shapes.write_split(tmp_path / "d", "train", 16, 1, turns=1)
    shapes.write_split(tmp_path / "d", "eval", 8, 2, turns=1)
    ev = str(tmp_path / "d" / "eval.jsonl")
    spec = model_spec_from_dir(d).model_copy(update={"bias_update_rate": 0.0})  # base + adapter = trained model
    cfg = build_run_config({
        "model": spec.model_dump(mode="json"), "lora": {"rank": 4, "alpha": 8, "vision_tower": "lora",
                                                        "projector": "full"},
        "train": dict(steps=2, lr=1e-2, warmup_steps=0, micro_batch_size=4, seq_len=40, log_every=1,
                      eval_batches=2, output_dir=str(tmp_path / "run"), init_from=str(d), seed=0, device="cpu",
                      dtype="fp32"),
        "data": {"train": str(tmp_path / "d" / "train.jsonl"), "eval": ev}})
    r = api.train(cfg, quiet=True)
    assert r.eval_after < r.eval_before
    res = api.evaluate(d, ev, r.output_dir / "adapter", seq_len=40, batch_size=4, max_batches=2)
    assert abs(res["loss"] - r.eval_after) < 1e-5


def test_attention_adapter_loads_in_peft(seed, tmp_path):
    """A LoRA adapter on the text model's attention, exported with the kimi_k25 name map, is what peft (0.21.2)
    applies to transformers' Kimi_K25ForConditionalGeneration: same logits, no missing or unexpected keys.
    (peft does not place per-expert adapters on this family's fused experts: its MoE conversion lacks it.)"""
    import warnings

    peft = pytest.importorskip("peft")
    import transformers

    from moeadapt.config import LoRASpec
    from moeadapt.lora import export_peft
    from moeadapt.onboard import onboard_model, peft_maps

    d = _ckpt(tmp_path, seed)
    ours, _ = onboard_model(d, dtype=torch.float32)
    spec = ours.spec
    lora = LoRASpec(rank=2, alpha=4.0, targets=["attn.wq_b", "attn.wkv_b", "attn.wo"])
    g = torch.Generator().manual_seed(seed)
    random_adapters(ours, lora, g, 0.2)
    out = export_peft(ours, lora, tmp_path / "adapter", **peft_maps(d))
    ids = torch.randint(0, spec.vision.image_token_id, (1, 16), generator=g)
    hf = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(str(d), dtype=torch.float32,
                                                                      attn_implementation="eager").eval()
    with torch.no_grad():
        base = hf(input_ids=ids).logits.float()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = peft.PeftModel.from_pretrained(hf, str(out)).eval()
    msgs = [str(w.message) for w in caught if "adapter keys" in str(w.message) or "unexpected" in str(w.message)]
    assert not msgs, msgs
    with torch.no_grad():
        got, ref = pm(input_ids=ids).logits.float(), ours.eval()(ids).logits.float()
    assert (ref - base).abs().max() > 1e-3 and (got - ref).abs().max() <= 1e-4
