"""The on-device dataset: batch augmentation keeps images and labels aligned and is a pure
function of (seed, epoch, sample index): not of the batch a sample lands in."""

import torch

from engine.data.device import DeviceLoader
from engine.data.sampler import GlobalBatchSampler, plan_batches
from engine.vision.device import DeviceImages

N = 64


def labelled_images(translate=0, flip="random") -> DeviceImages:
    """Each image encodes its label (in channel 0, everywhere) and its index (channel 1), and
    is asymmetric left/right (channel 2 ramps), so a flip is visible."""
    labels = torch.arange(N) % 10
    images = torch.zeros(N, 3, 8, 8, dtype=torch.uint8)
    images[:, 0] = (labels * 20).view(-1, 1, 1).to(torch.uint8)
    images[:, 1] = torch.arange(N).view(-1, 1, 1).to(torch.uint8)
    images[:, 2] = torch.arange(8).view(1, 1, 8).to(torch.uint8) * 30
    return DeviceImages(images, labels, (0, 0, 0), (1 / 255, 1 / 255, 1 / 255), flip, translate)


def test_augmented_images_stay_with_their_labels():
    data = labelled_images(translate=2)
    index = torch.randperm(N)
    x, y = data.batch(index, seed=3, epoch=1)
    assert torch.equal(x[:, 0, 4, 4], (y * 20).float())  # reflect padding keeps the channel
    assert torch.equal(x[:, 1, 4, 4], index.float())


def test_a_sample_is_augmented_alike_in_any_batch():
    data = labelled_images(translate=2)
    whole, _ = data.batch(torch.arange(N), seed=3, epoch=1)
    order = torch.randperm(N)
    shuffled, _ = data.batch(order, seed=3, epoch=1)
    assert torch.equal(shuffled, whole[order])
    other_epoch, _ = data.batch(torch.arange(N), seed=3, epoch=2)
    other_seed, _ = data.batch(torch.arange(N), seed=4, epoch=1)
    assert not torch.equal(other_epoch, whole) and not torch.equal(other_seed, whole)


def test_translate_shifts_within_the_padding_and_varies_per_sample():
    data = labelled_images(translate=2, flip="none")
    x, _ = data.batch(torch.arange(N), seed=0, epoch=0)
    plain, _ = data.batch(torch.arange(N))
    shifts = {int(x[i, 2, 0, 4] - plain[i, 2, 0, 4]) // 30 for i in range(N)}
    assert shifts == {-2, -1, 0, 1, 2}


def test_alternating_flip_mirrors_every_sample_on_every_other_epoch():
    data = labelled_images(flip="alternate")
    mirrored = [data.batch(torch.arange(N), 5, e)[0][:, 2, 0, 0] > 0 for e in range(3)]
    assert torch.equal(mirrored[0], mirrored[2]) and torch.equal(mirrored[1], ~mirrored[0])
    assert 0 < int(mirrored[0].sum()) < N  # the first orientation is random per sample


def test_device_loader_serves_the_sampler_order_with_aligned_labels():
    data = labelled_images(translate=1)
    sampler = GlobalBatchSampler(N, plan_batches(16, 8, 1), 0, seed=9)
    sampler.set_epoch(1)
    batches = list(DeviceLoader(data, sampler, train=True))
    assert len(batches) == len(sampler) == 8
    keys = [k[0] for mb in sampler for k in mb]
    assert torch.cat([b.index for b in batches]).tolist() == keys
    assert all(torch.equal(b.x[:, 0, 2, 2], (b.y * 20).float()) for b in batches)
