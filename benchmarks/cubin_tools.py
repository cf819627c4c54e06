"""Reading a compiled kernel's cubin with the tools that ship in Triton's wheel (no GPU needed).

Shared by ``kernel_resources.py`` and ``kernel_probe.py`` (kernels Triton compiled on the GPU
machine) and ``ptx_probe.py`` (cubins built for sm_90 on a CPU machine). Flag-free, so every
script can import it.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess


def tool(name: str) -> str:
    """Path of ``name`` (cuobjdump, nvdisasm, ptxas) in the imported Triton's wheel."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass_profile(cubin_path: str) -> dict:
    """Registers, stack (spills) and shared memory from ``cuobjdump -res-usage``, and the
    static count of each SASS opcode from ``nvdisasm -g``, with the local loads / stores
    (spill traffic) per kernel source line (``{"file:line": [LDL, STL]}``, from the line
    table Triton emits)."""
    res = subprocess.run([tool("cuobjdump"), "-res-usage", cubin_path], capture_output=True,
                         text=True).stdout
    dis = subprocess.run([tool("nvdisasm"), "-g", "-c", cubin_path], capture_output=True,
                         text=True).stdout
    ops = collections.Counter()
    seq = []  # opcodes in program order
    where, by_line = "?", collections.defaultdict(lambda: [0, 0])
    for line in dis.splitlines():
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            where = f"{os.path.basename(m.group(1))}:{m.group(2)}"
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            op = m.group(2).split(".")[0]
            ops[op] += 1
            seq.append(op)
            if op in ("LDL", "STL"):
                by_line[where][op == "STL"] += 1
    # Spill traffic beside the MMAs, where it costs: local loads/stores within 40 instructions
    # of an HGMMA (a static proxy for the hot loop; the total counts set-up code too).
    mma = [i for i, op in enumerate(seq) if op == "HGMMA"]
    local = [i for i, op in enumerate(seq) if op in ("LDL", "STL")]
    near = sum(1 for i in local if any(abs(i - j) < 40 for j in mma))
    regs, stack = re.search(r"REG:(\d+)", res), re.search(r"STACK:(\d+)", res)
    # wgmma waits by how many groups they leave in flight: where every HGMMA is followed by a
    # wait to 0, ptxas serialized the MMAs (C7512) and nothing overlaps them.
    waits = collections.Counter(int(n, 16) for n in re.findall(
        r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*(0x[0-9a-f]+)", dis))
    return {"registers": int(regs.group(1)) if regs else None,
            "stack_bytes": int(stack.group(1)) if stack else None,
            "wgmma_waits_by_in_flight": dict(sorted(waits.items())),
            "local_ops": len(local), "local_ops_near_mma": near,
            "local_ops_by_line": dict(sorted(by_line.items())),
            "res_usage": res.strip()[-800:], "n_instructions": sum(ops.values()),
            "opcodes": dict(ops.most_common(60))}


def compiled_kernels(kernel) -> list:
    """The compiled kernels (``CompiledKernel``) that a ``@triton.jit`` function's launches have
    produced in this process, one per specialisation, from Triton's per-device JIT caches."""
    out = []
    for caches in getattr(kernel, "device_caches", {}).values():
        out.extend(caches[0].values())
    return out
