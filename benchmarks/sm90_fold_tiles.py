"""sm90_check for the fold_io kernels at their GPU tile sizes (sm90_check compiles the tiles the
interpreter picked, BM=16/BK=32; on a GPU fused_lora uses BM=64, BK=128 / BN=128 and num_warps/stages).

    TRITON_INTERPRET=0 python benchmarks/sm90_fold_tiles.py   # records the bf16 launches of tests -k fold_bf16, recompiles at GPU tiles
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sm90_check  # noqa: E402

GPU = {  # kernel -> (constexprs, launch options) as fused_lora / triton_permute choose them off the interpreter
    "_lora_in_kernel": (dict(BM=64, BK=128), dict(num_warps=4, num_stages=3)),
    "_fold_swiglu_bwd_kernel": (dict(BM=64, BN=128), dict(num_warps=4, num_stages=2)),
    "_lora_out_kernel": (dict(BM=64, BN=128), dict(num_warps=4, num_stages=2)),
    "_combine_rows_kernel": (dict(BLOCK_T=8, BLOCK_D=256), {}),
}

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "l.json"
        env = dict(os.environ, TRITON_INTERPRET="1", _SM90_RECORD=str(out))
        if "SM90_CHILD_PYTHONPATH" in os.environ:  # as in sm90_check
            env["PYTHONPATH"] = os.environ["SM90_CHILD_PYTHONPATH"]
        subprocess.run([sys.executable, sm90_check.__file__, "pytest", "tests/ops/test_moe_ops.py", "-k", "fold_bf16"],
                       env=env, check=True, stdout=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[1])
        recs = [r for r in json.loads(out.read_text()) if r["name"] in GPU]
    for r in recs:
        const, opts = GPU[r["name"]]
        r["const"].update(const)
        r["opts"] = opts
    bad = sm90_check.compile_all(recs)
    print(f"{len(recs)} launches at GPU tiles, {bad} over the limit or failed")
    sys.exit(1 if bad else 0)
