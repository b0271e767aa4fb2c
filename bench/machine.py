"""What a benchmark ran on, for its table and JSON: the CPU's model and the SIMD kernel each compiled module takes
here (the default, self-checked where the module checks; an AVX-512 CPU and an AVX2 one run different code).

    from machine import describe   # bench/ is the script's directory, so on sys.path
"""

from __future__ import annotations

import platform


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def kernels() -> dict:
    """{compiled module: the kernel its calls take by default}, 'not built' where the extension is missing."""
    from kimi_explore.model import kda_recurrence, sequence_ops, token_ops
    from kimi_explore.weights import bf16_matvec, mxfp4_matvec

    out = {"mxfp4_matvec": mxfp4_matvec.default_isa() if mxfp4_matvec.AVAILABLE else "not built",
           "bf16_matvec": bf16_matvec.default_isa() if bf16_matvec.AVAILABLE else "not built"}
    for name, module in (("kda_recurrence", kda_recurrence), ("sequence_ops", sequence_ops), ("token_ops", token_ops)):
        out[name] = module.isas()[-1] if module.AVAILABLE else "not built"  # the best the CPU has (token_ops: its RMSNorm)
    return out


def describe() -> dict:
    return {"cpu": cpu_model(), "kernels": kernels()}


def line(d: dict) -> str:
    return f"cpu: {d['cpu']}; kernels: " + ", ".join(f"{k} {v}" for k, v in d["kernels"].items())
