"""State offload (``ApexW(state_offload=True)``) on the Triton engine: the state lives in host memory and streams
through a few device buffers. On a GPU the buffers are CUDA memory and the copies run on side streams; on the CPU the
interpreter's kernels update CPU buffers, and the same bucket pipeline (order learning, prefetch, misprediction,
bounded slots, resume) runs with plain copies."""

import ctypes

import pytest
import torch

from apexw_hf.accounting import optimizer_state_placement
from apexw_hf.optim import ApexW, tied_offload
from apexw_hf.optim import base as optim_base
from apexw_hf.optim import offload as offload_mod

from ..optim.release_model import groups, make, train, train_from, train_tied_from
from .fake_streams import byte_range, record_streams
from .helpers import DEVICE

FORMATS = ["compact", "8bit", "4bit", "fp32"]


def _opt(model, fmt, offload, release, clip=None, bucket=300):
    kw = dict(gradient_release=True, release_bucket_size=bucket, max_grad_norm=clip) if release else {}
    return ApexW(groups(model), lr=2e-2, state_format=fmt, engine="triton", state_offload=offload, **kw)


PIECE = 1500  # bytes of state per launch in these tests: most tensors of the tiny model are cut into pieces


@pytest.fixture
def small_chunks(monkeypatch):
    """Launches of at most PIECE bytes of state under offload: several pieces per tensor of the tiny model."""
    monkeypatch.setattr(offload_mod, "PIECE_BYTES", PIECE)


def _pieces(off):
    return [piece for piece, _ in off._order]


def _same(a, b, oa, ob):
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for i, entry in sa["state"].items():
        for k, v in entry.items():
            w = sb["state"][i][k]
            assert v.dtype == w.dtype and torch.equal(v.cpu(), w.cpu()), (i, k)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", ["step", "release", "release_clipped"])
def test_offloaded_state_gives_the_same_bits(fmt, mode, small_chunks):
    release, clip = mode != "step", (0.05 if mode == "release_clipped" else None)
    a, b = make().to(DEVICE), make().to(DEVICE)
    oa, ob = _opt(a, fmt, False, release, clip), _opt(b, fmt, True, release, clip)
    train(a, oa, 4)
    train(b, ob, 4)
    _same(a, b, oa, ob)
    off = ob._offload
    # more launches per step than device buffers, so buffers were reused and later launches were prefetched; some
    # tensor's state went through in several pieces
    assert len(off._order) > len(off.slots) + 2
    cut = [id(p) for piece in _pieces(off) for p in piece.params]
    assert len(cut) > len(set(cut))
    assert off.hits > 0 and off.misses >= len(off._order)
    # every state tensor lives in host memory; the device holds the buffers only
    for entry in ob.state.values():
        for k, v in entry.items():
            assert v.device.type == "cpu", k
            assert k == "step" or v.is_pinned() == (DEVICE == "cuda")
    placement = optimizer_state_placement(ob)
    assert placement["host"] == ob.state_bytes() == oa.state_bytes()
    assert placement["device"] == ob.staging_bytes() > 0


def test_the_learned_order_prefetches_every_launch_after_the_first_step(small_chunks):
    for release in (False, True):
        model = make().to(DEVICE)
        opt = _opt(model, "8bit", True, release)
        train(model, opt, 1)
        off = opt._offload
        first, cuts = off.misses, off._cuts_version
        assert first == len(off._order) > len(off.slots)  # the first step knows no order: every launch copies in
        train(model, opt, 3)
        assert off.misses == first  # later steps: every launch found its state on the device
        assert off._cuts_version == cuts  # and its pieces: cut once (a new cut recomputes every piece's overlaps)
        assert off.hits == 3 * len(off._order)
        # the device holds `slots` buffers, each the size of the largest piece, which is at most PIECE bytes (one
        # work item of 256 elements takes 4 x 256 bytes of 8-bit state with alignment) though whole tensors hold more
        largest = max(piece.size for piece in _pieces(off))
        assert off.device_bytes() == len(off.slots) * largest
        assert largest <= PIECE
        sizes = [sum(s[k].numel() * s[k].element_size() for k in s if k != "step") for s in opt.state.values()]
        assert max(sizes) > PIECE


