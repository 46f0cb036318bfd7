"""Every model family a competitor brings, run as the pipeline runs it: tiny random models of each family with
the kind of tokenizer it ships (tests/families.py), text pairs through tokenize, train, predict_test and
python -m predict, each a fork of this process running the module as `python -m` does (imports paid once);
the decoders (Qwen2, Llama, Gemma 2) also on single texts with LoRA.

The test rows' outputs are checked by another path than the one that wrote them: the trained fold read by
transformers alone, each text tokenized on its own (no padding, so no pad token and no last-token search
over padding), with segment ids only where the model has more than one token type."""
import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tests.families import FAMILIES, build
from tests.shape_data import pair_rows, write_data
from tests.test_params import run_module_in
from tests.test_pipeline import REPO, set_params

PAIRS = dict(preprocess__text_column="premise", preprocess__text_pair_column="hypothesis",
             preprocess__label_column="label", preprocess__id_column="id")
# one short epoch: what is checked is that each family runs and predicts what transformers computes
FAST = dict(train__epochs=1, train__batch_size=8, train__effective_batch_size=8, train__lr=1e-3,
            train__freeze_embeddings=False, train__mixed_precision=False, tokenize__max_length="auto",
            train__evaluations="epoch", cv__folds=[0])
DECODERS = [name for name, family in FAMILIES.items() if family.decoder]


def forked(folder, module, *args):
    """`python -m module *args` in folder, run in a fork of this process: (exit code, stdout, stderr)."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=run_module_in, args=(str(folder), module, args))
    child.start()
    child.join(timeout=300)
    streams = [(folder / f".{name}").read_text() for name in ("stdout", "stderr")]
    for name in ("stdout", "stderr"):
        (folder / f".{name}").unlink()
    return child.exitcode, *streams


def run_ok(folder, module, *args):
    code, out, err = forked(folder, module, *args)
    assert code == 0 and "Traceback" not in err, f"{module} {args}: exit {code}\n{out}\n{err}"
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A project folder with pair data fetched, preprocessed and split (one holdout fold): each case copies it."""
    for module in ("stages.fetch", "stages.preprocess", "stages.split", "stages.tokenize", "stages.train",
                   "stages.predict_test", "stages.distill", "predict"):
        __import__(module)  # imported once, here; each run is a fork of this process
    folder = tmp_path_factory.mktemp("families")
    source = write_data(folder / "source", pair_rows, 120, 24)
    project = folder / "project"
    project.mkdir()
    for name in ("params.yaml",):
        shutil.copy(REPO / name, project / name)
    set_params(project, fetch__source=str(source), model__name=str(folder), **PAIRS, **FAST)
    for stage in ("stages.fetch", "stages.preprocess", "stages.split"):
        run_ok(project, stage)
    return project, source


