"""User-level DP (issue #13): user sampling, one clipped gradient per user, the cap, group privacy, plan = report."""

import itertools
import json
import math

import numpy as np
import pytest
import torch
from scipy import stats
from scipy.optimize import brentq

from dpllm.config import ConfigError, DataConfig, parse_config
from dpllm.privacy import user_level
from dpllm.privacy.accounting import PrivacyPlanError, compute_epsilon_history
from tests.helpers import TEXTS, batch_of, explicit_grads, tiny_model

# ---- ULS sampling ------------------------------------------------------------------------------------------

def test_uls_inclusion_is_bernoulli_q_per_user_and_takes_all_their_records():
    sizes = [1, 3, 2, 5, 1, 4] * 6  # 36 users of different sizes
    users, start = [], 0
    for s in sizes:
        users.append(list(range(start, start + s)))
        start += s
    q, draws = 0.25, 4000
    sampler = user_level.UserPoissonBatchSampler(user_records=users, sample_rate=q,
                                                 generator=torch.Generator().manual_seed(3))
    masks = np.zeros((draws, len(users)), dtype=bool)
    for t, batch in enumerate(itertools.islice(iter(sampler), draws)):
        chosen = {sampler.user_of[i] for i in batch}
        # a sampled user brings every one of its records, contiguous, and nothing else comes
        assert sorted(batch) == sorted(i for u in chosen for i in users[u])
        masks[t, sorted(chosen)] = True
    counts = masks.sum(axis=0)  # Binomial(draws, q) per user, whatever the user's size
    chi2 = (((counts - draws * q) ** 2) / (draws * q * (1 - q))).sum()
    assert stats.chi2.sf(chi2, df=len(users)) > 1e-4
    per_step = masks.sum(axis=1)  # Binomial(U, q) users per step: variance U·q·(1−q), not 0
    assert 0.85 < per_step.var() / (len(users) * q * (1 - q)) < 1.15
    corr = np.corrcoef(masks.T.astype(float))
    assert np.abs(corr[np.triu_indices(len(users), 1)]).max() < 0.1
    # a large user is not sampled more often than a small one
    big, small = [u for u, s in enumerate(sizes) if s == 5], [u for u, s in enumerate(sizes) if s == 1]
    assert abs(counts[big].mean() - counts[small].mean()) < 4 * math.sqrt(draws * q * (1 - q) / len(big))


def test_uls_processes_share_users_not_records():
    users = [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9], [10]]

    def first(rank, world):
        s = user_level.UserPoissonBatchSampler(user_records=users, sample_rate=0.6, rank=rank, world_size=world,
                                               generator=torch.Generator().manual_seed(5))
        return next(iter(s)), s.user_of

    whole, user_of = first(0, 1)
    parts = [first(r, 2)[0] for r in (0, 1)]
    assert sorted(parts[0] + parts[1]) == sorted(whole)
    assert not {user_of[i] for i in parts[0]} & {user_of[i] for i in parts[1]}


