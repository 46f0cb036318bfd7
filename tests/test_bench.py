"""The bench tools' own logic, on hand-made inputs: bench.profile_step's rows (a GPU's kernel time, the casts
split by what is cast), the benchmark's row 4 against each kind of hardware's goal, and its tokenize stage's
PYTHONPATH. Speed itself is what they measure."""
import os

import pytest
import torch


def test_the_gpu_profile_counts_each_operations_kernels_in_its_row_and_the_rest_as_idle():
    """bench.profile_step --gpu on hand-made profiler events of 2 steps: each row holds the GPU time of the
    kernels its operations launched themselves (not their callers' or their own CPU time), the last row the
    wall time no kernel ran."""
    from types import SimpleNamespace

    from bench import profile_step as ps

    def op(name, parent=None, cpu_us=50.0, gpu_us=0.0, kernels=0):
        return SimpleNamespace(name=name, cpu_parent=parent, device_type=torch.autograd.DeviceType.CPU,
                               self_cpu_time_total=cpu_us, self_device_time_total=gpu_us, kernels=[None] * kernels)

    backward = op("autograd::engine::evaluate_function: MmBackward0")
    step = op("Optimizer.step#AdamW.step")
    to = op("aten::to")
    events = [
        op("aten::addmm", gpu_us=3000.0, kernels=2),
        op("aten::mm", backward, gpu_us=5000.0, kernels=2),
        backward,
        op("aten::_flash_attention_backward", gpu_us=400.0, kernels=1),
        op("aten::_cudnn_attention_forward", gpu_us=600.0, kernels=1),  # the kernel torch 2.11 picks on an H200 in bf16
        op("aten::_fused_adamw_", step, gpu_us=400.0, kernels=1),
        step,
        op("aten::copy_", to, gpu_us=200.0, kernels=1),  # a batch moved to the GPU, or an autocast cast
        to,
        op("aten::add_", gpu_us=400.0, kernels=1),
        SimpleNamespace(name="sm90_xmma_gemm", cpu_parent=None, device_type=torch.autograd.DeviceType.CUDA,
                        self_cpu_time_total=0.0, self_device_time_total=3000.0, kernels=[]),  # counted by its op
    ]
    rows = ps.breakdown(events, wall_s=0.020, steps=2, gpu=True)  # 20 ms for 2 steps, 10 ms of kernels
    assert rows["matrix products (mm, addmm, bmm)"] == pytest.approx(4.0)
    assert rows["attention (SDPA kernels)"] == pytest.approx(0.5)
    assert rows["optimizer (AdamW, clipping, zero_grad)"] == pytest.approx(0.2)
    assert rows["dtype casts (autocast)"] == pytest.approx(0.1)
    assert rows["other elementwise and reductions"] == pytest.approx(0.2)
    assert rows[ps.REST] == pytest.approx(5.0)  # 10 ms per step of wall, 5 of kernels
    assert sum(rows.values()) == pytest.approx(10.0)
    assert ps.launches(events, steps=2) == (pytest.approx(0.25), 4.5)  # 10 ops x 50 us; 9 kernels
    cpu_rows = ps.breakdown(events, wall_s=0.020, steps=2)  # the same events on a CPU: their own CPU time
    assert cpu_rows["matrix products (mm, addmm, bmm)"] == pytest.approx(0.05)
    assert cpu_rows[ps.REST] == pytest.approx(10.0 - 0.25)
    assert ps.GPU_IDLE in ps.table({"bf16": (rows, 11.0)}, gpu=True)


def test_the_profiles_casts_split_by_whether_a_weight_is_cast():
    """bench.profile_step --casts on hand-made events of 2 steps: a cast's own time (the allocation and the
    copy under it included) counts as a weight's when the tensor it casts has a weight's shape, whichever
    operation of the cast records the shape; the optimizer's copies are the optimizer's, not casts."""
    from types import SimpleNamespace

    from bench import profile_step as ps

    def op(name, parent=None, shapes=(), us=0.0):
        return SimpleNamespace(name=name, cpu_parent=parent, device_type=torch.autograd.DeviceType.CPU,
                               self_cpu_time_total=us, input_shapes=[list(s) for s in shapes])

    forward = op("aten::_to_copy", op("aten::linear"), [(384, 1536), (), ()], us=100.0)  # a weight, to bf16
    backward = op("aten::_to_copy", op("ToCopyBackward0"), [(384, 1536)], us=100.0)  # its gradient, to fp32
    activation = op("aten::_to_copy", op("sdpa_fp32"), [(32, 12, 33, 32)], us=300.0)  # q to fp32
    step = op("Optimizer.step#AdamW.step")
    events = [forward, op("aten::empty_strided", forward, [(), ()], us=200.0),
              op("aten::copy_", forward, [(384, 1536), (384, 1536), ()], us=700.0),
              backward, op("aten::copy_", backward, [(384, 1536), (384, 1536), ()], us=900.0),
              activation, op("aten::empty_strided", activation, [()], us=100.0),
              op("aten::copy_", activation, [(32, 12, 33, 32), (32, 12, 33, 32), ()], us=1600.0),
              step, op("aten::copy_", step, [(384, 1536), (384, 1536), ()], us=5000.0)]
    split = ps.cast_split(events, steps=2, weight_shapes={(384, 1536), (1536, 384), (384,)})
    assert split == {ps.WEIGHTS: pytest.approx(1.0), ps.OTHERS: pytest.approx(1.0)}  # (100+200+700+100+900) us / 2
    assert ps.breakdown(events, wall_s=0.01, steps=2)[ps.CASTS] == pytest.approx(2.0)  # the same row, whole


