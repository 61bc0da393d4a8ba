"""Correlated noise's memory (dpllm.privacy.correlated.memory): what the recurrence keeps is counted exactly, and a
run whose recurrence cannot fit is refused with the numbers before anything is written. Availability is
monkeypatched (no real out-of-memory)."""

from __future__ import annotations

import logging

import pytest
import torch

from dpllm.config import ConfigError, parse_config
from dpllm.distributed import World
from dpllm.privacy import correlated
from dpllm.privacy.correlated import memory
from dpllm.privacy.correlated.banded import BandMF
from dpllm.privacy.correlated.blt import optimize_blt

GIB = 2 ** 30


def _held(rec) -> int:
    """Bytes of the tensors in a recurrence's state."""
    state = rec.state_dict()
    tensors = [t for v in state.get("history", {}).values() for t in v] + list(state.get("buffers", {}).values())
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("make, dtype", [
    (lambda: BandMF.optimized(bands=4, steps=16).recurrence(), None),
    (lambda: optimize_blt(16, 2, 4).recurrence(), None),
    (lambda: optimize_blt(16, 2, 4).recurrence(dtype=torch.float64), None),
    (lambda: BandMF.optimized(bands=3, steps=16).recurrence(), torch.bfloat16),  # banded keeps bf16 draws
    (lambda: optimize_blt(16, 3, 4).recurrence(), torch.bfloat16),  # BLT: float32 buffers for bf16 draws
])
def test_state_bytes_is_what_the_recurrence_holds_in_its_steady_state(make, dtype):
    params = [torch.zeros(7, 5), torch.zeros(11, dtype=torch.float64), torch.zeros(3, 2, 2)]
    if dtype is not None:
        params = [p.to(dtype) for p in params]
    rec = make()
    for _ in range(6):  # past b−1 steps: the history is full
        for i, p in enumerate(params):
            rec.apply(i, torch.randn(p.shape).to(p.dtype))
        rec.end_step()
    assert _held(rec) > 0 and memory.state_bytes(rec, params) == _held(rec)


def test_fsdp_shards_count_locally_and_ddp_keeps_the_state_on_rank_0_only():
    class Shard(torch.Tensor):  # what a DTensor offers here: its local part
        pass

    p = torch.zeros(100)
    sharded = p.as_subclass(Shard)
    sharded.to_local = lambda: p[:50]
    rec = BandMF.optimized(bands=3, steps=8).recurrence()
    assert memory.state_bytes(rec, [sharded]) == 2 * 50 * 4
    noise = correlated.build("banded", 3, steps=8, num_records=100, batch=10, noise_multiplier=1.0)
    both = []
    for rank in (0, 1):
        memory.check_fits(noise, [p], world=World(rank=rank, size=2, kind="ddp"), device="cpu", lora=False,
                          gather=lambda n: both.append(n) or [n])
    assert [n.need for n in both] == [2 * 100 * 4, 0]
    assert memory.check_fits(correlated.build("independent", 1, steps=8, num_records=100, batch=10), [p],
                             world=World(), device="cpu", lora=False) is None


def test_processes_on_one_host_share_its_memory_and_each_gpu_is_its_own():
    need = lambda rank, place, n: memory.Need(rank=rank, place=place, need=n * GIB, available=3 * GIB,  # noqa: E731
                                              source="x")
    assert memory.shortfalls([need(0, "host", 2), need(1, "host", 2)]) == [("host", 4 * GIB, 3 * GIB, "x")]
    assert memory.shortfalls([need(0, "host/cuda:0", 2), need(1, "host/cuda:1", 2)]) == []


def _run(out, *extra, steps=4, bands=4):
    from dpllm.train import train
    from tests.test_resume import RUN

    short = [*RUN[:RUN.index("--max_steps")], "--max_steps", str(steps), *RUN[RUN.index("--max_steps") + 2:]]
    return train(parse_config(["--output_dir", str(out), *short, "--noise", "banded", "--bands", str(bands), *extra]))