def test_whole_user_batches_never_split_a_user():
    user_of = {i: i // 3 for i in range(12)}  # 4 users of 3 records
    parts = user_level.whole_user_batches(list(range(12)), user_of, 5)
    assert [len(p) for p in parts] == [3, 3, 3, 3]
    assert all(len({user_of[i] for i in p}) == 1 for p in parts)
    assert user_level.whole_user_batches([], user_of, 5) == [[]]
    with pytest.raises(ValueError):
        user_level.whole_user_batches(list(range(12)), user_of, 2)


# ---- one clipped gradient per user (hooks) -----------------------------------------------------------------

def _explicit_record_grads(model, tok):
    """Each record's gradient of its own mean token loss, one backward pass per record."""
    return explicit_grads(model, (batch_of(tok, [text]) for text in TEXTS))


def _uls_sum(model, tok, rows: list[int], users: list[int], C: float, mode: str = "hooks", policy: str = "auto"):
    """The clipped sum (noise 0) that ULS accumulates for the records ``rows`` (hooks optimizer or bk module)."""
    from dpllm.config import PrivacyConfig
    from dpllm.data import TokenizedRecords, make_collate
    from dpllm.privacy.engine import make_private
    from dpllm.privacy.plan import PrivacyPlan
    from dpllm.train import forward_loss

    ds = TokenizedRecords(TEXTS, tok, 48)
    plan = PrivacyPlan(num_records=3, sample_rate=0.5, steps=1, noise_multiplier=0.0, delta=1e-5, accountant="rdp",
                       expected_batch_size=1)
    user_records = [[i for i, u in enumerate(users) if u == v] for v in sorted(set(users))]
    private = make_private(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=ds,
                           collate_fn=make_collate(tok.pad_token_id), plan=plan, logical_batch_size=2,
                           cfg=PrivacyConfig(grad_sample_mode=mode, max_grad_norm=C),
                           user_records=user_records)
    assert private.grad_sample_mode == mode
    opt = private.optimizer
    opt.zero_grad()
    if mode == "bk":  # one backward pass leaves the clipped per-user sum in p.grad
        private.model.set_policy(policy)
        private.set_users([users[i] for i in rows])
        forward_loss(private.model, batch_of(tok, [TEXTS[i] for i in rows])).backward()
        return torch.cat([p.grad.reshape(-1) for p in opt.params]), private.model.last_norms
    assert isinstance(opt, user_level.UserLevelDPOptimizer)
    opt.signal_skip_step(do_skip=True)  # accumulate only: summed_grad is the clipped sum
    private.set_users([users[i] for i in rows])
    forward_loss(private.model, batch_of(tok, [TEXTS[i] for i in rows])).backward()
    opt.step()
    out = torch.cat([p.summed_grad.reshape(-1) for p in opt.params])
    private.model._close()
    return out, None


def _explicit_uls(g: torch.Tensor, users: list[int]):
    """Per-user mean gradients, their norms, and C = their median (some users clipped, some not)."""
    means = torch.stack([g[[i for i, u in enumerate(users) if u == v]].mean(0) for v in sorted(set(users))])
    norms = means.norm(dim=1)
    return means, norms, float(norms.median())


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_uls_clipped_sum_is_the_explicit_per_user_computation(mode):
    model, tok = tiny_model()
    g = _explicit_record_grads(model, tok)
    users = [0, 0, 1, 2, 2, 2]  # user 0: records 0,1; user 1: record 2; user 2: records 3,4,5
    means, norms, C = _explicit_uls(g, users)
    want = sum(min(1.0, C / (float(n) + 1e-6)) * m for m, n in zip(means, norms))
    got, _ = _uls_sum(model, tok, list(range(6)), users, C, mode)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)
    # a record-level clip of the same rows is a different sum (the test can fail)
    record_level = sum(min(1.0, C / (float(n) + 1e-6)) * r for r, n in zip(g, g.norm(dim=1)))
    assert not torch.allclose(got, record_level, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("kind, finetuning", [("tiny-gpt2", "full"), ("tiny-llama", "full"), ("tiny-llama", "lora"),
                                              ("tiny-gpt2", "lora")])
@pytest.mark.parametrize("policy", ["ghost", "explicit"])
def test_uls_bk_norms_and_sum_equal_the_explicit_per_user_computation_in_float64(kind, finetuning, policy):
    """bk's per-user norms (cross terms between a user's records: ghost pairs, explicit sums, embedding
    rows shared across records) and clipped sum, against per-record autograd averaged by hand. Rows of a
    user need not be adjacent."""
    model, tok = tiny_model(kind, finetuning)
    model = model.double()
    g = _explicit_record_grads(model, tok).double()
    users = [7, 3, 7, 3, 3, 11]  # user 3: records 1,3,4; user 7: 0,2; user 11: 5
    means, norms, C = _explicit_uls(g, users)
    want = sum(min(1.0, C / (float(n) + 1e-6)) * m for m, n in zip(means, norms))
    got, last = _uls_sum(model, tok, list(range(6)), users, C, "bk", policy)
    torch.testing.assert_close(last, norms, rtol=1e-6, atol=1e-9)
    err = (got - want).abs().max()
    assert err <= 1e-6 * want.abs().max(), err
    # the record-level norms are not the per-user ones (the test can fail)
    assert not torch.allclose(g.norm(dim=1)[[1, 0, 5]], norms, rtol=1e-2)


def test_a_users_contribution_to_one_step_is_at_most_C():
    model, tok = tiny_model(seed=1)
    users = [0, 0, 1, 2, 2, 2]
    C = 1e-3  # far below every gradient norm: every user is clipped
    for mode in ("hooks", "bk"):
        for v in range(3):
            rows = [i for i, u in enumerate(users) if u == v]
            alone, _ = _uls_sum(model, tok, rows, users, C, mode)
            assert alone.norm() <= C * (1 + 1e-4)
            assert alone.norm() > 0.99 * C  # clipped to C exactly, not to C per record nor C/k


def test_uls_bk_without_the_users_of_a_batch_refuses_to_clip_per_record():
    from dpllm.privacy.bk import BookKeepingModule

    model, tok = tiny_model()
    bk = BookKeepingModule(model, clip_weights=lambda n: torch.ones_like(n), per_user=True)
    from dpllm.train import forward_loss

    with pytest.raises(RuntimeError, match="set_users"):
        forward_loss(bk, batch_of(tok)).backward()


# ---- contribution bounding (ELS cap) -----------------------------------------------------------------------

def test_cap_keeps_at_most_k_records_per_user_at_random():
    users = [f"u{i % 7}" if i < 70 else "big" for i in range(100)]  # 7 users of 10, one of 30
    ids = list(range(100))
    a = user_level.cap_users(ids, users, 4, torch.Generator().manual_seed(1))
    b = user_level.cap_users(ids, users, 4, torch.Generator().manual_seed(2))
    for cap in (a, b):
        assert all(len(r) <= 4 for r in cap["by_user"].values())
        assert set(cap["kept"]) <= set(ids) and len(cap["kept"]) == 8 * 4
        assert cap["users_trimmed"] == 8 and cap["records_dropped"] == 100 - 32 and cap["largest_user"] == 30
        assert all(users[i] == u for u, r in cap["by_user"].items() for i in r)
    assert a["kept"] != b["kept"]  # the choice is random, not the first k
    whole = user_level.cap_users(ids, users, None, torch.Generator())
    assert whole["kept"] == ids and whole["users_trimmed"] == 0


# ---- group privacy (ELS) -----------------------------------------------------------------------------------

def _gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact ε of a Gaussian mechanism with sensitivity/σ = mu at δ (Balle & Wang 2018, Thm. 8)."""
    norm = stats.norm

    def d(eps):
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta
    return 0.0 if d(0.0) <= 0 else brentq(d, 0.0, 500.0)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_mixture_accounting_equals_the_exact_full_batch_gaussian(k):
    # q = 1: every step is a Gaussian mechanism; a user of k records has sensitivity k·C, so T steps at noise
    # σ·C are one Gaussian with μ = k·√T/σ, whose (ε, δ) is known exactly. The PLD is an upper bound
    # (pessimistic discretisation) and tight: never below, within 1%.
    sigma, steps, delta = 4.0, 4, 1e-5
    exact = _gaussian_epsilon(k * math.sqrt(steps) / sigma, delta)
    eps = user_level.mixture_epsilon(history=[(sigma, 1.0, steps)], delta=delta, group_size=k)
    assert exact * (1 - 1e-9) <= eps <= exact * 1.01 + 1e-3, (eps, exact)


@pytest.mark.parametrize("sigma, q, steps, k", [(1.0, 0.05, 100, 2), (2.0, 0.1, 50, 4), (3.0, 0.02, 200, 3),
                                                (0.8, 0.05, 40, 1), (0.6, 0.02, 300, 16)])
def test_mixture_accounting_against_opacus_and_the_textbook_group_conversion(sigma, q, steps, k):
    """k = 1: the mixture is the subsampled Gaussian, as Opacus's PRV and RDP accountants compute it.
    k > 1: the textbook conversion of a record-level (ε_r, δ_r) (Opacus) is (k·ε_r, k·e^{(k−1)ε_r}·δ_r); the
    tight accounting at that δ must not exceed k·ε_r (else one of the two would be wrong), and multi-stage
    histories compose."""
    history = [(sigma, q, steps)]
    if k == 1:
        delta = 1e-5
        eps = user_level.mixture_epsilon(history=history, delta=delta, group_size=1)
        assert eps == pytest.approx(compute_epsilon_history(history=history, delta=delta, accountant="prv"), rel=0.03)
        assert eps <= compute_epsilon_history(history=history, delta=delta, accountant="rdp") * (1 + 1e-9)
    else:
        delta_r = 1e-7
        eps_r = compute_epsilon_history(history=history, delta=delta_r, accountant="prv")
        delta = k * math.exp((k - 1) * eps_r) * delta_r
        if delta < 1:  # the textbook conversion says something: the tight one says at least as much
            assert user_level.mixture_epsilon(history=history, delta=delta, group_size=k) <= k * eps_r
    half = [(sigma, q, steps // 2), (sigma, q, steps - steps // 2)]
    assert user_level.mixture_epsilon(history=half, delta=1e-5, group_size=k) == pytest.approx(
        user_level.mixture_epsilon(history=history, delta=1e-5, group_size=k), rel=1e-3)


def test_mixture_accounting_on_its_coarse_grid_is_an_upper_bound_within_one_percent_of_a_fine_grid():
    """The report's ε (a 1e-2 loss grid) against the same mechanism's PLD on a 1e-3 grid (tests/test_mixture_pld
    checks that PLD against dp-accounting's own construction): never below it, and within 1%."""
    from dpllm.privacy.mixture import mixture_pld

    sigma, q, steps, k, delta = 1.5, 0.05, 200, 4, 1e-5
    fine = mixture_pld(sigma=sigma, sample_rate=q, group_size=k, discretization=1e-3).self_compose(steps)
    fine = fine.get_epsilon_for_delta(delta)
    ours = user_level.mixture_epsilon(history=[(sigma, q, steps)], delta=delta, group_size=k)
    assert fine <= ours <= fine * 1.01


def test_module_examples_hold():
    import doctest

    result = doctest.testmod(user_level)
    assert result.attempted >= 2 and result.failed == 0


def test_calibrated_sigma_meets_the_user_level_target_and_more_records_need_more_noise():
    sigmas = []
    for k in (1, 2, 4):
        sigma = user_level.calibrate_mixture(target_epsilon=4.0, delta=1e-5, sample_rate=0.05, steps=100, group_size=k)
        eps = user_level.mixture_epsilon(history=[(sigma, 0.05, 100)], delta=1e-5, group_size=k)
        assert 4.0 * 0.98 <= eps <= 4.0
        sigmas.append(sigma)
    assert sigmas[0] < sigmas[1] < sigmas[2]
    with pytest.raises(PrivacyPlanError, match="cannot be met"):
        user_level.calibrate_mixture(target_epsilon=1e-3, delta=1e-12, sample_rate=1.0, steps=10, group_size=2)


# ---- config, splits, plan = report -------------------------------------------------------------------------

def test_uls_refuses_opacus_ghost_with_the_fix():
    for mode in ("ghost", "ghost_fsdp"):
        with pytest.raises(ConfigError, match="set grad_sample_mode: bk"):
            parse_config(["--privacy_unit", "user", "--user_sampling", "uls", "--grad_sample_mode", mode])
    for mode in ("bk", "auto", "hooks"):
        parse_config(["--privacy_unit", "user", "--user_sampling", "uls", "--grad_sample_mode", mode])
    parse_config(["--privacy_unit", "user", "--user_sampling", "els", "--grad_sample_mode", "ghost",
                  "--max_records_per_user", "4"])


def test_pydoc_users_split_by_user(tmp_path):
    from dpllm.data import load_records, load_records_and_users, make_splits

    cfg = DataConfig(privacy_unit="user")
    records, users = load_records_and_users(cfg)
    # the record level's records are the distinct texts; at user level a paragraph two users share is each one's
    assert list(dict.fromkeys(records)) == load_records(DataConfig()) and len(records) > len(set(records))
    assert 100 < len(set(users)) < len(records)
    s = make_splits(records, cfg, users)
    train_users = {users[i] for i in s.train}
    assert not train_users & {users[i] for i in s.heldout}
    assert sorted(train_users) == s.users["train"]
    # JSONL with a user column; a missing user is an error naming the column
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"record number {i} of the support tickets", "author": f"a{i % 3}"})
                            + "\n" for i in range(9)))
    recs, us = load_records_and_users(DataConfig(dataset=str(path), privacy_unit="user", user_column="author"))
    assert us == [f"a{i % 3}" for i in range(9)]
    from dpllm.data import DataError

    with pytest.raises(DataError, match="user column 'who'"):
        load_records_and_users(DataConfig(dataset=str(path), privacy_unit="user", user_column="who"))


