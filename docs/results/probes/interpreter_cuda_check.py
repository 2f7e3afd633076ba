"""On a GPU with TRITON_INTERPRET=1: engine="auto" on CUDA parameters gives the bits of engine="torch" (and warns
once); engine="triton" refuses them with a clear error (the interpreter cannot run kernels over CUDA addresses).

    python docs/results/probes/interpreter_cuda_check.py
"""

import os
import warnings

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
import torch  # noqa: E402

from apexw_hf import ApexW  # noqa: E402

for fmt in ("compact", "8bit", "4bit"):
    g = torch.Generator(device="cuda").manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(300, 7, device="cuda", generator=g)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    c = [torch.nn.Parameter(p.detach().clone()) for p in a]
    oa, ob = ApexW(a, state_format=fmt, engine="auto"), ApexW(b, state_format=fmt, engine="torch")
    oc = ApexW(c, state_format=fmt, engine="triton")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            for x, y, z in zip(a, b, c):
                x.grad = torch.randn(x.shape, device="cuda", generator=g)
                y.grad = x.grad.clone()
                z.grad = x.grad.clone()
            oa.step()
            ob.step()
    same = all(torch.equal(x, y) for x, y in zip(a, b))
    try:
        oc.step()
        refused = "no"
    except RuntimeError as e:
        refused = str(e)[:80]
    print(
        fmt,
        "auto==torch:",
        same,
        "warned:",
        any("TRITON_INTERPRET" in str(x.message) for x in w),
        "triton refused:",
        refused,
    )
