"""The tuner's sampler: Optuna's TPE, its random draws for trial n seeded with tune.seed + n.

Workers that share a study each hold a sampler. Seeded once each with the same tune.seed, two workers
starting together drew the same numbers: during TPE's first, random trials both suggested the same
params (a test saw trials 1 and 2 run lr 0.00151, warmup_ratio 0.190 both). The storage gives each trial
a number no other worker gets, so seeding each trial by its number makes every trial's draws its own,
and a study run again, or resumed, with the same results draws the same suggestions as it did.
"""
import optuna


class SeededPerTrial(optuna.samplers.BaseSampler):
    """TPESampler(**options) whose draws for each trial come from seed + the trial's number."""

    def __init__(self, seed, **options):
        self.seed, self.options = seed, options
        self.tpe = optuna.samplers.TPESampler(seed=seed, **options)

    def before_trial(self, study, trial):
        self.tpe = optuna.samplers.TPESampler(seed=self.seed + trial.number, **self.options)
        self.tpe.before_trial(study, trial)

    def infer_relative_search_space(self, study, trial):
        return self.tpe.infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
        return self.tpe.sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self.tpe.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(self, study, trial, state, values):
        self.tpe.after_trial(study, trial, state, values)

    def reseed_rng(self):
        self.tpe.reseed_rng()
