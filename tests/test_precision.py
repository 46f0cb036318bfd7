"""The precision each part of a training step runs in follows from what the hardware is, never from a
timing: bf16 on a CPU with AMX or AVX512-BF16 (its attention in fp32), fp32 on other CPUs, fp16 on GPUs
without native bf16 (modeling/precision.py)."""
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, TrainerCallback
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from modeling import precision
from modeling.models import make_collator
from modeling.precision import attention_in_fp32, cpu_autocast_dtype, gpu_autocast_dtype
from predicting.inference import predicted_in_fp32
from tests.test_speed import MACHINE, WORDS, train_params
from training.arguments import training_arguments
from training.speed import Throughput
from training.trainer import CountingTrainer

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("isa, bf16", [
    ("AMX", True),          # a Xeon from Sapphire Rapids on
    ("AVX512-BF16", True),  # an AMD EPYC (Zen 4 on), Cooper Lake
    ("AVX512", False),      # AVX-512 without bf16 instructions: bf16 would be emulated
    ("AVX2", False),
    ("DEFAULT", False),
])
def test_a_cpu_trains_in_bf16_exactly_where_it_has_bf16_instructions(tmp_path, monkeypatch, isa, bf16):
    monkeypatch.setattr(precision, "cpu_isa", lambda: isa)
    assert cpu_autocast_dtype(isa) == (torch.bfloat16 if bf16 else None)
    args = training_arguments(train_params(mixed_precision=True), {**MACHINE, "loader_workers": 2}, str(tmp_path),
                              "cpu", 8, 4)
    assert args.bf16 == bf16 and not args.fp16
    said = precision.describe(True, "cpu")
    assert said == ("bfloat16 (a CPU with " + isa + ")" if bf16 else
                    "float32 (a CPU with " + isa + ": no bf16 instructions)"), said
    off = training_arguments(train_params(mixed_precision=False), MACHINE, str(tmp_path), "cpu", 8, 4)
    assert not off.bf16 and not off.fp16 and precision.describe(False, "cpu") == "float32 (train.mixed_precision: false)"
    assert args.dataloader_num_workers == 0 and not args.dataloader_pin_memory
    assert args.gradient_accumulation_steps == 4 and args.optim == "adamw_torch_fused"


def cpu_flags():
    """The CPU's flags as the kernel lists them in /proc/cpuinfo: what the hardware is, read without torch."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    found = re.search(r"^flags\s*:(.*)$", text, re.M)
    return set(found[1].split()) if found else None


@pytest.mark.skipif(cpu_flags() is None, reason="reads /proc/cpuinfo (Linux)")
def test_the_instruction_set_is_the_cpus_own_and_holding_torch_to_avx2_holds_it_to_fp32():
    """This machine's answer against its /proc/cpuinfo flags, in a fresh process each time, and again with
    torch's kernels held to AVX2 (ATEN_CPU_CAPABILITY), where bf16 has no instructions: fp32 there."""
    flags = cpu_flags()
    expected = ("AMX" if "amx_tile" in flags else "AVX512-BF16" if "avx512_bf16" in flags else None)
    script = "from modeling.precision import autocast_dtype, cpu_isa; print(cpu_isa(), autocast_dtype(True, 'cpu'))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("ATEN_CPU_CAPABILITY", None)
    for capped in (False, True):
        if capped:
            env["ATEN_CPU_CAPABILITY"] = "avx2"
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        isa, dtype = done.stdout.split()
        if capped:
            assert (isa, dtype) == ("AVX2", "None"), done.stdout
        elif expected and "avx512f" in flags:
            assert (isa, dtype) == (expected, "torch.bfloat16"), done.stdout
        else:
            assert dtype == "None" and isa not in ("AMX", "AVX512-BF16"), done.stdout


@pytest.mark.parametrize("capability, dtype", [((7, 5), torch.float16), ((7, 0), torch.float16), ((6, 1), torch.float16),
                                               ((8, 0), torch.bfloat16), ((8, 9), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_gpus_without_native_bf16_train_in_fp16(capability, dtype):
    # a T4 (7.5) says torch.cuda.is_bf16_supported(), but emulates bf16: it must get fp16 with loss scaling
    assert gpu_autocast_dtype(capability) == dtype


@pytest.mark.parametrize("device, dtype, implementation, fp32", [
    ("cpu", torch.bfloat16, "sdpa", True),    # every CPU: bf16 attention 0.14x-0.62x fp32 where measured
    ("cpu", None, "sdpa", False),             # fp32 training: nothing to change
    ("cpu", torch.bfloat16, "eager", False),  # the model does not use sdpa
    ("cuda", torch.bfloat16, "sdpa", False),  # GPUs' bf16 attention kernels are their fast ones
    ("cuda", torch.float16, "sdpa", False),
])
def test_the_attention_runs_in_fp32_on_a_cpu_training_in_bf16(device, dtype, implementation, fp32):
    assert attention_in_fp32(device, dtype, implementation) is fp32


def test_fp32_attention_computes_softmax_attention_in_fp32_and_trains_with_it(tiny_model_dir, tokenizer, tmp_path):
    """Inside bf16 autocast, the registered attention returns (in bf16) softmax(q k^T / sqrt(d) + mask) v
    computed in fp64 from the same inputs, far closer than bf16 attention; Trainer trains with it and
    the model saved afterwards is back on sdpa."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8).bfloat16() for _ in range(3))
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    keep[0, :, :, 4:] = False  # the first text is 4 tokens long
    scores = q.double() @ k.double().transpose(-1, -2) / 8**0.5
    expected = scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v.double()
    module = torch.nn.Module()
    module.is_causal = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = precision.fp32_sdpa(module, q, k, v, keep)
        bf16, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, keep)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 6, 4, 8)  # (batch, tokens, heads, head dim)
    reference = expected.transpose(1, 2)
    assert (out.double() - reference).abs().max() <= 2**-8 * reference.abs().max()  # one bf16 rounding
    assert (out.double() - reference).abs().max() <= (bf16.double() - reference).abs().max()

    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=3)
    seen = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(model.config._attn_implementation)

    data = [{"input_ids": ids, "labels": i % 3} for i, ids in enumerate(tokenizer(WORDS)["input_ids"])]
    args = dataclasses.replace(training_arguments(train_params(), MACHINE, str(tmp_path), "cpu", 8, 1), bf16=True,
                               max_steps=2, save_strategy="no", logging_strategy="no", eval_strategy="no")
    with precision.in_fp32(model):
        CountingTrainer(model=model, args=args, train_dataset=data, data_collator=make_collator(tokenizer, "cpu"),
                        throughput=Throughput(), callbacks=[Record()]).train()
    assert seen == [precision.SDPA_FP32] * 2
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(KeyboardInterrupt), precision.in_fp32(model):  # back to sdpa however the block ends
        raise KeyboardInterrupt
    assert model.config._attn_implementation == "sdpa"
    with precision.in_fp32(model, on=False):
        assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("trained_in_fp32, device, dtype, fp32", [
    (True, "cpu", torch.bfloat16, True),      # predicted as it trained
    (True, "cpu", None, False),               # this CPU predicts in fp32: all of it is fp32 already
    (True, "cuda", torch.bfloat16, False),    # a GPU's bf16 attention kernels are its fast ones
    (False, "cpu", torch.bfloat16, False),    # trained with bf16 attention
    (None, "cpu", torch.bfloat16, False),     # a model saved before pipeline.json said
])
def test_rows_are_predicted_with_fp32_attention_where_the_run_trained_so(trained_in_fp32, device, dtype, fp32):
    assert predicted_in_fp32(trained_in_fp32, device, dtype) is fp32