def test_a_changed_order_falls_back_to_copies_and_keeps_the_bits(small_chunks):
    """A block without a gradient in one step (frozen for a step): the buckets of that step differ from the learned
    order; the launches that were not prefetched copy their state in, and the bits are those without offload."""
    runs = []
    for offload in (False, True):
        model = make().to(DEVICE)
        opt = _opt(model, "4bit", offload, True)
        train(model, opt, 2)
        for p in model.blocks[0].parameters():
            p.requires_grad_(False)
        train_from(model, opt, 2)
        for p in model.blocks[0].parameters():
            p.requires_grad_(True)
        misses = opt._offload.misses if offload else 0
        train_from(model, opt, 3)
        train_from(model, opt, 4)
        runs.append((model, opt, misses))
    (a, oa, _), (b, ob, misses) = runs
    _same(a, b, oa, ob)
    assert ob._offload.misses > misses  # the step after the change did not match the learned order everywhere


@pytest.mark.parametrize("release", [False, True])
def test_resume_in_the_middle_is_exact(release, tmp_path, small_chunks):
    a = make().to(DEVICE)
    oa = _opt(a, "8bit", True, release, clip=0.5 if release else None)
    train(a, oa, 3)
    torch.save({"model": a.state_dict(), "opt": oa.state_dict()}, tmp_path / "ckpt.pt")
    for t in range(3, 5):
        train_from(a, oa, t)
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    for offload in (True, False):  # into an offloaded optimizer, and into one that keeps its state on the device
        b = make(seed=5).to(DEVICE)
        b.load_state_dict(saved["model"])
        ob = _opt(b, "8bit", offload, release, clip=0.5 if release else None)
        ob.load_state_dict(saved["opt"])
        if offload:
            assert all(v.device.type == "cpu" for e in ob.state.values() for v in e.values())
        for t in range(3, 5):
            train_from(b, ob, t)
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)


@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
def test_whole_tensors_move_in_one_copy_and_checkpoints_hold_only_the_state(fmt, tmp_path):
    """The host state of consecutive tensors lies as a piece lays it out in its slot: a piece of whole tensors is one
    copy each way. Each state tensor has a storage of its own (a saved state dict holds the state's bytes, not the
    host blocks'), and loading a state dict writes into the same host memory."""
    model = make().to(DEVICE)
    opt = _opt(model, fmt, True, True, bucket=10**9)  # one launch per param group, one piece each (64 MiB pieces)
    train(model, opt, 2)
    off = opt._offload
    pieces = _pieces(off)
    assert all(len(piece.ranges) > 3 for piece in pieces)
    assert all(len(copies) == 1 for piece in pieces for _, copies, _ in piece.copies.values())
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    size = (tmp_path / "opt.pt").stat().st_size
    assert size < 2 * opt.state_bytes() + 2**20 < offload_mod.ARENA_BYTES
    blocks = [b.data_ptr() for b in off._blocks]

    def addresses():
        return sorted(t.data_ptr() for e in opt.state.values() for k, t in e.items() if k != "step")

    before = addresses()
    opt.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    assert [b.data_ptr() for b in off._blocks] == blocks and addresses() == before
    train_from(model, opt, 2)  # and the next step reads what was loaded there
    assert all(len(copies) == 1 for piece in _pieces(off) for _, copies, _ in piece.copies.values())


def test_a_grown_device_buffer_is_not_kept_alive_by_cached_copies(monkeypatch):
    """The device buffers grow during the first step (pieces of 1 and 1.5 KiB here); a replaced buffer is referenced
    by nothing of the offload's, the pieces' cached copy views included, so the device memory it held is free again
    at once (not when each piece next passes through that buffer)."""
    monkeypatch.setattr(offload_mod, "PIECE_BYTES", 2500)
    model = make().to(DEVICE)
    opt = _opt(model, "8bit", True, True)
    train(model, opt, 1)
    off = opt._offload
    assert len({piece.size for piece in _pieces(off)}) > 1
    live = [s.buffer.data_ptr() for s in off.slots if s.buffer is not None]
    for piece in _pieces(off):
        for index, (base, copies, raw) in piece.copies.items():
            assert base == off.slots[index].buffer.data_ptr()
            assert all(dst.untyped_storage().data_ptr() in live for _, dst in copies)
            assert raw is None or [(h.data_ptr(), d.data_ptr(), d.numel()) for h, d in copies] == raw.triples


