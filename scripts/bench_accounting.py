"""CPU time of dpllm's vectorised accountant paths against the library constructions they stand in for (figures, not
a test; the equalities are tested in tests/test_mixture_pld.py, tests/test_rdp_series.py and, for the PLD search,
tests/test_noise_and_accounting.py).

Three comparisons, each on the same inputs in this one process, cold caches before every timed call:

* ``mixture``: the user-level (ELS / ``user_sampling: record``) PLD of one DP-SGD step for a group of k records.
  dp-accounting's ``from_mixture_gaussian_mechanism`` (its recursive grid inversion, one scalar privacy loss per
  tree node) against :func:`dpllm.privacy.mixture.mixture_pld` (the same search over every grid point at once), and
  the ε each gives after ``--compose`` steps.
* ``rdp``: RDP calibration of σ for a target ε. The grid bisection over Opacus's own RDP ε (what dpllm ran before:
  :func:`dpllm.privacy.accounting.smallest_grid_noise` with ``compute_rdp`` + ``get_privacy_spent`` per σ) against
  :func:`dpllm.privacy.accounting.calibrate_noise` (searches with :mod:`dpllm.privacy.rdp_series`, decides with
  Opacus's ε); both must return the same σ. Also one ε evaluation by each at the calibrated σ.
* ``pld``: PLD calibration of σ (plans whose rounding margin PLD's plain FFT holds). The same grid bisection from
  σ = 1 over dpllm's PLD ε against :func:`dpllm.privacy.accounting.calibrate_noise` (false position on the grid from
  the RDP bound's σ, :func:`dpllm.privacy.accounting.smallest_smooth_noise`); both must return the same σ, and the
  PLD evaluations each made are counted.

    OMP_NUM_THREADS=1 python scripts/bench_accounting.py --out runs/bench/accounting.json
    python scripts/bench_accounting.py --smoke            # one small case each (tests/test_scripts_smoke.py)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from datetime import datetime, timezone

MIXTURE = [(1.0, 0.05, 2), (1.0, 0.05, 4), (1.0, 0.05, 8), (0.8, 0.01, 16)]  # (σ, q, k)
RDP = [(8.0, 1e-5, 16 / 92, 2), (8.0, 1e-5, 0.01, 1000), (1.0, 1e-5, 0.004, 2500), (3.0, 1e-7, 1024 / 10 ** 6, 977)]
PLD = [(8.0, 1e-5, 0.01, 1000), (2.0, 1e-5, 0.02, 500), (8.0, 1e-6, 256 / 50_000, 2000),
       (4.0, 1e-9, 1 / 97_657, 97_657)]
SMOKE_MIXTURE, SMOKE_RDP, SMOKE_PLD = [(1.0, 0.05, 2)], [(1.0, 1e-5, 0.004, 2500)], [(0.4, 1e-5, 0.05, 10)]


def _cpu(fn, repeats: int):
    """(least CPU seconds over ``repeats`` calls, the last result); ``fn`` clears its own caches."""
    best, out = math.inf, None
    for _ in range(repeats):
        start = time.process_time()
        out = fn()
        best = min(best, time.process_time() - start)
    return best, out


def mixture_case(sigma: float, q: float, k: int, *, compose: int, delta: float, repeats: int) -> dict:
    from dp_accounting.pld import privacy_loss_distribution

    from dpllm.privacy import mixture

    sens, probs = [float(j) for j in range(k + 1)], mixture.step_probabilities(q, k)

    def theirs():
        return privacy_loss_distribution.from_mixture_gaussian_mechanism(
            standard_deviation=sigma, sensitivities=sens, sampling_probs=probs,
            value_discretization_interval=mixture.DISCRETIZATION)

    def ours():
        mixture.mixture_pld.cache_clear()
        return mixture.mixture_pld(sigma=sigma, sample_rate=q, group_size=k)

    t_theirs, p_theirs = _cpu(theirs, repeats)
    t_ours, p_ours = _cpu(ours, repeats)
    e_theirs = p_theirs.self_compose(compose).get_epsilon_for_delta(delta)
    e_ours = p_ours.self_compose(compose).get_epsilon_for_delta(delta)
    return {"sigma": sigma, "q": q, "k": k, "compose": compose, "delta": delta, "dp_accounting_cpu_s": t_theirs,
            "dpllm_cpu_s": t_ours, "speedup": t_theirs / t_ours, "epsilon_dp_accounting": e_theirs,
            "epsilon_dpllm": e_ours, "epsilon_rel_diff": abs(e_ours - e_theirs) / e_theirs}


def _clear_rdp_caches() -> None:
    from dpllm.privacy import accounting, rdp_series

    rdp_series.rdp_of_one_step.cache_clear()
    accounting._rdp_of_one_step.cache_clear()


def rdp_case(target: float, delta: float, q: float, steps: int, *, repeats: int) -> dict:
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
    from opacus.accountants.rdp import RDPAccountant

    from dpllm.privacy import accounting, rdp_series

    orders = RDPAccountant.DEFAULT_ALPHAS

    def opacus_eps(sigma: float) -> float:
        rdp = compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders)
        return float(get_privacy_spent(orders=orders, rdp=rdp, delta=delta)[0])

    def unreachable():
        return accounting.PrivacyPlanError("unreachable")

    def before():
        return accounting.smallest_grid_noise(opacus_eps, target, digits=accounting.SIGMA_DIGITS,
                                              unreachable=unreachable)

    def after():
        _clear_rdp_caches()
        return accounting.calibrate_noise(target_epsilon=target, delta=delta, sample_rate=q, steps=steps,
                                          accountant="rdp")

    t_before, s_before = _cpu(before, repeats)
    t_after, s_after = _cpu(after, repeats)
    t_eps_opacus, e_opacus = _cpu(lambda: opacus_eps(s_after), repeats)

    def series():
        _clear_rdp_caches()
        return rdp_series.rdp_epsilon(history=[(s_after, q, steps)], delta=delta)

    t_eps_series, e_series = _cpu(series, repeats)
    return {"target_epsilon": target, "delta": delta, "q": q, "steps": steps,
            "sigma_opacus_bisection": s_before, "sigma_dpllm": s_after, "same_sigma": s_before == s_after,
            "calibration_opacus_bisection_cpu_s": t_before, "calibration_dpllm_cpu_s": t_after,
            "calibration_speedup": t_before / t_after, "epsilon_opacus_cpu_s": t_eps_opacus,
            "epsilon_series_cpu_s": t_eps_series, "epsilon_speedup": t_eps_opacus / t_eps_series,
            "epsilon_opacus": e_opacus, "epsilon_series": e_series,
            "epsilon_rel_diff": abs(e_series - e_opacus) / e_opacus}


def pld_case(target: float, delta: float, q: float, steps: int, *, repeats: int) -> dict:
    from dpllm.privacy import accounting

    calls: list = []

    def eps(sigma: float) -> float:
        calls.append(sigma)
        return accounting.pld_epsilon(history=[(sigma, q, steps)], delta=delta)

    def before():
        calls.clear()
        return accounting.smallest_grid_noise(eps, target, digits=accounting.SIGMA_DIGITS,
                                              unreachable=lambda: accounting.PrivacyPlanError("unreachable"))

    def after():
        calls.clear()
        accounting._PLD_CACHE.clear()
        pld = accounting.pld_epsilon
        accounting.pld_epsilon = lambda **kw: calls.append(kw["history"][-1][0]) or pld(**kw)
        try:
            return accounting.calibrate_noise(target_epsilon=target, delta=delta, sample_rate=q, steps=steps,
                                              accountant="pld")
        finally:
            accounting.pld_epsilon = pld

    t_before, s_before = _cpu(before, repeats)
    n_before = len(calls)
    t_after, s_after = _cpu(after, repeats)
    return {"target_epsilon": target, "delta": delta, "q": q, "steps": steps, "sigma_bisection": s_before,
            "sigma_dpllm": s_after, "same_sigma": s_before == s_after, "pld_evaluations_bisection": n_before,
            "pld_evaluations_dpllm": len(calls), "calibration_bisection_cpu_s": t_before,
            "calibration_dpllm_cpu_s": t_after, "calibration_speedup": t_before / t_after}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="one small case of each (seconds)")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per figure; the least CPU time is kept")
    ap.add_argument("--compose", type=int, default=100, help="steps the mixture PLD is composed over for its ε")
    ap.add_argument("--out", default=None, help="JSON file for the figures")
    args = ap.parse_args(argv)
    repeats = 1 if args.smoke else args.repeats
    result = {"command": "python scripts/bench_accounting.py" + (" --smoke" if args.smoke else ""),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.machine(),
              "cpus": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "mixture": [], "rdp": [], "pld": []}
    print("mixture-of-Gaussians PLD (user-level ε): dp-accounting vs dpllm.privacy.mixture, CPU s")
    print(f"{'σ':>5} {'q':>6} {'k':>3} {'dp-accounting':>14} {'dpllm':>8} {'×':>6} {'ε rel. diff':>12}")
    for sigma, q, k in (SMOKE_MIXTURE if args.smoke else MIXTURE):
        r = mixture_case(sigma, q, k, compose=args.compose, delta=1e-5, repeats=repeats)
        result["mixture"].append(r)
        print(f"{sigma:>5g} {q:>6g} {k:>3} {r['dp_accounting_cpu_s']:>14.3f} {r['dpllm_cpu_s']:>8.3f} "
              f"{r['speedup']:>6.1f} {r['epsilon_rel_diff']:>12.1e}")
    print("\nRDP calibration: bisection over Opacus's ε vs dpllm.privacy.accounting.calibrate_noise, CPU s")
    print(f"{'ε':>4} {'δ':>6} {'q':>8} {'T':>5} {'σ':>7} {'same σ':>6} {'bisection':>9} {'dpllm':>7} {'×':>6} "
          f"{'one ε ×':>8}")
    for target, delta, q, steps in (SMOKE_RDP if args.smoke else RDP):
        r = rdp_case(target, delta, q, steps, repeats=repeats)
        result["rdp"].append(r)
        print(f"{target:>4g} {delta:>6g} {q:>8.4g} {steps:>5} {r['sigma_dpllm']:>7.4g} {str(r['same_sigma']):>6} "
              f"{r['calibration_opacus_bisection_cpu_s']:>9.3f} {r['calibration_dpllm_cpu_s']:>7.3f} "
              f"{r['calibration_speedup']:>6.1f} {r['epsilon_speedup']:>8.1f}")
    print("\nPLD calibration: bisection from σ = 1 vs dpllm.privacy.accounting.calibrate_noise, CPU s "
          "(PLD evaluations)")
    print(f"{'ε':>4} {'δ':>6} {'q':>8} {'T':>6} {'σ':>7} {'same σ':>6} {'bisection':>14} {'dpllm':>12} {'×':>5}")
    for target, delta, q, steps in (SMOKE_PLD if args.smoke else PLD):
        r = pld_case(target, delta, q, steps, repeats=repeats)
        result["pld"].append(r)
        print(f"{target:>4g} {delta:>6g} {q:>8.4g} {steps:>6} {r['sigma_dpllm']:>7.4g} {str(r['same_sigma']):>6} "
              f"{r['calibration_bisection_cpu_s']:>9.3f} ({r['pld_evaluations_bisection']:>2}) "
              f"{r['calibration_dpllm_cpu_s']:>7.3f} ({r['pld_evaluations_dpllm']:>2}) "
              f"{r['calibration_speedup']:>5.1f}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
        print(f"\nwritten: {args.out}")
    return result


if __name__ == "__main__":
    main()
