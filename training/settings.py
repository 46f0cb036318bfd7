"""The train and machine sections of params.yaml, which the train stage and the students of the pseudo
and distill stages read alike, and the --fold argument of the stages that run once per fold."""
import argparse

from pipeline.settings import SEEDS, Range, load_params
from tasks.shapes import SHAPES, TASK_PARAMS
from training import lora, losses, qlora, techniques
from training.batch_size import check_batch_size
from training.processes import per_process_batch

# what each train.* key accepts; load_params turns anything else into a one-line error
TRAIN_PARAMS = {"epochs": (float, Range(0, low_open=True)), "batch_size": (int, "auto", Range(1)),
                "effective_batch_size": (int, Range(1)), "lr": (float, "auto", Range(0, 1, low_open=True)),
                "weight_decay": (float, Range(0, 1)), "warmup_ratio": (float, Range(0, 1, high_open=True)),
                "max_grad_norm": (float, Range(0)), "seed": (int, SEEDS), "group_by_length": (bool,),
                "mixed_precision": (bool,), "tf32": (bool,), "fused_adamw": (bool,), "compile": (bool,),
                "dropout": (float, "model", Range(0, 1, high_open=True)),
                "freeze_embeddings": (bool,), "num_processes": (int, Range(1)), "evaluations": (int, "epoch", Range(1)),
                "keep_best": (bool,), "patience": (int, None, Range(1)), "gradient_checkpointing": (bool,),
                "lora_rank": (int, Range(0)), "lora_alpha": (float, Range(0, low_open=True)),
                "lora_modules": (lora.ALL_LINEAR, list), "load_in_4bit": (bool,), "adamw_8bit": (bool,), "loss": ("auto", *losses.LOSSES),
                **techniques.TECHNIQUE_PARAMS}

# what each machine.* key accepts; the train, pseudo, distill and pretrain stages read the section
MACHINE_PARAMS = {"checkpoint_dir": (str,), "checkpoint_minutes": (float, Range(0, low_open=True)),
                  "checkpoint_steps": (int, None, Range(1)), "loader_workers": (int, Range(0)), "pin_memory": (bool,)}


def parse_fold(argv, prog="python -m stages.train", what="train one fold"):
    parser = argparse.ArgumentParser(prog=prog, description=what)
    parser.add_argument("--fold", type=int, default=0, help="the fold to train (an item of cv.folds); default 0")
    return parser.parse_args(argv).fold


def train_settings():
    """The train, machine and task.metric settings, checked before any work."""
    params = load_params("train", TRAIN_PARAMS)
    machine = load_params("machine", MACHINE_PARAMS)
    task = load_params("task", TASK_PARAMS)
    lora.check_modules(params["lora_modules"])
    qlora.check(params)
    techniques.loss_name(params, task["kind"], SHAPES[task["kind"]].loss)
    check_batch_size(params["batch_size"], per_process_batch(params["effective_batch_size"], params["num_processes"]))
    return params, machine, task["metric"]  # train.keep_best and train.patience go by task.metric