def test_export_and_dequantized_state_match_the_device_run():
    a, b = make().to(DEVICE), make().to(DEVICE)
    oa, ob = _opt(a, "4bit", False, True), _opt(b, "4bit", True, True)
    train(a, oa, 2)
    train(b, ob, 2)
    for p, q in zip(a.parameters(), b.parameters()):
        da, db = oa.dequantized_state(p), ob.dequantized_state(q)
        assert db["exp_avg"].device == q.device
        for k in da:
            assert torch.equal(da[k], db[k])
    ea, eb = oa.to_torch_adamw_state_dict(), ob.to_torch_adamw_state_dict()
    for i in ea["state"]:
        for k in ea["state"][i]:
            assert torch.equal(ea["state"][i][k].cpu(), eb["state"][i][k].cpu())


def test_errors_name_what_is_wrong(monkeypatch):
    model = make()
    with pytest.raises(TypeError, match="state_offload must be a bool"):
        ApexW(model.parameters(), state_offload="yes")
    with pytest.raises(ValueError, match="plain-PyTorch engine"):
        ApexW(model.parameters(), engine="torch", state_offload=True)
    with monkeypatch.context() as m:  # CPU parameters outside the interpreter (FSDP2's CPUOffloadPolicy shards too)
        m.setattr(optim_base, "_interpreted", lambda: False)
        with pytest.raises(ValueError, match=r"parameters on cpu \(FSDP2's CPUOffloadPolicy.*CUDA GPU"):
            ApexW(model.parameters(), engine="triton", state_offload=True)
    monkeypatch.setattr(offload_mod, "host_bytes_available", lambda: 1000)
    with pytest.raises(ValueError, match=r"needs 0\.00 GiB \(\d+ bytes\) of host memory .* has 0\.00 GiB available"):
        ApexW(model.to(DEVICE).parameters(), engine="triton", state_format="8bit", state_offload=True)


