"""Sharded loading and export on gloo ranks: a tiny random Hugging Face checkpoint written by transformers,
loaded at world 1, 2 and 4 (FSDP2, ep 1 and 2) with each rank reading only its boxes, gives the single-process
weights bit for bit and the same first-step loss; each rank reads about its share of the bytes. A DCP
checkpoint written at world 2 loads at world 4. The sharded export at world 2 (Hugging Face names, several
files) loads in transformers with the original logits, and ours loads back in moeadapt."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _harness import spawn

# the ranks import this module: transformers is imported by the test bodies only (it costs seconds per rank)
pytestmark = [pytest.mark.dist, pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                                   reason="transformers is not installed")]


def save_tiny(fam: str, out: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "onboard"))
    from onboard_helpers import save_tiny as save

    return save(fam, out)

FAMILIES = ("qwen3_moe", "deepseek_v3")
ROWS, SEQ = 4, 16


def _batch(vocab: int, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (ROWS, SEQ + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _sharded(ckpt: Path, par: dict, spec_from: Path | None = None):
    """Build on meta -> parallelize on meta -> to_empty -> each rank fills its boxes from the checkpoint."""
    from moeadapt.config import ParallelSpec
    from moeadapt.models.model import build_model
    from moeadapt.onboard import read_family_dir
    from moeadapt.onboard.sources import open_source
    from moeadapt.parallel import build_parallel_dims, parallelize_model
    from moeadapt.parallel.sharded_io import load_sharded

    spec = read_family_dir(spec_from or ckpt).spec
    dims = build_parallel_dims(ParallelSpec(**par), spec, "cpu")
    model = parallelize_model(build_model(spec, "meta"), dims)
    model.to_empty(device="cpu")
    model.set_backend("reference")
    return spec, dims, model, load_sharded(model, open_source(ckpt), dims)


def _loss(model, spec) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _batch(spec.vocab_size)
    per = ROWS // world
    loss = model(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per], return_logits=False).loss.detach()
    dist.all_reduce(loss)
    return float(loss) / world


def _load_run(rank, world, root: str, ep: int):
    from moeadapt.parallel.checkpoint import gather_full_state

    root = Path(root)
    out = {}
    for fam in FAMILIES:
        spec, dims, model, info = _sharded(root / fam, dict(dp_shard=world, ep=ep))
        state = gather_full_state(model, dims)
        if rank == 0:
            torch.save(state, root / f"state_{fam}_w{world}.pt")
        reads = [None] * world
        dist.all_gather_object(reads, info["bytes_read"])
        out[fam] = {"loss": _loss(model, spec), "bytes_read": reads}
        if world == 2 and fam == "qwen3_moe":  # a full-training DCP checkpoint for the world-4 run to load
            import torch.distributed.checkpoint as dcp

            from moeadapt.parallel.checkpoint import _portable, expert_param_names
            from moeadapt.parallel.safe_dcp import SafeWriter

            experts = expert_param_names(model)
            sd = {f"model.{n}": _portable(t, n in experts, dims) for n, t in model.state_dict().items()
                  if not n.endswith("tokens_per_expert")}
            dcp.save(sd, storage_writer=SafeWriter(str(root / "dcp")))  # JSON metadata, as our checkpoints
        if world == 2:
            _export(root, fam, spec, dims, model)
        if world == 4 and fam == "qwen3_moe":
            _, _, model2, info2 = _sharded(root / "dcp", dict(dp_shard=world, ep=ep), root / fam)
            state2 = gather_full_state(model2, dims)
            if rank == 0:
                for k, v in state.items():
                    assert torch.equal(v, state2[k]), f"DCP load at world 4: {k} differs"
            dcp_reads = [None] * world
            dist.all_gather_object(dcp_reads, info2["bytes_read"])
            out["dcp_bytes_read"] = dcp_reads
    if world == 2:
        _one_rank_fails(rank, root, dims, model)
    if rank == 0:
        (root / f"w{world}.json").write_text(json.dumps(out))


def _one_rank_fails(rank: int, root: Path, dims, model) -> None:
    """A check that fails on rank 1 only: rank 1 raises its error, rank 0 does not go on alone."""
    from moeadapt.onboard import OnboardError
    from moeadapt.onboard.sources import open_source
    from moeadapt.parallel.sharded_io import load_sharded

    src = open_source(root / "deepseek_v3")
    if rank == 1:
        def broken(shapes):
            raise OnboardError("checkpoint unreadable on this rank")

        src.check = broken
    with pytest.raises(OnboardError if rank == 1 else RuntimeError,
                       match="unreadable on this rank" if rank == 1 else "another rank failed to check init_from"):
        load_sharded(model, src, dims)
    assert src.bytes_read == 0


def _reference(ckpt: Path):
    from moeadapt.onboard import onboard_model

    model, _ = onboard_model(ckpt, dtype=torch.float32)
    x, y = _batch(model.spec.vocab_size)
    with torch.no_grad():
        return model, float(model(x, y, return_logits=False).loss)


@pytest.mark.slow
def test_hf_checkpoint_loads_sharded_at_world_1_2_4(runs):
    from moeadapt.onboard.sources import open_source
    from moeadapt.parallel.sharded_io import load_sharded

    tmp_path = runs
    for fam in FAMILIES:
        ref, ref_loss = _reference(tmp_path / fam)
        own = {k: v for k, v in ref.state_dict().items() if not k.endswith("tokens_per_expert")}
        total = sum(v.numel() * v.element_size() for k, v in own.items() if k != "lm_head.weight"
                    or not ref.spec.tie_word_embeddings)
        # world 1: the same functions without a process group
        one = ref.__class__(ref.spec).to_empty(device="cpu")
        info = load_sharded(one, open_source(tmp_path / fam))
        assert all(torch.equal(v, one.state_dict()[k]) for k, v in own.items())
        assert info["bytes_read"] <= total
        for world in (2, 4):
            got = json.loads((tmp_path / f"w{world}.json").read_text())[fam]
            assert abs(got["loss"] - ref_loss) < 1e-5, f"{fam} world {world}: loss {got['loss']} vs {ref_loss}"
            state = torch.load(tmp_path / f"state_{fam}_w{world}.pt", weights_only=True)
            bad = [k for k, v in own.items() if not torch.equal(v, state[k].float())]
            assert not bad, f"{fam} world {world}: {bad[:4]} differ from the single-process load"
            reads = got["bytes_read"]
            # each rank reads its share; only the few unsharded tensors (router biases) are read by all
            assert total * 0.95 <= sum(reads) <= total * 1.05, (fam, world, reads, total)
            assert max(reads) <= total / world * 1.3 + 4096, (fam, world, reads, total)
    # DCP reads whole saved chunks (here the world-2 halves, each with its serialisation header): a world-4 rank
    # reads the half its quarter lies in
    from moeadapt.parallel.safe_dcp import read_safe_metadata

    stored = sum(v.length for v in read_safe_metadata(tmp_path / "dcp").storage_data.values())
    dcp_reads = json.loads((tmp_path / "w4.json").read_text())["dcp_bytes_read"]
    assert all(0.4 * stored < r <= 0.6 * stored for r in dcp_reads), (dcp_reads, stored)


def _export(root: Path, fam: str, spec, dims, model) -> None:
    from moeadapt.onboard.loader import HFLayout
    from moeadapt.onboard.sources import open_source
    from moeadapt.parallel.sharded_io import export_sharded

    cfg = json.loads((root / fam / "config.json").read_text())
    src = open_source(root / fam)
    src.loader.check()
    export_sharded(model, root / f"hf_{fam}", cfg, dims, layout=HFLayout(src.loader.rules, src.loader.src_shapes),
                   max_shard_bytes=30_000)
    export_sharded(model, root / f"ours_{fam}", {"moeadapt": spec.model_dump(mode="json")}, dims,
                   max_shard_bytes=30_000)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The tiny checkpoints, then world 2 (load, DCP save, exports) and world 4 (load, DCP load), ep 2."""
    root = tmp_path_factory.mktemp("sharded_io")
    for fam in FAMILIES:
        save_tiny(fam, root / fam)
    spawn(_load_run, 2, str(root), 2)
    spawn(_load_run, 4, str(root), 2)
    return root