def _run(tmp_path, sampling, mode="hooks", **extra):
    from dpllm.train import train

    args = ["--model_name_or_path", "tiny-llama", "--finetuning", "full", "--tiny_hidden_size", "32",
            "--tiny_num_layers", "1", "--max_records", "300", "--max_length", "32", "--privacy_unit", "user",
            "--max_records_per_user", "4", "--user_sampling", sampling, "--grad_sample_mode", mode,
            "--max_steps", "3", "--logical_batch_size", "16", "--physical_batch_size", "8", "--eval_every", "0",
            "--eval_max_records", "8", "--target_delta", "1e-3", "--output_dir", str(tmp_path / sampling),
            "--progress", "false", "--reproducible_noise", "true"]
    for k, v in extra.items():
        if v is None:  # unset an option set above
            del args[args.index(f"--{k}"):args.index(f"--{k}") + 2]
        else:
            args += [f"--{k}", str(v)]
    train(parse_config(args))
    return tmp_path / sampling


@pytest.mark.parametrize("sampling, mode", [("uls", "hooks"), ("uls", "bk"), ("els", "hooks")])
def test_plan_matches_the_training_report_and_splits_list_users(tmp_path, sampling, mode):
    from dpllm import ledger
    from dpllm.privacy.planning import user_plan_table
    from dpllm.privacy.report import PrivacyReport

    run = _run(tmp_path, sampling, mode)
    report = PrivacyReport.read(run)
    assert report.grad_sample_mode == mode
    u = report.user_level
    assert report.privacy_unit == "user" and u["sampling"] == sampling and u["max_records_per_user"] == 4
    assert report.epsilon <= 8.0 and report.delta == 1e-3 < 1 / u["num_users"]
    assert u["users_trimmed"] > 0 and u["records_dropped"] > 0
    plan = user_plan_table(sampling=sampling, num_users=u["num_users"], records_per_user=u["group_size"] if
                           sampling == "els" else 4, num_records=report.num_records,
                           users_per_batch=u.get("users_per_batch"), batch=16, steps=3, delta=1e-3,
                           target_epsilon=8.0, noise_multiplier=report.noise_multiplier, epsilons=[])
    assert plan["given_noise"]["epsilon"] == pytest.approx(report.epsilon, rel=1e-6)
    assert plan["sample_rate"] == pytest.approx(report.sample_rate)
    if sampling == "els":
        # a user of 4 records costs > 3× a record here (seen 3.3 at this split's 246 kept records, q = 16/246)
        assert u["group_size"] == 4 and u["record_epsilon"] < report.epsilon / 3.2
        assert "group privacy" in u["group_privacy"]
    assert ledger.verify(run).ok
    last = ledger.read(run)[-1]
    assert last["epsilon"] == report.epsilon and last["user_level"]["num_users"] == u["num_users"]
    splits = json.loads((run / "splits.json").read_text())
    from dpllm.data import load_records_and_users

    _, users = load_records_and_users(DataConfig(privacy_unit="user", max_records=300, min_chars=32))
    trained = [users[i] for i in splits["train"]]
    assert set(trained) == set(splits["users"]["train"])
    assert max(trained.count(x) for x in set(trained)) <= 4  # the cap holds in what was trained on
    assert not set(splits["users"]["train"]) & {users[i] for i in splits["heldout"]}
    assert not set(splits["train"]) & set(splits["users"]["dropped_records"])
    if sampling == "els":  # the user-level audit: members and non-members are users
        from mia.__main__ import main as mia_main

        assert mia_main(["audit", "--unit", "user", "--checkpoint", str(run), "--attacks", "loss",
                         "--n-bootstrap", "20", "--no-progress"]) == 0
        rep = json.loads((run / "audit_users" / "mia_report.json").read_text())
        assert rep["unit"] == "user" and rep["n_members"] == u["num_users"]
        assert rep["n_nonmembers"] == len(splits["users"]["heldout"])
        assert rep["dp_bound"]["privacy_unit"] == "user"
        assert rep["privacy_bounds"]["unit"] == "user" and rep["privacy_bounds"]["group_size"] == 4  # the cap