def test_piece_size_follows_the_state_unless_given():
    """By default a piece is 1/72 of the whole state within [32, 64] MiB, in three device buffers, or four where it is
    over 1.5 times the cap (8B shapes); offload_piece_mib sets the piece (three buffers); a bad value, or the option
    without state_offload, is refused naming what is allowed."""
    mib = 2**20
    layout = offload_mod.default_layout
    assert layout(0) == (32 * mib, 3)
    assert layout(72 * 40 * mib) == (40 * mib, 3)
    assert layout(10**12) == (64 * mib, 4)
    assert [layout(72 * n * mib)[1] for n in (1, 40, 64, 65, 96, 97)] == [3, 3, 3, 3, 3, 4]
    assert layout(6_500_000_000) == (64 * mib, 3)  # a 3B model's 8-bit state: 3 x 64 MiB
    assert layout(16 * 2**30) == (64 * mib, 4)  # an 8B model's 8-bit state: 4 x 64 MiB
    assert layout(8_400_000_000) == (64 * mib, 4)  # and its 4-bit state
    assert layout(3_400_000_000) == (3_400_000_000 // 72, 3)  # a 3B model's 4-bit state: 1/72 of it
    model = make().to(DEVICE)
    opt = ApexW(model.parameters(), engine="triton", state_format="4bit", state_offload=True)
    # a tiny model's state: the smallest default piece, three buffers
    assert (opt._offload.piece_bytes, len(opt._offload.slots)) == (32 * mib, 3)
    opt = ApexW(model.parameters(), engine="triton", state_format="4bit", state_offload=True, offload_piece_mib=3)
    assert (opt._offload.piece_bytes, len(opt._offload.slots)) == (3 * mib, 3)
    with pytest.MonkeyPatch.context() as mp:  # bounds the fp32 state of the tiny model (31 KB) exceeds 72 x 1.5 times
        mp.setattr(offload_mod, "MIN_PIECE_BYTES", 64)
        mp.setattr(offload_mod, "PIECE_BYTES", 128)
        opt = ApexW(model.parameters(), engine="triton", state_format="fp32", state_offload=True)
        assert (opt._offload.piece_bytes, len(opt._offload.slots)) == (128, 4)
    for bad in (0, True, 1.5, "8"):
        with pytest.raises(ValueError, match=r"offload_piece_mib must be an int >= 1 \(MiB\) or None"):
            ApexW(model.parameters(), engine="triton", state_offload=True, offload_piece_mib=bad)
    with pytest.raises(ValueError, match="offload_piece_mib is for state_offload=True"):
        ApexW(model.parameters(), engine="triton", offload_piece_mib=8)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_offload_names_through_the_trainer(tmp_path, accumulate):
    """optim="apexw_4bit_offload" (release + offload) trains as "apexw_4bit_release", and "apexw_4bit" with
    optim_args="state_offload=true" (no release, so gradient accumulation works) as "apexw_4bit"; the callback says
    where the state is."""
    pytest.importorskip("datasets")  # the tiny data set is a datasets.Dataset (not on every GPU image)
    from transformers import Trainer, TrainingArguments

    from apexw_hf.integrations.callbacks import OptimizerStateCallback

    from ..integrations.tiny import make_model, token_dataset, train_kwargs

    args = "engine=triton,release_bucket_size=4000" if accumulate == 1 else "engine=triton"
    if accumulate == 1:
        cells = [("apexw_4bit_release", args), ("apexw_4bit_offload", args)]
    else:
        cells = [("apexw_4bit", args), ("apexw_4bit", args + ",state_offload=true")]
    trainers = []
    for i, (name, optim_args) in enumerate(cells):
        kw = train_kwargs(tmp_path / str(i), optim=name, optim_args=optim_args, max_grad_norm=0.5, weight_decay=0.1,
                          gradient_accumulation_steps=accumulate, use_cpu=DEVICE == "cpu")
        trainer = Trainer(model=make_model(lora=False), args=TrainingArguments(**kw), train_dataset=token_dataset(),
                          callbacks=[OptimizerStateCallback()])
        trainer.train()
        trainers.append(trainer)
    a, b = (dict(t.model.named_parameters()) for t in trainers)
    assert all(torch.equal(a[n], b[n]) for n in a)
    opt = trainers[1].optimizer.optimizer
    assert opt.state_offload and opt.gradient_release == (accumulate == 1)
    logs = [h for h in trainers[1].state.log_history if "loss" in h]
    assert logs[-1]["state_offload"] == 1
    assert logs[-1]["optimizer_state_host_mib"] * 2**20 == opt.state_bytes()
    assert logs[-1]["optimizer_state_device_mib"] * 2**20 == opt.staging_bytes() > 0
    assert [h["loss"] for h in logs] == [h["loss"] for h in trainers[0].state.log_history if "loss" in h]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("release", [False, True])
def test_pieces_across_tensor_boundaries_give_the_same_bits(fmt, release, monkeypatch):
    """bf16 tensors of whole 256-element rows (the kernel's aligned word path) and pieces of several work items that
    end inside one tensor and start inside the next: each piece holds a tensor once, and the bits are those without
    offload (a piece that held two ranges of one tensor read the first range's state from the wrong place)."""
    # 9 to 40 work items by format; none a divisor of the first tensor's 64
    monkeypatch.setattr(offload_mod, "PIECE_BYTES", 12000 if fmt == "4bit" else 20000)
    sizes = (16384, 1024, 4096, 256)
    runs = []
    for offload in (False, True):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16, device=DEVICE)) for n in sizes]
        kw = dict(gradient_release=True, release_bucket_size=10**9, max_grad_norm=1.0) if release else {}
        opt = ApexW(ps, lr=1e-2, state_format=fmt, engine="triton", state_offload=offload, **kw)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            noise = [torch.randn(p.shape, generator=g).to(DEVICE) for p in ps]
            if release:
                sum((p.float() * n).sum() for p, n in zip(ps, noise)).backward()
            else:
                for p, n in zip(ps, noise):
                    p.grad = n.to(torch.bfloat16)
            opt.step()
            opt.zero_grad()
        runs.append((ps, opt))
    (a, _), (b, ob) = runs
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    pieces = _pieces(ob._offload)
    assert any(len({id(p) for p in piece.params}) > 1 for piece in pieces)  # some piece spans two tensors
    assert any(len(piece.params) == 1 and piece.programs[1] - piece.programs[0] > 1 for piece in pieces)
    for piece in pieces:
        assert len(piece.params) == len({id(p) for p in piece.params})


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_piece_holds_nearly_its_stated_bytes(fmt, monkeypatch):
    """A piece cut inside a tensor holds at most PIECE_BYTES and misses it by less than one work item's state and one
    range's rounding per state tensor, in every format (block scales are a few bytes per item: bounding an item by
    every tensor's share aligned on its own filled a 4-bit piece to about a third)."""
    monkeypatch.setattr(offload_mod, "PIECE_BYTES", 20000)
    p = torch.nn.Parameter(torch.randn(65536, device=DEVICE))
    opt = ApexW([p], lr=1e-2, state_format=fmt, engine="triton", state_offload=True)
    p.grad = torch.randn_like(p)
    opt.step()
    s, off = opt.state[p], opt._offload
    pieces = _pieces(off)
    per_item = off._cuts[pieces[0].cut][0].chunk_elements  # a work item's elements
    item = pad = 0
    for k in offload_mod._tensor_keys(s):
        u = 1 if s[k].numel() == p.numel() else p.numel() // s[k].numel()
        item += -(-per_item // u) * s[k].element_size()
        pad += s[k].element_size() + offload_mod.ALIGN
    assert len(pieces) > 1
    for piece in pieces[:-1]:
        assert 20000 - pad - item < piece.size <= 20000
    assert pieces[-1].size <= 20000


_ONE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
_ARRAYS = [ctypes.POINTER(ctypes.c_uint64)] * 2 + [ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t]
_ATTRS = [ctypes.POINTER(offload_mod._MemcpyAttributes), ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t]
_BATCH_13 = ctypes.CFUNCTYPE(ctypes.c_int, *_ARRAYS, *_ATTRS, ctypes.c_void_p)
_BATCH_12_8 = ctypes.CFUNCTYPE(ctypes.c_int, *_ARRAYS, *_ATTRS, ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p)
_VERSION = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))
# the driver copies' stand-ins: one copy per call, or a piece's copies in one batched call (CUDA 13's ABI, or 12.8's
# with its failure index)
DRIVERS = ["one", "batch_13", "batch_12.8"]


