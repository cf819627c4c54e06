"""A/B of the torch native CPU path's variants, round-robin in one process (issue #31).

Arms are ``name=module:workers:chunk_log2`` with module ``new`` (the tree's
``backends/torch/cpu.py``) or ``old`` (``--old_module``, e.g. a copy of the previous tree's file),
workers ``auto`` or an int (``cpu.WORKERS``), and ``cpu.CHUNK_ELEMENTS = 2**chunk_log2``. Direct
calls of ``forward``/``backward`` (no autograd), B=1, H=4, D=64, float32, block 64, against dense
``scaled_dot_product_attention`` (forward and forward+backward through autograd). Believe it once
``tests/cpu_attention_test.py`` passes::

    PYTHONPATH=. python benchmarks/cpu_path_ab.py --old_module=.ab/old_cpu.py \\
        --arms=old=old:auto:22,new=new:auto:22,new_callers=new:1:22
"""

from __future__ import annotations

import importlib.util
import json
import os
import time

import numpy as np
from absl import app, flags

ARMS = flags.DEFINE_list("arms", ["new=new:auto:22"], "name=module:workers:chunk_log2")
OLD = flags.DEFINE_string("old_module", "", "path of the old cpu.py (for module 'old')")
CASES = flags.DEFINE_list("cases", ["local256:4096", "local256:16384", "bigbird:8192"],
                          "pattern:N")
REPS = flags.DEFINE_integer("reps", 5, "round-robin repetitions (median)")
OUT = flags.DEFINE_string("out", "/tmp/cpu_path_ab.json", "JSON results")

B, H, D, BS = 1, 4, 64, 64


def _measure(kind: str, n: int, arms: dict) -> dict:
    """Round-robin medians of every arm's forward and forward+backward and of dense SDPA."""
    import torch  # noqa: PLC0415

    from sparsetp.bench.attention import bench_pattern  # noqa: PLC0415
    from sparsetp.core import make_layout  # noqa: PLC0415
    from sparsetp.core import patterns as P  # noqa: PLC0415

    causal = kind == "local256"
    pattern = P.causal() & P.local(256, 0) if causal else bench_pattern(kind, n, BS).pattern
    layout = make_layout(pattern, n, H, BS)
    q, k, v, do = (torch.randn(B, H, n, D) for _ in range(4))
    fns = {}
    for name, (mod, workers, chunk) in arms.items():
        def setup(mod=mod, workers=workers, chunk=chunk):
            mod.WORKERS, mod.CHUNK_ELEMENTS = workers, chunk

        def fwd(mod=mod, setup=setup):
            setup()
            return mod.forward(q, k, v, layout, D ** -0.5)

        def fwd_bwd(mod=mod, setup=setup):
            setup()
            o, lse = mod.forward(q, k, v, layout, D ** -0.5)
            return mod.backward(q, k, v, o, lse, do, None, layout, D ** -0.5)
        fns[f"{name}_fwd"], fns[f"{name}_fwd_bwd"] = fwd, fwd_bwd
    tq, tk, tv = (t.clone().requires_grad_(True) for t in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def sdpa_fwd():
        with torch.no_grad():
            sdpa(q, k, v, is_causal=causal)
    fns["sdpa_fwd"] = sdpa_fwd
    fns["sdpa_fwd_bwd"] = lambda: sdpa(tq, tk, tv, is_causal=causal).backward(do)
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(REPS.value):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    med = {name: float(np.median(ts)) for name, ts in times.items()}
    base = {"fwd": med["sdpa_fwd"], "fwd_bwd": med["sdpa_fwd_bwd"]}
    return {"case": kind, "n": n, "ms": {k: round(v * 1e3, 2) for k, v in med.items()},
            "speedup_vs_sdpa": {k: round(base["fwd" if k.endswith("_fwd") else "fwd_bwd"] / v, 3)
                                for k, v in med.items() if not k.startswith("sdpa")},
            "load": os.getloadavg()}


def main(argv):
    del argv
    import torch  # noqa: PLC0415

    from sparsetp.backends.torch import cpu as new  # noqa: PLC0415

    mods = {"new": new}
    if OLD.value:
        spec = importlib.util.spec_from_file_location("old_cpu", OLD.value)
        mods["old"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods["old"])
    arms = {}
    for item in ARMS.value:
        name, rest = item.split("=")
        mod, workers, chunk = rest.split(":")
        arms[name] = (mods[mod], None if workers == "auto" else int(workers), 1 << int(chunk))
    results = []
    for case in CASES.value:
        kind, n = case.split(":")
        r = _measure(kind, int(n), arms)
        results.append(r)
        print(json.dumps(r), flush=True)
    meta = {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "arms": ARMS.value, "reps": REPS.value,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with open(OUT.value, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
