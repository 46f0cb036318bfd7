"""--trials N: N finished trials in all, every worker together, however many workers share the study.

A trial uses the budget from the moment it starts: running, complete and pruned trials count, failed
ones do not (their params are tried again or the next suggestion takes their place), nor waiting
ones (enqueued, not started). A worker does not start a trial while the counted ones reach N. Two
workers asking at the same moment may both get one; the storage's trial ids order them, and the
one whose trial has more than N counted trials up to its own id gives it back unstarted (marked,
left out of the table, its queued params queued again). A running trial whose worker died stops
counting once the storage fails it as stale (tune.heartbeat), so a dead worker does not hold a slot.
"""
OVER_BUDGET = "over_budget"  # user attribute of a trial given back before it started


class OverBudget(Exception):
    """A trial asked for at the same moment as another worker's last one: given back unstarted."""


def optimize(study, objective, trials, catch=()):
    """study.optimize(objective) until `trials` trials count (this worker's and the others'); the
    exceptions in `catch` fail a trial and the study goes on."""
    def claimed(trial):
        if not within(study, trial._trial_id, trials):
            give_back(study, trial._trial_id)
            study.stop()
            raise OverBudget()
        return objective(trial)

    def stop_when_spent(study, trial):
        if used(study) >= trials:
            study.stop()

    if used(study) < trials:
        study.optimize(claimed, callbacks=[stop_when_spent], catch=(*catch, OverBudget))


def counted_states():
    from optuna.trial import TrialState

    return (TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED)


def fail_stale(study):
    """Fail the running trials whose worker stopped sending heartbeats (their params are queued again)."""
    import warnings

    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)  # nothing without heartbeats


def used(study):
    """The trials that count against the budget now, stale ones failed first."""
    fail_stale(study)
    return len(study.get_trials(deepcopy=False, states=counted_states()))


def within(study, trial_id, budget):
    """Whether the trial with storage id `trial_id`, running, is one of the first `budget` counted trials."""
    ahead = [t for t in study.get_trials(deepcopy=False, states=counted_states()) if t._trial_id <= trial_id]
    return len(ahead) <= budget


def give_back(study, trial_id):
    """Before a trial over the budget is told failed: mark it, and queue its params again if it had
    taken queued ones (a trial before it may yet fail and free a slot for them)."""
    frozen = study._storage.get_trial(trial_id)
    study._storage.set_trial_user_attr(trial_id, OVER_BUDGET, True)
    queued = frozen.system_attrs.get("fixed_params") or frozen.params  # enqueued, or a stale trial's retry
    if queued:
        study.enqueue_trial(queued, user_attrs=frozen.user_attrs)