def test_delta_must_be_below_one_over_users(tmp_path):
    with pytest.raises(PrivacyPlanError, match="1/N"):
        _run(tmp_path, "els", target_delta=0.05)  # 29 users: δ ≥ 1/U


def test_els_refuses_a_given_noise_that_misses_the_user_level_target(tmp_path):
    # σ = 0.5 over 3 steps for users of 4 records is far above ε = 1 at the user level (fine at the record level)
    with pytest.raises(PrivacyPlanError, match=r"noise_multiplier=0.5 gives user-level ε=.* > target_epsilon=1 "):
        _run(tmp_path, "els", noise_multiplier=0.5, target_epsilon=1.0)


def test_record_mode_reports_per_record_and_states_the_group_privacy_user_epsilon(tmp_path):
    from dpllm import ledger
    from dpllm.privacy.report import PrivacyReport

    run = _run(tmp_path, "record", max_records_per_user=2)
    report = PrivacyReport.read(run)
    u = report.user_level
    assert report.privacy_unit == "record" and report.epsilon <= 8.0 and u["group_size"] == 2
    # the user-level ε group privacy gives: more than twice the record-level ε at the same δ
    assert u["user_epsilon"] > 1.5 * report.epsilon
    assert u["user_epsilon"] == pytest.approx(user_level.mixture_epsilon(
        history=report.history, delta=report.delta, group_size=2))
    assert "UNBOUNDED" not in report.summary() and "user-level ε is" in report.summary()
    assert ledger.verify(run).ok


