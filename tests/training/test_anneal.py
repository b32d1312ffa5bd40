"""Annealing experiment: the planted landscape's optimum and trap, and a small run of the CLI."""

import json
import math

import numpy as np
import pytest
import torch

from training.anneal_experiment import AnnealConfig, Landscape, landscape_facts, main, run_experiment


def _np_energy(x, tau=0.25, gap=40.0):
    def eq(deg):
        a = np.deg2rad(deg)
        return np.stack([np.cos(a), np.sin(a), np.zeros_like(a)], 1)

    pos = eq(np.array([-30.0, 0.0, 30.0, 180.0]))
    neg = np.concatenate([eq(np.array([180 - gap, 180 + gap])), [[0, 0, 1.0], [0, 0, -1.0]]])
    lse = lambda v: v.max(-1) + np.log(np.exp(v - v.max(-1, keepdims=True)).sum(-1))  # noqa: E731
    return -lse(x @ pos.T / tau) + lse(x @ np.concatenate([pos, neg]).T / tau)


def test_landscape_energy_optimum_and_trap():
    land = Landscape()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 3))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    assert np.allclose(land.energy(torch.from_numpy(x)).numpy(), _np_energy(x), atol=1e-12)
    # Riemannian gradient vs central finite differences along a tangent direction
    xt = torch.from_numpy(x)
    v = torch.from_numpy(rng.normal(size=(50, 3)))
    v = v - (v * xt).sum(1, keepdim=True) * xt
    h = 1e-6
    fd = (
        land.energy(torch.nn.functional.normalize(xt + h * v, dim=1))
        - land.energy(torch.nn.functional.normalize(xt - h * v, dim=1))
    ) / (2 * h)
    assert torch.allclose((land.riemannian_grad(xt) * v).sum(1), fd, atol=1e-6)
    facts = landscape_facts(land)
    assert facts["optimum_energy"] == pytest.approx(float(_np_energy(np.array([[1.0, 0, 0]]))[0]), abs=1e-12)
    # a dense random cloud on the sphere never goes below the planted optimum
    cloud = rng.normal(size=(200_000, 3))
    cloud /= np.linalg.norm(cloud, axis=1, keepdims=True)
    assert _np_energy(cloud).min() >= facts["optimum_energy"] - 1e-9
    # the trap is a strict local minimum: every small step away raises the energy
    ring = np.array(
        [
            [-math.cos(0.05), math.sin(0.05) * math.cos(a), math.sin(0.05) * math.sin(a)]
            for a in np.linspace(0, 2 * np.pi, 64, endpoint=False)
        ]
    )
    assert (_np_energy(ring) > facts["trap_energy"]).all()
    assert facts["trap_energy"] > facts["optimum_energy"]
    assert facts["saddle_energy"] > facts["trap_energy"] and facts["barrier_depth"] > 0.5


def test_small_run_log_not_worse_than_exp():
    cfg = AnnealConfig(steps=800, seeds=2, particles=48)
    res = run_experiment(cfg)
    rows = {r["schedule"]: r for r in res["results"]}
    assert rows["none"]["global_basin_fraction"] == 0.0  # no noise: stays in the trap
    assert rows["none"]["quenched_energy_gap"] == pytest.approx(
        res["landscape"]["trap_energy"] - res["landscape"]["optimum_energy"], abs=1e-6
    )
    assert rows["log"]["global_basin_fraction"] >= rows["exp"]["global_basin_fraction"]
    assert rows["log"]["quenched_energy_gap"] <= rows["exp"]["quenched_energy_gap"] + 1e-9
    for r in rows.values():
        assert r["quenched_energy_gap"] >= -1e-9


def test_cli_writes_json_and_plot(tmp_path, capsys):
    assert (
        main(
            [
                "--steps",
                "60",
                "--seeds",
                "1",
                "--particles",
                "8",
                "--schedules",
                "log,none",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    data = json.loads((tmp_path / "anneal.json").read_text())
    assert [r["schedule"] for r in data["results"]] == ["log", "none"]
    assert (tmp_path / "anneal.png").stat().st_size > 1000
    assert "runs in global basin" in capsys.readouterr().out


def test_seed_option_changes_the_noise_and_is_recorded(tmp_path):
    runs = {}
    for seed in (1, 2):
        out = tmp_path / str(seed)
        assert (
            main(
                [
                    "--steps",
                    "60",
                    "--seeds",
                    "1",
                    "--particles",
                    "8",
                    "--schedules",
                    "log",
                    "--seed",
                    str(seed),
                    "--out",
                    str(out),
                    "--no-plot",
                ]
            )
            == 0
        )
        runs[seed] = json.loads((out / "anneal.json").read_text())
    assert runs[1]["config"]["seed"] == 1 and runs[2]["config"]["seed"] == 2
    assert (
        runs[1]["results"][0]["trajectory_global_half"] != runs[2]["results"][0]["trajectory_global_half"]
        or runs[1]["results"][0]["final_energy_gap"] != runs[2]["results"][0]["final_energy_gap"]
    )


def test_bad_schedule_name():
    with pytest.raises(ValueError, match="warm"):
        run_experiment(AnnealConfig(schedules=("warm",)))
