"""pytorchexample: A Flower / PyTorch app.

Flower's ``examples/quickstart-pytorch`` task as Flower writes it (its ``Net``, its
``load_data`` over a ``flwr_datasets`` partition with lazy per-batch transforms, its
train / test loops), on local data in CIFAR-10's format instead of a download:
scikit-learn's digits drawn as 32x32 RGB images (``img``, ``label``), and the
transform written with torch instead of torchvision's ``ToTensor`` / ``Normalize``.
"""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from datasets import ClassLabel, Dataset, Features, Image
from flwr_datasets.partitioner import IidPartitioner
from PIL import Image as PILImage
from torch.utils.data import DataLoader


class Net(nn.Module):
    """Model (simple CNN adapted from 'PyTorch: A 60 Minute Blitz')"""

    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def local_images(n: int | None = None) -> Dataset:
    """scikit-learn's digits as a CIFAR-10-shaped ``datasets.Dataset``: ``img`` a 32x32
    RGB PIL image (each 8x8 digit scaled 4x, tinted by its index), ``label`` 0-9."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    pixels = (bunch.images[:n] / 16.0 * 255).astype(np.uint8).repeat(4, 1).repeat(4, 2)
    tint = np.random.default_rng(0).uniform(0.5, 1.0, size=(len(pixels), 1, 1, 3))
    rgb = (pixels[..., None] * tint).astype(np.uint8)
    features = Features({"img": Image(), "label": ClassLabel(num_classes=10)})
    imgs = [PILImage.fromarray(a) for a in rgb]
    return Dataset.from_dict({"img": imgs, "label": bunch.target[:n].tolist()}, features)


fds = None  # Cache the partitioner over the local data set


def pytorch_transforms(img):
    """torchvision's ``Compose([ToTensor(), Normalize((0.5,) * 3, (0.5,) * 3)])``."""
    x = torch.from_numpy(np.array(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return (x - 0.5) / 0.5


def apply_transforms(batch):
    """Apply transforms to the partition from FederatedDataset."""
    batch["img"] = [pytorch_transforms(img) for img in batch["img"]]
    return batch


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    """Load partition of the local data."""
    # Only initialize the partitioner once
    global fds
    if fds is None:
        fds = IidPartitioner(num_partitions=num_partitions)
        fds.dataset = local_images().train_test_split(test_size=0.2, seed=0)["train"]
    partition = fds.load_partition(partition_id)
    # Divide data on each node: 80% train, 20% test
    partition_train_test = partition.train_test_split(test_size=0.2, seed=42)
    # Construct dataloaders
    partition_train_test = partition_train_test.with_transform(apply_transforms)
    trainloader = DataLoader(partition_train_test["train"], batch_size=batch_size, shuffle=True)
    testloader = DataLoader(partition_train_test["test"], batch_size=batch_size)
    return trainloader, testloader


def load_centralized_dataset():
    """Load test set and return dataloader."""
    test_dataset = local_images().train_test_split(test_size=0.2, seed=0)["test"]
    dataset = test_dataset.with_transform(apply_transforms)
    return DataLoader(dataset, batch_size=128)


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)  # move model to GPU if available
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    avg_trainloss = running_loss / (epochs * len(trainloader))
    return avg_trainloss


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    net.eval()
    with torch.no_grad():
        for batch in testloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy
