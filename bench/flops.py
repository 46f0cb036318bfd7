"""Row 5: the share of this machine's matmul peak that training reaches, the peak sampled during the
training it is compared with."""
import statistics
import time

import torch
from transformers import TrainerCallback

from bench.common import sync, verdict


def matmul_peak(device, dtype, sizes, seconds):
    """Best FLOP/s of square matmuls of the given sizes, each run for about `seconds`."""
    best = 0.0
    for n in sizes:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        a @ b
        sync()
        queued = 10 if device == "cuda" else 1  # the GPU gets several before each wait
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for _ in range(queued):
                a @ b
            sync()
            count += queued
        best = max(best, 2 * n**3 * count / (time.perf_counter() - start))
    return best


def non_embedding_parameters(model):
    return sum(p.numel() for name, p in model.named_parameters() if "embeddings" not in name)


class PeakSampler(TrainerCallback):
    """Every `every` optimizer steps and after the last, stops the throughput clock and measures the
    matmul peak for a moment: on a shared machine the peak is then sampled under the same load as
    the training."""

    def __init__(self, meter, measure, every=10):
        self.meter, self.measure, self.every = meter, measure, every
        self.peaks = []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            start = time.perf_counter()
            self.peaks.append(self.measure())
            self.meter.start += time.perf_counter() - start  # the pause is not training time


def report_flops(n_params, ours, baseline, peaks, precision, goals):
    peak = statistics.mean(peaks)  # sampled during training: under the same load
    useful = 6 * n_params * ours["tokens_per_s"]
    share = useful / peak
    print(f"5. useful training FLOP/s: 6 x {n_params / 1e6:.1f}M non-embedding params x "
          f"{ours['tokens_per_s']:.0f} tokens/s = {useful / 1e9:.1f} GFLOP/s = {share:.0%} of the {precision} "
          f"matmul peak measured here, {peak / 1e9:.1f} GFLOP/s (mean of {len(peaks)} samples taken during "
          f"training, {min(peaks) / 1e9:.1f} to {max(peaks) / 1e9:.1f}) "
          f"(goal on {goals['why']} >= {goals['mfu']:.0%}: {verdict(share, goals['mfu'])}); the baseline: "
          f"{6 * n_params * baseline['tokens_per_s'] / peak:.0%}")