class _FakeDriver:
    """``libcuda.so.1`` on the CPU for :class:`offload._DriverCopies`: its copy functions as C function pointers
    (ctypes passes the arguments as it would to the driver) that record each copy on the stand-in stream of its
    handle, then do it at once (``ctypes.memmove``). ``abi``: one of DRIVERS (for "one", the driver has no batched
    copy: each is a ``cuMemcpyAsync``). ``calls``: the driver calls made; ``batches``: how many were batched."""

    def __init__(self, rec, streams, abi):
        self.rec, self.streams, self.calls, self.batches = rec, {s.cuda_stream: s for s in streams}, 0, 0
        self.cuMemcpyAsync = _ONE(self._one)
        if abi == "batch_13":
            self.cuMemcpyBatchAsync_v2 = _BATCH_13(lambda *a: self._batch(*a[:-1], None, a[-1]))
        elif abi == "batch_12.8":
            self.cuMemcpyBatchAsync = _BATCH_12_8(self._batch)
            self.cuDriverGetVersion = _VERSION(self._version)

    def _copy(self, dst, src, nbytes, stream):
        self.rec.op(self.streams[stream], "copy", reads=[(src, src + nbytes)], writes=[(dst, dst + nbytes)])
        ctypes.memmove(dst, src, nbytes)

    def _one(self, dst, src, nbytes, stream):
        self.calls += 1
        self._copy(dst, src, nbytes, stream)
        return 0

    def _batch(self, dsts, srcs, sizes, count, attrs, attr_starts, num_attrs, fail_index, stream):
        self.calls, self.batches = self.calls + 1, self.batches + 1
        assert count > 1 and num_attrs == 1 and attr_starts[0] == 0
        assert attrs[0].src_access_order == 1 and attrs[0].flags == 0  # in stream order, no hints
        for i in range(count):
            self._copy(dsts[i], srcs[i], sizes[i], stream)
        return 0

    @staticmethod
    def _version(out):
        out[0] = 12080
        return 0