@pytest.mark.slow
def test_sharded_export_round_trip(runs):
    import transformers

    from moeadapt.models.model import build_model
    from moeadapt.onboard import read_family_dir
    from moeadapt.onboard.sources import open_source
    from moeadapt.parallel.sharded_io import load_sharded

    tmp_path = runs
    for fam in FAMILIES:
        out = tmp_path / f"hf_{fam}"
        files = sorted(p.name for p in out.glob("model-*.safetensors"))
        assert len(files) > 1 and (out / "model.safetensors.index.json").is_file(), files
        assert not list(tmp_path.glob(f".hf_{fam}*")), "temporary directory left behind"
        x, _ = _batch(96)
        with torch.no_grad():
            a = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / fam)).float().eval()
            b = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
            la, lb = a(x).logits, b(x).logits
        assert torch.equal(la, lb), f"{fam}: transformers logits differ by {(la - lb).abs().max():.2e}"
        ref, _ = _reference(tmp_path / fam)
        ours = build_model(read_family_dir(tmp_path / f"ours_{fam}").spec, "meta").to_empty(device="cpu")
        load_sharded(ours, open_source(tmp_path / f"ours_{fam}"))
        ours.set_backend("reference")
        with torch.no_grad():
            lo, lr = ours.eval()(x).logits, ref(x).logits
        assert torch.equal(lo, lr), f"{fam}: moeadapt logits differ by {(lo - lr).abs().max():.2e}"
        assert (lr - la).abs().max() < 1e-4, f"{fam}: moeadapt vs transformers {(lr - la).abs().max():.2e}"


