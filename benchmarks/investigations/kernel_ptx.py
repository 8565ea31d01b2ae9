"""The loss stage's Triton kernels compiled for sm_90 (H100 / H200) on a machine without a GPU: one PTX
fingerprint per kernel and configuration, to show that a change to ``functional/kernels/triton_kernels.py`` leaves the
compiled code as it was (or to see what it changed) before any GPU is lent.

Each kernel is compiled at D = 384 (3 chunks of 128 lanes) for the autotuner's first bf16 stats and
gradient configurations and its fp32 one, with every optional term on (and the forward once with none). The
fingerprint hashes the PTX less its debug information (``.loc`` / ``.file`` lines, the debug sections and
their ``$L__tmp`` labels), so that code moved between lines of the source still compares equal.

Run from the repository root, once per checkout, and compare::

    python benchmarks/investigations/kernel_ptx.py --tree . --dump /tmp/ptx_new
    python benchmarks/investigations/kernel_ptx.py --tree ../old --dump /tmp/ptx_old
    diff -r /tmp/ptx_old /tmp/ptx_new

Needs Triton with its NVIDIA backend (the Linux wheel: the dev extra); nothing runs on a device.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said (it warns otherwise)

FWD_ARGS = [
    "X",
    "Y",
    "M_out",
    "L_out",
    "Acc_out",
    "SG_out",
    "E_out",
    "scale",
    "n_x",
    "n_y",
    "n_y_pad",
    "diag",
    "n_bucket",
]
GRAD_ARGS = [
    "A",
    "B",
    "La_m",
    "La_ls",
    "Lb_m",
    "Lb_ls",
    "wa",
    "wb",
    "w_diag",
    "Out",
    "SG_out",
    "scale",
    "n_a",
    "n_b",
    "n_b_pad",
    "diag",
    "n_bucket",
]
#: (operand dtype, BM, BN, warps, stages)
CONFIGS = [("bf16", 128, 64, 8, 2), ("bf16", 64, 64, 8, 2), ("fp32", 64, 32, 8, 2)]


def _signature(args: list[str], dtype: str) -> dict[str, str]:
    out = {}
    for name in args:
        if name in ("X", "Y", "A", "B"):
            out[name] = f"*{dtype}"
        elif name in ("scale", "wa", "wb", "w_diag"):
            out[name] = "fp32"
        elif name.startswith("n_") or name == "diag":
            out[name] = "i32"
        else:  # statistics and outputs
            out[name] = "*fp32"
    return out


def _strip_debug(ptx: str) -> str:
    ptx = re.sub(r"\.section\s+\.debug.*", "", ptx, flags=re.S)
    lines = (re.sub(r"//.*", "", line).rstrip() for line in ptx.splitlines())
    return "\n".join(
        line for line in lines if line and not re.match(r"\s*(\.loc|\.file)\b|\$L__tmp\d+:$", line)
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tree", default=".", help="the checkout whose kernels are compiled")
    parser.add_argument(
        "--dump", type=Path, help="a folder for each kernel's PTX (debug information removed)"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(Path(args.tree).resolve()))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from st_cached_losses.functional.kernels import triton_kernels as kernels

    print(f"kernels from {kernels.__file__}")
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
    kinds = [
        ("fwd_acc", kernels.rows_fwd_kernel, FWD_ARGS, dict(WITH_ACC=True, WITH_SG=True, HAS_DIAG=True)),
        ("fwd_stats", kernels.rows_fwd_kernel, FWD_ARGS, dict(WITH_ACC=False, WITH_SG=False, HAS_DIAG=False)),
        (
            "grad",
            kernels.rows_grad_kernel,
            GRAD_ARGS,
            dict(HAS_LA=True, HAS_LB=True, HAS_DIAG=True, WITH_SG=True),
        ),
    ]
    for dtype, bm, bn, warps, stages in CONFIGS:
        for kind, fn, names, flags in kinds:
            const = dict(D=384, DC=128, NUM_DC=3, PRECISION="tf32", UPCAST=False, ROUND_P=False, BM=bm, BN=bn)
            const.update(flags)
            signature = _signature(names, dtype) | {name: "constexpr" for name in const}
            source = ASTSource(
                fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()}
            )
            compiled = triton.compile(
                source, target=GPUTarget("cuda", 90, 64), options={"num_warps": warps, "num_stages": stages}
            )
            ptx = _strip_debug(compiled.asm["ptx"])
            label = f"{dtype}_{bm}x{bn}_{kind}"
            if args.dump:
                (args.dump / f"{label}.ptx").write_text(ptx)
            digest = hashlib.sha256(ptx.encode()).hexdigest()[:16]
            print(f"{label:24s} ptx {digest}  shared memory {compiled.metadata.shared} bytes", flush=True)


if __name__ == "__main__":
    main()