def _streams_on_the_cpu(monkeypatch, rec, driver=None):
    """State offload on the CPU takes its CUDA path with the stand-in streams of ``rec``: side streams at binding, and
    each launch recorded on the compute stream as writing the bytes of its device buffer that hold its piece.
    ``driver`` (one of DRIVERS): the stagers' copies go through :class:`offload._DriverCopies` over a stand-in of the
    CUDA driver (:class:`_FakeDriver`), as on a GPU, instead of ``Tensor.copy_`` (None)."""
    bind, done = offload_mod.StateOffload._bind, offload_mod.StateOffload._done

    def bind_streams(self, device):
        first = self.device is None
        bind(self, device)
        if first:
            self._h2d, self._d2h = torch.cuda.Stream(device), torch.cuda.Stream(device)
            if driver:
                self._h2d.cuda_stream, self._d2h.cuda_stream = 1, 2
                lib = _FakeDriver(rec, [self._h2d, self._d2h], driver)
                self._raw = offload_mod._DriverCopies(lib)
                self._raw.lib = lib
                assert self._raw.batched == (driver != "one")

    def launched(self, slot, piece):
        base = slot.buffer.data_ptr()
        rec.op(rec.compute, "launch", writes=[(base, base + piece.size)], keep=(slot.buffer,))
        done(self, slot, piece)

    monkeypatch.setattr(offload_mod.StateOffload, "_bind", bind_streams)
    monkeypatch.setattr(offload_mod.StateOffload, "_done", launched)


@pytest.mark.skipif(DEVICE == "cuda", reason="CPU stand-ins for the streams (the CUDA tests run the real ones)")
@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
@pytest.mark.parametrize("release", [False, True])
@pytest.mark.parametrize("lookup", ["once", "each"])
@pytest.mark.parametrize("copier", ["copy_", *DRIVERS])
def test_copies_and_launches_wait_for_what_they_must_follow(fmt, release, lookup, copier, small_chunks, monkeypatch):
    """The events the offload records and waits for order every copy and launch after whatever they must follow on a
    GPU: a copy in after the launch and copy out of what its buffer held and after the copy out that last wrote its
    host state, a launch after its copy in, a copy out after its launch (``fake_streams``: on the CPU every copy runs
    when issued, so only this check sees the order a GPU would run them in). ``lookup``: the stager looks the compute
    stream up once and switches streams with ``set_stream`` ("once"), or, where the current device is another than the
    parameters', every switch goes through ``torch.cuda.stream`` ("each"), as the prefetch at a step's end does.
    ``copier``: the stagers' copies through ``Tensor.copy_`` or, as on a GPU, the CUDA driver (DRIVERS; then with no
    stream switch inside the stagers, and only where the current device is the parameters')."""
    with record_streams(monkeypatch) as rec:
        _streams_on_the_cpu(monkeypatch, rec, driver=None if copier == "copy_" else copier)
        switches = {"set_stream": 0, "stream": 0}
        set_stream, stream = torch.cuda.set_stream, torch.cuda.stream

        def counted(name, fn):
            def call(*a):
                switches[name] += 1
                return fn(*a)

            return call

        monkeypatch.setattr(torch.cuda, "set_stream", counted("set_stream", set_stream))
        monkeypatch.setattr(torch.cuda, "stream", counted("stream", stream))
        if lookup == "each":
            monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # not the parameters' (CPU: index None)
        a, b = make(), make()
        oa, ob = _opt(a, fmt, False, release), _opt(b, fmt, True, release)
        train(a, oa, 4)
        train(b, ob, 4)
        off = ob._offload
        assert off.hits > 0 and off.misses > 0 and rec.count("launch") == 4 * len(off._order)
        assert rec.count("copy") >= 2 * rec.count("launch")  # every piece in and out, at least one copy each
        assert rec.hazards() == []
        _same(a, b, oa, ob)
        driven = off._raw.lib.calls if copier != "copy_" else 0
        if lookup == "once":  # torch.cuda.stream only outside the stagers: the prefetch at each step's end
            assert switches["stream"] <= 4 * (len(ob._offload.slots) - 1)
            if copier == "one":
                assert switches["set_stream"] == 0 and driven >= 2 * rec.count("launch")
            elif copier != "copy_":  # a piece's copies each way in one call where it has several
                assert switches["set_stream"] == 0 and driven >= rec.count("launch") and off._raw.lib.batches > 0
            else:
                assert switches["set_stream"] > 0
        else:
            assert switches["set_stream"] == 0 and switches["stream"] > 0 and driven == 0


