"""The pretrain stage's masked-LM step scoring only the masked tokens (training/mlm.py MaskedTokensTrainer)
against the model's own forward, which scores every token, side by side in one run: the embedded MiniLM on
the embedded train and test tweets at pretrain.*'s settings in params.yaml, through the stage's Trainer and
collator, in the precision the stage would choose. Each side trains `--steps` steps from the same start
twice, the two sides alternating; the ratio is of tokens/s over both.

    python -m bench.pretraining --steps 10
"""
import argparse
import tempfile
import time

import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer
from transformers import logging as hf_logging
from transformers import set_seed
from transformers.trainer_callback import PrinterCallback

from bench.common import NO_CHECKPOINTS, load_average, load_corpus
from modeling.models import resolve_model
from modeling.precision import autocast_dtype, cpu_isa
from pipeline.settings import load_params
from reading.tokens import joined
from stages.preprocess import PREPROCESS_PARAMS
from stages.pretrain import PRETRAIN_PARAMS
from training import mlm
from training.arguments import pretraining_arguments


def run(params, tokenizer, sequences, masked_only, steps, dtype, folder):
    """(seconds, tokens, final training loss) of `steps` pretraining steps from the same start."""
    set_seed(params["seed"])
    hf_logging.set_verbosity_error()  # the new head's loading report
    lm = AutoModelForMaskedLM.from_pretrained(resolve_model("minilm"))
    head = mlm.masked_lm_head(lm) if masked_only else None
    args = pretraining_arguments({**params, "epochs": 1}, NO_CHECKPOINTS, folder, "cpu", dtype)
    args.max_steps, args.logging_strategy, args.save_strategy = steps, "no", "no"
    collator = mlm.BatchSeededMasking(tokenizer, params["mask_probability"], params["seed"])
    trainer = mlm.MaskedTokensTrainer(model=lm, head=head, args=args, data_collator=collator,
                                      train_dataset=[{"input_ids": ids} for ids in sequences])
    trainer.remove_callback(PrinterCallback)
    tokens = sum(len(ids) for ids in sequences)  # steps x batch texts: each step takes a batch of them
    start = time.perf_counter()
    result = trainer.train()
    return time.perf_counter() - start, tokens, result.training_loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per side per round (default 10)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    hf_logging.disable_progress_bar()
    params = load_params("pretrain", PRETRAIN_PARAMS)
    train, _, test = load_corpus(load_params("preprocess", PREPROCESS_PARAMS))
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("minilm"))
    texts = mlm.corpus([{"text": train}, {"text": test}])
    # the same texts, in order, for both sides: the first steps x batch of them
    sequences = tokenizer(joined(texts[:opts.steps * params["batch_size"]], tokenizer), truncation=True,
                          max_length=params["max_length"])["input_ids"]
    dtype = autocast_dtype(True, "cpu")
    print(f"cpu ({cpu_isa()}), {torch.get_num_threads()} torch threads, "
          f"{str(dtype or torch.float32).removeprefix('torch.')}; load average {load_average()}")
    print(f"MiniLM masked-LM steps of {params['batch_size']} tweets ({params['mask_probability']:.0%} masked), "
          f"{opts.steps} steps a side a round, 2 rounds")
    totals = {False: [0.0, 0], True: [0.0, 0]}
    losses = {}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(2):
            for masked_only in (False, True):
                seconds, tokens, losses[masked_only] = run(params, tokenizer, sequences, masked_only, opts.steps,
                                                           dtype, folder)
                totals[masked_only][0] += seconds
                totals[masked_only][1] += tokens
    rate = {side: tokens / seconds for side, (seconds, tokens) in totals.items()}
    print(f"every token scored (the model's own forward): {rate[False]:,.0f} tokens/s, "
          f"{totals[False][0] / (2 * opts.steps):.2f} s a step; training loss {losses[False]:.4f}")
    print(f"masked tokens only (the pretrain stage):     {rate[True]:,.0f} tokens/s, "
          f"{totals[True][0] / (2 * opts.steps):.2f} s a step; training loss {losses[True]:.4f}")
    print(f"masked tokens only vs every token: {rate[True] / rate[False]:.2f}x; load average {load_average()}")


if __name__ == "__main__":
    main()
