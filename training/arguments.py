"""Trainer's settings (TrainingArguments) from the train (or pretrain) and machine sections of params.yaml."""
import torch
from transformers import TrainingArguments
from transformers.utils import is_torch_tf32_available

from modeling.precision import autocast_dtype
from training.lowmemory import optimizer


def training_arguments(params, machine, output_dir, device, batch_size, accumulation):
    """Trainer's settings from the train and machine sections; output_dir receives the checkpoints."""
    cuda = device == "cuda"
    dtype = autocast_dtype(params["mixed_precision"], device)
    return TrainingArguments(
        output_dir=output_dir,
        num_train_epochs=params["epochs"],
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size * 2,  # no gradients kept: twice the batch fits
        gradient_accumulation_steps=accumulation,
        learning_rate=params["lr"],
        weight_decay=params["weight_decay"],
        warmup_steps=params["warmup_ratio"],  # a float below 1 is a fraction of all steps
        max_grad_norm=params["max_grad_norm"],
        lr_scheduler_type="linear",
        seed=params["seed"],
        train_sampling_strategy="group_by_length" if params["group_by_length"] else "random",
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,  # with a gradient scaler
        tf32=params["tf32"] if cuda and is_torch_tf32_available() else None,  # None: leave torch's setting
        optim=optimizer(params["fused_adamw"], params["adamw_8bit"], device)[0],  # 8-bit AdamW on CUDA
        dataloader_pin_memory=machine["pin_memory"] and cuda,
        # on the CPU, loader workers would take cores from the model
        dataloader_num_workers=machine["loader_workers"] if cuda else 0,
        dataloader_persistent_workers=cuda and machine["loader_workers"] > 0,
        use_cpu=not cuda,  # also what makes several processes on a CPU talk through gloo
        torch_compile=params["compile"],
        # train.evaluations n: pruning.EvaluateEvenly asks for each of the n evaluations itself
        eval_strategy="epoch" if params["evaluations"] == "epoch" else "no",
        # checkpoints to resume from (the finished model goes to models/fold-K): every checkpoint_steps
        # when set; every checkpoint_minutes in any case (StopOnSignal asks for those)
        save_strategy="steps" if machine["checkpoint_steps"] else "no",
        save_steps=machine["checkpoint_steps"] or 1,
        save_total_limit=1,  # the newest is all a resumed run needs
        logging_strategy="steps",
        logging_steps=0.02,  # a fraction: about 50 points on the loss curve whatever the data size
        # on: every micro-batch Trainer asks the GPU whether the loss is nan, a wait for the host each step;
        # off: a nan loss shows in the curve as nan instead of being averaged away
        logging_nan_inf_filter=False,
        report_to="none",  # dvclive is attached explicitly, to write into reports/train/fold-K
        disable_tqdm=True,  # training.progress prints instead: a bar on a terminal, lines in a log
    )


def pretraining_arguments(params, machine, output_dir, device, dtype):
    """Trainer's settings for the pretrain stage's masked-language-model training: the pretrain section, the
    checkpoints and loaders of the machine section, the precision `dtype` (None: fp32). Checkpoints as in
    training_arguments."""
    cuda = device == "cuda"
    return TrainingArguments(
        output_dir=output_dir,
        num_train_epochs=params["epochs"],
        per_device_train_batch_size=params["batch_size"],
        learning_rate=params["lr"],
        weight_decay=0.01,
        warmup_steps=0.06,  # a fraction of all steps, as RoBERTa pretrained
        lr_scheduler_type="linear",
        seed=params["seed"],
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        dataloader_pin_memory=machine["pin_memory"] and cuda,
        dataloader_num_workers=machine["loader_workers"] if cuda else 0,
        use_cpu=not cuda,
        save_strategy="steps" if machine["checkpoint_steps"] else "no",
        save_steps=machine["checkpoint_steps"] or 1,
        save_total_limit=1,
        logging_strategy="steps",
        logging_steps=0.02,
        report_to="none",
        disable_tqdm=True,  # training.progress prints instead
    )
