"""`torchrun -m moeadapt train` end to end (FSDP + EP + selective AC + DCP), resume at another world size,
and a failing rank ending the job within bounded time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml
from _harness import ROOT, free_port, micro_spec, spawn

pytestmark = pytest.mark.dist


def _torchrun(nproc: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MOEADAPT_DIST_TIMEOUT="60")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_torchrun_train_then_resume_on_fewer_ranks(tmp_path):
    spec = micro_spec().model_dump()
    cfg = {"model": spec, "data": {"train": "builtin:tinystories", "format": "text"},
           "train": {"steps": 4, "micro_batch_size": 2, "seq_len": 32, "lr": 3e-3, "save_every": 2, "log_every": 1,
                     "eval_batches": 1, "resume": True, "output_dir": str(tmp_path / "run"), "device": "cpu"},
           "parallel": {"dp_shard": 2, "ep": 2, "a2a_chunks": 2, "activation_checkpointing": "selective"}}
    f = tmp_path / "cfg.yaml"
    f.write_text(yaml.safe_dump(cfg))
    r = _torchrun(2, "--max-restarts", "1", "-m", "moeadapt", "train", str(f))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = tmp_path / "run"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000004"
    assert (run / "checkpoints" / "step_0000004" / "metadata.json").is_file()
    assert (run / "model" / "model.safetensors").is_file() and (run / "summary.json").is_file()
    # resume from latest on one rank (ep=1), micro-batch doubled so the global batch is the same
    r = _torchrun(1, "-m", "moeadapt", "train", str(f), "--set", "train.steps=6", "train.micro_batch_size=4",
                  "parallel.dp_shard=1", "parallel.ep=1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout and "step 4" in r.stdout
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [x["step"] for x in recs if x["kind"] == "train"]
    assert steps[-1] == 6 and steps.count(5) == 1, steps


CRASH_ONCE = """
import os, sys
sys.path.insert(0, os.environ["PYTHONPATH"])
import moeadapt.parallel.run as run

_save = run.save_distributed


def save_then_crash(*a, **k):  # first attempt only: rank 1 dies right after the step-2 checkpoint
    out = _save(*a, **k)
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and os.environ["RANK"] == "1":
        os._exit(3)
    return out


run.save_distributed = save_then_crash
from moeadapt.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_max_restarts_resumes_from_latest(tmp_path):
    cfg = {"model": micro_spec().model_dump(), "data": {"train": "builtin:tinystories", "format": "text"},
           "train": {"steps": 3, "micro_batch_size": 2, "seq_len": 32, "save_every": 2, "log_every": 1,
                     "eval_batches": 1, "resume": True, "output_dir": str(tmp_path / "run"), "device": "cpu"},
           "parallel": {"dp_shard": 2, "ep": 2}}
    f, wrapper = tmp_path / "cfg.yaml", tmp_path / "crash_once.py"
    f.write_text(yaml.safe_dump(cfg))
    wrapper.write_text(CRASH_ONCE)
    # (the agent's store outlives the failed round: init_distributed prefixes its keys per attempt, without
    # which the restarted ranks could read the dead ranks' addresses)
    r = _torchrun(2, "--max-restarts", "1", str(wrapper), "train", str(f))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "resumed from" in out and "at step 2" in out, out[-4000:]
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs if x["kind"] == "train"][-1] == 3


FAIL_SCRIPT = """
import os, sys, time, torch, torch.distributed as dist
sys.path.insert(0, os.environ["PYTHONPATH"])
from moeadapt.parallel import init_distributed
init_distributed("cpu", timeout_s=float(os.environ["T"]))
if dist.get_rank() == 1:
    raise SystemExit("rank 1: simulated failure")
dist.all_reduce(torch.ones(1))  # rank 0 waits here for a rank that is gone
"""


def test_failing_rank_ends_torchrun_job_quickly(tmp_path):
    f = tmp_path / "fail.py"
    f.write_text(FAIL_SCRIPT)
    t0 = time.perf_counter()
    env_t = os.environ.get("T")
    os.environ["T"] = "30"
    try:
        r = _torchrun(2, str(f), timeout=120)
    finally:
        os.environ.pop("T") if env_t is None else os.environ.__setitem__("T", env_t)
    assert r.returncode != 0
    assert "simulated failure" in (r.stdout + r.stderr)
    assert time.perf_counter() - t0 < 60


def _hang(rank, world):
    import torch
    import torch.distributed as dist

    if rank == 1:
        time.sleep(8)  # never joins the collective in time
        return
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError):
        dist.all_reduce(torch.ones(1))
    assert time.perf_counter() - t0 < 7, "the process-group timeout did not fire"


def test_process_group_timeout_raises_instead_of_hanging(monkeypatch):
    monkeypatch.setenv("MOEADAPT_TEST_TIMEOUT", "3")
    spawn(_hang, 2)


@pytest.mark.slow
@pytest.mark.parametrize("pack", [False, True])
def test_torchrun_train_with_cp_matches_one_process(tmp_path, pack):
    """cp=2 on 2 ranks reads the same rows as one process and splits them in time: same losses. pack: short
    documents with data.pack_documents (position_ids split over the cp ranks with the tokens)."""
    spec = micro_spec(index_topk=6).model_dump()
    data = {"train": "builtin:tinystories", "format": "text"}
    if pack:
        short = tmp_path / "short.jsonl"
        short.write_text("".join(json.dumps({"text": "ab" * (i % 9 + 1)}) + "\n" for i in range(120)))
        data = {"train": str(short), "format": "text", "pack_documents": True, "eval_fraction": 0.25}
    losses = {}
    for name, nproc, par in (("cp2", 2, {"cp": 2}), ("one", 1, {})):
        cfg = {"model": spec, "data": data,
               "train": {"steps": 2, "micro_batch_size": 2, "seq_len": 36, "lr": 3e-3, "log_every": 1,
                         "eval_batches": 1, "output_dir": str(tmp_path / name), "device": "cpu"},
               "parallel": par}
        f = tmp_path / f"{name}.yaml"
        f.write_text(yaml.safe_dump(cfg))
        r = _torchrun(nproc, "-m", "moeadapt", "train", str(f))
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        recs = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [x["loss"] for x in recs if x["kind"] == "train"] + \
                       [x["eval_loss"] for x in recs if x["kind"] == "eval"]
    assert len(losses["cp2"]) == len(losses["one"]) >= 3, losses
    for a, b in zip(losses["cp2"], losses["one"]):
        assert abs(a - b) < 1e-4, losses