def test_a_recurrence_that_cannot_fit_is_refused_with_the_numbers_before_anything_is_written(tmp_path, monkeypatch):
    seen = []
    real = memory.need_of

    def spy(recurrence, params, **kw):
        seen.append((sum(p.numel() for p in params), {p.dtype for p in params}, torch.device(kw["device"]).type))
        return real(recurrence, params, **kw)

    monkeypatch.setattr(memory, "available_bytes", lambda device: (1000, "MemAvailable (/proc/meminfo)"))
    monkeypatch.setattr(memory, "need_of", spy)
    with pytest.raises(ConfigError) as err:
        _run(tmp_path / "run")
    msg = str(err.value)
    [(n, dtypes, device)] = seen
    assert n > 50_000 and dtypes == {torch.float32} and device == "cpu"  # the tiny Llama, fully fine-tuned
    # three past draws (b = 4) of every trainable parameter in float32, against the 1,000 bytes free
    assert f"needs {memory.size(3 * n * 4)}, 0.977 KiB free (MemAvailable (/proc/meminfo))" in msg
    assert "fewer bands" in msg and "LoRA" in msg and "FSDP2" in msg
    assert not (tmp_path / "run" / "config.yaml").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_cuda_reads_the_devices_free_memory_and_cpu_reads_memavailable(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 * GIB, 80 * GIB))
    assert memory.available_bytes("cuda:0") == (5 * GIB, "free on cuda:0 (torch.cuda.mem_get_info)")
    noise = correlated.build("banded", 3, steps=8, num_records=100, batch=10, noise_multiplier=1.0)
    big = torch.empty(GIB // 2 + 1, device="meta")  # two past draws of it in float32: just over 4 GiB
    line = memory.check_fits(noise, [big[: GIB // 16]], world=World(), device="cuda:0", lora=True)
    assert "rank 0: 512 MiB of 5 GiB free (free on cuda:0 (torch.cuda.mem_get_info))" in line
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * GIB, 80 * GIB))
    with pytest.raises(ConfigError, match=r"/cuda:0: needs 4 GiB, 3 GiB free \(free on cuda:0") as err:
        memory.check_fits(noise, [big], world=World(), device="cuda:0", lora=True)
    assert "LoRA" not in str(err.value) and "fewer bands (privacy.bands < 3" in str(err.value)
    avail, source = memory.available_bytes("cpu")
    meminfo = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines())
    assert source == "MemAvailable (/proc/meminfo)"
    assert avail == pytest.approx(int(meminfo["MemAvailable"].split()[0]) * 1024, rel=0.2)


def test_a_run_that_fits_logs_its_cost_once_at_setup(tmp_path, monkeypatch, caplog):
    from dpllm.train import Trainer
    from tests.test_resume import RUN

    monkeypatch.setattr(memory, "available_bytes", lambda device: (64 * GIB, "MemAvailable (/proc/meminfo)"))
    trainer = Trainer(parse_config(["--output_dir", str(tmp_path / "run"), *RUN, "--noise", "banded", "--bands", "2"]))
    with caplog.at_level(logging.INFO, logger="dpllm.privacy.run"):
        for stage in (trainer.setup_process, trainer.setup_data, trainer.setup_plan, trainer.setup_model):
            stage()  # the stages up to the model; the check is the model stage's last word before the run directory
    lines = [r.getMessage() for r in caplog.records if "correlated noise (banded" in r.getMessage()]
    assert len(lines) == 1 and "b−1 = 1 past draws" in lines[0] and "of 64 GiB free" in lines[0]
    n = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert f"rank 0: {memory.size(n * 4)} of 64 GiB free" in lines[0]


def test_blt_reusing_the_draws_storage_gives_the_same_noise_without_a_copy():
    """BLTRecurrence(reuse_draws=True) computes x in the fresh draw's own storage (no model-sized allocation per
    step) and gives the noise of the copying recurrence; a draw in another dtype is still copied into float32."""
    strategy = optimize_blt(16, 2, 4)
    copying, reusing = strategy.recurrence(), strategy.recurrence(reuse_draws=True)
    g = torch.Generator().manual_seed(0)
    for t in range(5):
        z = torch.randn(50, generator=g)
        want = copying.apply(0, z)
        kept = z.clone()
        got = reusing.apply(0, z)
        assert got.data_ptr() == z.data_ptr() and want.data_ptr() != z.data_ptr()
        assert t == 0 or not torch.equal(kept, z)  # the draw's storage now holds x (= z at the first step)
        assert torch.allclose(got, want, rtol=0, atol=1e-6)
        copying.end_step()
        reusing.end_step()
    low = strategy.recurrence(reuse_draws=True)
    zb = torch.randn(8, generator=g).bfloat16()
    x = low.apply(0, zb)
    assert x.dtype == torch.bfloat16 and x.data_ptr() != zb.data_ptr()


def test_dptrainer_refuses_a_recurrence_that_cannot_fit_before_training(tmp_path, monkeypatch):
    """The Trainer drop-in checks the same memory as the recipe, once its model is wrapped: nothing trains."""
    from tests.helpers import tiny_dptrainer, tiny_model

    n = sum(p.numel() for p in tiny_model(finetuning="lora")[0].parameters() if p.requires_grad)  # the same shapes
    monkeypatch.setattr(memory, "available_bytes", lambda device: (1000, "MemAvailable (/proc/meminfo)"))
    with pytest.raises(ConfigError) as err:
        tiny_dptrainer(tmp_path / "run", noise="banded", bands="2").train()
    # one past draw (b = 2) of every trainable (LoRA) parameter in float32, against the 1,000 bytes free
    assert f"needs {memory.size(n * 4)}, 0.977 KiB free" in str(err.value) and "fewer bands" in str(err.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