@pytest.mark.skipif(DEVICE == "cuda", reason="CPU stand-ins for the streams (the CUDA tests run the real ones)")
@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
@pytest.mark.parametrize("copier", ["copy_", *DRIVERS])
def test_a_changed_order_copies_in_after_the_other_cuts_copies_out(fmt, copier, small_chunks, monkeypatch):
    """A block frozen for a step (as in the test above) changes the buckets: that step's pieces overlap the learned
    order's pieces in other ways, and their copies in must follow the copies out of the other cuts' pieces that last
    wrote the same host state, wherever those went (without those waits this finds hazards)."""
    with record_streams(monkeypatch) as rec:
        _streams_on_the_cpu(monkeypatch, rec, driver=None if copier == "copy_" else copier)
        a, b = make(), make()
        # small buckets: a bucket of the changed step then takes pieces of several learned ones
        oa, ob = _opt(a, fmt, False, True, bucket=100), _opt(b, fmt, True, True, bucket=100)
        for model, opt in ((a, oa), (b, ob)):
            train(model, opt, 2)
            for t, frozen in ((2, False), (3, True), (4, False), (5, False)):
                for p in model.blocks[0].parameters():
                    p.requires_grad_(not frozen)
                train_from(model, opt, t)
        cuts = {piece.cut for pieces in ob._offload._cuts.values() for piece in pieces[1]}
        assert len(cuts) > len({piece.cut for piece in _pieces(ob._offload)})  # more than one step's cuts
        assert rec.hazards() == []
        assert any(len(ob._offload._overlapping(piece)) > 1 for piece in _pieces(ob._offload))
        _same(a, b, oa, ob)


@pytest.mark.skipif(DEVICE == "cuda", reason="CPU stand-ins for the streams")
def test_the_order_check_sees_a_copy_in_that_waits_for_no_copy_out(small_chunks, monkeypatch):
    """The check above can fail: copies in that skip their waits for copies out overwrite a buffer (or read host
    state) that a copy out may not have finished with."""
    with record_streams(monkeypatch) as rec:
        _streams_on_the_cpu(monkeypatch, rec)
        model = make()
        opt = _opt(model, "8bit", True, True)
        train(model, opt, 1)
        off = opt._offload
        wait = off._h2d.wait_event

        def skip_copies_out(event):
            if rec.ops[event.op].stream != off._d2h.name:
                wait(event)

        off._h2d.wait_event = skip_copies_out
        train(model, opt, 2)
    found = {(a.stream, b.stream) for a, b in rec.hazards()}
    # a copy out, then a copy in over its bytes, and so the launch after that copy in
    assert found == {(off._d2h.name, off._h2d.name), (off._d2h.name, "compute"), ("compute", off._h2d.name)}