def test_a_large_group_has_a_finite_but_large_user_level_epsilon():
    # The textbook conversion is unbounded here (δ_r = δ/(16·e^{15·ε_r}) underflows); the mixture is finite.
    record = compute_epsilon_history(history=[(0.5, 0.05, 300)], delta=1e-5, accountant="prv")
    eps = user_level.mixture_epsilon(history=[(0.5, 0.05, 300)], delta=1e-5, group_size=16)
    assert math.isfinite(eps) and eps > 16 * record


def test_canary_users_write_their_canary_in_several_records(tmp_path):
    from dpllm.privacy.report import PrivacyReport
    from mia.audit import read_canaries

    run = _run(tmp_path, "uls", num_canaries=6, canary_records_per_user=3, canary_design="rare")
    canaries = json.loads((run / "canaries.json").read_text())
    assert canaries["unit"] == "user" and canaries["records_per_user"] == 3
    included = sum(c["included"] for c in canaries["canaries"])
    splits = json.loads((run / "splits.json").read_text())
    report = PrivacyReport.read(run)
    assert report.num_records == len(splits["train"]) + 3 * included  # 3 records per included canary user
    assert report.user_level["num_users"] == len(splits["users"]["train"]) + included
    texts, coins = read_canaries(run)[:2]
    assert len(texts) == 6 and list(coins) == [c["included"] for c in canaries["canaries"]]
    with pytest.raises(ConfigError, match="canary_records_per_user"):
        parse_config(["--privacy_unit", "user", "--max_records_per_user", "2", "--canary_records_per_user", "3"])


