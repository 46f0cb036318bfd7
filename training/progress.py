"""What the train stage prints and logs while it trains. On a terminal, a progress bar; in a log (`dvc
queue logs`, CI, `dvc repro > file`), where a bar's redraws would pile up, one line every 5% of the
steps. Each evaluation is one line in both. Replaces Trainer's own printing, which writes a Python dict
per logging step. The training curves go to dvclive (LiveCallback), rebuilt from a checkpoint when a
run resumes."""
import json
import time

from tqdm.auto import tqdm
from transformers import TrainerCallback
from transformers.integrations import DVCLiveCallback

from pipeline.command import interactive
from tasks.scores import NAMES
from training import checkpoint


def duration(seconds):
    """'1:02:03' or '2:03'."""
    minutes, seconds = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


def evaluation_line(epoch, metrics, shown):
    """One evaluation: the epoch, the scores `shown` (the task shape's `progress`), the validation loss."""
    scores = "".join(f"{NAMES[name]} {metrics.get(f'eval_{name}', float('nan')):.4f}, " for name in shown)
    return f"epoch {epoch:.2f}".rstrip("0").rstrip(".") + f": validation {scores}loss {metrics.get('eval_loss', float('nan')):.4f}"


def step_line(step, max_steps, loss, elapsed, steps_done):
    """One progress line: steps, share done, the latest training loss, time spent and left."""
    left = elapsed / steps_done * (max_steps - step) if steps_done else 0.0
    loss_text = f", loss {loss:.4f}" if loss is not None else ""
    return (f"step {step}/{max_steps} ({step / max_steps:.0%}){loss_text}, "
            f"{duration(elapsed)} elapsed, {duration(left)} left")


class ProgressLog(TrainerCallback):
    """A bar when `bar` (default: common.interactive(), a person watches a terminal), else a line
    every `every` of the steps; a line per evaluation with the scores `shown` (the task shape's
    `progress`: accuracy and macro-F1, micro- and macro-F1, RMSE and Pearson). Only the main process of a
    multi-process run prints."""

    def __init__(self, every=0.05, bar=None, shown=("accuracy", "f1_macro")):
        self.every, self.shown = every, shown
        self.interactive = interactive() if bar is None else bar
        self.bar = None
        self.loss = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start, self.first_step = time.perf_counter(), state.global_step  # a resumed run starts later
        self.next_line = state.global_step + max(1, round(self.every * state.max_steps))
        if self.interactive and state.is_world_process_zero:
            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="training", unit="step",
                            dynamic_ncols=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.loss = logs["loss"]
            if self.bar is not None:
                self.bar.set_postfix(loss=f"{self.loss:.4f}", refresh=False)

    def on_step_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)
        elif state.global_step >= self.next_line or state.global_step == state.max_steps:
            self.next_line += max(1, round(self.every * state.max_steps))
            print(step_line(state.global_step, state.max_steps, self.loss, time.perf_counter() - self.start,
                            state.global_step - self.first_step), flush=True)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if state.is_world_process_zero and metrics:
            line = evaluation_line(state.epoch, metrics, self.shown)
            (self.bar.write if self.bar is not None else print)(line)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class LiveCallback(DVCLiveCallback):
    """dvclive's Trainer callback, stepping by optimizer step (not by log call) and timing epochs."""

    def on_log(self, args, state, control, **kwargs):
        if self.live is not None:
            self.live.step = state.global_step
        super().on_log(args, state, control, **kwargs)

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.epoch_start = time.perf_counter()

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.live is not None:
            self.live.log_metric("epoch_time_s", round(time.perf_counter() - self.epoch_start, 1))


def open_live(resume, folder):
    """dvclive's logger for the fold's curves. DVC deletes a stage's metrics and plots before it
    reruns it, so a resumed run rebuilds the curves up to its checkpoint from the checkpoint."""
    from dvclive import Live  # here, not at the top: the benchmark imports this module where dvclive is not

    live = Live(dir=str(folder), dvcyaml=None, save_dvc_exp=False)
    if resume:
        checkpoint.replay_logs(live, json.loads((resume / checkpoint.STATE).read_text())["log_history"])
    return live
