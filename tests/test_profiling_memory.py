"""lmloss.profiling.peak_memory on CPU: an exact, deterministic count of live tensor bytes inside a block."""

from __future__ import annotations

import torch

from lmloss.profiling import peak_memory

MiB = 1024**2


def test_peak_is_the_largest_sum_of_live_tensors_created_in_the_block():
    with peak_memory() as mem:
        a = torch.empty(MiB // 4)  # 1 MiB
        b = torch.empty(MiB // 2)  # 2 MiB  -> 3 MiB live
        del a  # 2 MiB live
        c = torch.empty(MiB // 8)  # 0.5 MiB -> 2.5 MiB live
        del b, c
        d = torch.empty(MiB // 4, dtype=torch.float64)  # 2 MiB
        del d
    assert mem.peak_bytes == 3 * MiB
    assert mem.peak_mib == 3.0


def test_views_of_a_tensor_created_in_the_block_are_counted_once():
    with peak_memory() as mem:
        a = torch.empty(256, 1024)  # 1 MiB
        views = [a[:10], a.view(-1), a.t(), a.reshape(1024, 256), a[::2], a.unsqueeze(0)]
        b = torch.empty(256, 256)  # 0.25 MiB
        del views, a, b
    assert mem.peak_bytes == MiB + MiB // 4


def test_in_place_ops_on_a_tensor_created_in_the_block_add_nothing():
    with peak_memory() as mem:
        a = torch.zeros(256, 1024)
        a.add_(1).mul_(3).exp_()
        a[:5].fill_(2.0)
    assert mem.peak_bytes == MiB


def test_tensors_live_before_the_block_are_not_counted():
    before = torch.empty(512, 1024)  # 2 MiB, untouched inside
    with peak_memory() as mem:
        x = torch.empty(128, 1024)  # 0.5 MiB
        del x
    assert before.numel() > 0
    assert mem.peak_bytes == MiB // 2


def test_views_and_in_place_ops_of_a_tensor_live_before_the_block_are_not_counted():
    before = torch.zeros(512, 1024)  # 2 MiB
    with peak_memory() as mem:
        flat = before.view(-1)
        before.add_(1)
        y = torch.empty(128, 1024)  # 0.5 MiB: the only allocation in the block
        del flat, y
    assert mem.peak_bytes == MiB // 2


def test_out_argument_into_a_preallocated_tensor_adds_nothing():
    out = torch.empty(256, 1024)
    a = torch.ones(256, 1024)
    with peak_memory() as mem:
        torch.add(a, 1.0, out=out)
        torch.exp(a[:10], out=out[:10])
    assert mem.peak_bytes == 0


def test_out_argument_that_resizes_an_empty_tensor_is_counted():
    with peak_memory() as mem:
        out = torch.empty(0)
        torch.add(torch.ones(256, 1024), 1.0, out=out)  # input 1 MiB + out resized to 1 MiB
    assert out.shape == (256, 1024)
    assert mem.peak_bytes == 2 * MiB


def test_autograd_buffers_are_counted_and_freed():
    w = torch.randn(256, 1024, requires_grad=True)  # 1 MiB, before the block
    with peak_memory() as mem:
        y = (w * 2).sum()  # the 1 MiB product is freed once summed (w * 2 saves no tensor)
        y.backward()  # w.grad: 1 MiB, allocated after the product is gone
    assert w.grad is not None
    assert MiB <= mem.peak_bytes <= MiB + 64


def test_saved_activations_stay_counted_until_backward():
    w = torch.randn(256, 1024, requires_grad=True)  # 1 MiB, before the block
    with peak_memory() as mem:
        y = (w.exp() * 3).sum()  # exp's output is saved for backward: 1 MiB, then the product 1 MiB
        y.backward()  # exp saved (1 MiB) + grad of the product (1 MiB) + w.grad (1 MiB)
    assert 3 * MiB <= mem.peak_bytes <= 3 * MiB + 64


def test_peak_is_repeatable_run_to_run():
    def work():
        x = torch.randn(300, 700)
        return torch.log_softmax(x, -1).exp().sum()

    peaks = []
    for _ in range(3):
        with peak_memory() as mem:
            work()
        peaks.append(mem.peak_bytes)
    assert peaks[0] > 0
    assert peaks == [peaks[0]] * 3


def test_record_lists_the_storages_alive_at_the_peak_largest_first():
    with peak_memory(record=True, min_bytes=MiB) as mem:
        small = torch.empty(1024)  # below min_bytes: counted, not listed
        big = torch.empty(1024, 1024)  # 4 MiB
        mid = torch.zeros(512, 1024, dtype=torch.float16)  # 1 MiB
        del big, mid, small
        late = torch.empty(256, 1024)  # 1 MiB, after the peak
        del late
    assert mem.peak_bytes == 5 * MiB + 4096
    sizes = [(a.nbytes, a.shape, a.dtype) for a in mem.allocations]
    assert sizes == [(4 * MiB, (1024, 1024), "torch.float32"), (MiB, (512, 1024), "torch.float16")]
    assert all(__file__.rsplit("/", 1)[-1] in a.site for a in mem.allocations)


def test_record_is_off_by_default():
    with peak_memory() as mem:
        x = torch.empty(1024, 1024)
        del x
    assert mem.peak_bytes == 4 * MiB
    assert mem.allocations == []
