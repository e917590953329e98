"""nn.DataParallel's behaviour, as notebook 08's table states it (section 1): an ordinary model uses one device, the
batch is cut like torch.chunk (fewer pieces than GPUs for a small batch), what forward sets on a replica is lost, a
replica has no parameters() ("StopIteration in replica 0"), and a loss computed in forward comes back one per GPU,
whose plain mean is the batch's only for equal pieces. On the CPU the four steps of DataParallel's forward are played
by hand (torch.chunk to scatter, copy.deepcopy to replicate); with two GPUs or more the real DataParallel must agree.
"""

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.memory import peak_memory
from helpers.models import MLP
from helpers.workers.common import gradient_batch, mlp

GPUS = torch.cuda.device_count()
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason="the real DataParallel needs 2 GPUs or more")


class LossInForward(nn.Sequential):
    """Its layers, then the mean loss of the piece it got (a loss computed in forward); notes the rows on self."""

    def forward(self, x, y):
        self.rows_seen = len(x)  # set on whichever copy runs: a replica's is thrown away with the replica
        return F.cross_entropy(super().forward(x), y)


def data_parallel_by_hand(module: nn.Module, x: torch.Tensor, y: torch.Tensor, n_devices: int):
    """DataParallel's forward on the CPU: chunk the batch, a fresh replica per piece, gather the losses."""
    pieces = list(zip(x.chunk(n_devices), y.chunk(n_devices)))  # 1. scatter: fewer pieces for a small batch
    replicas = [copy.deepcopy(module) for _ in pieces]  # 2. replicate, as many as pieces
    losses = [replica(*piece) for replica, piece in zip(replicas, pieces)]  # 3. parallel_apply (threads on GPUs)
    return torch.stack(losses), [replica.rows_seen for replica in replicas]  # 4. gather: one loss per piece


def _cases(n_devices: int) -> list[int]:
    """Row counts: fewer than the devices, odd above them (unequal pieces), and two per device (equal pieces)."""
    return [n_devices - 1, n_devices + 1 + n_devices % 2, 2 * n_devices]


class FindsItsDevice(nn.Linear):
    def forward(self, x):
        return super().forward(x.to(next(self.parameters()).device))  # its first parameter's device


def test_an_ordinary_model_keeps_its_parameters_and_gradients_on_one_device():
    """Having several GPUs is not using them: one step of a plain model touches only the device it was moved to."""
    device = torch.device("cuda", 0) if GPUS else torch.device("cpu")
    model = MLP(64, (64,), 10).to(device)
    inputs, targets = torch.randn(32, 1, 8, 8, device=device), torch.zeros(32, dtype=torch.long, device=device)
    F.cross_entropy(model(inputs), targets).backward()
    used = {tensor.device for p in model.parameters() for tensor in (p, p.grad)}
    assert used == {device}
    assert not any(torch.cuda.memory_allocated(index) for index in range(1, GPUS))  # GPUs 1, 2, ... held nothing


@pytest.mark.parametrize("n_devices", [2, 3, 4])
def test_a_batch_with_fewer_rows_than_devices_is_cut_into_fewer_pieces(n_devices):
    """torch.chunk makes pieces of ceil(rows / devices) rows: 5 rows on 4 devices are 2 + 2 + 1, three pieces."""
    assert [len(piece) for piece in torch.arange(5).chunk(4)] == [2, 2, 1]
    net = LossInForward(mlp(0, (64,)))
    x, y = gradient_batch(0, 2 * n_devices)
    with torch.no_grad():
        losses, seen = data_parallel_by_hand(net, x[: n_devices - 1], y[: n_devices - 1], n_devices)
    assert len(losses) == len(seen) == n_devices - 1 < n_devices and seen == [1] * (n_devices - 1)


@pytest.mark.parametrize("n_devices", [2, 3, 4])
@pytest.mark.parametrize("seed", [0, 2**32 - 1])
def test_a_loss_in_forward_comes_back_per_piece_and_only_a_rows_weighted_mean_is_the_batch_s(n_devices, seed):
    """The remedy of "Pytorch使用GPU进行训练注意事项" for GPU 0's memory, the loss inside forward: each GPU returns its
    piece's mean, so a plain mean of them is the batch's loss only when the pieces are equal; weighting by rows always is."""
    net = LossInForward(mlp(seed, (64,)))
    x, y = gradient_batch(seed, 2 * n_devices)
    with torch.no_grad():
        for n in _cases(n_devices):
            losses, seen = data_parallel_by_hand(net, x[:n], y[:n], n_devices)
            full = F.cross_entropy(net[0](x[:n]), y[:n])  # the loss on the gathered outputs
            assert sum(seen) == n and len(losses) == len(seen) <= n_devices
            torch.testing.assert_close((losses * torch.tensor(seen)).sum() / n, full)
            equal = len(set(seen)) == 1
            plain_mean_right = bool(torch.isclose(losses.mean(), full, rtol=1e-6))
            assert plain_mean_right == equal or float(losses.max() - losses.min()) < 1e-4
    uneven = _cases(n_devices)[1]
    assert len(set(data_parallel_by_hand(net, x[:uneven], y[:uneven], n_devices)[1])) > 1  # the case is there