@pytest.mark.parametrize("device, isa, precision, ratio, verdict", [
    ("cpu", "AMX", "bfloat16 (a CPU with AMX; the attention in fp32)", 1.86, "meets the goal"),  # goal 1.6x
    ("cpu", "AMX", "bfloat16 (a CPU with AMX; the attention in fp32)", 1.03, "BELOW THE GOAL"),
    ("cpu", "AVX512-BF16", "bfloat16 (a CPU with AVX512-BF16; the attention in fp32)", 1.03, "meets the goal"),  # 1.0x
    ("cpu", "AVX512-BF16", "bfloat16 (a CPU with AVX512-BF16; the attention in fp32)", 0.90, "BELOW THE GOAL"),
    ("cuda", "AVX2", "bfloat16 (NVIDIA H100 80GB HBM3, compute capability 9.0)", 1.66, "meets the goal"),  # 1.6x
    ("cuda", "AVX2", "bfloat16 (NVIDIA H100 80GB HBM3, compute capability 9.0)", 1.21, "BELOW THE GOAL"),
    ("cpu", "AVX2", None, None, "meets the goal"),  # fp32 there: not timed, as fast as fp32 (1.0x, the goal)
])
def test_row_4_judges_the_precision_the_defaults_train_in_against_the_hardwares_goal(device, isa, precision, ratio,
                                                                                      verdict):
    """Row 4 of bench.benchmark: the mixed precision the stage trains in against fp32, its ratio judged against
    the goal of the hardware (a GPU's 1.6x also for its host's ISA); where the stage trains fp32 bf16 is not
    timed, and the defaults count as 1.0x fp32."""
    from bench.common import hardware_goals
    from bench.training import precision_line

    goals = hardware_goals(device, isa)
    fp32, mixed = ({"tokens_per_s": 1000.0}, {"tokens_per_s": 1000.0 * ratio}) if ratio else (None, None)
    line = precision_line(fp32, mixed, 50, precision, goals)
    assert line.startswith("4. ") and line.endswith(f"goal >= {goals['bf16']}x on {goals['why']}: {verdict})")
    if ratio:
        assert f"training in {precision}," in line and f": {ratio:.2f}x (" in line
        assert f"{1000.0 * ratio:.0f} vs 1000 real tokens/s over 50 steps each" in line
    else:
        assert "not timed" in line and "fp32, 1.0x" in line


@pytest.mark.parametrize("pythonpath, expected", [
    (None, "{repo}"),
    ("", "{repo}"),
    ("/tmp/site", "{repo}" + os.pathsep + "/tmp/site"),  # the GPU machine's packages, kept after the repo
])
def test_the_benchmarks_tokenize_stage_keeps_the_pythonpath_it_was_given(pythonpath, expected):
    from bench.common import REPO
    from bench.tokenize_memory import stage_environment

    environ = {"HOME": "/root"} if pythonpath is None else {"HOME": "/root", "PYTHONPATH": pythonpath}
    assert stage_environment(environ) == {"HOME": "/root", "PYTHONPATH": expected.format(repo=REPO)}
    assert environ.get("PYTHONPATH") == pythonpath  # the caller's own left as it was


@pytest.mark.parametrize("gains, spread, expected", [
    ([0.02, 0.01, 0.03], 0.005, "gain"),     # one sign at every seed, the mean above the defaults' spread
    ([0.02, 0.01, 0.03], 0.025, "noise"),    # the same gains within a wider spread of the defaults
    ([0.05, -0.01, 0.04], 0.001, "noise"),   # one seed lost: no gain, however large the mean
    ([-0.02, -0.03, -0.01], 0.01, "loss"),
    ([0.0, 0.0, 0.0], 0.0, "noise"),
])
def test_the_leaderboard_calls_a_gain_only_outside_the_seeds_spread(gains, spread, expected):
    from bench.techniques import verdict

    assert verdict(gains, spread) == expected


