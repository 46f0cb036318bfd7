"""Big encoders on a small GPU (docs/big-models.md), three measurements:

    python -m bench.big_models --speed      # MiniLM on this machine: step time with gradient checkpointing
                                            # and LoRA against full fine-tuning, side by side in one run
    python -m bench.big_models --f1 4000    # macro-F1 of LoRA against full fine-tuning, trained on 4000
                                            # of the embedded tweets, scored on 1000 others
    python -m bench.big_models --memory     # what a training step holds for bert-base/large-sized models:
                                            # weights, gradients, AdamW's state (counted), activations
                                            # (counted on this CPU at one 512-token text)
    python -m bench.big_models --decoders   # the same for the 2025 winners' models with LoRA and QLoRA:
                                            # Qwen2.5-1.5B/7B, Gemma-2-9B, DeBERTa-v3-large, ModernBERT-large

Rows of one table run interleaved (each setting for half its steps, then again in reverse order), so a
change in the machine's load affects them alike.
"""
import argparse
import math
import tempfile

import numpy as np
import torch
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, BertConfig, DebertaV2Config, Gemma2Config,
                          ModernBertConfig, Qwen2Config)

from bench.common import dataset, load_corpus, minilm_model
from bench.training import train_as_the_stage
from modeling.models import resolve_model
from pipeline.settings import load_params
from training import lora, lowmemory
from training.settings import MACHINE_PARAMS, TRAIN_PARAMS

SETTINGS = {  # row name: the train.* keys changed from params.yaml
    "full fine-tuning": {},
    "gradient checkpointing": {"gradient_checkpointing": True},
    "LoRA r 8, all-linear": {"lora_rank": 8, "lora_alpha": 16},
    "LoRA r 8 + gradient checkpointing": {"lora_rank": 8, "lora_alpha": 16, "gradient_checkpointing": True},
}


def QUIET(*_):  # the train stage's log lines: not printed here
    pass


def trainable(model):
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def speed(params, steps, rows):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("minilm"))
    texts, labels, _ = load_corpus(load_params("preprocess"))
    sequences = tokenizer(texts[:rows], truncation=True, max_length=128)["input_ids"]
    times, counts = {name: [] for name in SETTINGS}, {}
    with tempfile.TemporaryDirectory() as folder:
        data = dataset(folder, "train", sequences, labels[:rows])
        for order in (list(SETTINGS), list(reversed(SETTINGS))):
            for name in order:
                changed = {**params, **SETTINGS[name]}
                model = lowmemory.prepare(minilm_model(changed["dropout"], changed["freeze_embeddings"]), changed,
                                          "cpu", say=QUIET)
                counts[name] = (trainable(model), sum(p.numel() for p in model.parameters()))
                meter = train_as_the_stage(model, changed, tokenizer, sequences, data, folder, "cpu", steps // 2, 2)
                times[name].append(meter)
    base = sum(m.seconds for m in times["full fine-tuning"]) / sum(m.samples for m in times["full fine-tuning"])
    print(f"MiniLM on the CPU, {steps} optimizer steps per row (effective batch {params['effective_batch_size']}, "
          f"texts of the embedded tweets cut at 128 tokens), the train section's settings otherwise:")
    print("| setting | trained parameters | s per 1000 examples | step time vs full |")
    print("|---|---|---|---|")
    for name, meters in times.items():
        per = sum(m.seconds for m in meters) / sum(m.samples for m in meters)
        t, total = counts[name]
        print(f"| {name} | {t / 1e6:.2f}M of {total / 1e6:.1f}M ({t / total:.1%}) | {1000 * per:.1f} | {per / base:.2f}x |")


def f1(params, rows, seeds):
    from sklearn.metrics import f1_score

    from modeling.models import make_collator
    from predicting.inference import predict_logits

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("minilm"))
    texts, labels, _ = load_corpus(load_params("preprocess"))
    order = np.random.default_rng(0).permutation(len(texts))
    train, val = order[:rows], order[rows:rows + 1000]
    sequences = tokenizer([texts[i] for i in order[:rows + 1000]], truncation=True, max_length=128)["input_ids"]
    runs = {"full fine-tuning, lr 1e-4": {}, "LoRA r 8, all-linear, lr 1e-3": {"lora_rank": 8, "lora_alpha": 16, "lr": 1e-3}}
    print(f"macro-F1 on 1000 held-out tweets after 1 epoch on {rows} (MiniLM, the train section's settings otherwise):")
    with tempfile.TemporaryDirectory() as folder:
        data = dataset(folder, "train", sequences[:rows], [labels[i] for i in train])
        for name, changes in runs.items():
            scores = []
            for seed in seeds:
                changed = {**params, **changes, "seed": seed}
                torch.manual_seed(seed)
                model = lowmemory.prepare(minilm_model(changed["dropout"], changed["freeze_embeddings"]), changed,
                                          "cpu", say=QUIET)
                steps = math.ceil(rows / changed["effective_batch_size"])
                train_as_the_stage(model, changed, tokenizer, sequences, data, folder, "cpu", steps, 0)
                logits = predict_logits(model, make_collator(tokenizer, "cpu"), sequences[rows:], 64, "cpu")
                scores.append(f1_score([labels[i] for i in val], logits.argmax(1).numpy(), average="macro"))
            print(f"| {name} | {np.mean(scores):.4f} ± {np.std(scores):.4f} | seeds {', '.join(map(str, seeds))}: "
                  f"{', '.join(f'{s:.4f}' for s in scores)} |")


