"""Models by name for forecasts: the paper's five CNNs plus BERT-base and GPT-2, built from configs.

No weights are downloaded. Each entry builds the user contract's parts for a given batch size:
(model, batch, loss_fn, make_optimizer) — the same contract a user's FILE.py:FUNC meets.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from tensile.errors import TensileUserError

ModelParts = tuple[torch.nn.Module, tuple[torch.Tensor, ...], Callable, Callable]


@dataclass(frozen=True)
class ZooEntry:
    build: Callable[[], torch.nn.Module]
    input_shape: tuple[int, ...]  # one sample: (C, H, W) images or (sequence length,) tokens
    kind: str  # "image" (cross entropy over classes) or "lm" (the model computes its own loss)
    classes_or_vocab: int


_torchvision_ops: list[torch.library.Library | None] = []  # once checked: the stub library, or None


def _native_ops_load() -> bool:
    """Whether torchvision's own C++ ops load here (they do on a CUDA machine, not with the CPU torch)."""
    spec = importlib.util.find_spec("torchvision")
    folders = (spec.submodule_search_locations or []) if spec else []
    library = next((path for folder in folders for path in Path(folder).glob("_C*.so")), None)
    if library is None:
        return False
    try:
        torch.ops.load_library(str(library))  # torchvision's import loads the same file: no second registration
    except OSError:
        return False
    return True


def _torchvision() -> ModuleType:
    """torchvision on the CPU machine is a CUDA build whose C++ ops do not load; its models work once nms is
    defined. Where they load (a GPU machine), defining nms as well would abort the process.

    timm and transformers import torchvision too, so every zoo builder goes through here first."""
    if not _torchvision_ops:
        if _native_ops_load():
            _torchvision_ops.append(None)
        else:
            library = torch.library.Library("torchvision", "DEF")
            library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _torchvision_ops.append(library)
    import torchvision.models

    return torchvision.models


def _vgg16() -> torch.nn.Module:
    return _torchvision().vgg16()


def _resnet50() -> torch.nn.Module:
    return _torchvision().resnet50()


def _densenet121() -> torch.nn.Module:
    return _torchvision().densenet121()


def _inception_v3() -> torch.nn.Module:
    return _torchvision().inception_v3(weights=None, aux_logits=False, init_weights=False)


def _inception_v4() -> torch.nn.Module:
    _torchvision()
    import timm

    return timm.create_model("inception_v4", pretrained=False)


def _bert_base() -> torch.nn.Module:
    _torchvision()
    from transformers import BertConfig, BertForMaskedLM

    # transformers' @strict configs take attn_implementation through **kwargs; their dataclass signature lacks it
    return BertForMaskedLM(BertConfig(attn_implementation="eager"))  # type: ignore[call-arg]


def _gpt2() -> torch.nn.Module:
    _torchvision()
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(attn_implementation="eager"))  # type: ignore[call-arg]  # as BertConfig above


ZOO: dict[str, ZooEntry] = {
    "vgg16": ZooEntry(_vgg16, (3, 224, 224), "image", 1000),
    "inception_v3": ZooEntry(_inception_v3, (3, 299, 299), "image", 1000),
    "inception_v4": ZooEntry(_inception_v4, (3, 299, 299), "image", 1000),
    "resnet50": ZooEntry(_resnet50, (3, 224, 224), "image", 1000),
    "densenet121": ZooEntry(_densenet121, (3, 224, 224), "image", 1000),
    "bert_base": ZooEntry(_bert_base, (128,), "lm", 30522),
    "gpt2": ZooEntry(_gpt2, (128,), "lm", 50257),
}
ALIASES = {"vgg-16": "vgg16", "resnet-50": "resnet50", "densenet-121": "densenet121", "densenet": "densenet121",
           "inceptionv3": "inception_v3", "inceptionv4": "inception_v4", "bert": "bert_base", "bert-base": "bert_base"}


def zoo_entry(name: str) -> tuple[str, ZooEntry]:
    key = ALIASES.get(name.lower(), name.lower().replace("-", "_"))
    if key not in ZOO:
        raise TensileUserError(
            f"unknown model '{name}'; known models: {', '.join(ZOO)} (or FILE.py:FUNC for your own model)"
        )
    return key, ZOO[key]


def _image_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    images, labels = batch
    return torch.nn.functional.cross_entropy(model(images), labels)


def _lm_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    tokens, labels = batch
    return model(input_ids=tokens, labels=labels).loss


def build_zoo_parts(
    name: str,
    batch_size: int,
    *,
    device: str,
    input_shape: tuple[int, ...] | None = None,
    seed: int = 0,
) -> ModelParts:
    """The contract's parts on `device` ("meta" for forecasts, "cpu" or "cuda" for live runs); optimizer added later."""
    _, entry = zoo_entry(name)
    shape = tuple(input_shape or entry.input_shape)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    with torch.device(device):
        model = entry.build()
    model.train()
    if device == "meta":
        inputs = torch.empty((batch_size, *shape), device="meta", dtype=torch.float32 if entry.kind == "image" else torch.long)
        labels = torch.empty((batch_size,) if entry.kind == "image" else (batch_size, *shape), dtype=torch.long, device="meta")
    elif entry.kind == "image":
        inputs = torch.randn((batch_size, *shape), generator=generator)
        labels = torch.randint(0, entry.classes_or_vocab, (batch_size,), generator=generator)
    else:
        inputs = torch.randint(0, entry.classes_or_vocab, (batch_size, *shape), generator=generator)
        labels = inputs.clone()
    if device not in ("meta", "cpu"):  # drawn on the host, so a batch is the same on every device
        inputs, labels = inputs.to(device), labels.to(device)
    loss_fn = _image_loss if entry.kind == "image" else _lm_loss
    return model, (inputs, labels), loss_fn, lambda params: torch.optim.Adam(params)
