"""The device's two ceilings, measured (METHOD.md): device-to-device copy bandwidth (bytes read
+ written) and a large bf16 matrix product through cuBLAS, on random data.

    python benchmarks/bench_ceilings.py [--out ceilings.json]
"""

from __future__ import annotations

import argparse
import json

import torch


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import triton.testing as tt

    dev = torch.cuda.get_device_properties(0)
    src = torch.randn(1024 * 1024 * 1024 // 4, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = tt.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    copy_gbps = 2 * src.numel() * 4 / ms / 1e6
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms_mm = tt.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    tflops = 2 * 8192**3 / ms_mm / 1e9
    res = {
        "gpu": torch.cuda.get_device_name(0),
        "sms": dev.multi_processor_count,
        "l2_mb": getattr(dev, "L2_cache_size", 0) / 2**20,
        "torch": torch.__version__,
        "copy_gbps": round(copy_gbps, 1),
        "bf16_matmul_tflops_8192": round(tflops, 1),
    }
    print(json.dumps(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
