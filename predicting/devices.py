"""Predicting on every GPU present (a Kaggle notebook's two T4s): the models' work shared out over the
devices, one thread per device, each loading its own copy of a model onto its GPU (CUDA runs kernels
outside Python's lock, so the threads' GPUs work at once). With fewer models than GPUs (a distilled
student on two T4s) each model's rows are split between the GPUs, whole texts at a time, so the windows
of a long text are averaged on one device."""
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from predicting.inference import fold_outputs, load_fold


def prediction_devices():
    """cuda:0 ... cuda:N-1 for the N GPUs present, else the CPU."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"cuda:{i}" for i in range(count)] or ["cpu"]


def shares(models, devices):
    """The work as (model, part, parts) shares, model after model; share i goes to device i % devices. A model
    is split in parts only where there are more devices than models."""
    parts = max(1, devices // models)
    return [(model, part, parts) for model in range(models) for part in range(parts)]


def rows_of_part(row_texts, part, parts):
    """The rows of part `part` of `parts`: the texts split in contiguous groups, every row of a text in one."""
    groups = np.array_split(np.unique(row_texts), parts)
    return np.flatnonzero(np.isin(row_texts, groups[part]))


def on_devices(work, devices, run):
    """run(share, device) for every share of `work`, share i on devices[i % len(devices)]; a device's shares one
    after another in its own thread. The results in the order of `work`."""
    results = [None] * len(work)

    def serve(d):
        for i in range(d, len(work), len(devices)):
            results[i] = run(work[i], devices[d])

    if len(devices) == 1:
        serve(0)
    else:
        with ThreadPoolExecutor(len(devices)) as pool:
            for done in [pool.submit(serve, d) for d in range(len(devices))]:
                done.result()  # a share's error, raised here
    return results


def predict_on_devices(folders, runs, sequences, token_types, row_texts, devices, batch_size=None):
    """Each model's outputs (one row per text, in text order) for the token ids, the models shared out over
    `devices`."""
    def run(share, device):
        model, part, parts = share
        rows = rows_of_part(row_texts, part, parts)
        tokenizer, loaded = load_fold(folders[model], runs[model], device)
        return fold_outputs(tokenizer, loaded, runs[model], [sequences[i] for i in rows],
                            None if token_types is None else [token_types[i] for i in rows], device, batch_size,
                            row_texts[rows])

    work = shares(len(folders), len(devices))
    results = on_devices(work, devices, run)
    parts = work[0][2]
    return [np.concatenate(results[m * parts:(m + 1) * parts]) for m in range(len(folders))]


def estimate(folder, run, sequences, token_types, device, models, devices, batch_size=None, sample_rows=256):
    """(rows/s, seconds for every model over every row) from one model on a sample of the rows spread over
    their lengths, before the real work: what a time-limited notebook needs to know first."""
    picked = np.unique(np.linspace(0, len(sequences) - 1, min(sample_rows, len(sequences))).astype(int))
    tokenizer, model = load_fold(folder, run, device)
    begin = time.perf_counter()
    fold_outputs(tokenizer, model, run, [sequences[i] for i in picked],
                 None if token_types is None else [token_types[i] for i in picked], device, batch_size)
    rate = len(picked) / (time.perf_counter() - begin)
    rounds = -(-len(shares(models, devices)) // devices)  # the shares the busiest device runs
    parts = shares(models, devices)[0][2]
    return rate, rounds * len(sequences) / parts / rate