def test_plan_cli_states_the_unit_and_refuses_delta_over_one_over_users(capsys):
    from dpllm.privacy.planning import cli_main

    common = ["--unit", "user", "--num-users", "500", "--records-per-user", "4", "--batch", "64", "--epochs", "1",
              "--target-epsilon", "8", "--epsilons", "", "--accountant", "rdp"]
    assert cli_main(common + ["--sampling", "els", "--delta", "1e-4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["unit"] == "user" and plan["num_users"] == 500 and plan["records_per_user"] == 4
    # tight accounting: the user-level target is met with less noise than the textbook conversion's, whose
    # record level is ε/k = 2 (at the tiny δ/(k·e^{(k−1)·2})); here record ε at δ/k is above 2, user ε at 8
    assert 7.8 <= plan["target"]["epsilon"] <= 8.0 and 2.0 < plan["target"]["record_epsilon"] < 8.0
    assert "mixture" in plan["group_privacy"] and plan["record_delta"] == pytest.approx(1e-4 / 4)
    assert cli_main(common + ["--sampling", "uls", "--delta", "1e-4"]) == 0
    assert "unit: USER" in capsys.readouterr().out
    assert cli_main(common + ["--sampling", "uls", "--delta", "0.005"]) == 2  # δ ≥ 1/U = 0.002
    assert "1/N" in capsys.readouterr().err


def test_the_cap_choice_is_secret_unless_reproducible():
    from dpllm.distributed import World

    def draw(reproducible):
        g = user_level.cap_generator(reproducible=reproducible, seed=0, stage="s", world=World())
        return torch.randperm(1000, generator=g).tolist()

    assert draw(False) != draw(False)  # fresh OS entropy each run, whatever train.seed says
    assert draw(True) == draw(True)


# ---- the group size is the declared cap, never the data's largest user (issue #21, item 3) ----------------

def _two_record_users(tmp_path, users=40):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"text": f"user {u} wrote ticket {j} about the printer on floor {u % 7}",
                                        "user": f"u{u}"}) + "\n" for u in range(users) for j in range(2)))
    return path


