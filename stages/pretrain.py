"""pretrain: further masked-language-model pretraining of the model on the competition's own texts (Sun et
al. 2019: within-task pretraining), once, before any fold trains.

Reads data/processed/{train,test}.csv (the text column, and text_pair for pairs; test.csv when there is
one) and pretrain.extra_file, unlabelled texts of the same domain. Off by default (pretrain.epochs 0): it
then loads nothing and writes models/pretrained/pretrained.json and reports/pretrain/metrics.json, each
{"pretrained": false}, the same bytes whatever the texts, so that the train stages keep their cache.
On: the model with a masked-LM head (AutoModelForMaskedLM; a model saved without one, as MiniLM is, gets a
new head) trains with transformers' Trainer and masked-LM collator (training/mlm.py) on the distinct texts
but a share (pretrain.held_out), which is masked once to measure the MLM loss before and after. The head
scores only the masked tokens (mlm.MaskedTokensTrainer: the model's own loss, 1.6x faster on a CPU). Writes
models/pretrained (the encoder with the checkpoint's own pooler, the tokenizer, pretrained.json), which the
train stage starts from (training/pretrained.py), and reports/pretrain/metrics.json.
It reads no train.* or cv.* key: changing those never reruns it. Checkpoints as the train stage's, into
<machine.checkpoint_dir>/pretrain (training/checkpoint.py): a rerun with the same settings and texts
resumes from the newest and ends as an uninterrupted run would, and Ctrl-C or SIGTERM saves one before
stopping.
"""
import logging
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

from pipeline.command import interactive, run_main, seconds_since_start
from pipeline.outputs import atomic_dir, write_json
from pipeline.settings import SEEDS, PipelineError, Range, load_params
from reading.csvfiles import read_csv
from reading.extra import extra_files, extra_texts
from training.pretrained import MARKER, PRETRAINED

PROCESSED = Path("data/processed")
METRICS = Path("reports/pretrain/metrics.json")
# what each pretrain.* key accepts; load_params turns anything else into a one-line error
PRETRAIN_PARAMS = {"epochs": (float, Range(0)), "lr": (float, Range(0, 1, low_open=True)),
                   "batch_size": (int, Range(1)), "max_length": (int, Range(2)),
                   "mask_probability": (float, Range(0, 1, low_open=True, high_open=True)),
                   "held_out": (float, Range(0, 0.5, low_open=True)), "extra_file": (str, None),
                   "extra_column": (str,), "seed": (int, SEEDS)}


def main():
    params = load_params("pretrain", PRETRAIN_PARAMS)
    files = extra_files(params["extra_file"]) if params["extra_file"] is not None else []  # said even when off
    if not params["epochs"]:  # off: the same bytes whatever the texts, so the train stages keep their cache key
        with atomic_dir(PRETRAINED) as tmp:
            write_json(tmp / MARKER, {"pretrained": False})
        write_json(METRICS, {"pretrained": False})
        return [PRETRAINED, METRICS]
    return pretrain(params, files)


def pretrain(params, files):
    """The stage, on: reads the texts (those of the extra `files` too), masks the held-out ones, trains,
    writes models/pretrained and the metrics."""
    # imported here, not above: off (the default, in every `dvc repro` of a new project) the stage loads
    # neither torch nor transformers, seconds of imports for two small files
    import transformers

    from modeling.models import model_params
    from training import checkpoint
    from training.settings import MACHINE_PARAMS

    machine = load_params("machine", MACHINE_PARAMS)
    model = model_params()
    if not interactive():  # bars of weights loaded, downloads: one endless line in a log
        transformers.utils.logging.disable_progress_bar()
    texts, extra_used = read_texts(params, files)
    inputs = masked_inputs(params, model, texts)
    folder = checkpoint.root(machine["checkpoint_dir"]) / "pretrain"
    trainer, scores = train_masked_lm(params, machine, model, inputs, extra_used, folder)
    written = write_outputs(model, texts, inputs, trainer, scores, extra_used)
    checkpoint.remove(folder)
    return written


def read_texts(params, files):
    """(the distinct texts to pretrain on, how many of them only the extra files have)."""
    from training import mlm

    extra = extra_texts(files, params["extra_column"])
    frames = [read_csv(PROCESSED / "train.csv")]
    if (PROCESSED / "test.csv").exists():
        frames.append(read_csv(PROCESSED / "test.csv"))
    texts = mlm.corpus(frames, extra)
    if len(texts) < 2:
        raise PipelineError(f"{PROCESSED}: {len(texts)} distinct text(s): pretraining needs some to train on "
                            "and some held out")
    return texts, len(texts) - len(mlm.corpus(frames))  # the extra texts not already among the competition's


def masked_inputs(params, model, texts):
    """The model's tokenizer, the token ids of every text, which texts train and which are held out, and
    the held-out texts masked once (batches), each setting checked against the model."""
    from transformers import AutoConfig, AutoTokenizer

    from modeling.models import resolve_model
    from reading.tokens import joined, model_limit
    from training import mlm

    source, remote_code = resolve_model(model["name"]), model["trust_remote_code"]
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=remote_code)
    limit = model_limit(tokenizer, AutoConfig.from_pretrained(source, trust_remote_code=remote_code))
    if params["max_length"] > limit:
        raise PipelineError(f"params.yaml: pretrain.max_length {params['max_length']} is more than model.name "
                            f"{model['name']!r} takes ({limit} tokens): set it to at most {limit}")
    if tokenizer.mask_token is None:
        raise PipelineError(f"model.name {model['name']!r} has no mask token, so no masked-language-model "
                            "pretraining: set pretrain.epochs: 0")
    sequences = tokenizer(joined(texts, tokenizer), truncation=True, max_length=params["max_length"])["input_ids"]
    trained, held = mlm.held_out_split(len(texts), params["held_out"], params["seed"])
    held_out = mlm.masked_once(tokenizer, [sequences[i] for i in held], params["mask_probability"],
                               params["seed"], params["batch_size"])
    if not mlm.masked_count(held_out):
        raise PipelineError(f"no token of the {len(held)} held-out texts was masked: raise pretrain.held_out "
                            "or pretrain.mask_probability")
    return SimpleNamespace(source=source, tokenizer=tokenizer, sequences=sequences, trained=trained, held=held,
                           held_out=held_out, digest=mlm.texts_digest(texts))


