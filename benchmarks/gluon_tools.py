"""What the Gluon (sm_90) lab scripts share: TMA descriptors, the layout-list arguments, CPU
stand-in inputs, a compile-for-sm_90 profile without a GPU, and the per-case record loop.

Used by ``gluon_fwd.py`` and ``gluon_bwd.py``. Flag-free (like
``cubin_tools.py``), so every script can import it. The library's own launcher is
``sparsetp/backends/torch/hopper.py``.
"""

from __future__ import annotations

import functools
import json
import re
import tempfile

from cubin_tools import sass_profile


@functools.cache
def base_module(path: str):
    """Another commit's ``sparsetp/kernels/hopper.py`` (``git show
    REV:sparsetp/kernels/hopper.py > FILE``) as a module of its own, so that its kernels run
    beside this checkout's in one process (the lab scripts' ``--base_hopper``)."""
    import importlib.util  # noqa: PLC0415
    import sys  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location("base_hopper", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["base_hopper"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def lab_pattern(spec: str, n: int, block: int, heads: int):
    """The pattern of a lab script's ``--patterns`` entry: ``documents`` (``real_models.py``'s
    packing of ``n`` tokens, causal within each document), else the bench tool's spec
    (:func:`sparsetp.bench.attention.bench_pattern`)."""
    from attention_common import document_lengths  # noqa: PLC0415

    from sparsetp.bench.attention import bench_pattern  # noqa: PLC0415
    from sparsetp.core import patterns as P  # noqa: PLC0415

    if spec == "documents":
        return P.documents(document_lengths(n)) & P.causal()
    return bench_pattern(spec, n, block, heads).pattern


def run_cases(measure, seq_lens, patterns, out: str | None = None,
              header: dict | None = None) -> list:
    """``measure(spec, n)`` for every N, then pattern; a case that raises is recorded with its
    error, not fatal. Each record is printed as a JSON line; all are written to ``out`` as
    ``{**header, "records": [...]}``."""
    records = []
    for n in map(int, seq_lens):
        for spec in patterns:
            try:
                rec = measure(spec, n)
            except Exception as exc:  # noqa: BLE001 (a failed case is recorded, not fatal)
                rec = {"pattern": spec, "N": n, "error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(json.dumps(rec), flush=True)
            records.append(rec)
    if out:
        with open(out, "w") as f:
            json.dump({**(header or {}), "records": records}, f, indent=1)
    return records


def output_args(kernel, outputs: dict) -> tuple[tuple, tuple]:
    """(descriptors, pointers) of ``kernel``'s outputs ``{name: (tensor, box rows)}``, each in
    the given order: an output whose ``<name>_desc`` parameter ``kernel`` has is stored by TMA
    (its descriptor follows the inputs' descriptors); another commit's kernel may take the
    pointer instead (after the input pointers)."""
    by_tma = {n: f"{n}_desc" in kernel.arg_names for n in outputs}
    return (tuple(tma_desc(t, rows) for n, (t, rows) in outputs.items() if by_tma[n]),
            tuple(t for n, (t, _) in outputs.items() if not by_tma[n]))


def tma_desc(t, rows: int):
    """A host TMA descriptor of the contiguous ``t`` viewed as ``[numel / D, D]``, boxes of
    ``rows`` rows (the library's kernels read ``[B * H * N, D]`` this way)."""
    from triton.experimental.gluon import language as gl  # noqa: PLC0415
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: PLC0415

    d = t.shape[-1]
    gdt = {"torch.bfloat16": gl.bfloat16, "torch.float16": gl.float16}[str(t.dtype)]
    t2 = t.reshape(-1, d)
    lay = gl.NVMMASharedLayout.get_default_for([rows, d], gdt)
    return TensorDescriptor(t2, list(t2.shape), list(t2.stride()), [rows, d], lay)


def list_args(meta) -> tuple:
    """The query-major list arguments of the sm_90 kernels, in their order: q_count,
    q_partial, q_index, q_mask_id, masks, q_order, then the strides of q_count, q_index and
    masks (as ``sparsetp.kernels.abi`` passes them to the portable kernels)."""
    qc, qi, mk = meta["q_count"], meta["q_index"], meta["masks"]
    return ((qc, meta["q_partial"], qi, meta["q_mask_id"], mk, meta["q_order"]),
            (*qc.stride(), *qi.stride(), *mk.stride()))


def stand_ins(block: int, head_dim: int = 128):
    """CPU tensors with the kernels' argument types, for compiling without a GPU: q-shaped
    bf16 ``[1, 2, 256, head_dim]``, stats-shaped fp32 ``[1, 2, 256]`` and layout lists."""
    import torch  # noqa: PLC0415

    i32 = torch.empty(2, 2, 4, dtype=torch.int32)
    meta = {"q_count": i32[:, :, 0], "q_partial": i32[:, :, 0], "q_index": i32,
            "q_mask_id": i32, "masks": torch.empty(3, block, 4, dtype=torch.int32),
            "q_order": i32[:, :, 0], "mask_quarters": torch.empty(3, dtype=torch.int32),
            "q_halves": i32[:, :, 0]}
    return (torch.empty(1, 2, 256, head_dim, dtype=torch.bfloat16), torch.empty(1, 2, 256),
            meta)


def sm90_profile(kernel, args, constexprs: dict, num_warps: int) -> dict:
    """Compile the Gluon ``kernel`` for sm_90 on ``args`` (stand-ins typed as a real launch
    types them: int32 lists, every pointer 16-byte aligned; an argument named in
    ``constexprs`` is compiled as that constant, as the launcher's binder does with integers
    equal to 1) and report shared memory, registers, spills (stack, and local loads / stores
    by source line), setmaxnreg, CTA barriers, wgmma and TMA instruction counts."""
    import torch  # noqa: PLC0415
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.experimental.gluon._runtime import GluonASTSource  # noqa: PLC0415
    from triton.runtime.jit import mangle_type  # noqa: PLC0415

    sig = {}
    for name, a in zip(kernel.arg_names, args, strict=False):
        if isinstance(a, torch.Tensor):
            sig[name] = "*i32" if a.dtype == torch.int32 else mangle_type(a)
        elif isinstance(a, int):
            sig[name] = "i32"
        elif isinstance(a, float):
            sig[name] = "fp32"
        else:
            sig[name] = mangle_type(a)
    constexprs = {**constexprs, "num_warps": num_warps}
    for name in constexprs:
        sig[name] = "constexpr"
    attrs = {(i, ): [["tt.divisibility", 16]] for i, a in enumerate(args)
             if isinstance(a, torch.Tensor)}
    c = triton.compile(GluonASTSource(kernel, sig, constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    ptx = c.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        sass = sass_profile(f.name)
    return {"shared": c.metadata.shared, "registers": sass["registers"],
            "stack_bytes": sass["stack_bytes"], "local_ops_by_line": sass["local_ops_by_line"],
            "hgmma": sass["opcodes"].get("HGMMA", 0),
            "wgmma_waits_by_in_flight": sass["wgmma_waits_by_in_flight"],
            "local_ops_near_mma": sass["local_ops_near_mma"],
            "setmaxnreg": re.findall(r"setmaxnreg[.a-z0-9]*\s+\d+", ptx),
            "bar_sync": ptx.count("bar.sync"), "wgmma": ptx.count("wgmma.mma_async"),
            "tma": ptx.count("cp.async.bulk.tensor")}