def test_els_accounts_for_the_declared_cap_not_the_largest_user_found(tmp_path):
    """Cap 8, every user holds 2 records: a neighbour may still add a user of 8 records, so k = 8.

    Before the fix the run reported the mixture ε of k = 2 (the data's largest user), here 6× too low
    (5.25 instead of 32.19 at σ = 1, q = 1/4, 3 steps, δ = 1e-3).
    """
    from dpllm import ledger
    from dpllm.privacy.planning import user_plan_table
    from dpllm.privacy.report import PrivacyReport

    run = _run(tmp_path, "els", dataset=_two_record_users(tmp_path), max_records_per_user=8, max_records=1000,
               noise_multiplier=1.0, target_epsilon=100)
    report = PrivacyReport.read(run)
    u = report.user_level
    assert u["group_size"] == 8 and u["largest_user_records"] == 2 and u["max_records_per_user"] == 8
    assert report.history == [[1.0, 0.25, 3]] and report.delta == 1e-3  # 32 users × 2 records, batch 16
    eps_cap = user_level.mixture_epsilon(history=report.history, delta=1e-3, group_size=8)
    eps_found = user_level.mixture_epsilon(history=report.history, delta=1e-3, group_size=2)
    assert report.epsilon == pytest.approx(eps_cap, rel=1e-9)
    assert eps_cap == pytest.approx(32.188, abs=1e-3) and eps_found == pytest.approx(5.246, abs=1e-3)
    # the plan CLI's numbers for the same cap are the report's; the ledger recomputes the same ε from k = the cap
    plan = user_plan_table(sampling="els", num_users=u["num_users"], records_per_user=8,
                           num_records=report.num_records, batch=16, steps=3, delta=1e-3, noise_multiplier=1.0,
                           epsilons=[])
    assert plan["given_noise"]["epsilon"] == pytest.approx(report.epsilon, rel=1e-9)
    assert ledger.verify(run).ok
    # a release states the cap and the relation, and withholds the counts found in the private data
    from dpllm.export import model_card, release_report

    released = release_report(report)
    assert released.user_level == {k: u[k] for k in ("unit", "sampling", "max_records_per_user", "group_size",
                                                     "users_per_batch", "group_privacy", "record_epsilon",
                                                     "record_delta")}
    card = model_card(released, lora=False, has_base=False)
    assert "add or remove one user (with at most 8 records)" in card and "at most 8 records per user" in card
    assert f"{u['num_users']} users" not in card and released.num_records is None


def test_els_without_a_cap_is_refused_and_record_without_one_is_unbounded(tmp_path):
    from dpllm import ledger
    from dpllm.privacy.report import PrivacyReport

    with pytest.raises(ConfigError, match="set max_records_per_user"):
        parse_config(["--privacy_unit", "user", "--user_sampling", "els"])
    # record-level DP with splits by user: without a cap no user-level ε follows, whatever the data holds
    run = _run(tmp_path, "record", dataset=_two_record_users(tmp_path), max_records_per_user=None,
               max_records=1000)
    report = PrivacyReport.read(run)
    u = report.user_level
    assert u["group_size"] is None and u["user_epsilon"] is None and u["largest_user_records"] == 2
    assert "max_records_per_user" in u["group_privacy"] and "UNBOUNDED" in report.summary()
    assert ledger.verify(run).ok


def test_the_ledger_refuses_a_group_size_other_than_the_cap():
    from dpllm.ledger import LedgerError, _check_epsilons

    line = {"epsilon": 1.0, "history": [[1.0, 0.25, 3]], "delta": 1e-3, "accountant": "prv",
            "user_level": {"sampling": "els", "group_size": 2, "max_records_per_user": 8, "record_delta": 5e-4}}
    with pytest.raises(LedgerError, match="max_records_per_user=8"):
        _check_epsilons([line])
