"""One process of tests/test_fsdp_bk.py's launch (2 gloo processes): :func:`run_cases`, called by tests/ddp_runs.py
before the recipe's runs, or alone: ``python -m torch.distributed.run --nproc_per_node 2 tests/fsdp_bk_worker.py
FOUND.json SCRATCH_DIR``.

Each case builds the same model twice from one seed: a reference that one process runs unsharded on *all* the
step's records with bk, and a copy sharded with FSDP2 (:func:`dpllm.distributed.shard_model`) on which each
process runs its own share. Both take one SGD step (σ = 0 unless the case says otherwise). Every process
computes the reference itself (same seed, same records), so no reference value crosses the process group.
The ghost_fsdp checks of tests/fsdp_worker.py and tests/fsdp_guards_worker.py run in the same launch (one launch
costs ~15-20 s of CPU here).
Rank 0 writes what it found as JSON to FOUND.json (whole: written beside it and renamed, so that a reader polling for
it never sees half of it).
"""

import copy
import faulthandler
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

faulthandler.enable(all_threads=True)  # an abort (SIGABRT) prints every thread's Python stack
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from opacus import PrivacyEngine  # noqa: E402

from dpllm.config import ModelConfig  # noqa: E402
from dpllm.distributed import finish_process, shard_model  # noqa: E402
from dpllm.models import build_tiny, byte_tokenizer, prepare_model  # noqa: E402
from dpllm.privacy.bk import make_private_bk  # noqa: E402
from dpllm.privacy.correlated.blt import optimize_blt  # noqa: E402
from dpllm.train import forward_loss  # noqa: E402
from tests.helpers import TEXTS, batch_of  # noqa: E402

RECORDS = TEXTS + ["Noise of standard deviation sigma times C.", "A record is a row.", "Shards partition a tensor.",
                   "Ten records, six on one process and four on the other."]
SHARES = [list(range(0, 6)), list(range(6, 10))]  # uneven on purpose
USERS = [0, 0, 1, 2, 2, 2, 3, 4, 4, 5]  # ULS: a user's records are on one process
EMPTY = {k: torch.zeros((0, 1), dtype=torch.long) for k in ("input_ids", "attention_mask", "labels")}
LR = 0.5