def test_what_forward_sets_on_a_replica_is_lost_with_the_replica():
    """replicate() makes each step's replicas with Module._replicate_for_data_parallel (runs on the CPU too): a new
    object with a copy of the module's __dict__, so an attribute forward sets lands on the replica alone."""
    net = LossInForward(mlp(0, (64,)))
    x, y = gradient_batch(0, 6)
    replica = net._replicate_for_data_parallel()
    with torch.no_grad():
        torch.testing.assert_close(replica(x, y), F.cross_entropy(net[0](x), y))  # it runs the module's layers
    assert replica.rows_seen == 6  # the replica set it
    assert not hasattr(net, "rows_seen")  # the wrapped module never did


@pytest.mark.skipif(GPUS > 0, reason="checks DataParallel without a GPU")
def test_without_a_gpu_data_parallel_just_calls_the_module_so_its_attribute_sticks():
    """No replicas without two GPUs: the attribute bug hides until there are."""
    net = LossInForward(mlp(0, (64,)))
    x, y = gradient_batch(0, 6)
    wrapped = nn.DataParallel(net)
    with torch.no_grad():
        assert torch.equal(wrapped(x, y), net(x, y))
    assert wrapped.device_ids == [] and net.rows_seen == len(x)


def test_a_replica_has_no_registered_parameters_so_next_parameters_raises_stop_iteration():
    """Since PyTorch 1.5 a replica's weights are plain attributes (Module._replicate_for_data_parallel sets
    _parameters = {}): the "StopIteration: Caught StopIteration in replica 0" of a forward that asks them."""
    layer = FindsItsDevice(64, 10)
    replica = layer._replicate_for_data_parallel()  # what replicate() makes of a module, every step
    assert len(list(layer.parameters())) == 2 and not list(replica.parameters())
    with pytest.raises(StopIteration):
        replica(torch.randn(4, 64))
    assert layer(torch.randn(4, 64)).shape == (4, 10)  # the module itself finds its device


def test_data_parallel_s_own_docstring_recommends_ddp_even_on_one_node():
    doc = " ".join((nn.DataParallel.__doc__ or "").split())
    assert "recommended to use" in doc and "DistributedDataParallel" in doc
    assert "even if there is only a single node" in doc


@needs_two_gpus
def test_data_parallel_splits_the_rows_over_the_gpus_and_gpu0_peaks_highest():
    """8192 rows with 4096 outputs each: the gathered output makes GPU 0 the busiest."""
    calls = []  # the replicas share the model's hooks and this list: each appends (its device, the rows it got)
    wide = MLP(64, (1024,), 4096).to("cuda:0")
    wide.register_forward_pre_hook(lambda module, args: calls.append((str(args[0].device), len(args[0]))))
    inputs = torch.randn(8192, 1, 8, 8, device="cuda:0")
    targets = torch.randint(0, 4096, (8192,), device="cuda:0")
    with contextlib.ExitStack() as stack:
        peaks = [stack.enter_context(peak_memory(f"cuda:{index}")) for index in range(GPUS)]
        F.cross_entropy(nn.DataParallel(wide)(inputs), targets).backward()
    assert sum(rows for _, rows in calls) == 8192 and len({device for device, _ in calls}) == GPUS
    assert peaks[0].bytes > max(peak.bytes for peak in peaks[1:])


@needs_two_gpus
def test_data_parallel_and_data_parallel_function_give_the_hand_made_losses_on_output_device():
    net = LossInForward(mlp(0, (64,)))
    x, y = gradient_batch(0, 2 * GPUS)
    on_gpu, ids = copy.deepcopy(net).to("cuda:0"), list(range(GPUS))
    parallel = nn.DataParallel(on_gpu, device_ids=ids, output_device=GPUS - 1)
    with torch.no_grad():
        for n in _cases(GPUS):
            losses, _ = data_parallel_by_hand(net, x[:n], y[:n], GPUS)
            pair = (x[:n].cuda(), y[:n].cuda())
            for out in (parallel(*pair), nn.parallel.data_parallel(on_gpu, pair, ids, output_device=GPUS - 1)):
                assert out.device == torch.device("cuda", GPUS - 1)  # gathered on output_device
                torch.testing.assert_close(out.cpu(), losses, rtol=1e-4, atol=1e-5)  # one loss per GPU that ran
    assert not hasattr(on_gpu, "rows_seen")  # set on the replicas only


@needs_two_gpus
def test_the_real_data_parallel_raises_stop_iteration_in_a_replica():
    layer = FindsItsDevice(64, 10).cuda()
    with pytest.raises(StopIteration):
        nn.DataParallel(layer)(torch.randn(4, 64, device="cuda"))
