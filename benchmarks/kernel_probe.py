"""Question: did Triton compile what a kernel variant asked for (GPU)?

A kernel A/B (``kernel_ab.py``) says whether a variant is faster, not whether the compiler did
what the variant asked for (a ``tl.range(..., warp_specialize=True)`` may specialize nothing).
Each positional argument is a copy of ``sparsetp/kernels/attention.py``, loaded and launched by
``kernel_versions.py`` for one causal forward+backward (bf16, H=16, D=128, block 128). Per
compiled kernel it records warps, shared memory, registers, spills, the global scratch Triton
asks for (device-side tensor descriptors need one), and counts in the TTGIR / PTX:
``ttg.warp_specialize`` regions, TMA copies (``async_tma_copy_global_to_local``,
``cp.async.bulk.tensor``) and ``setmaxnreg``.

Believe it only if ``python -m pytest -q tests/torch_attention_test.py`` passes (and, for a
variant, ``kernel_ab.py``'s gate)::

    python benchmarks/kernel_probe.py --out=$OUT/probe.json /tmp/.variant.py [...]
"""

from __future__ import annotations

import json
import os
import traceback

from absl import app, flags
from cubin_tools import compiled_kernels

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "kernel_probe.json", "where to write the JSON")
flags.DEFINE_integer("n", 8192, "sequence length of the causal call that compiles the kernels")


def compiled_facts(kernel) -> list[dict]:
    """One record per compiled specialisation of ``kernel`` (a ``@triton.jit`` object)."""
    out = []
    for ck in compiled_kernels(kernel):
        ttgir, ptx = ck.asm.get("ttgir", ""), ck.asm.get("ptx", "")
        out.append({
            "num_warps": ck.metadata.num_warps, "shared": ck.metadata.shared,
            "n_regs": getattr(ck, "n_regs", None), "n_spills": getattr(ck, "n_spills", None),
            "global_scratch": getattr(ck.metadata, "global_scratch_size", None),
            "ttgir_warp_specialize": ttgir.count("ttg.warp_specialize"),
            "ttgir_tma_copy": ttgir.count("async_tma_copy_global_to_local"),
            "ptx_cp_async_bulk_tensor": ptx.count("cp.async.bulk.tensor"),
            "ptx_setmaxnreg": ptx.count("setmaxnreg")})
    return out


def probe(path: str, n: int) -> dict:
    import kernel_versions
    import torch

    from sparsetp.core import make_layout
    from sparsetp.core import patterns as P

    kernels = kernel_versions.load(path)
    lay = make_layout(P.causal(), n, 16, 128)
    q, k, v, d_out = (torch.randn(1, 16, n, 128, device="cuda", dtype=torch.bfloat16)
                      for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    kernel_versions.attention(q, k, v, lay, kernels)[0].backward(d_out)
    torch.cuda.synchronize()
    return {name: compiled_facts(kern) for name, kern in kernels.items()}


def main(argv):
    if len(argv) < 2:
        raise app.UsageError("give at least one copy of sparsetp/kernels/attention.py")
    out = {}
    for path in argv[1:]:
        name = os.path.basename(path)
        try:
            out[name] = probe(path, FLAGS.n)
        except Exception:  # noqa: BLE001 - a variant that fails is recorded, the rest still run
            out[name] = {"error": traceback.format_exc()[-3000:]}
        print(name, json.dumps(out[name]), flush=True)
    with open(FLAGS.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    app.run(main)