MODELS = {  # randomly initialised from their published sizes: no download
    "bert-base (110M)": BertConfig(),
    "bert-large (335M)": BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}


def saved_activation_bytes(model, tokens, checkpointing):
    """Bytes autograd keeps for the backward pass of one text of `tokens` tokens in bf16 autocast (counted
    through saved-tensor hooks, each storage once; with checkpointing, the layers' inputs it keeps)."""
    model.train()
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    layer_inputs = []
    hooks = [m.register_forward_pre_hook(lambda _, args, kw: layer_inputs.append(
        (args[0] if args else kw["hidden_states"]).untyped_storage().nbytes()), with_kwargs=True)
        for m in model.modules() if type(m).__name__.endswith("Layer") and hasattr(m, "attention")]
    ids = torch.full((1, tokens), 1000)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().sum()
    for h in hooks:
        h.remove()
    del out
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = sum(n for ptr, n in storages.items() if ptr not in weights)
    return kept + (sum(layer_inputs[:len(hooks)]) if checkpointing else 0)


def memory(tokens):
    gb = 2**30
    print(f"Memory of one training step, by parts (GiB). Weights fp32; gradients for the trained weights; AdamW's two "
          f"moments (8-bit: bitsandbytes' layout); activations kept for the backward pass of ONE text of {tokens} "
          "tokens, counted on this CPU in bf16 autocast (a T4 runs fp16: the same sizes; its attention kernels "
          "may keep less). A GPU adds the CUDA context and allocator slack (training/batch_size.py keeps 15% free).")
    print("| model | weights | grads + AdamW: full | full, 8-bit AdamW | LoRA r 8 all-linear | activations per text: "
          "plain | with gradient checkpointing |")
    print("|---|---|---|---|---|---|---|")
    for name, config in MODELS.items():
        config.num_labels = 3
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_config(config)
        weights = sum(p.numel() for p in model.parameters())
        head = sum(p.numel() for n in lora.head_modules(model) for p in getattr(model, n).parameters())
        linear = dict(model.named_modules())
        adapters = sum(8 * (linear[t].in_features + linear[t].out_features)
                       for t in lora.target_modules(model, lora.ALL_LINEAR))
        full = 4 * weights + lowmemory.adamw_state_bytes(model)
        eight = 4 * weights + lowmemory.adamw_state_bytes(model, eight_bit=True)
        lora_state = (4 + 4 + 8) * (adapters + head)
        plain = saved_activation_bytes(model, tokens, False)
        checkpointed = saved_activation_bytes(model, tokens, True)
        print(f"| {name} | {4 * weights / gb:.2f} | {full / gb:.2f} | {eight / gb:.2f} | {lora_state / gb:.3f} "
              f"(+ weights {4 * (weights + adapters) / gb:.2f}) | {plain / gb:.3f} | {checkpointed / gb:.3f} |")
        del model


BIG = {  # the published configs' sizes (their config.json on the hub), randomly initialised: no download
    "Qwen2.5-1.5B": lambda **k: Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                                           num_key_value_heads=2, tie_word_embeddings=True, **k),
    "Qwen2.5-7B": lambda **k: Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                                         num_key_value_heads=4, tie_word_embeddings=False, **k),
    "Gemma-2-9B": lambda **k: Gemma2Config(vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_attention_heads=16,
                                          num_key_value_heads=8, head_dim=256, **k),
    "DeBERTa-v3-large": lambda **k: DebertaV2Config(vocab_size=128100, hidden_size=1024, num_attention_heads=16,
                                                    intermediate_size=4096, relative_attention=True, position_buckets=256,
                                                    norm_rel_ebd="layer_norm", share_att_key=True, pos_att_type=["p2c", "c2p"],
                                                    max_relative_positions=-1, position_biased_input=False, type_vocab_size=0,
                                                    pooler_hidden_size=1024, **k),
    "ModernBERT-large": lambda **k: ModernBertConfig(vocab_size=50368, hidden_size=1024, intermediate_size=2624,
                                                     num_attention_heads=16, **k),
}
LAYERS = {"Qwen2.5-1.5B": 28, "Qwen2.5-7B": 28, "Gemma-2-9B": 42, "DeBERTa-v3-large": 24, "ModernBERT-large": 28}