def _tied_on_the_cpu(monkeypatch, rec):
    """The tied weight's gradient part offloaded from CPU gradients, made on the compute stream by the output layer's
    backward and used there by the step (both recorded), its copies in chunks of 96 bytes."""
    monkeypatch.setattr(tied_offload, "_offloadable", lambda t: t.is_contiguous())
    monkeypatch.setattr(offload_mod, "SIDE_CHUNK_BYTES", 96)
    monkeypatch.setattr(offload_mod, "SIDE_FIRST_BYTES", {"out": 192, "in": 96})
    copy_out, take = tied_offload.TiedGradOffload._copy_out, tied_offload.TiedGradOffload.take

    def made(self, p, g, transposed):
        rec.op(rec.compute, "part", writes=[byte_range(g)], keep=(g,))
        copy_out(self, p, g, transposed)

    def used(self, p):
        part = take(self, p)
        if part is not None:
            rec.op(rec.compute, "use", reads=[byte_range(part)], keep=(part,))
        return part

    monkeypatch.setattr(tied_offload.TiedGradOffload, "_copy_out", made)
    monkeypatch.setattr(tied_offload.TiedGradOffload, "take", used)


@pytest.mark.skipif(DEVICE == "cuda", reason="CPU stand-ins for the streams")
@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
def test_tied_part_goes_in_chunks_beside_the_state_and_waits_for_what_it_must_follow(fmt, small_chunks, monkeypatch):
    """With state offload the tied weight's part goes out and back in chunks on the state's copy streams, between the
    pieces' copies: each chunk out after the part is made, each chunk back after the last chunk out and before the
    part is used, none over memory a piece's copy or launch uses unordered; the same bits as ordinary steps."""
    with record_streams(monkeypatch) as rec:
        _streams_on_the_cpu(monkeypatch, rec)
        _tied_on_the_cpu(monkeypatch, rec)
        a, b = make(), make()
        oa = _opt(a, fmt, False, True)
        ob = ApexW(
            groups(b), lr=2e-2, state_format=fmt, engine="triton", state_offload=True, gradient_release=True,
            release_bucket_size=300, tied_grad_offload=True,
        )
        for t in range(4):
            train_from(a, oa, t)
            train_tied_from(b, ob, t)
        off, tied = ob._offload, ob._release.offload
        host = byte_range(tied._host[id(b.emb.weight)])
        def on_host(o):
            return any(host[0] <= r0 and r1 <= host[1] for r0, r1 in o.writes + o.reads)

        chunks = [(j, o) for j, o in enumerate(rec.ops) if o.name == "copy" and on_host(o)]
        part = b.emb.weight.numel() * b.emb.weight.element_size()
        # steps 2-4 (the first runs before the offload has streams): out and back, in chunks of 96 bytes
        assert len(chunks) == 3 * 2 * -(-part // 96)
        assert {o.stream for _, o in chunks} == {off._d2h.name, off._h2d.name}
        first, last = chunks[0][0], chunks[-1][0]
        pieces = [o for o in rec.ops[first:last] if o.name == "copy" and not on_host(o)]
        assert {o.stream for o in pieces} == {off._d2h.name, off._h2d.name}  # the pieces' copies went between them
        assert rec.count("part") == 4 and rec.count("use") == 4
        assert rec.hazards() == []
        _same(a, b, oa, ob)


@pytest.mark.skipif(DEVICE == "cuda", reason="CPU stand-ins for the streams")
def test_the_order_check_sees_a_tied_chunk_that_waits_for_no_part(small_chunks, monkeypatch):
    """The check above can fail: chunks out issued when the part is queued that do not wait for the compute stream read
    the part before it is made (the chunks issued later follow a piece's launch, which follows the part)."""
    with record_streams(monkeypatch) as rec:
        _streams_on_the_cpu(monkeypatch, rec)
        _tied_on_the_cpu(monkeypatch, rec)
        model = make()
        opt = ApexW(
            groups(model), lr=2e-2, state_format="8bit", engine="triton", state_offload=True, gradient_release=True,
            release_bucket_size=300, tied_grad_offload=True,
        )
        train_tied_from(model, opt, 0)
        pump = offload_mod.StateOffload._pump

        def no_wait(self, direction, nbytes, until=None, current=None):
            for job in self._side["out"]:
                job.after = []
            pump(self, direction, nbytes, until, current)

        monkeypatch.setattr(offload_mod.StateOffload, "_pump", no_wait)
        train_tied_from(model, opt, 1)
    assert ("compute", opt._offload._d2h.name) in {(a.stream, b.stream) for a, b in rec.hazards()}