def by_transformers(folder, test, pairs):
    """Class probabilities of the rows of `test` from the trained fold in `folder`, by transformers alone,
    one text at a time, computed in a fork: torch's thread pool started in this process would hang the
    forks that run the next stages."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=probabilities_to, args=(folder, test, pairs))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0, f"transformers could not read {folder}: exit {child.exitcode}"
    saved = np.load(folder / "by_transformers.npz")
    return saved["probabilities"], int(saved["tokens"])


def probabilities_to(folder, test, pairs):
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True).eval()
    types = pairs and getattr(model.config, "type_vocab_size", 2) > 1 and "token_type_ids" in tokenizer.model_input_names
    outputs, tokens = [], 0
    with torch.inference_mode():
        for _, row in test.iterrows():
            encoded = tokenizer(row["premise"], row["hypothesis"] if pairs else None, return_tensors="pt",
                                return_token_type_ids=types)
            outputs.append(model(**encoded).logits.softmax(-1)[0].numpy())
            tokens += encoded["input_ids"].shape[1]
    np.savez(folder / "by_transformers.npz", probabilities=np.array(outputs), tokens=tokens)


def run_family(prepared, tmp_path, family, pairs=True, lora_rank=0):
    """tokenize, train@0, predict_test and python -m predict for one family's tiny model: (project folder,
    the test rows, the stage's test outputs, python -m predict's)."""
    project, source = prepared
    work = tmp_path / "project"
    shutil.copytree(project, work)
    model = build(family, tmp_path / family)
    set_params(work, model__name=str(model), model__trust_remote_code=FAMILIES[family].remote_code, train__lora_rank=lora_rank,
               **({} if pairs else {"preprocess__text_pair_column": None}))
    if not pairs:  # single texts: preprocess again without the second column
        run_ok(work, "stages.preprocess")
        run_ok(work, "stages.split")
    for stage, *args in (("stages.tokenize",), ("stages.train", "--fold", "0"), ("stages.predict_test",)):
        run_ok(work, stage, *args)
    test = pd.read_csv(source / "test.csv", dtype=str, keep_default_na=False)
    test.drop(columns="label").to_csv(work / "new.csv", index=False)
    said = run_ok(work, "predict", "new.csv", "--out", "predicted.csv", "--probabilities", "probabilities.csv",
                  "--batch-size", "5")  # other batches than the stage's: a row's output must not depend on its batch
    stage = pd.read_csv(work / "predictions/test/fold-0.csv").drop(columns="row").to_numpy()
    return work, test, stage, pd.read_csv(work / "probabilities.csv"), said


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_trains_on_text_pairs_and_predicts_what_transformers_computes(prepared, tmp_path, family):
    work, test, stage, predicted, said = run_family(prepared, tmp_path, family)
    expected, tokens = by_transformers(work / "models/fold-0", test, pairs=True)
    np.testing.assert_allclose(stage, expected, atol=1e-4)
    labels = sorted(set(test["label"]))
    np.testing.assert_allclose(predicted[labels].to_numpy(), expected, atol=1e-4)
    assert f"predicting {len(test)} rows ({tokens:,} tokens) with 1 model(s) on cpu" in said, said


@pytest.mark.parametrize("family", DECODERS)
def test_a_decoder_trains_with_lora_on_single_texts(prepared, tmp_path, family):
    work, test, stage, predicted, _ = run_family(prepared, tmp_path, family, pairs=False, lora_rank=4)
    expected, _ = by_transformers(work / "models/fold-0", test, pairs=False)  # a plain model: the adapters merged
    np.testing.assert_allclose(stage, expected, atol=1e-4)
    np.testing.assert_allclose(predicted[sorted(set(test["label"]))].to_numpy(), expected, atol=1e-4)


def test_a_loss_that_becomes_nan_stops_the_fold_with_one_line_naming_the_setting(prepared, tmp_path):
    """A model whose activations overflow (its embeddings scaled past what float32 squares: the layer norm's
    variance is infinite, as Gemma's activations are in float16): Trainer would train on and the fold submit
    NaNs; the stage stops at the first logged loss that is not finite, names train.lr, and writes no model."""
    from safetensors.torch import load_file, save_file

    project, _ = prepared
    work = tmp_path / "project"
    shutil.copytree(project, work)
    model = build("bert", tmp_path / "bert")
    weights = load_file(model / "model.safetensors")
    name = next(key for key in weights if key.endswith("word_embeddings.weight"))
    weights[name] = weights[name] * 1e25
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    set_params(work, model__name=str(model))
    run_ok(work, "stages.tokenize")
    code, out, err = forked(work, "stages.train", "--fold", "0")
    assert code == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "training loss became nan by step 1 " in lines[0] and "train.lr" in lines[0], err
    assert not (work / "models/fold-0").exists()


def test_lr_auto_gives_a_decoder_with_lora_the_lora_rate(prepared, tmp_path):
    """train.lr auto on a tiny decoder with LoRA: the LoRA paper's 5e-4 for a model under 1B, said in the
    log and reached by the schedule (dvclive's learning_rate curve peaks there after the warmup)."""
    project, _ = prepared
    work = tmp_path / "project"
    shutil.copytree(project, work)
    set_params(work, model__name=str(build("qwen2", tmp_path / "qwen2")), train__lora_rank=4, train__lr="auto")
    run_ok(work, "stages.tokenize")
    out = run_ok(work, "stages.train", "--fold", "0")
    assert "train.lr auto: 0.0005 for a model of 0.1M parameters with LoRA" in out, out
    curve = pd.read_csv(work / "reports/train/fold-0/plots/metrics/learning_rate.tsv", sep="\t")
    assert 4e-4 <= curve["learning_rate"].max() <= 5e-4, curve


@pytest.mark.parametrize("config, lora, rate", [
    ("MiniLM-L6-H384", False, 1e-4),                 # 22.7M weights: the default run's rate
    ("bert-base", False, 3e-5),                      # 109M: BERT's 2e-5 to 5e-5
    ("deberta-v3-large", False, 1e-5),              # 435M: DeBERTa-v3's 5e-6 to 1e-5
    ("roberta-base", True, 5e-4),                    # 125M with LoRA: the LoRA paper's 5e-4
    ("Qwen2.5-7B", True, 2e-4),                      # 7.1B with LoRA: QLoRA's 2e-4 for 7B-13B
])
def test_lr_auto_follows_the_published_rates_for_real_model_sizes(config, lora, rate):
    """The real configs' sizes, counted on the meta device (no weights), against the rates the papers
    trained models of that size with."""
    from transformers import AutoModelForSequenceClassification, BertConfig, DebertaV2Config, Qwen2Config, RobertaConfig

    from training.learning_rate import auto_lr, weights

    configs = {
        "MiniLM-L6-H384": BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
        "bert-base": BertConfig(),
        "deberta-v3-large": DebertaV2Config(vocab_size=128100, hidden_size=1024, num_hidden_layers=24,
                                            num_attention_heads=16, intermediate_size=4096, relative_attention=True,
                                            position_buckets=256, norm_rel_ebd="layer_norm", share_att_key=True,
                                            pos_att_type=["p2c", "c2p"], max_relative_positions=-1,
                                            position_biased_input=False, type_vocab_size=0, pooler_hidden_size=1024),
        "roberta-base": RobertaConfig(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1),
        "Qwen2.5-7B": Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                  num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    }
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(configs[config])
    assert auto_lr(weights(model), lora) == rate


def test_a_decoder_teachers_fold_distilled_into_an_encoder_of_another_vocabulary(prepared, tmp_path):
    """The LMSYS pattern: a decoder (Qwen2, byte-level BPE) trained as the teacher, a BERT (WordPiece) student
    of its first layer learning its out-of-fold outputs from the texts tokenized by its own tokenizer; the
    student's test outputs are what transformers computes from its saved folder, and python -m predict
    --student reads new texts with the student's tokenizer."""
    project, source = prepared
    work = tmp_path / "project"
    shutil.copytree(project, work)
    student = build("bert", tmp_path / "bert")
    set_params(work, model__name=str(build("qwen2", tmp_path / "qwen2")),
               distill__students={"small": {"model": str(student), "layers": 1}}, distill__epochs=1)
    for stage, *args in (("stages.tokenize",), ("stages.train", "--fold", "0"), ("stages.predict_test",)):
        run_ok(work, stage, *args)
    out = run_ok(work, "stages.distill", "--student", "small")
    assert "the texts tokenized again by its own" in out and "learning the out-of-fold outputs of 12 training texts" in out, out
    folder = work / "students/distill/small/model"
    assert json.loads((folder / "config.json").read_text())["model_type"] == "bert"
    test = pd.read_csv(source / "test.csv", dtype=str, keep_default_na=False)
    expected, _ = by_transformers(folder, test, pairs=True)
    np.testing.assert_allclose(pd.read_csv(work / "students/distill/small/predictions/test.csv")
                               .drop(columns="row").to_numpy(), expected, atol=1e-4)
    test.drop(columns="label").to_csv(work / "new.csv", index=False)
    run_ok(work, "predict", "new.csv", "--out", "predicted.csv", "--probabilities", "probabilities.csv",
           "--student", "small")
    np.testing.assert_allclose(pd.read_csv(work / "probabilities.csv")[sorted(set(test["label"]))].to_numpy(),
                               expected, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_decoder_trains_with_qlora_and_saves_the_model_it_trained(prepared, tmp_path, family):
    """train.load_in_4bit on a CPU (bitsandbytes' 4-bit layers run there too): the linear layers trained
    through 4-bit NF4 weights, the saved model plain (float32, no quantization in its config) and computing
    what the quantized, adapted model computed in training: the validation rows' out-of-fold outputs, which
    the 4-bit model wrote, are what transformers computes from the saved folder."""
    project, _ = prepared
    work = tmp_path / "project"
    shutil.copytree(project, work)
    set_params(work, model__name=str(build(family, tmp_path / family)), train__lora_rank=4, train__load_in_4bit=True,
               preprocess__text_pair_column=None)
    for stage, *args in (("stages.preprocess",), ("stages.split",), ("stages.tokenize",)):
        run_ok(work, stage, *args)
    out = run_ok(work, "stages.train", "--fold", "0")
    assert "train.load_in_4bit: the pretrained linear layers' weights in 4-bit NF4 (bitsandbytes), computed in float32" in out
    config = json.loads((work / "models/fold-0/config.json").read_text())
    assert "quantization_config" not in config
    oof = pd.read_csv(work / "predictions/fold-0/oof.csv", index_col="row")
    rows = pd.read_csv(work / "data/processed/train.csv", dtype=str, keep_default_na=False).iloc[oof.index]
    expected, _ = by_transformers(work / "models/fold-0", rows.rename(columns={"text": "premise"}), pairs=False)
    np.testing.assert_allclose(oof.to_numpy(), expected, atol=1e-4)


def test_qlora_without_lora_is_one_line_before_any_work(prepared, tmp_path):
    project, _ = prepared
    work = tmp_path / "project"
    shutil.copytree(project, work)
    set_params(work, train__load_in_4bit=True, train__lora_rank=0)
    code, _, err = forked(work, "stages.train", "--fold", "0")
    assert code == 1 and err.strip().splitlines() == [
        "error: params.yaml: train.load_in_4bit needs train.lora_rank above 0 (4-bit weights are frozen; LoRA's "
        "adapters are what trains): set train.lora_rank: 16"], err


def test_a_model_of_remote_code_without_trust_remote_code_is_one_line_naming_the_setting(prepared, tmp_path):
    project, _ = prepared
    work = tmp_path / "project"
    shutil.copytree(project, work)
    set_params(work, model__name=str(build("remote-code", tmp_path / "remote")), model__trust_remote_code=False)
    code, _, err = forked(work, "stages.tokenize")
    assert code == 1 and err.strip().splitlines() == [
        f"error: model.name {str(tmp_path / 'remote')!r} comes with its own Python code (config.json's auto_map): set "
        "model.trust_remote_code: true if you trust its authors, or pick another model"], err
    assert not (work / "data/tokenized").exists()


def test_a_nan_loss_in_float16_names_the_precision_settings():
    """Gemma in fp16 on a T4 (no bf16 there): the line names train.mixed_precision and the GPUs with bf16,
    not the learning rate."""
    from transformers import TrainerState

    from pipeline.settings import PipelineError
    from training.trainer import FiniteLoss

    state = TrainerState(global_step=40, max_steps=100, logging_steps=2)
    FiniteLoss(torch.float16, 2e-4).on_log(None, state, None, logs={"loss": 0.7})  # a finite loss goes on
    with pytest.raises(PipelineError) as raised:
        FiniteLoss(torch.float16, 2e-4).on_log(None, state, None, logs={"loss": float("inf")})
    assert str(raised.value) == (
        "the training loss became inf by step 40 of 100 in float16: the model overflows float16 (Gemma does); set "
        "train.mixed_precision: false (float32), or train on a GPU with bfloat16 (compute capability 8.0 or more: "
        "A100, L4, H100)")