def build(kind: str, finetuning: str, *, dtype=torch.float64, checkpointing: bool = False):
    torch.manual_seed(0)
    cfg = ModelConfig(model_name_or_path=kind, finetuning=finetuning, tiny_hidden_size=32, tiny_num_layers=2,
                      tiny_num_heads=2, tiny_intermediate_size=64, tiny_max_positions=128,
                      lora_r=3)  # LoRA A has 3 rows: shards of 2 and 1, one padded row in the reduce-scatter
    tok = byte_tokenizer()
    model, _ = prepare_model(build_tiny(cfg, tok, 64), cfg, dp=True, keep_tie=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # LoRA B starts at zero, which makes A's gradient zero
                p.normal_(0, 0.05)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(dtype).train(), tok


def step(model, tok, shares, *, C, sigma=0.0, world_size=1, users=None, micro=1, noise_seed=0):
    """One bk step over ``shares`` (this process's records) in ``micro`` physical batches; SGD(lr) update."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    expected = len(set(USERS)) if users is not None else len(RECORDS)
    bk, opt = make_private_bk(engine=PrivacyEngine(accountant="rdp"), model=model, optimizer=optimizer,
                              clip_weights=lambda n: (C / n).clamp(max=1.0), noise_multiplier=sigma,
                              max_grad_norm=C, expected_batch_size=expected, world_size=world_size,
                              noise_generator=torch.Generator().manual_seed(noise_seed), per_user=users is not None)
    size = max(1, -(-len(shares) // micro))
    parts = [shares[i: i + size] for i in range(0, len(shares), size)]
    parts += [[]] * (micro - len(parts))  # every process runs as many passes (FSDP's are collectives)
    norms = []
    for i, part in enumerate(parts):
        opt.signal_skip_step(do_skip=i < len(parts) - 1)
        if users is not None:
            bk.set_users([users[j] for j in part])
        # an empty share runs one fully masked row, as the trainer does (forward_loss): zero gradient, same passes
        forward_loss(bk, batch_of(tok, [RECORDS[j] for j in part]) if part else EMPTY).backward()
        norms += bk.last_norms.tolist() if part else []
        opt.step()
        if i < len(parts) - 1:  # the last step's p.grad (the noised, scaled update) is what the cases compare
            opt.zero_grad()
    return bk, norms


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def compare(ref_model, model, ref_grads) -> dict:
    """Largest relative difference of the update and of the parameters after it, over every trainable tensor."""
    got = {n: full(p.detach()) for n, p in model.named_parameters() if p.requires_grad}
    want = {n: p.detach() for n, p in ref_model.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys()
    worst_update, worst_param = 0.0, 0.0
    for n in want:
        update = (got[n] - (want[n] + LR * ref_grads[n])) / -LR  # what the sharded step applied, as a gradient
        scale = ref_grads[n].abs().max().clamp(min=1e-30)
        worst_update = max(worst_update, float((update - ref_grads[n]).abs().max() / scale))
        worst_param = max(worst_param, float((got[n] - want[n]).abs().max() / want[n].abs().max()))
    return {"update_rel": worst_update, "param_rel": worst_param}


def equivalence(kind, finetuning, *, rank, users=None, micro=1, checkpointing=False, shares=SHARES) -> dict:
    ref, tok = build(kind, finetuning)
    model = shard_model(build(kind, finetuning, checkpointing=checkpointing)[0])
    everyone = sum(shares, [])
    # C at the median per-record (per-user) norm: some records are clipped, some are not
    _, probe = step(copy.deepcopy(ref), tok, everyone, C=1e9, users=users)
    C = float(torch.tensor(probe).median())
    _, ref_norms = step(ref, tok, everyone, C=C, users=users)
    ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.requires_grad}
    _, norms = step(model, tok, shares[rank], C=C, world_size=2, users=users, micro=micro)
    mine = shares[rank] if users is None else sorted({users[j] for j in shares[rank]})
    offset = 0 if rank == 0 else (len(shares[0]) if users is None else len({users[j] for j in shares[0]}))
    norm_rel = max((abs(a - b) / b for a, b in zip(norms, ref_norms[offset: offset + len(mine)])), default=0.0)
    return {**compare(ref, model, ref_grads), "norm_rel": norm_rel, "clipped": int(sum(n > C for n in ref_norms)),
            "records": len(ref_norms)}


def noise(rank) -> dict:
    """σ > 0: the sharded step's update minus the σ = 0 reference is the noise/B, drawn per shard."""
    sigma, C = 2.0, 1e-3
    ref, tok = build("tiny-llama", "full")
    model = shard_model(build("tiny-llama", "full")[0])
    step(ref, tok, sum(SHARES, []), C=C)
    step(model, tok, SHARES[rank], C=C, sigma=sigma, world_size=2, noise_seed=1000 + rank)
    local, everywhere = [], []
    for (_n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        # the noise each process drew, on its own shard only: (grad - ref grad) · B
        shard = p.grad.to_local() - q.grad.detach().chunk(2)[rank][: p.grad.to_local().shape[0]]
        local.append(shard.flatten() * len(RECORDS))
        everywhere.append((full(p.grad.detach()) - q.grad.detach()).flatten() * len(RECORDS))
    local, everywhere = torch.cat(local), torch.cat(everywhere)
    gathered = [torch.zeros(0)] * 2
    dist.all_gather_object(gathered, local[:4096])
    return {"sigma_C": sigma * C, "coordinates": everywhere.numel(), "variance": float(everywhere.pow(2).mean()),
            "zero_coordinates": int((everywhere == 0).sum()), "first_rank0": gathered[0].tolist(),
            "first_rank1": gathered[1].tolist()}


def banded(rank, strategy=None) -> dict:
    """privacy.noise: banded (or blt, given its ``strategy``) under FSDP2: each process runs the recurrence over its
    own shards' draws; the noise its optimizer adds equals the recurrence applied to draws from its own generator,
    step after step."""
    from opacus.optimizers.optimizer import _generate_noise

    from dpllm.privacy.bk.optimizer import ShardedLeanAccumulation
    from dpllm.privacy.correlated.banded import BandMF

    model = shard_model(build("tiny-llama", "full", dtype=torch.float32)[0])
    strategy = strategy or BandMF.optimized(bands=3, steps=8)
    opt = ShardedLeanAccumulation(torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=2.0,
                                  max_grad_norm=0.5, expected_batch_size=1,
                                  generator=torch.Generator().manual_seed(50 + rank))
    opt.recurrence = strategy.recurrence()
    steps = []
    for _ in range(4):
        for p in opt.params:
            p.summed_grad = torch.zeros_like(p)
        opt.add_noise()
        steps.append([p.grad.to_local().detach().clone() for p in opt.params])
    g, mine, worst = torch.Generator().manual_seed(50 + rank), strategy.recurrence(), 0.0
    for added in steps:
        for key, x in enumerate(added):
            want = mine.apply(key, _generate_noise(std=1.0, reference=x, generator=g))
            worst = max(worst, float((x - want).abs().max()))
        mine.end_step()
    first = torch.cat([x.flatten() for x in steps[0]])
    gathered = [torch.zeros(0)] * 2
    dist.all_gather_object(gathered, first[:2048])
    shapes = [list(x.shape) for x in steps[0]]
    kept = opt.recurrence.state_dict()  # banded: the b−1 latest x of each parameter; BLT: its d buffers
    history = len(kept["history"][0]) if "history" in kept else int(kept["buffers"][0].shape[0])
    return {"max_abs_diff": worst, "history": history, "shapes": shapes,
            "buffer_shapes": [list(v.shape) for v in kept.get("buffers", {}).values()],
            "global_shapes": [list(p.shape) for p in opt.params], "first_rank0": gathered[0].tolist(),
            "first_rank1": gathered[1].tolist(), "step_corr": float(torch.corrcoef(torch.stack(
                [torch.cat([x.flatten() for x in steps[0]]), torch.cat([x.flatten() for x in steps[1]])]))[0, 1])}


def quantile(rank) -> dict:
    """clipping: quantile under FSDP2: each process clips its records at the same C and counts their centred bits;
    the counts are summed and noised once (rank 0's generator, after its shard's noise); every process moves C
    alike; each shard of the sum is noised once at σ_g·C."""
    from opacus.optimizers.optimizer import _generate_noise

    from dpllm.privacy.quantile import QuantileClipping, centred_count, gradient_noise_multiplier

    sigma, sigma_b = 2.0, 1.2  # σ_b near its bound σ/2 = 1: σ_g = 3.6, far from σ
    ref, tok = build("tiny-llama", "full")
    model = shard_model(build("tiny-llama", "full")[0])
    everyone = sum(SHARES, [])
    _, probe = step(copy.deepcopy(ref), tok, everyone, C=1e9)
    low, high = sorted(probe)[4:6]
    C = (low + high) / 2  # between the two middle norms: no record sits at C, whatever the rounding
    step(ref, tok, everyone, C=C)  # σ = 0: the clipped sum
    q = QuantileClipping(initial=C, target_quantile=0.5, lr=0.2, count_noise_multiplier=sigma_b,
                         expected_batch_size=len(RECORDS))
    released = []
    real = q.release_noised
    q.release_noised = lambda noised: released.append((q.count, noised)) or real(noised)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    bk, opt = make_private_bk(engine=PrivacyEngine(accountant="rdp"), model=model, optimizer=optimizer,
                              clip_weights=q.weights, noise_multiplier=sigma, max_grad_norm=C,
                              expected_batch_size=len(RECORDS), world_size=2,
                              noise_generator=torch.Generator().manual_seed(1000 + rank), quantile=q)
    opt.signal_skip_step(do_skip=False)
    forward_loss(bk, batch_of(tok, [RECORDS[j] for j in SHARES[rank]])).backward()
    opt.step()
    (local_count, noised), = released
    total = torch.tensor([local_count], dtype=torch.float64)
    dist.all_reduce(total)
    # replay this process's stream: its shard's gradient noise, then (rank 0 only) the count's
    replay = torch.Generator().manual_seed(1000 + rank)
    for p in opt.params:
        _generate_noise(std=1.0, reference=p.grad.to_local(), generator=replay)
    count_noise = float(_generate_noise(std=sigma_b, reference=torch.zeros(1, dtype=torch.float64),
                                        generator=replay)) if rank == 0 else 0.0
    same_stream = bool(torch.equal(replay.get_state(), opt.generator.get_state()))
    from_rank0 = [0.0, 0.0]
    dist.all_gather_object(from_rank0, count_noise)
    clips = [0.0, 0.0]
    dist.all_gather_object(clips, q.clip)
    diff = torch.cat([((full(p.grad.detach()) - r.grad.detach()) * len(RECORDS)).flatten()
                      for p, r in zip(model.parameters(), ref.parameters())])
    return {"C": C, "clips": clips, "steps": q.steps, "local_count": local_count, "total_count": float(total),
            "reference_count": centred_count(torch.tensor(probe), C), "noised": noised,
            "count_noise_rank0": from_rank0[0], "stream_replayed": same_stream,
            "sigma_g_C": gradient_noise_multiplier(sigma, sigma_b) * C, "sigma_C": sigma * C,
            "variance": float(diff.pow(2).mean()), "coordinates": diff.numel()}


def quantile_ddp(rank, mode) -> dict:
    """clipping: quantile under DDP with Opacus hooks or ghost (its distributed optimizers): the processes' counts
    summed and noised once (rank 0's stream, after the gradient's noise, which Opacus draws on rank 0 only); C moved
    alike; the reduced gradient is the clipped sum over both processes plus noise of std σ_g·C."""
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from opacus.optimizers.optimizer import _generate_noise

    from dpllm.config import PrivacyConfig
    from dpllm.privacy import clipping
    from dpllm.privacy.engine import _wrap_opacus
    from dpllm.privacy.quantile import QuantileClipping, centred_count, gradient_noise_multiplier

    sigma, sigma_b, m = 1.0, 0.55, 10  # σ_g = 2.40
    torch.manual_seed(0)
    x = torch.randn(m, 40, dtype=torch.float64) * torch.linspace(0.2, 3.0, m, dtype=torch.float64)[:, None]
    y = torch.randn(m, dtype=torch.float64)
    net = torch.nn.Sequential(torch.nn.Linear(40, 30, bias=False)).double()
    per_record = []
    for i in range(m):  # the reference: each record's gradient by autograd, alone
        net.zero_grad()
        (net(x[i: i + 1]).sum() - y[i]).pow(2).backward()
        per_record.append(net[0].weight.grad.detach().clone())
    norms = torch.stack([g.norm() for g in per_record])
    low, high = norms.sort().values[4:6].tolist()
    C = (low + high) / 2  # no record at C
    clipped_sum = sum(g * min(1.0, C / float(g.norm())) for g in per_record)
    net.zero_grad()
    q = QuantileClipping(initial=C, target_quantile=0.5, lr=0.2, count_noise_multiplier=sigma_b, expected_batch_size=m)
    released = []
    real = q.release_noised
    q.release_noised = lambda noised: released.append((q.count, noised)) or real(noised)
    model, opt, criterion = _wrap_opacus(
        engine=PrivacyEngine(accountant="rdp"), model=DPDDP(net), optimizer=torch.optim.SGD(net.parameters(), lr=0.0),
        criterion=torch.nn.MSELoss(), fn=clipping.get("flat"), cfg=PrivacyConfig(max_grad_norm=C, clipping="quantile"),
        mode=mode, noise_multiplier=sigma, expected_batch_size=m / 2,
        noise_generator=torch.Generator().manual_seed(1000 + rank), quantile=q)
    mine = list(range(6)) if rank == 0 else list(range(6, m))
    out = model(x[mine]).sum(1)
    loss = criterion(out, y[mine]) if criterion is not None else torch.nn.functional.mse_loss(out, y[mine])
    loss.backward()
    opt.step()
    (local_count, noised), = released
    total = torch.tensor([local_count], dtype=torch.float64)
    dist.all_reduce(total)
    replay = torch.Generator().manual_seed(1000 + rank)
    count_noise = 0.0
    if rank == 0:  # Opacus noises the gradient on rank 0 only; the count's draw follows it there
        _generate_noise(std=1.0, reference=net[0].weight, generator=replay)
        count_noise = float(_generate_noise(std=sigma_b, reference=torch.zeros(1, dtype=torch.float64),
                                            generator=replay))
    same_stream = bool(torch.equal(replay.get_state(), opt.generator.get_state()))
    from_rank0, clips = [0.0, 0.0], [0.0, 0.0]
    dist.all_gather_object(from_rank0, count_noise)
    dist.all_gather_object(clips, q.clip)
    diff = net[0].weight.grad.detach() * m - clipped_sum  # the reduced gradient is (sum + noise) / m
    return {"C": C, "clips": clips, "steps": q.steps, "local_count": local_count, "total_count": float(total),
            "reference_count": centred_count(norms, C), "noised": noised, "count_noise_rank0": from_rank0[0],
            "stream_replayed": same_stream, "sigma_g_C": gradient_noise_multiplier(sigma, sigma_b) * C,
            "variance": float(diff.pow(2).mean()), "coordinates": diff.numel(),
            "optimizer": type(opt).__name__}


class RawUse(torch.nn.Module):
    """A tied output computed as ``h @ emb.weight.T``: the weight is used outside its own layer."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, input_ids, **_):
        return torch.nn.functional.linear(self.lin(self.emb(input_ids)), self.emb.weight)


def refusal(mixed: bool, reshard: bool) -> str:
    """bk under FSDP refuses a raw gradient before it reaches .grad (whatever the FSDP settings)."""
    torch.manual_seed(0)
    model = shard_model(RawUse(), mixed_precision="bf16" if mixed else "no", reshard_after_forward=reshard)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    bk, _ = make_private_bk(engine=PrivacyEngine(), model=model, optimizer=optimizer,
                            clip_weights=lambda n: (1 / n).clamp(max=1.0), noise_multiplier=0.0, max_grad_norm=1.0,
                            expected_batch_size=4, world_size=2)
    try:
        bk(torch.randint(0, 50, (2, 5))).float().pow(2).mean().backward()
    except RuntimeError as err:
        return str(err).split(";")[0]
    return "not refused; grad is " + ("set" if model.emb.weight.grad is not None else "None")


def mixed_precision(rank) -> dict:
    """bf16 compute (fp32 shards and reduction), parameters kept gathered after forward: same step as fp32 ref."""
    ref, tok = build("tiny-llama", "full", dtype=torch.float32)
    model = build("tiny-llama", "full", dtype=torch.float32)[0]
    model = shard_model(model, mixed_precision="bf16", reshard_after_forward=False)
    step(ref, tok, sum(SHARES, []), C=1e9)  # no clipping: differences are bf16 rounding, not clip factors
    step(model, tok, SHARES[rank], C=1e9, world_size=2)
    num = sum(float((full(p.grad) - q.grad).pow(2).sum()) for p, q in zip(model.parameters(), ref.parameters()))
    den = sum(float(q.grad.pow(2).sum()) for q in ref.parameters())
    return {"rel_l2": (num / den) ** 0.5, "grad_dtype": str(next(model.parameters()).grad.dtype)}


def ghost_fsdp_guard() -> str:
    """ghost_fsdp under FSDP: a weight used outside its layer is refused at the first forward pass."""
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    from dpllm.config import PrivacyConfig
    from dpllm.privacy.engine import PrivacyPlan, make_private

    torch.manual_seed(0)
    model = FSDP2Wrapper(RawUse())
    model.emb.set_reshard_after_forward(False)  # the root's forward then uses emb's unsharded weight itself
    plan = PrivacyPlan(num_records=10, sample_rate=0.5, steps=1, noise_multiplier=1.0, delta=1e-5, accountant="rdp",
                       expected_batch_size=5)
    pt = make_private(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=list(range(10)),
                      collate_fn=lambda x: x, cfg=PrivacyConfig(grad_sample_mode="ghost_fsdp"), plan=plan,
                      logical_batch_size=5, noise_generator=torch.Generator().manual_seed(dist.get_rank()),
                      sampling_generator=torch.Generator().manual_seed(0), rank=dist.get_rank(), world_size=2)
    try:
        pt.model(torch.randint(0, 50, (2, 5)))
    except RuntimeError as err:
        return str(err).split(";")[0]
    return "not refused"


def run_cases(out: str, scratch: str) -> None:
    """Every case on this process (the process group started); rank 0 writes what was found to ``out``. Warnings are
    silenced here only: the recipe's runs after this in the same process keep theirs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _run_cases(Path(out), Path(scratch))


def _run_cases(out: Path, scratch: Path) -> None:
    rank = dist.get_rank()
    found = {
        "llama_full": equivalence("tiny-llama", "full", rank=rank),
        "gpt2_tied_full": equivalence("tiny-gpt2", "full", rank=rank),
        "llama_lora": equivalence("tiny-llama", "lora", rank=rank),
        "virtual_batches": equivalence("tiny-llama", "full", rank=rank, micro=2),
        "uls": equivalence("tiny-gpt2", "full", rank=rank, users=USERS),
        "checkpointing": equivalence("tiny-llama", "full", rank=rank, checkpointing=True),
        "empty_share": equivalence("tiny-gpt2", "full", rank=rank, micro=2, shares=[list(range(10)), []]),
        "noise": noise(rank),
        "mixed_precision": mixed_precision(rank),
        "banded": banded(rank),
        "blt": banded(rank, strategy=optimize_blt(8, 2, 2)),  # 2 buffers, min-separation 2: 4 participations
        "quantile": quantile(rank),
        "quantile_ddp": {mode: quantile_ddp(rank, mode) for mode in ("hooks", "ghost")},
    }
    from tests.fsdp_worker import check  # the ghost_fsdp path, in the same launch

    found["ghost_fsdp"] = {ft: check(ft, scratch / ft) for ft in ("full", "lora")}
    # refusals last: a backward pass that failed half-way leaves nothing the cases above need (the recipe's runs after
    # them in tests/test_fsdp_bk.py's launch build, shard and wrap models of their own)
    found["ghost_fsdp_guard"] = ghost_fsdp_guard()
    from tests.fsdp_guards_worker import check as hook_copy  # test_gradient_paths's hook copy under ghost_fsdp

    found["ghost_fsdp_hook_copy"] = [None, None]
    dist.all_gather_object(found["ghost_fsdp_hook_copy"], hook_copy())
    found["refusal"] = {f"mixed={m},reshard={r}": refusal(m, r) for m in (False, True) for r in (True, False)}
    if rank == 0:
        part = out.with_name(out.name + ".part")
        part.write_text(json.dumps(found))
        os.replace(part, out)
    dist.barrier()  # both processes done before either goes on (the recipe's runs, or the exit)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    run_cases(sys.argv[1], sys.argv[2])
    finish_process(0)
