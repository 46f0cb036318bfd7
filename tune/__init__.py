"""Hyperparameter search over the pipeline, each trial a DVC experiment (python -m tune). It drives the
pipeline from outside: no stage imports it, and changing it reruns nothing."""
