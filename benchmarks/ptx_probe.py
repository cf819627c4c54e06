"""Compile the attention kernels for sm_90 on a machine without a GPU and count what matters.

Question: what code does Triton generate for each kernel (registers, spills, shared memory, SASS
opcode counts, the width of every ``cp.async`` copy), for the GPU machine's Triton, before a
kernel variant costs a device call? Triton compiles for any target without a GPU
(``triton.compile`` with a ``GPUTarget``; ptxas, cuobjdump and nvdisasm ship in its wheel, read
through ``cubin_tools.py``). Findings: ``benchmarks/KERNEL_NOTES.md``.

Install the GPU machine's Triton beside the local one and point PYTHONPATH at it::

    pip install --target /tmp/t36 --no-deps triton==3.6.0
    PYTHONPATH=/tmp/t36:$PWD python benchmarks/ptx_probe.py --kernels=bwd_dkdv,bwd_dq

``--source`` takes a copy of ``sparsetp/kernels/attention.py`` (a variant, loaded by
``kernel_versions.py``) instead of the tree's. Each kernel compiles under the launch's own
config for ``--dtype`` (bf16 by default) at ``--block`` and ``--head_dim``
(``sparsetp.kernels.tiles.tile_config``; flags override sub, warps and stages); every pointer is
marked 16-byte aligned and the unit strides are specialised to 1, as Triton does for the
contiguous tensors of a real launch. ``tests/ptx_probe_test.py`` runs it on the CI's Triton and
must pass before its numbers are believed.
"""

from __future__ import annotations

import collections
import json
import re
import sys
import tempfile

from absl import app, flags
from cubin_tools import sass_profile

FLAGS = flags.FLAGS
flags.DEFINE_string("source", None, "a copy of sparsetp/kernels/attention.py (default: the tree's)")
flags.DEFINE_list("kernels", ["fwd", "bwd_dq", "bwd_dkdv"], "kernel names "
                  "(sparsetp.kernels.abi.KERNEL_NAMES)")
flags.DEFINE_integer("block", 64, "kernel tile (BLOCK)")
flags.DEFINE_integer("head_dim", 128, "HEAD_DIM")
flags.DEFINE_integer("sub", None, "sub-tile walked per step (SUB_N / SUB_M); default: the "
                     "launch's (tiles.tile_config on CUDA)")
flags.DEFINE_integer("num_warps", None, "warps; default: the launch's")
flags.DEFINE_integer("num_stages", None, "pipeline stages; default: the launch's")
flags.DEFINE_integer("capability", 90, "CUDA compute capability of the target")
flags.DEFINE_string("out", None, "also write the results as JSON here")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32", "float64"],
                  "input dtype (statistics: float64 for float64, else float32). float64 kernels "
                  "compile under the GPU's typing rules, which the interpreter does not check")

# Arguments by role; anything else that is not a constexpr is an int32 scalar.
_INPUT = {"Q", "K", "V", "DO", "DQ", "DK", "DV", "Out"}  # the input dtype
_STATS = {"LSE", "Delta", "DLSE"}  # the statistics dtype (abi.stats_dtype)
_PTR = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32", "float64": "*fp64"}
_UNIT_STRIDES = {"stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_dod", "stride_dqd",
                 "stride_dkd", "stride_dvd", "stride_ln", "stride_mw", "stride_ik"}


def _kernels(source: str | None) -> dict:
    from sparsetp.kernels import abi, interpreter

    if source is None:
        kernels = {name: abi.kernel(name) for name in abi.KERNEL_NAMES}
    else:
        import kernel_versions  # imports torch: only for a variant

        kernels = kernel_versions.load(source)
    if any(interpreter.is_interpreted(k) for k in kernels.values()):
        raise SystemExit("the kernels were created interpreted (TRITON_INTERPRET=1): unset it, "
                         "this tool compiles them")
    return kernels


def probe(fn, *, block: int, sub: int, head_dim: int, num_warps: int, num_stages: int,
          capability: int, dtype: str = "bfloat16") -> dict:
    """Compile ``fn`` (a ``@triton.jit`` attention kernel) for sm_<capability>; return register
    use, spills (from cuobjdump) and a histogram of ``cp.async`` copies by width in bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sparsetp.kernels import abi

    names = fn.arg_names
    constexprs = {"BLOCK": block, "HEAD_DIM": head_dim, "MASK_WORDS": abi.mask_words(block),
                  "DOT_PRECISION": abi.dot_precision(dtype), "DOT_UPCAST": False,
                  "ORDERED": True, "ALIGNED": True,
                  "SUB_N": sub, "SUB_M": sub, "HEAD_DIM_PAD": abi.head_dim_padded(head_dim),
                  "GROUPED": False, "HAS_DLSE": False}
    constexprs = {k: v for k, v in constexprs.items() if k in names}
    constexprs.update({n: 1 for n in names if n in _UNIT_STRIDES})
    sig = {}
    for n in names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in _INPUT:
            sig[n] = _PTR[dtype]
        elif n in _STATS:
            sig[n] = _PTR[abi.stats_dtype(dtype)]
        elif n in ("sm_scale", "sm_scale_lo"):
            sig[n] = "fp32"
        elif n.startswith(("q_", "k_")) or n == "masks":
            sig[n] = "*i32"
        else:
            sig[n] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*")}
    compiled = triton.compile(ASTSource(fn, sig, constexprs, attrs),
                              target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = compiled.asm["ptx"]
    copy = r"cp\.async\.c[ag]\.shared\.global[^,]*,[^,]*,\s*(0x[0-9a-f]+|\d+)"
    widths = collections.Counter(int(w, 0) for w in re.findall(copy, ptx))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = sass_profile(f.name)
    return {"triton": triton.__version__, "registers": sass["registers"],
            "stack_bytes": sass["stack_bytes"], "n_instructions": sass["n_instructions"],
            "opcodes": sass["opcodes"], "shared_bytes": compiled.metadata.shared,
            "cp_async_static_by_bytes": dict(sorted(widths.items())),
            "ttgir_async_copies": compiled.asm["ttgir"].count("async_copy_global_to_local")}


def main(argv):
    del argv
    from sparsetp.kernels.tiles import tile_config

    kernels = _kernels(FLAGS.source)
    out = {}
    for name in FLAGS.kernels:
        if name not in kernels:
            raise app.UsageError(f"--kernels: {name!r} is not one of {sorted(kernels)}")
        cfg = tile_config(name, head_dim=FLAGS.head_dim, dtype=FLAGS.dtype,
                          block_size=FLAGS.block, device_kind="cuda")
        config = {"sub": FLAGS.sub or cfg.sub, "num_warps": FLAGS.num_warps or cfg.num_warps,
                  "num_stages": FLAGS.num_stages or cfg.num_stages}
        out[name] = {**config, **probe(kernels[name], block=FLAGS.block, head_dim=FLAGS.head_dim,
                                       capability=FLAGS.capability, dtype=FLAGS.dtype,
                                       **config)}
        print(name, json.dumps(out[name]), flush=True)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "kernels": out}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
