"""CPU mode for Megatron-Core, device resolution and the Transformer Engine / FP8 checks.

Every test that enables CPU mode does so through the ``cpu_mode_on`` fixture, which
disables it again (try/finally) because the rest of the suite runs in the same process.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from bebop_megatron.config import load_config
from bebop_megatron.model.builder import use_transformer_engine
from bebop_megatron.platform import cpu_mode, have_transformer_engine, resolve_device
from bebop_megatron.training.precision import INSTALL_HINT, check_fp8_available

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error paths")
needs_no_te = pytest.mark.skipif(have_transformer_engine(), reason="checks the missing-TE error paths")


def _owner(red):
    if red.module == "torch.Tensor":
        return torch.Tensor
    if red.module == "torch.nn.Module":
        return torch.nn.Module
    return importlib.import_module(red.module)


def _current_attrs() -> dict:
    return {(r.module, r.attr): getattr(_owner(r), r.attr) for r in cpu_mode.REDIRECTIONS}


@pytest.fixture
def cpu_mode_on():
    assert not cpu_mode.is_enabled(), "CPU mode leaked from an earlier test"
    cpu_mode.enable()
    try:
        yield
    finally:
        cpu_mode.disable()
    assert not cpu_mode.is_enabled()


def test_megatron_compatibility():
    # Fails when a Megatron-Core (or torch) upgrade moves or removes a patched attribute.
    assert cpu_mode.check_megatron_compatibility() == []


def test_every_redirection_has_a_one_line_reason():
    assert len(cpu_mode.REDIRECTIONS) > 0
    seen = set()
    for red in cpu_mode.REDIRECTIONS:
        assert isinstance(red.reason, str) and red.reason.strip(), red
        assert "\n" not in red.reason, red
        assert callable(red.make), red
        key = (red.module, red.attr)
        assert key not in seen, f"{key} redirected twice (disable() would restore the wrong original)"
        seen.add(key)


def test_enable_disable_restores_every_original_attribute():
    before = _current_attrs()
    cpu_mode.enable()
    try:
        assert cpu_mode.is_enabled()
        during = _current_attrs()
        for red in cpu_mode.REDIRECTIONS:
            key = (red.module, red.attr)
            # Patched, unless the replacement is the original itself (te_general_gemm is
            # already None when Transformer Engine is not installed).
            assert during[key] is not before[key] or red.make(before[key]) is before[key], key
        cpu_mode.enable()  # idempotent: a second enable must not save the patched values
        assert all(_current_attrs()[k] is during[k] for k in during)
    finally:
        cpu_mode.disable()
    assert not cpu_mode.is_enabled()
    after = _current_attrs()
    for key, original in before.items():
        assert after[key] is original, f"{key} not restored"
    cpu_mode.disable()  # a second disable is a no-op
    assert all(_current_attrs()[k] is before[k] for k in before)
    if not torch.cuda.is_available():
        # The device-rewriting mode is gone too: CUDA requests fail again.
        with pytest.raises((RuntimeError, AssertionError)):
            torch.empty(2, device="cuda")
        with pytest.raises((RuntimeError, AssertionError)):
            torch.ones(1).cuda()


def test_megatron_compiled_functions_run_as_written_in_cpu_mode(monkeypatch):
    """Megatron-Core's ``jit_fuser`` (``lazy_compile`` here) builds nothing while CPU mode is on
    and gives the function's own result; after ``disable()`` it compiles at the next call."""
    from megatron.core import jit

    from bebop_megatron.platform import lazy_imports

    built = []
    monkeypatch.setattr(torch, "compile", lambda fn, **options: built.append(options) or fn)

    def gelu_gate(y):
        a, b = torch.chunk(y, 2, -1)
        return torch.nn.functional.gelu(a, approximate="tanh") * b

    assert jit.jit_fuser is lazy_imports.lazy_compile
    fused = jit.jit_fuser(gelu_gate)
    y = torch.randn(3, 8, dtype=torch.float64)
    cpu_mode.enable()
    try:
        torch.testing.assert_close(fused(y), gelu_gate(y), rtol=0, atol=0)
        assert built == []
    finally:
        cpu_mode.disable()
    fused(y)
    assert built == [{}]
    assert lazy_imports.uncompiled(fused) is gelu_gate


def test_gated_deltanet_element_wise_methods_are_megatrons_own_functions_without_fla():
    """gdn_torch unwraps Megatron's compile wrappers, the lazy ones too (it used to keep those,
    so that each process compiled them on any device)."""
    from bebop_megatron.platform import gdn_torch

    if gdn_torch.have_fla():
        pytest.skip("flash-linear-attention is installed: nothing is redirected")
    assert gdn_torch.enable()
    module = importlib.import_module(gdn_torch.MODULE)
    for name in gdn_torch.UNCOMPILED:
        fn = module._GDNBase.__dict__[name]
        assert fn.__code__.co_filename == module.__file__ and fn.__name__ == name, (name, fn.__code__.co_filename)


