"""Pruning a tuning trial from inside the train stage.

`python -m tune` runs each Optuna trial as a DVC experiment and tells the train stage which trial
it is through the environment (PIPELINE_TRIAL). The stage then reports its validation scores to the
study as it goes, and stops a trial the study's pruner judges hopeless:
- by evaluation (one fold): the score of each of train.evaluations evaluations, at step k (the k-th
  of n, k/n of the way through the run), so trials with other batch sizes or epochs compare;
- by fold (several folds): each fold's final score at step K once fold K has finished; a fold of a
  trial that the pruner has stopped does not start, and the folds that finished stay cached.

The variable is not a param because it changes nothing a finished run writes: a run that is
pruned writes no output and exits with PRUNED_EXIT_CODE, so DVC records no stage of it and its
half-trained model never reaches the cache as if it were the result of its params.
"""
import json
import math
import os
from dataclasses import asdict, dataclass

from transformers import TrainerCallback

TRIAL_ENV = "PIPELINE_TRIAL"
PRUNED_EXIT_CODE = 3
PRUNERS = ("halving", "median", "wilcoxon", "none")


def make_pruner(name, startup=0):
    """The Optuna pruner tune.pruner names; the tuner and the train stage build the same one. startup
    (tune.pruner_startup): no trial is pruned at a step (an evaluation, a fold) until that many other
    trials have reported a score there."""
    import optuna

    if name == "halving":
        # successive halving over the evaluations: at the 1st and the 3rd a trial goes on only if it is
        # in the best third of the trials scored there (Optuna's advice for TPE; README, Tuning). Not its
        # bootstrap_count: that prunes every trial reaching a rung before that many have, the opposite
        pruner = optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3)
    elif name == "median":
        # a trial stops when its best score so far is below the median of the finished trials' at that step
        pruner = optuna.pruners.MedianPruner(n_startup_trials=0, n_warmup_steps=0)
    elif name == "wilcoxon":
        pruner = optuna.pruners.WilcoxonPruner(p_threshold=0.1)
    else:
        return optuna.pruners.NopPruner()
    return start_up(pruner, startup) if startup else pruner


def start_up(pruner, startup):
    """`pruner`, whose verdict to prune a trial at a step stands only once `startup` other trials (running,
    complete or pruned) have reported a score at that step. The inner pruner is asked first either way:
    successive halving records the trial's score at its rung when asked, for the trials after it."""
    import optuna
    from optuna.trial import TrialState

    class StartUp(optuna.pruners.BasePruner):
        def prune(self, study, trial):
            if not pruner.prune(study, trial):
                return False
            step = trial.last_step
            states = (TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED)
            others = [t for t in study.get_trials(deepcopy=False, states=states)
                      if t.number != trial.number and step in t.intermediate_values]
            return len(others) >= startup

    return StartUp()


@dataclass(frozen=True)
class TrialLink:
    """Which trial of which study a train stage runs for, and how it reports."""
    storage: str     # the study's storage URL (it may hold a password: never printed)
    study: str
    trial_id: int    # Optuna's storage id of the trial
    number: int      # the trial's number in its study, for messages
    metric: str      # the validation metric reported, a key of the train stage's evaluation (f1_macro)
    by: str          # "evaluation" or "fold"
    pruner: str      # one of PRUNERS
    startup: int = 0  # tune.pruner_startup

    @classmethod
    def from_env(cls, environ=os.environ):
        value = environ.get(TRIAL_ENV)
        return cls(**json.loads(value)) if value else None

    def to_env(self):
        return json.dumps(asdict(self))

    def open(self):
        """The Optuna trial, for report and should_prune; None when the study cannot be reached (the
        trial then runs to its end: losing the pruner must not lose the training)."""
        import optuna

        try:
            storage = optuna.storages.RDBStorage(self.storage, engine_kwargs=engine_kwargs(self.storage))
            study = optuna.load_study(study_name=self.study, storage=storage,
                                      pruner=make_pruner(self.pruner, self.startup))
            return optuna.trial.Trial(study, self.trial_id)
        except Exception as e:  # a database down, a network gone: the training goes on unpruned
            print(f"tune: cannot reach study {self.study!r} ({type(e).__name__}); trial {self.number} "
                  "runs to its end, unpruned")
            return None


def engine_kwargs(url):
    """SQLAlchemy settings: SQLite waits for a lock held by another process (the tuner, another worker)
    instead of failing at once."""
    return {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}


def prune_at_fold(link, fold):
    """With several folds: whether trial `link` was judged hopeless by the folds it finished (reported
    by report_fold), so fold `fold` should not start. Records where it stopped."""
    trial = link.open() if fold > 0 else None
    if trial is None or not trial.should_prune():
        return False
    trial.set_user_attr("pruned_at", f"fold {fold}")
    return True


def report_fold(link, fold, score, steps):
    """With several folds: fold `fold`'s final validation score, once its outputs are written, and its
    optimizer steps."""
    trial = link.open()
    if trial is not None:
        trial.set_user_attr(f"steps fold {fold}", [steps, steps])
        if math.isfinite(score):
            trial.report(score, step=fold)


class EvaluateEvenly(TrainerCallback):
    """train.evaluations n: evaluate n times, at steps ceil(k * max_steps / n) for k = 1..n (the last one
    at the end), so that the k-th evaluation of every trial falls k/n of the way through its run."""

    def __init__(self, n):
        self.n = n

    def on_step_end(self, args, state, control, **kwargs):
        step, last = state.global_step, state.max_steps
        if evaluation_index(self.n, step, last) > evaluation_index(self.n, step - 1, last):
            control.should_evaluate = True


def evaluation_index(n, step, max_steps):
    """k for an evaluation at `step` of `max_steps` when a run evaluates n times (EvaluateEvenly): the
    number of the n evenly spaced points reached; 0 before the first. From the step, not from a count
    of evaluations, so a run resumed from a checkpoint numbers them as the run it continues."""
    return math.floor(n * step / max_steps + 1e-9)


class EvaluationReporter(TrainerCallback):
    """With one fold: reports each evaluation's score as step k of n and stops training when the pruner
    says so (never at the last evaluation: the run is done by then). `pruned` is the k it stopped at.
    In a run of several processes the first one asks the study and tells the others. At the end it
    records the optimizer steps run and planned, from which python -m tune.show counts what pruning saved."""

    def __init__(self, link, n, main_process=True):
        self.link, self.n, self.main_process = link, n, main_process
        self.trial = link.open() if main_process else None
        self.pruned = 0

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        k = evaluation_index(self.n, state.global_step, state.max_steps)
        score = (metrics or {}).get(f"eval_{self.link.metric}")
        stop = False
        if self.trial is not None and score is not None and math.isfinite(score) and k >= 1:
            self.trial.report(score, step=k)
            stop = state.global_step < state.max_steps and self.trial.should_prune()
            if stop:
                self.trial.set_user_attr("pruned_at", f"evaluation {k} of {self.n}")
        if args.world_size > 1:
            import torch

            decision = [stop]
            torch.distributed.broadcast_object_list(decision, src=0)
            stop = decision[0]
        if stop:
            self.pruned = k
            control.should_training_stop = True
            control.should_save = False

    def on_train_end(self, args, state, control, **kwargs):
        if self.trial is not None:
            self.trial.set_user_attr("steps fold 0", [state.global_step, state.max_steps])
