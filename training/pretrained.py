"""Where fine-tuning starts: the pretrain stage's model when it pretrained one, else model.name's."""
import json
from pathlib import Path

PRETRAINED = Path("models/pretrained")
MARKER = "pretrained.json"  # {"pretrained": false} when pretrain.epochs is 0: nothing else is written then


def start_model(model_source, folder=PRETRAINED):
    """The folder the pretrain stage wrote (a str) when its pretrained.json says it pretrained, else model_source."""
    try:
        pretrained = json.loads((Path(folder) / MARKER).read_text(encoding="utf-8"))["pretrained"]
    except (OSError, ValueError, KeyError):
        return model_source
    return str(folder) if pretrained else model_source
