"""The training precision: bf16 on GPUs whose tensor cores compute it, fp16 with loss scaling on older
ones, and on a CPU bf16 only where its bf16 matmuls are measured faster than fp32."""
import functools
import time

import torch

from training.speed import across_processes

# bf16 must beat fp32 by this much in cpu_bf16_speedup's test to be used: a clear margin, so that
# the choice does not flip with the machine's load (measured: 0.37x on one CPU, 3.7x on another)
BF16_MIN_SPEEDUP = 1.3


def cpu_isa():
    """The best of the instruction sets torch's CPU kernels use here, as they detect it: "AMX" (bf16 tile
    matrix units, Xeon Sapphire Rapids on), "AVX512-BF16" (bf16 dot products in vector registers: recent
    AMD EPYC, Cooper Lake), "AVX512", "AVX2", or what torch.backends.cpu.get_cpu_capability() says."""
    if _check("_is_amx_tile_supported"):
        return "AMX"
    if _check("_is_avx512_bf16_supported"):
        return "AVX512-BF16"
    return torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT" (or another platform's)


def _check(name):
    check = getattr(torch.cpu, name, None)
    return bool(check and check())


def cpu_has_bf16():
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX), as torch's own kernels detect them."""
    checks = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(check() for check in checks if check is not None)


@functools.lru_cache(maxsize=None)
def cpu_bf16_speedup(size=1024, burst_seconds=0.08):
    """How many times faster this CPU multiplies bf16 matrices than fp32 ones, in about half a second:
    the best of three bursts of size x size matmuls each, interleaved so load affects both alike.
    The instructions alone do not make bf16 fast: a virtual Xeon that reports AVX512-BF16 ran bf16
    matmuls at 103 GFLOP/s against 282 in fp32, where an AMD EPYC ran them 3.7x faster than fp32.
    In a multi-process run every process measures and all take the slowest ratio, so that all train in
    one precision (a collective: every process makes its first call at the same point)."""
    rates = {torch.float32: 0.0, torch.bfloat16: 0.0}
    pairs = {dtype: (torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)) for dtype in rates}
    for _ in range(3):
        for dtype, (a, b) in pairs.items():
            a @ b  # the first call may pick and load kernels
            count, start = 0, time.perf_counter()
            while time.perf_counter() - start < burst_seconds:
                a @ b
                count += 1
            rates[dtype] = max(rates[dtype], count / (time.perf_counter() - start))
    return across_processes([rates[torch.bfloat16] / rates[torch.float32]], "min")[0]


def gpu_autocast_dtype(capability):
    """bf16 on GPUs whose tensor cores compute it (compute capability 8.0 and up: A100, L4, H100, RTX 30xx
    on); fp16 with loss scaling on older ones (T4, V100: 7.x). torch.cuda.is_bf16_supported() is true on a
    T4 too, where bf16 is emulated and slow, so the capability decides."""
    return torch.bfloat16 if capability >= (8, 0) else torch.float16


def autocast_dtype(mixed_precision, device):
    """The autocast dtype for training and prediction, None for fp32: on a GPU bf16 where it is native,
    else fp16 (gpu_autocast_dtype); on a CPU bf16 where it has bf16 instructions and they are faster
    than fp32 here (cpu_bf16_speedup)."""
    if not mixed_precision:
        return None
    if device == "cuda":
        return gpu_autocast_dtype(torch.cuda.get_device_capability())
    return torch.bfloat16 if cpu_has_bf16() and cpu_bf16_speedup() >= BF16_MIN_SPEEDUP else None


def precision_note(mixed_precision, device):
    """Why the precision is not bf16, for the log ("" when nothing to say): a GPU without native bf16,
    or a CPU with bf16 instructions that are not faster than fp32."""
    if mixed_precision and device == "cuda" and autocast_dtype(True, device) == torch.float16:
        major, minor = torch.cuda.get_device_capability()
        return (f" with loss scaling ({torch.cuda.get_device_name()}, compute capability {major}.{minor}, "
                "has no native bf16)")
    if mixed_precision and device == "cpu" and cpu_has_bf16() and autocast_dtype(True, device) is None:
        return (f" (this CPU has bf16 instructions, but multiplies bf16 matrices {cpu_bf16_speedup():.2f}x as fast "
                f"as fp32, below the {BF16_MIN_SPEEDUP}x it takes to use them)")
    return ""