def layer_list(model):
    """The model's stack of transformer layers (encoder.layer, layers)."""
    return max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len)


def kept_bytes(model, tokens, checkpointing):
    """Bytes autograd keeps for the backward pass of one text of `tokens` tokens in bf16 autocast (saved-tensor
    hooks, each storage once, weights not counted); with checkpointing, what it keeps is each layer's input
    plus one layer's own activations while that layer is recomputed."""
    model.train()
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.full((1, tokens), 100)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().sum()
    del out
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in weights)


def decoders(tokens, rank=16):
    """The table in docs/big-models.md: exact weight and optimizer bytes from each config (meta device), and the
    activations of one text counted on models of 1 and 2 layers of that config, scaled to its layers."""
    gb = 2**30
    print(f"GiB. QLoRA: linear weights of the layers in 4-bit NF4 with double-quantized scales (0.5 + 0.127/8 "
          f"bytes), every other weight fp32 (PEFT's preparation). LoRA r {rank} all-linear: adapters and head, their "
          f"gradients and AdamW's two moments (16 bytes each). Activations: one text of {tokens} tokens, bf16 autocast.")
    print("| model | weights fp32 | QLoRA weights | LoRA state | activations per text: plain | with gradient checkpointing |")
    print("|---|---|---|---|---|---|")
    for name, make in BIG.items():
        with torch.device("meta"):
            model = AutoModelForSequenceClassification.from_config(make(num_hidden_layers=LAYERS[name], num_labels=3))
        total = sum(p.numel() for p in model.parameters())
        targets = lora.target_modules(model, lora.ALL_LINEAR)
        modules = dict(model.named_modules())
        linear = sum(modules[t].weight.numel() for t in targets)
        head = sum(p.numel() for n in lora.head_modules(model) for p in getattr(model, n).parameters())
        adapters = sum(rank * (modules[t].in_features + modules[t].out_features) for t in targets)
        qlora_weights = linear * (0.5 + 0.127 / 8) + 4 * (total - linear)
        per = {}
        for layers in (1, 2):  # a layer's activations are the same in every layer: two models give them
            torch.manual_seed(0)
            small = AutoModelForSequenceClassification.from_config(make(num_hidden_layers=layers, num_labels=3, pad_token_id=0))
            small = lora.wrap(small, rank, 2 * rank, lora.ALL_LINEAR)
            per[layers] = kept_bytes(small, tokens, False)
            inputs = tokens * small.config.hidden_size * 4  # a layer's input, the fp32 residual stream
            del small
        layer = per[2] - per[1]
        plain = per[1] + (LAYERS[name] - 1) * layer
        checkpointed = (per[1] - layer) + LAYERS[name] * inputs + layer
        print(f"| {name} ({total / 1e9:.2f}B) | {4 * total / gb:.2f} | {qlora_weights / gb:.2f} | "
              f"{16 * (adapters + head) / gb:.3f} | {plain / gb:.2f} | {checkpointed / gb:.2f} |", flush=True)


def main():
    parser = argparse.ArgumentParser(prog="python -m bench.big_models", description=__doc__.splitlines()[0])
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--steps", type=int, default=20, help="--speed: optimizer steps per row")
    parser.add_argument("--f1", type=int, metavar="ROWS", help="train on this many tweets, score on 1000 others")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--tokens", type=int, default=512, help="--memory, --decoders: the text's length")
    parser.add_argument("--decoders", action="store_true")
    args = parser.parse_args()
    params = load_params("train", TRAIN_PARAMS)
    load_params("machine", MACHINE_PARAMS)
    if args.speed:
        speed(params, args.steps, rows=args.steps * params["effective_batch_size"])
    if args.f1:
        f1(params, args.f1, args.seeds)
    if args.memory:
        memory(args.tokens)
    if args.decoders:
        decoders(args.tokens)


if __name__ == "__main__":
    main()
