"""What Triton compiled for each kernel of a variant, read off the compiled kernels (GPU).

Why: a kernel A/B (``gpu_attention_check.py --kernel_ab``) says whether a variant is faster,
not whether the compiler did what the variant asked for. Session 9 asked for Hopper warp
specialization (``tl.range(..., warp_specialize=True)`` over TMA descriptor loads) and got
none; this script is how that was seen. Per kernel it records warps, shared memory, registers,
spills, the global scratch Triton asks for (device-side tensor descriptors need one), and
counts in the TTGIR / PTX: ``ttg.warp_specialize`` regions, TMA copies
(``async_tma_copy_global_to_local``, ``cp.async.bulk.tensor``) and ``setmaxnreg``.

Usage (GPU machine, repo root on PYTHONPATH; one causal N=8192 fwd+bwd per variant)::

    python benchmarks/kernel_probe.py --out=$OUT/probe.json .ab_variant.py [...]
"""

from __future__ import annotations

import json
import os
import traceback

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "kernel_probe.json", "where to write the JSON")
flags.DEFINE_integer("n", 8192, "sequence length of the causal call that compiles the kernels")


def compiled_facts(kernel) -> list[dict]:
    """One record per compiled specialisation of ``kernel`` (a ``@triton.jit`` object)."""
    out = []
    for caches in getattr(kernel, "device_caches", {}).values():
        for ck in caches[0].values():
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
    import torch

    from sparsetp.backends.torch import attention as tattn
    from sparsetp.core import make_layout
    from sparsetp.core import patterns as P
    from sparsetp.kernels import launch as L

    kernels = L._load_kernels(path)
    lay = make_layout(P.causal(), n, 16, 128)
    q, k, v, d_out = (torch.randn(1, 16, n, 128, device="cuda", dtype=torch.bfloat16)
                      for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    with L._using_kernels(kernels):
        tattn.sparse_attention(qg, kg, vg, lay).backward(d_out)
    torch.cuda.synchronize()
    return {name: compiled_facts(kern) for name, kern in kernels.items()}


def main(argv):
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
