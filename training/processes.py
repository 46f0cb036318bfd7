"""Several training processes (DistributedDataParallel), for the train stage: relaunching it under
torchrun with train.num_processes > 1, joining the others, and agreeing on one batch size."""
import os
import sys

import torch

from pipeline.settings import PipelineError
from training.batch_size import pick_batch_size
from training.speed import across_processes


def torchrun_command(num_processes, stage_args):
    """This stage under torchrun on this machine: one process per GPU (or CPU share), rendezvous on
    a free local port (--standalone), each with this stage's arguments (the fold)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_processes}",
            "-m", running_module(), *stage_args]


def running_module():
    """The module this process runs as `python -m` (stages.train, stages.pseudo, ...)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return spec.name if spec else "stages.train"


def relaunch_environment(environ):
    """`environ` for this stage relaunched: without the tests' stage log, since the stage ran once, not again."""
    return {k: v for k, v in environ.items() if k != "PIPELINE_STAGE_LOG"}


def become(command, env):
    """Replace this process by `command` with `env` (the same pid, so dvc and signals still see one stage):
    what it printed so far is flushed first. Raises OSError where command cannot be started."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, env)


def relaunch_under_torchrun(num_processes):
    """Replace this process by torchrun running num_processes copies of this stage: its exit code
    becomes the stage's, and signals (Ctrl-C, SIGTERM) reach torchrun, which passes them on."""
    become(torchrun_command(num_processes, sys.argv[1:]), relaunch_environment(os.environ))


def join_processes(num_processes, device):
    """(number of processes, this one's rank). With num_processes > 1 and no torchrun around yet,
    becomes torchrun (does not return); under torchrun (ours, or one started by hand across
    machines) joins the others."""
    if device == "cuda" and num_processes > torch.cuda.device_count():
        raise PipelineError(f"params.yaml: train.num_processes {num_processes} is more than the "
                            f"{torch.cuda.device_count()} GPU(s) this process sees; one process per GPU")
    if num_processes > 1 and "LOCAL_RANK" not in os.environ:
        relaunch_under_torchrun(num_processes)
    world_size, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world_size > 1:
        if device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        # now, not when Trainer starts: the processes agree on the batch size before that
        torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo")
    return world_size, rank


def per_process_batch(effective_batch_size, world_size):
    """Examples per optimizer step in each process: the effective batch split evenly."""
    if effective_batch_size % world_size:
        raise PipelineError(f"params.yaml: train.effective_batch_size {effective_batch_size} does not split evenly "
                            f"over train.num_processes {world_size}: make it a multiple of {world_size}")
    return effective_batch_size // world_size


def agreed_batch_size(model, sequences, params, world_size, device):
    """(per-process batch, accumulation steps, longest batch) as pick_batch_size finds them, the
    same in every process: a GPU with less free memory sets the batch for all, so that all
    processes take the same number of steps."""
    process_batch = per_process_batch(params["effective_batch_size"], world_size)
    batch_size, accumulation, seq_len = pick_batch_size(
        model, sequences, params["batch_size"], process_batch, params["mixed_precision"], device, params["adamw_8bit"])
    smallest = int(across_processes([batch_size], "min")[0])
    if smallest != batch_size:
        batch_size, accumulation = smallest, process_batch // smallest
    return batch_size, accumulation, seq_len