def test_tensor_factories_with_cuda_device_give_cpu_tensors(cpu_mode_on):
    assert torch.empty(2, device="cuda").device.type == "cpu"
    assert torch.zeros(2, device="cuda:0").device.type == "cpu"
    assert torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.tensor([1.0, 2.0], device="cuda").device.type == "cpu"
    assert torch.full((2,), 3.0, device=0).device.type == "cpu"  # an int is a CUDA ordinal
    x = torch.arange(3.0)
    assert x.cuda().device.type == "cpu"
    assert x.to("cuda").device.type == "cpu"
    assert x.to(device="cuda").device.type == "cpu"
    assert x.to(torch.device("cuda"), torch.float64).dtype == torch.float64
    assert x.new_zeros(2, device="cuda").device.type == "cpu"
    assert torch.nn.Linear(2, 2).cuda().weight.device.type == "cpu"
    assert torch.equal(x.cuda(), x)


def test_current_device_is_usable_as_a_device(cpu_mode_on):
    dev = torch.cuda.current_device()
    assert torch.zeros(2, device=dev).device.type == "cpu"
    assert torch.arange(2).to(dev).device.type == "cpu"
    assert torch.device(dev).type == "cpu"


def test_tensor_type_reports_cuda_names_while_enabled():
    cpu_mode.enable()
    try:
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
        assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.ones(1, dtype=torch.float16).type() == "torch.cuda.HalfTensor"
        # type(dtype) still converts and is not renamed.
        assert torch.ones(1).type(torch.float64).dtype == torch.float64
    finally:
        cpu_mode.disable()
    assert torch.ones(1).type() == "torch.FloatTensor"


def test_streams_and_events_are_no_ops(cpu_mode_on):
    x = torch.arange(4.0)
    s = torch.cuda.Stream()
    cur = torch.cuda.current_stream()
    cur.wait_stream(s)
    with torch.cuda.stream(s):
        y = x * 2
    assert torch.equal(y, torch.tensor([0.0, 2.0, 4.0, 6.0]))
    x.record_stream(s)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end.record(s)
    s.wait_event(end)
    end.synchronize()
    assert end.query() and s.query()
    assert start.elapsed_time(end) == 0.0
    assert s.record_event() is not None
    torch.cuda.synchronize()
    assert torch.cuda.default_stream() == torch.cuda.current_stream()


def test_rng_redirection_matches_cpu_generator(cpu_mode_on):
    torch.cuda.manual_seed(5)
    a = torch.rand(3)
    torch.manual_seed(5)
    b = torch.rand(3)
    assert torch.equal(a, b)

    state = torch.cuda.get_rng_state()
    c = torch.rand(4)
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(4), c)
    assert not torch.equal(state, torch.get_rng_state())  # the state moved on after the draw


def test_megatron_rng_tracker_forks_on_cpu(cpu_mode_on):
    from megatron.core.tensor_parallel import random as tp_random

    tracker = tp_random.CudaRNGStatesTracker()
    tracker.add("a", 1234)
    torch.manual_seed(0)
    outside_before = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside_before), "fork must restore the outer state"
    with tracker.fork("a"):
        second = torch.rand(3)
    torch.manual_seed(1234)
    ref = torch.rand(6)
    assert torch.equal(first, ref[:3]) and torch.equal(second, ref[3:])


@needs_no_cuda
def test_cuda_is_still_unavailable_while_enabled(cpu_mode_on):
    # CPU mode redirects calls; it must not pretend a GPU exists (device=auto would pick it).
    assert not torch.cuda.is_available()
    assert resolve_device("auto") == "cpu"


@needs_no_cuda
def test_resolve_device():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == "cpu"
    with pytest.raises(ValueError) as excinfo:
        resolve_device("cuda")
    msg = str(excinfo.value)
    assert "device=cuda" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu")


def test_fp8_on_cpu_is_a_clear_error():
    cfg = load_config(None, ["precision=fp8"])
    assert cfg.precision == "fp8"
    with pytest.raises(ValueError) as excinfo:
        check_fp8_available("cpu")
    msg = str(excinfo.value)
    assert "CUDA" in msg and "precision=fp8" in msg and "\n" not in msg


@needs_no_te
def test_fp8_on_cuda_without_te_gives_install_hint():
    with pytest.raises(ValueError) as excinfo:
        check_fp8_available("cuda")
    assert "Transformer Engine" in str(excinfo.value)
    assert "pip install -e '.[gpu]'" in str(excinfo.value)
    assert "pip install -e '.[gpu]'" in INSTALL_HINT


@needs_no_te
def test_transformer_engine_impl_without_te_gives_install_hint():
    assert not have_transformer_engine()
    cfg = load_config(None, ["model.transformer_impl=transformer_engine"])
    for device in ("cpu", "cuda"):
        with pytest.raises(ValueError) as excinfo:
            use_transformer_engine(cfg, device)
        msg = str(excinfo.value)
        assert "model.transformer_impl" in msg and "pip install -e '.[gpu]'" in msg and "\n" not in msg


