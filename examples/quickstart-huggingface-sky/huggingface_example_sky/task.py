"""huggingface_example: A Flower / Hugging Face app.

Flower's ``examples/quickstart-huggingface`` task as Flower writes it (``load_data``
tokenizing a ``flwr_datasets`` partition, ``DataCollatorWithPadding`` DataLoaders whose
batches are dicts with an attention mask; ``get_model`` loading
``AutoModelForSequenceClassification``; ``train`` calling ``net(**batch).loss``), on
local data and a local model instead of downloads: lines of the Python standard
library's source, labelled comment (1) or code (0), and a tiny BERT with a word-level
tokenizer, written by :func:`model_path` to a local directory the first time.
"""

import os
import re
import sysconfig
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from datasets.utils.logging import disable_progress_bar
from flwr_datasets.partitioner import IidPartitioner
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
)

disable_progress_bar()
fds = None  # Cache the partitioner over the local data set
MAX_LENGTH = 32  # tokens per text (truncated)


def local_texts(n: int = 2400) -> Dataset:
    """``n`` lines of the standard library's source (sorted files, so every machine
    with the same Python reads the same): half comments (``text`` without its ``#``,
    ``label`` 1), half code (``label`` 0)."""
    comments, code = [], []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        for line in path.read_text(errors="replace").splitlines():
            line = line.strip()
            if len(line) < 12:
                continue
            if line.startswith("#"):
                comments.append(line.lstrip("#").strip())
            elif not line.startswith(('"', "'")):
                code.append(line)
        if min(len(comments), len(code)) >= n // 2:
            break
    texts = comments[: n // 2] + code[: n // 2]
    labels = [1] * (n // 2) + [0] * (n // 2)
    return Dataset.from_dict({"text": texts, "label": labels}).shuffle(seed=0)


def model_path(model_name: str = "") -> str:
    """``model_name`` (a local ``save_pretrained`` directory), or, when empty, a tiny
    BERT classifier with a word-level tokenizer over :func:`local_texts`, seeded,
    written once to ``$SKY_FLOWER_CACHE`` (default ``~/.cache/sky-flower``)."""
    if model_name:
        return model_name
    root = Path(os.environ.get("SKY_FLOWER_CACHE", Path.home() / ".cache" / "sky-flower"))
    path = root / "tiny-bert-comments"
    if (path / "config.json").exists():
        return str(path)
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    words: dict[str, int] = {}
    for text in local_texts()["text"]:
        for w in re.findall(r"\w+|[^\w\s]", text.lower()):
            words[w] = words.get(w, 0) + 1
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    common = sorted(words, key=lambda w: (-words[w], w))[:2000]
    vocab = {w: i for i, w in enumerate(special + common)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        do_lower_case=True,
        model_input_names=["input_ids", "attention_mask"],
    )
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=2,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = BertForSequenceClassification(config)
    tmp = root / f".tiny-bert-comments-{os.getpid()}"
    fast.save_pretrained(tmp)
    model.save_pretrained(tmp)
    try:
        tmp.rename(path)  # atomic: nodes building it at once keep the first
    except OSError:
        pass
    return str(path)


def load_data(
    partition_id: int, num_partitions: int, model_name: str
) -> tuple[DataLoader[Any], DataLoader[Any]]:
    """Load the local texts (training and eval)"""
    # Only initialize the partitioner once
    global fds
    if fds is None:
        # Partition the local data set into N partitions
        fds = IidPartitioner(num_partitions=num_partitions)
        fds.dataset = local_texts().train_test_split(test_size=0.2, seed=0)["train"]
    partition = fds.load_partition(partition_id)
    # Divide data: 80% train, 20% test
    partition_train_test = partition.train_test_split(test_size=0.2, seed=42)

    tokenizer = AutoTokenizer.from_pretrained(model_path(model_name), model_max_length=MAX_LENGTH)

    def tokenize_function(examples):
        return tokenizer(examples["text"], truncation=True, add_special_tokens=True)

    partition_train_test = partition_train_test.map(tokenize_function, batched=True)
    partition_train_test = partition_train_test.remove_columns("text")
    partition_train_test = partition_train_test.rename_column("label", "labels")

    data_collator = DataCollatorWithPadding(tokenizer=tokenizer)
    trainloader = DataLoader(
        partition_train_test["train"],
        shuffle=True,
        batch_size=32,
        collate_fn=data_collator,
    )

    testloader = DataLoader(partition_train_test["test"], batch_size=32, collate_fn=data_collator)

    return trainloader, testloader


def get_model(model_name):
    return AutoModelForSequenceClassification.from_pretrained(model_path(model_name), num_labels=2)


def train(net, trainloader, epochs, device) -> float:
    optimizer = AdamW(net.parameters(), lr=5e-4)
    net.to(device)
    net.train()
    losses = []
    for _ in range(epochs):
        for batch in trainloader:
            batch = {k: v.to(device) for k, v in batch.items()}
            outputs = net(**batch)
            loss = outputs.loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return sum(losses) / len(losses)


def test(net, testloader, device) -> tuple[Any | float, Any]:
    loss, correct = 0.0, 0
    net.to(device)
    net.eval()
    for batch in testloader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.no_grad():
            outputs = net(**batch)
        logits = outputs.logits
        loss += outputs.loss.item() * len(batch["labels"])
        correct += (torch.argmax(logits, dim=-1) == batch["labels"]).sum().item()
    loss /= len(testloader.dataset)
    accuracy = correct / len(testloader.dataset)
    return loss, accuracy
