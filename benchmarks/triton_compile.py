"""The ``triton_blocks`` kernels compiled for a GPU on a machine without one: each kernel, tile
shape and launch setting through Triton's compiler for an NVIDIA target, then the registers and
spills that ``ptxas -v`` reports. A kernel that fails to compile, or spills, is found here before
a GPU is lent; what is fast is still the GPU's to say (``benchmarks/gpu.py --only tiles``).

    python benchmarks/triton_compile.py                      # sm_90 (H100/H200), bf16, D 128
    python benchmarks/triton_compile.py --arch 80 --dtype fp16 --head-dims 64 128
    python benchmarks/triton_compile.py --defaults --dtype fp32 --head-dims 64 256   # Tiles() only

Needs triton (``make setup-triton``); runs with ``TRITON_INTERPRET`` unset (the interpreter has no
compiler). Each compile takes seconds to a minute of one core; the default grid is 18 of them.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compiled kernels, not interpreted
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 is its default

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from multihead.backends import mask_program, triton_kernels  # noqa: E402

#: (kernel, tiles (BM, BN), warps, stages): the backend's defaults (triton_blocks.Tiles) first,
#: then alternatives.
CONFIGS = [
    ("forward", (128, 64), 8, 3),
    ("forward", (128, 128), 8, 2),
    ("forward", (64, 64), 4, 3),
    ("backward_dq", (128, 64), 8, 2),
    ("backward_dq", (64, 64), 8, 3),
    ("backward_dq", (128, 32), 4, 3),
    ("backward_dkdv", (32, 64), 8, 3),
    ("backward_dkdv", (32, 64), 4, 3),
    ("backward_dkdv", (32, 128), 8, 2),
    ("backward_dkdv", (16, 64), 4, 3),
    ("backward_dkdv", (64, 64), 8, 3),
]
#: The programs compiled: no mask nor modifier; all five mask leaf kinds at once and a relative
#: bias under a softcap (the most the kernels evaluate per element).
PROGRAMS = {"no mask": ((), False), "5 leaves + mods": (tuple(range(1, 6)), True)}
TENSORS = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV_"}  # of the input dtype
POINTERS = {"RB": "*fp32", "LSE": "*fp32", "DELTA": "*fp32"}
POINTERS |= dict.fromkeys(["PTR", "COLS", "ROWS", "MP", "MD"], "*i32")


def signature(fn, dtype: str, constexprs: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in POINTERS:
            sig[name] = POINTERS[name]
        elif name in TENSORS:
            sig[name] = f"*{dtype}"
        elif name in ("qk_scale", "scale", "cap"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def constants(dtype: str, kinds: tuple, mods: bool, D: int, tiles: tuple) -> dict:
    padded = kinds + (0,) * (mask_program.MAX_LEAVES - len(kinds))
    dt = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[dtype]
    return dict(
        D=D,
        DV=D,
        NLEAF=len(kinds),
        **{f"K{i}": k for i, k in enumerate(padded)},
        TABLE=(1 << (1 << len(kinds))) - 2 if kinds else 1,
        BM=tiles[0],
        BN=tiles[1],
        BD=D,
        BDV=D,
        DT=dt,
        PREC="ieee" if dtype == "fp32" else "tf32",
        MODS=mods,
        HAS_REL=mods,
        HAS_CAP=mods,
        CAP_FIRST=False,
    )


def ptxas_info(ptx: str, arch: int) -> str:
    """Registers and spills from ``ptxas -v`` (the newest ptxas that came with triton)."""
    folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    path = "/tmp/triton_compile_check.ptx"
    with open(path, "w") as f:
        f.write(ptx)
    for name in ("ptxas-blackwell", "ptxas"):
        exe = os.path.join(folder, name)
        if not os.path.exists(exe):
            continue
        suffix = "a" if arch >= 90 else ""
        command = [exe, f"-arch=sm_{arch}{suffix}", "-v", path, "-o", "/dev/null"]
        out = subprocess.run(command, capture_output=True, text=True)
        text = out.stdout + out.stderr
        regs = re.search(r"Used (\d+) registers", text)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
        if regs:
            return f"{regs[1]} registers, spills {spills[1]}/{spills[2]} bytes" if spills else f"{regs[1]} registers"
    return "(ptxas -v gave nothing)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200, 80: A100)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128])
    parser.add_argument("--defaults", action="store_true", help="only the backend's default tilings (Tiles())")
    args = parser.parse_args(argv)
    configs = CONFIGS
    if args.defaults:
        from multihead.backends.triton_blocks import Tiles

        t = Tiles()
        defaults = [("forward", t.forward, 0), ("backward_dq", t.forward, 1), ("backward_dkdv", t.dkdv, 2)]
        configs = [(kernel, tiles, t.warps[i], t.stages[i]) for kernel, tiles, i in defaults]
    assert not triton_kernels.INTERPRETED, "TRITON_INTERPRET was set when triton was imported"
    target = GPUTarget("cuda", args.arch, 32)
    print(f"# triton {triton.__version__}, target sm_{args.arch}, {args.dtype}")
    failed = 0
    for D in args.head_dims:
        for program, (kinds, mods) in PROGRAMS.items():
            for kernel, tiles, warps, stages in configs:
                fn = getattr(triton_kernels, kernel)
                consts = constants(args.dtype, kinds, mods, D, tiles)
                t0 = time.time()
                try:
                    compiled = triton.compile(
                        ASTSource(fn, signature(fn, args.dtype, consts), constexprs=consts),
                        target=target,
                        options=dict(num_warps=warps, num_stages=stages),
                    )
                    info = ptxas_info(compiled.asm["ptx"], args.arch)
                except Exception as e:  # noqa: BLE001 (report every configuration)
                    failed += 1
                    info = "FAILED: " + " ".join(f"{type(e).__name__}: {e}".split())[:400]
                print(
                    f"D={D:<4} {program:<15} {kernel:<14} tiles {tiles[0]:>3}x{tiles[1]:<3} warps {warps} "
                    f"stages {stages}: {info} ({time.time() - t0:.0f} s to compile)",
                    flush=True,
                )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