def test_transformer_engine_auto_and_local_on_cpu():
    assert use_transformer_engine(load_config(None, ["model.transformer_impl=auto"]), "cpu") is False
    assert use_transformer_engine(load_config(None, ["model.transformer_impl=local"]), "cpu") is False
    assert use_transformer_engine(load_config(None, ["model.transformer_impl=local"]), "cuda") is False


# ----------------------------------------------------------------------------- bf16 on a CPU


def test_cpu_bf16_is_decided_by_a_cached_measurement(tmp_path, monkeypatch):
    """Issue 36 item 14: a GEMM probe (bf16 time / fp32 time), measured once and cached, decides;
    CPU flags do not (an EPYC with avx512_bf16 ran a 49k-vocabulary model 2.6x slower in bf16)."""
    from bebop_megatron.training import precision as prec

    monkeypatch.delenv(prec.ALLOW_SLOW_BF16, raising=False)
    monkeypatch.setenv("BEBOP_MEGATRON_CACHE", str(tmp_path / "cache"))
    probes = []

    def fake_probe(ratio):
        return lambda: probes.append(ratio) or ratio

    with pytest.raises(ValueError) as err:
        prec.check_cpu_bf16("cpu", "bf16", probe=fake_probe(2.6))
    cache = tmp_path / "cache" / prec.PROBE_FILE
    assert str(err.value) == (f"precision=bf16 on this CPU: its bf16 matrix products take 2.6x the time of fp32 here "
                              f"(measured once, cached in {cache}; more than 1.5x is refused); set precision=fp32 "
                              f"(or {prec.ALLOW_SLOW_BF16}=1 to run bf16 anyway)")
    with pytest.raises(ValueError):  # cached: not measured again (a fast fake result is not asked for)
        prec.check_cpu_bf16("cpu", "bf16", probe=fake_probe(0.5))
    assert probes == [2.6]
    cache.unlink()  # deleted: measured again
    prec.check_cpu_bf16("cpu", "bf16", probe=fake_probe(1.4))  # within 1.5x: runs
    assert probes == [2.6, 1.4]
    prec.check_cpu_bf16("cpu", "bf16", probe=fake_probe(9.0))  # the cached 1.4 holds
    cache.write_text("{truncated")
    with pytest.raises(ValueError, match="take 1.6x"):  # an unreadable cache is measured again
        prec.check_cpu_bf16("cpu", "bf16", probe=fake_probe(1.6))
    prec.check_cpu_bf16("cpu", "fp32", probe=fake_probe(9.0))
    prec.check_cpu_bf16("cuda", "bf16", probe=fake_probe(9.0))
    monkeypatch.setenv(prec.ALLOW_SLOW_BF16, "1")
    prec.check_cpu_bf16("cpu", "bf16", probe=fake_probe(9.0))
    assert probes == [2.6, 1.4, 1.6]


def test_the_bf16_probe_measures_the_three_output_layer_gemms(monkeypatch):
    from bebop_megatron.training import precision as prec

    monkeypatch.setattr(prec, "PROBE_SHAPE", (8, 16, 64))  # tiny: the real one takes ~0.1 s here
    ratio = prec.probe_bf16_slowdown()
    assert 0 < ratio < float("inf")
    assert prec.cpu_model()


def test_trainer_refuses_cpu_bf16_before_building(monkeypatch, tmp_path):
    """The trainer stops at once, before data, model or checkpoint are touched."""
    from bebop_megatron.config import load_config
    from bebop_megatron.training import Trainer, precision as prec

    monkeypatch.delenv(prec.ALLOW_SLOW_BF16, raising=False)
    monkeypatch.setenv("BEBOP_MEGATRON_CACHE", str(tmp_path))
    monkeypatch.setattr(prec, "probe_bf16_slowdown", lambda: 30.0)
    built = []
    monkeypatch.setattr("bebop_megatron.training.trainer.build_model", lambda *a, **k: built.append(1))
    cfg = load_config(None, ["device=cpu", "precision=bf16", "save.dir=null"])
    with pytest.raises(ValueError, match="set precision=fp32"):
        Trainer(cfg)
    assert not built


def test_a_single_process_needs_no_port(monkeypatch):
    """World size 1 uses an in-memory store: a MASTER_PORT that another process holds (e.g. inherited
    from a parent with its own process group) is not listened on, so it cannot fail with EADDRINUSE."""
    import socket

    import torch.distributed as dist

    from bebop_megatron.platform import init_distributed

    assert not dist.is_initialized(), "a process group leaked from an earlier test"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(held.getsockname()[1]))
        try:
            assert init_distributed("cpu") == (0, 1)
            t = torch.ones(3)
            dist.all_reduce(t)
            assert t.tolist() == [1.0, 1.0, 1.0]
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            cpu_mode.disable()
