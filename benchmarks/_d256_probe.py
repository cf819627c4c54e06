import torch, json, sys
sys.path.insert(0, 'benchmarks')
from gluon_bwd import _kernel_ms
from sparsetp.core import make_layout, patterns as P
from sparsetp.torch import sparse_attention
from sparsetp.kernels.options import launch_options
import triton
n, h = 8192, 16
lay = make_layout(P.causal(), n, h, 128)
res = {}
for d in (128, 256):
    q, k, v, do = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    for native in (True, False):
        with launch_options(native_autograd=native):
            def fb():
                out = sparse_attention(*leaves, lay)
                torch.autograd.grad(out, leaves, do)
            fb(); torch.cuda.synchronize()
            ms = triton.testing.do_bench(fb, warmup=25, rep=200)
            res[f"d{d}_native{native}"] = {"fwd_bwd_ms": ms, "kernels": _kernel_ms(fb)}
print(json.dumps(res, indent=1))
