"""Question: how do our compiled kernels' resources and instruction mix compare with
FlexAttention's on the same causal problem (GPU)?

Static resources can explain a per-kernel time gap (``bwd_kernels.py``) that tile shapes,
warps and stages do not. This compiles both on the GPU machine (one causal forward+backward,
bf16, H=16, D=128, block 128 under the default launch policy; Flex with its defaults) and
records per kernel: registers, spills, shared memory, the static count of each SASS opcode
(from the cubin, with the nvdisasm that ships with Triton) and the TTGIR dots; the TTGIR of
each kernel is written next to ``--out``.

Believe it only if ``python -m pytest -q tests/torch_attention_test.py`` passes::

    python benchmarks/kernel_resources.py --out=$OUT/kernel_resources.json
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile

from absl import app, flags
from cubin_tools import compiled_kernels, sass_profile

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "kernel_resources.json", "where to write the JSON")
flags.DEFINE_integer("n", 8192, "sequence length of the compiled cases (any multiple of 128)")


def ours(n: int) -> list[dict]:
    import torch

    from sparsetp.core import make_layout
    from sparsetp.core import patterns as P
    from sparsetp.kernels import abi
    from sparsetp.torch import sparse_attention

    h, d = 16, 128
    layout = make_layout(P.causal(), n, h, 128)
    q, k, v, do = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    sparse_attention(q, k, v, layout).backward(do)
    torch.cuda.synchronize()
    rows, tmp = [], tempfile.mkdtemp()
    for name in abi.KERNEL_NAMES:
        for i, compiled in enumerate(compiled_kernels(abi.kernel(name))):
            path = os.path.join(tmp, f"{name}_{i}.cubin")
            with open(path, "wb") as f:
                f.write(compiled.asm["cubin"])
            with open(os.path.join(os.path.dirname(os.path.abspath(FLAGS.out)),
                                   f"ours_{name}_{i}.ttgir"), "w") as f:
                f.write(compiled.asm["ttgir"])
            md = compiled.metadata
            rows.append({"impl": "sparsetp", "kernel": name,
                         "num_warps": md.num_warps, "num_stages": md.num_stages,
                         "shared": md.shared, "n_regs": getattr(compiled, "n_regs", None),
                         "n_spills": getattr(compiled, "n_spills", None),
                         "ttgir_dots": [ln.strip()[:300]
                                        for ln in compiled.asm["ttgir"].splitlines()
                                        if "warp_group_dot " in ln or "tt.dot " in ln],
                         **sass_profile(path)})
    return rows


def flex(n: int) -> list[dict]:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    cache = tempfile.mkdtemp()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    h, d = 16, 128
    mask = create_block_mask(lambda b, hh, qi, ki: qi >= ki, 1, h, n, n, device="cuda",
                             BLOCK_SIZE=128)
    q, k, v, do = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):  # all three: Flex drops the dK computation when k needs no gradient
        t.requires_grad_()
    fn = torch.compile(flex_attention)
    fn(q, k, v, block_mask=mask).backward(do)
    torch.cuda.synchronize()
    rows = []
    for path in glob.glob(os.path.join(cache, "**", "*.cubin"), recursive=True):
        meta_path = path[:-len(".cubin")] + ".json"
        meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
        src = glob.glob(os.path.join(os.path.dirname(path), "*.source")) + glob.glob(
            os.path.join(os.path.dirname(path), "*.ttir"))
        ttgir = path[:-len(".cubin")] + ".ttgir"
        if os.path.exists(ttgir) and os.path.getsize(path) > 100_000:  # the attention kernels
            with open(os.path.join(os.path.dirname(os.path.abspath(FLAGS.out)),
                                   f"flex_{meta.get('name', 'kernel')}.ttgir"), "w") as f:
                f.write(open(ttgir).read())
        rows.append({"impl": "flex", "kernel": meta.get("name", os.path.basename(path)),
                     "num_warps": meta.get("num_warps"), "num_stages": meta.get("num_stages"),
                     "shared": meta.get("shared"), "cubin": os.path.basename(path),
                     "sources": [os.path.basename(s) for s in src], **sass_profile(path)})
    return rows


def main(argv):
    del argv
    out = {"command": " ".join(sys.argv), "n": FLAGS.n, "rows": []}
    for fn in (ours, flex):
        try:
            out["rows"] += fn(FLAGS.n)
        except Exception:  # record and go on: the other half is still worth having
            import traceback

            out.setdefault("errors", []).append({"part": fn.__name__,
                                                 "error": traceback.format_exc()[-3000:]})
    with open(FLAGS.out, "w") as f:
        json.dump(out, f, indent=1, default=str)
    for r in out["rows"]:
        top = {k: v for k, v in list(r["opcodes"].items())[:25]}
        print(r["impl"], r["kernel"], "warps", r["num_warps"], "stages", r["num_stages"],
              "shared", r["shared"], "regs", r.get("n_regs"), "spills", r.get("n_spills"),
              "instrs", r["n_instructions"], top, flush=True)
        print("   ", r["res_usage"].replace("\n", " | ")[-300:], flush=True)
    for e in out.get("errors", []):
        print("ERROR", e["part"], e["error"][-1500:], flush=True)


if __name__ == "__main__":
    app.run(main)