def test_the_best_combination_merges_each_familys_largest_gain_called_a_gain():
    from bench.techniques import best_combination

    base = [0.70, 0.71, 0.72]  # std 0.01
    results = {"defaults": {"f1": base}}
    for name, _, _ in __import__("bench.techniques", fromlist=["ROWS"]).ROWS[1:]:
        results[name] = {"f1": base}
    results["averaging ema (decay 0.99, from 50%)"] = {"f1": [0.73, 0.74, 0.75]}  # +0.03 at each seed: a gain
    results["averaging swa (from 50%)"] = {"f1": [0.72, 0.73, 0.74]}             # +0.02: a smaller gain, same family
    results["focal_gamma 2"] = {"f1": [0.75, 0.70, 0.76]}                        # mean +0.027 but one seed lost
    results["class_weights balanced"] = {"f1": [0.72, 0.73, 0.74]}               # +0.02: a gain
    merged, names = best_combination(results)
    assert names == ["averaging ema (decay 0.99, from 50%)", "class_weights balanced"]
    assert merged == {"averaging": "ema", "class_weights": "balanced"}


def test_the_recipe_bench_runs_the_line_the_readme_gives_in_bold_and_its_keys_are_params():
    """bench.recipe takes its -S settings from the README's bold `dvc exp run` line, folded or not, and
    every key there is one params.yaml has."""
    import yaml

    from bench.common import REPO
    from bench.recipe import readme_recipe

    said = "What gained: (**`dvc exp run -S train.epochs=3\n-S train.lr=2e-5`**), and `dvc exp run -S x=1` not bold."
    assert readme_recipe(said) == ["train.epochs=3", "train.lr=2e-5"]
    with pytest.raises(SystemExit, match="no recipe line"):
        readme_recipe("`dvc exp run -S train.epochs=3`")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for setting in readme_recipe((REPO / "README.md").read_text()):
        section, key = setting.split("=")[0].split(".")
        assert key in params[section], setting


def test_the_recipe_bench_sets_its_data_in_params_yaml_and_changes_nothing_else(tmp_path):
    """bench.recipe's clone points fetch.source and preprocess.label_column at its data in a copy of
    params.yaml, as a YAML parser reads it back, every other value and every comment kept."""
    import yaml

    from bench.common import REPO
    from bench.recipe import set_params

    path = tmp_path / "params.yaml"
    path.write_text((REPO / "params.yaml").read_text())
    set_params(path, {"fetch.source": "/tmp/my data/rotten", "preprocess.label_column": "label"})
    before, after = yaml.safe_load((REPO / "params.yaml").read_text()), yaml.safe_load(path.read_text())
    assert after["fetch"]["source"] == "/tmp/my data/rotten"
    assert after["preprocess"]["label_column"] == "label"
    before["fetch"]["source"], before["preprocess"]["label_column"] = "/tmp/my data/rotten", "label"
    assert after == before
    old, new = (REPO / "params.yaml").read_text().splitlines(), path.read_text().splitlines()
    assert len(new) == len(old)
    assert [i for i, (a, b) in enumerate(zip(old, new)) if a != b] == [old.index("  source: tweets"),
                                                                      old.index("  label_column: sentiment")]
    set_params(path, {"train.epochs": 3})  # a line with a comment keeps it
    assert next(line for line in path.read_text().splitlines() if line.startswith("  epochs: 3")).endswith(
        next(line for line in old if line.startswith("  epochs: 1"))[len("  epochs: 1"):])


def test_the_recipe_bench_scores_a_row_by_what_it_made_last():
    """bench.recipe reads a distilled student's test score (it has no validation score), else the pseudo-label
    students', else the model's, from evaluate's metrics as they are written."""
    from bench.recipe import scores

    model = {"val": {"f1_macro": 0.71}, "test": {"f1_macro": 0.72}, "baseline": {"val": {"f1_macro": 0.6}}}
    assert scores(model) == (0.71, 0.72)
    assert scores({"val": {"f1_macro": 0.71}}) == (0.71, None)  # a test file without labels
    assert scores({"oof": {"f1_macro": 0.69}, "cv": {"f1_macro_mean": 0.7}}) == (0.69, None)  # K folds
    assert scores(model | {"pseudo": {"val": {"f1_macro": 0.75}, "test": {"f1_macro": 0.76}}}) == (0.75, 0.76)
    distilled = {"small": {"speed": {"speedup": 6.2}, "agreement": 0.94, "test": {"f1_macro": 0.70}}}
    assert scores(model | {"distill": distilled}) == (None, 0.70)