def train_masked_lm(params, machine, model, inputs, extra_used, folder):
    """(the Trainer that trained the model with a masked-LM head, the held-out MLM scores before and after),
    resuming a checkpoint in `folder` of the same settings and texts; a signal saves one and exits."""
    import torch
    import transformers
    from transformers import AutoModelForMaskedLM, set_seed
    from transformers.trainer_callback import PrinterCallback

    from modeling.precision import autocast_dtype
    from training import checkpoint, mlm
    from training.arguments import pretraining_arguments
    from training.progress import ProgressLog

    set_seed(params["seed"])  # before the model is built: seeds a new MLM head
    transformers.logging.set_verbosity_error()  # the table of weights not loaded: said in one line below
    lm, loading = AutoModelForMaskedLM.from_pretrained(inputs.source, trust_remote_code=model["trust_remote_code"],
                                                       output_loading_info=True)
    transformers.logging.set_verbosity_warning()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = autocast_dtype(True, device)
    checkpoint.check_writable(folder.parent, checkpoint.checkpoint_bytes(lm))
    print(f"loaded {inputs.source}" + ("; its masked-LM head is new (randomly initialised)" if loading["missing_keys"] else ""))
    print(f"pretrain on {device} ({str(dtype or torch.float32).removeprefix('torch.')}): {len(inputs.trained):,} texts "
          f"({extra_used:,} of them extra), {len(inputs.held):,} held out; {params['mask_probability']:.0%} of tokens "
          f"masked, at most {params['max_length']} tokens a text")
    before = mlm.held_out_scores(lm.to(device), inputs.held_out, device, dtype)
    head = mlm.masked_lm_head(lm)
    if head is not None and not mlm.head_reads_each_token_alone(lm, head, {k: v.to(device) for k, v in inputs.held_out[0].items()}):
        head = None
    print("the masked-LM head scores the masked tokens only" if head is not None else
          f"the masked-LM head scores every token: {type(lm).__name__}'s head was not found to score each token alone")
    settings = {**{f"pretrain.{k}": v for k, v in sorted(params.items())}, "model.name": model["name"],
                "texts sha256": inputs.digest}
    resume = checkpoint.prepare(settings, folder)
    # a checkpoint leaves out the MLM decoder, which is the word embeddings (tied): Trainer calls it missing
    logging.getLogger("transformers.trainer").addFilter(lambda record: "missing keys in the checkpoint" not in record.getMessage())
    with checkpoint.StopOnSignal(save_every=60 * machine["checkpoint_minutes"]) as stop:
        trainer = mlm.MaskedTokensTrainer(
            model=lm, head=head, args=pretraining_arguments(params, machine, str(folder), device, dtype),
            train_dataset=[{"input_ids": inputs.sequences[i]} for i in inputs.trained],
            data_collator=mlm.BatchSeededMasking(inputs.tokenizer, params["mask_probability"], params["seed"]),
            callbacks=[stop, ProgressLog(shown=())])
        trainer.remove_callback(PrinterCallback)  # it prints a dict per log; ProgressLog prints lines
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    if stop.stopped:
        print(f"stopped by {signal.Signals(stop.stopped).name} at step {trainer.state.global_step} of "
              f"{trainer.state.max_steps}; saved a checkpoint in {folder}: rerun to resume from it")
        sys.exit(128 + stop.stopped)
    return trainer, (before, mlm.held_out_scores(lm, inputs.held_out, device, dtype))


def write_outputs(model, texts, inputs, trainer, scores, extra_used):
    """models/pretrained (the encoder with its checkpoint's pooler, the tokenizer, the marker) and the metrics."""
    from transformers import AutoModel

    from training import mlm

    before, after = scores
    base = AutoModel.from_pretrained(inputs.source, trust_remote_code=model["trust_remote_code"])
    steps = trainer.state.global_step
    with atomic_dir(PRETRAINED) as tmp:
        mlm.with_pooler(trainer.model, base).save_pretrained(tmp)
        inputs.tokenizer.save_pretrained(tmp)
        write_json(tmp / MARKER, {"pretrained": True, "model": model["name"], "texts": len(texts),
                                  "texts sha256": inputs.digest, "steps": steps})
    seconds = round(seconds_since_start(), 1)
    held = len(inputs.held)
    write_json(METRICS, {"pretrained": True, "model": model["name"],
                         "texts": {"trained": len(inputs.trained), "held_out": held, "extra": extra_used},
                         "masked_tokens": mlm.masked_count(inputs.held_out), "steps": steps,
                         "mlm_loss": {"before": before["loss"], "after": after["loss"]},
                         "mlm_perplexity": {"before": before["perplexity"], "after": after["perplexity"]},
                         "seconds": seconds})
    print(f"pretrain: MLM loss on {held:,} held-out texts {before['loss']:.2f} -> {after['loss']:.2f} "
          f"(perplexity {before['perplexity']:.1f} -> {after['perplexity']:.1f}) in {seconds:.0f} s")
    return [PRETRAINED, METRICS]


if __name__ == "__main__":
    run_main(main)