@pytest.mark.slow
def test_torchrun_lora_finetune_from_hf_checkpoint(tmp_path):
    """The trainer at world 2 (FSDP + ep 2) loads a Hugging Face init_from shard by shard: its eval loss before
    training equals the single-process run's; the adapter (gathered) is written."""
    import subprocess

    import yaml
    from _harness import ROOT, free_port

    from moeadapt import api
    from moeadapt.config import build_run_config
    from moeadapt.onboard import model_spec_from_dir

    ckpt = tmp_path / "qwen"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "onboard"))
    from onboard_helpers import save_tiny as save

    save("qwen3_moe", ckpt, vocab_size=264)  # the byte tokenizer's vocabulary
    raw = {"model": str(ckpt), "lora": {"rank": 4, "targets": ["attn.q_proj", "experts.w1"]},
           "train": {"steps": 1, "micro_batch_size": 2, "seq_len": 16, "eval_batches": 1, "device": "cpu",
                     "init_from": str(ckpt), "output_dir": str(tmp_path / "one")},
           "data": {"train": "builtin:recall_qa", "eval_fraction": 0.01}}
    one = api.train(build_run_config(raw, from_dir=model_spec_from_dir), quiet=True)
    raw["train"]["output_dir"] = str(tmp_path / "two")
    raw["parallel"] = {"dp_shard": 2, "ep": 2}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MOEADAPT_DIST_TIMEOUT="60")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), "-m", "moeadapt", "train", str(tmp_path / "cfg.yaml")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert abs(two["eval_loss_before"] - one.eval_before) < 1e-5, (two["eval_loss_before"], one.eval_before)
    assert (tmp_path / "two" / "adapter" / "adapter_model.safetensors").is_file()
