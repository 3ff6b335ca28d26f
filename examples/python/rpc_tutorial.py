"""PyTorch's "Distributed Pipeline Parallelism Using RPC" tutorial, on actorpipe.

The tutorial cuts ResNet-50 into two shards, each an RPC worker holding an nn.Sequential under a
lock, splits every batch of 120 random 3x128x128 images into micro-batches, and trains with MSE
against one-hot labels, DistributedOptimizer(SGD, lr=0.05), for split sizes 1-8. Here the two
shards are one nn.Sequential cut at the same place (partition="cut:6"), the workers are actorpipe's
stage actors, and the loop is unchanged but for the lines docs/python.md lists:

    python3 examples/python/rpc_tutorial.py              # the tutorial's scenario
    python3 examples/python/rpc_tutorial.py --batch-size 8 --image-size 32 --batches 1 --splits 2
"""
import argparse
import time

import torch
import torch.nn as nn

import actorpipe

num_classes = 1000


def conv1x1(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class Bottleneck(nn.Module):
    """torchvision.models.resnet.Bottleneck (the tutorial imports it; copied to need no
    torchvision)."""
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample if downsample is not None else nn.Identity()

    def forward(self, x):
        identity = self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNetBase:
    """The tutorial's ResNetBase: builds the layers of both shards."""

    def __init__(self, block=Bottleneck, inplanes=64):
        self._block = block
        self.inplanes = inplanes

    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes * self._block.expansion:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * self._block.expansion, stride),
                                       nn.BatchNorm2d(planes * self._block.expansion))
        layers = [self._block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * self._block.expansion
        layers += [self._block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)


def resnet50_in_one_sequential():
    """ResNetShard1's seq, then ResNetShard2's seq and fc: the tutorial's two shards in order."""
    base = ResNetBase()
    shard1 = [nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64),
              nn.ReLU(inplace=True), nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
              base._make_layer(64, 3), base._make_layer(128, 4, stride=2)]
    shard2 = [base._make_layer(256, 6, stride=2), base._make_layer(512, 3, stride=2),
              nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(512 * Bottleneck.expansion,
                                                                      num_classes)]
    return nn.Sequential(*shard1, *shard2), len(shard1)


def run_master(split_size, batch_size, image_w, image_h, num_batches):
    # Was: model = DistResNet50(split_size, ["worker1", "worker2"]); loss_fn = nn.MSELoss();
    #      opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.05)
    seq, cut = resnet50_in_one_sequential()
    model = actorpipe.Pipeline(torch.jit.script(seq), stages=2, partition=f"cut:{cut}",
                               microbatches=-(-batch_size // split_size), loss="mse",
                               optimizer=("sgd", {"lr": 0.05}))
    one_hot_indices = torch.LongTensor(batch_size).random_(0, num_classes).view(batch_size, 1)
    losses = []
    for i in range(num_batches):
        print(f"Processing batch {i}")
        inputs = torch.randn(batch_size, 3, image_w, image_h)
        labels = torch.zeros(batch_size, num_classes).scatter_(1, one_hot_indices, 1)
        # Was: with dist_autograd.context() as context_id: outputs = model(inputs);
        #      dist_autograd.backward(context_id, [loss_fn(outputs, labels)]); opt.step(context_id)
        losses.append(model.train_step(inputs, labels))
    model.close()
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=120)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--splits", default="1,2,4,8", help="split sizes (samples per micro-batch)")
    args = parser.parse_args()
    torch.manual_seed(0)
    for num_split in [int(s) for s in args.splits.split(",")]:
        tik = time.time()
        losses = run_master(num_split, args.batch_size, args.image_size, args.image_size,
                            args.batches)
        tok = time.time()
        print(f"number of splits = {num_split}, execution time = {tok - tik}, "
              f"losses = {[round(l, 6) for l in losses]}")


if __name__ == "__main__":
    main()
