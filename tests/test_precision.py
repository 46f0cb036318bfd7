"""The precision each part of a training step runs in: bf16 on a CPU only where its bf16 matmuls were
measured faster (the same answer in every process), fp16 on GPUs without native bf16, the benchmark's row 4
judging the precision the defaults train in, and the attention kept in fp32 where this CPU's bf16 attention
measured slower, at the run's own shapes (modeling/precision.py, modeling/attention.py)."""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, BertConfig, PretrainedConfig, TrainerCallback
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from bench.training import defaults_vs_fp32, times_bf16
from predicting.inference import make_collator
from tests.test_speed import MACHINE, WORDS, train_params
from training import attention, precision
from training.arguments import training_arguments
from modeling.precision import BF16_MIN_SPEEDUP, gpu_autocast_dtype, precision_note
from training.speed import CountingTrainer, Throughput


@pytest.mark.parametrize("has_bf16, speedup, bf16", [
    (True, 3.0, True),    # an EPYC with AVX512-BF16 measured 3.7x: bf16
    (True, 0.5, False),   # a virtual Xeon that reports AVX512-BF16 measured 0.47x: fp32
    (False, 3.0, False),  # no bf16 instructions (an AVX2-only CPU): fp32 whatever a timing says
])
def test_cpu_trains_in_bf16_only_where_bf16_is_faster_and_in_the_main_process(tmp_path, monkeypatch, has_bf16,
                                                                               speedup, bf16):
    # the machine's own measurement would test one row of this table only, and the same one on every run
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: has_bf16)
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: speedup)
    args = training_arguments(train_params(mixed_precision=True), {**MACHINE, "loader_workers": 2}, str(tmp_path),
                              "cpu", 8, 4)
    assert args.bf16 == bf16 and not args.fp16
    note = precision_note(True, "cpu")
    if has_bf16 and not bf16:  # the log says why this CPU's bf16 instructions go unused
        assert note == (f" (this CPU has bf16 instructions, but multiplies bf16 matrices {speedup:.2f}x as fast "
                        f"as fp32, below the {BF16_MIN_SPEEDUP}x it takes to use them)"), note
    else:
        assert note == "", note
    off = training_arguments(train_params(mixed_precision=False), MACHINE, str(tmp_path), "cpu", 8, 4)
    assert not off.bf16 and not off.fp16
    assert args.dataloader_num_workers == 0 and not args.dataloader_pin_memory
    assert args.gradient_accumulation_steps == 4 and args.optim == "adamw_torch_fused"


def test_processes_of_one_run_agree_on_the_bf16_speedup(tmp_path):
    """Each process times its own matmuls; unagreed, two processes near the 1.3x margin could train
    in different precisions. Two gloo processes under torchrun must return the same ratio."""
    script = tmp_path / "measure.py"
    script.write_text("import os, pathlib, sys, torch\n"
                      "from modeling.precision import cpu_bf16_speedup\n"
                      "torch.distributed.init_process_group('gloo')\n"
                      "ratio = cpu_bf16_speedup(size=256, burst_seconds=0.02)\n"
                      "pathlib.Path(sys.argv[1], os.environ['RANK']).write_text(repr(ratio))\n"
                      "torch.distributed.destroy_process_group()\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = tmp_path / "ratios"
    out.mkdir()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ratios = {path.name: path.read_text() for path in out.iterdir()}
    assert set(ratios) == {"0", "1"}, done.stdout
    assert ratios["0"] == ratios["1"] and float(ratios["0"]) > 0, ratios


def test_a_cpu_whose_bf16_matmuls_are_emulated_measures_them_slower_than_fp32():
    """A CPU whose bf16 is slow, made on this one: oneDNN and torch's kernels held to AVX2, where bf16 has
    no instructions (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY). The real measurement must find bf16 slower
    (0.02x here), so that the train stage trains in fp32 and the benchmark's row 4 does not time bf16."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", "from modeling.precision import cpu_bf16_speedup\n"
                           "print(cpu_bf16_speedup(size=256, burst_seconds=0.02))"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    speedup = float(done.stdout)
    assert speedup < 1.0 < BF16_MIN_SPEEDUP, speedup
    assert not times_bf16("cpu", True, speedup)


@pytest.mark.parametrize("device, has_bf16, matmul_speedup, timed", [
    ("cuda", True, None, True),    # a GPU: always
    ("cpu", True, 3.7, True),      # an EPYC with AVX512-BF16: bf16 training timed, the defaults use it
    ("cpu", True, 1.2, True),      # faster matmuls, below the stage's 1.3x: timed, to show what the margin costs
    ("cpu", True, 0.47, False),    # a virtual Xeon whose bf16 is slow: the stage trains fp32
    ("cpu", False, None, False),   # no bf16 instructions
])
def test_row_4_times_bf16_where_this_cpu_multiplies_it_no_slower_than_fp32(device, has_bf16, matmul_speedup, timed):
    assert times_bf16(device, has_bf16, matmul_speedup) is timed


@pytest.mark.parametrize("bf16_ratio, defaults_in_bf16, judged", [
    (1.86, True, 1.86),   # the defaults train in bf16: its ratio is theirs
    (0.45, True, 0.45),   # bf16 chosen and slower: the goal sees it
    (0.45, False, 1.0),   # bf16 slower, the stage trains fp32: as fast as fp32
    (None, False, 1.0),   # bf16 not timed
])
def test_row_4s_goal_judges_the_precision_the_defaults_train_in(bf16_ratio, defaults_in_bf16, judged):
    assert defaults_vs_fp32(bf16_ratio, defaults_in_bf16) == judged


@pytest.mark.parametrize("capability, dtype", [((7, 5), torch.float16), ((7, 0), torch.float16), ((6, 1), torch.float16),
                                               ((8, 0), torch.bfloat16), ((8, 9), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_gpus_without_native_bf16_train_in_fp16(capability, dtype):
    # a T4 (7.5) says torch.cuda.is_bf16_supported(), but emulates bf16: it must get fp16 with loss scaling
    assert gpu_autocast_dtype(capability) == dtype


@pytest.mark.parametrize("device, dtype, implementation, speedup, fp32", [
    ("cpu", torch.bfloat16, "sdpa", 0.2, True),    # the EPYC's bf16 flash attention: 0.14x-0.21x fp32
    ("cpu", torch.bfloat16, "sdpa", 0.9, False),   # within the margin: bf16 stays
    ("cpu", torch.bfloat16, "sdpa", None, False),  # not measured
    ("cpu", None, "sdpa", 0.2, False),             # fp32 training: nothing to change
    ("cpu", torch.bfloat16, "eager", 0.2, False),  # the model does not use sdpa
    ("cuda", torch.bfloat16, "sdpa", 0.2, False),  # GPUs' bf16 attention kernels are their fast ones
])
def test_attention_runs_in_fp32_only_on_a_cpu_whose_bf16_attention_is_slower(device, dtype, implementation, speedup,
                                                                           fp32):
    assert attention.attention_in_fp32(device, dtype, implementation, speedup) is fp32


@pytest.mark.parametrize("lengths, expected", [
    ([10] * 100, 10),
    ([30, 10, 10, 10], 30),      # the median text is 10 tokens, but 30's attention is 9 of the 12 parts of the work
    ([10] * 9 + [100], 100),     # one long text: 10,000 of 10,900
    ([64] * 90 + [512] * 10, 512),
    ([64] * 99 + [512], 64),     # 262,144 of 667,648: the short ones are most of the work
])
def test_the_attention_probes_length_is_where_the_attention_work_is(lengths, expected):
    assert attention.attention_length(lengths) == expected


def test_the_attention_probe_takes_the_models_heads_and_head_size():
    lengths = [12] * 3 + [40] * 5
    assert attention.probe_shape(BertConfig(hidden_size=768, num_attention_heads=12), lengths) == (12, 64, 40)
    assert attention.probe_shape(BertConfig(hidden_size=64, num_attention_heads=4), lengths) == (4, 16, 40)
    named = PretrainedConfig(hidden_size=512, num_attention_heads=8, head_dim=80)  # a head size of its own
    assert attention.probe_shape(named, lengths) == (8, 80, 40)
    assert attention.probe_shape(PretrainedConfig(), lengths) == (12, 32, 40)  # names neither: MiniLM's


def test_the_stage_measures_the_attention_at_the_runs_shapes_and_says_which(tiny_model_dir):
    """On a CPU in bf16 the probe times the run's shapes, computed here by hand from the tiny model's config and
    the lengths (its answer is then cached for exactly those), and the log names them; where nothing could
    change (fp32, a GPU, padding-free batches) nothing is timed."""
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2)
    model.set_attn_implementation("sdpa")
    heads = model.config.num_attention_heads
    size = model.config.hidden_size // heads
    attention.bf16_attention_speedup.cache_clear()
    in_fp32, note = attention.choose(model, "cpu", torch.bfloat16, False, [[0] * 5, [0] * 7, [0] * 24, [0] * 24])
    assert note.endswith(f"as fast as fp32 here, {heads} heads of {size} at 24 tokens)"), note
    assert note.startswith("; attention in fp32 (bf16 attention measured " if in_fp32 else "; attention in bf16 (measured ")
    attention.bf16_attention_speedup(heads, size, 24)  # what the probe timed: these shapes, so a cached answer
    assert attention.bf16_attention_speedup.cache_info()[:2] == (1, 1)  # (hits, misses)
    attention.bf16_attention_speedup.cache_clear()
    assert attention.choose(model, "cpu", None, False, [[0] * 24]) == (False, "")
    assert attention.choose(model, "cuda", torch.bfloat16, False, [[0] * 24]) == (False, "")
    assert attention.choose(model, "cpu", torch.bfloat16, True, [[0] * 24]) == (False, "")  # padding-free batches
    assert attention.bf16_attention_speedup.cache_info().misses == 0


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
        out, _ = attention.fp32_sdpa(module, q, k, v, keep)
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
    with attention.in_fp32(model):
        CountingTrainer(model=model, args=args, train_dataset=data, data_collator=make_collator(tokenizer, "cpu"),
                        throughput=Throughput(), callbacks=[Record()]).train()
    assert seen == [attention.NAME] * 2
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(KeyboardInterrupt), attention.in_fp32(model):  # back to sdpa however the block ends
        raise KeyboardInterrupt
    assert model.config._attn_implementation == "sdpa"
    with attention.in_fp32(model, on=False):
        assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("trained_in_fp32, device, dtype, fp32", [
    (True, "cpu", torch.bfloat16, True),      # predicted as it trained
    (True, "cpu", None, False),               # this CPU predicts in fp32: all of it is fp32 already
    (True, "cuda", torch.bfloat16, False),    # a GPU's bf16 attention kernels are its fast ones
    (False, "cpu", torch.bfloat16, False),    # trained with bf16 attention
    (None, "cpu", torch.bfloat16, False),     # a model saved before pipeline.json said
])
def test_rows_are_predicted_with_fp32_attention_where_the_run_trained_so(trained_in_fp32, device, dtype, fp32):
    assert attention.predicted_in_fp32(trained_in_fp32, device, dtype) is fp32
