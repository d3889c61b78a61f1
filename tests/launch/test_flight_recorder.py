"""NCCL's flight recorder settings in every rendered target where NCCL may run (GPUs, several
processes): torchrun, containers, pyxis, the sbatch script and submit's script; dumps go to
the run directory's hang/, beside the engine's stack dumps (engine/hang.py)."""

import shlex
from pathlib import Path

import pytest

from launch import render, slurm
from launch.render import LaunchRequest
from tests.helpers import launch

ROOT = Path(__file__).resolve().parents[2]
DUMP = "runs/digits/RUN/hang/nccl_trace_rank_"
ITEMS = [
    "TORCH_FR_BUFFER_SIZE=2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT=1",
    f"TORCH_FR_DUMP_TEMP_FILE={DUMP}",
]
EXPORTS = [f"export {item}" for item in ITEMS]


def req(**kw) -> LaunchRequest:
    base = dict(recipe="digits", run_name="RUN", python="py", src="/src", image="img:1")
    return LaunchRequest(**{**base, **kw})


def test_torchrun_on_gpus_sets_them_on_one_node_and_on_several():
    assert render.local(req(gpus=2))[:5] == ["env", *ITEMS, "py"]
    multi = req(gpus=8, nodes=2, rdzv_endpoint="h:1", max_nodes=3)
    assert render.local(multi)[:6] == ["env", f"{render.FRESH_STORE}=1", *ITEMS, "py"]


@pytest.mark.parametrize("kw", [dict(gpus=1), dict(gpus=0, procs=4), dict(gpus=0, nodes=2)])
def test_none_where_nccl_cannot_run_several_processes(kw):
    r = req(rdzv_endpoint="h:1", **kw)
    for argv in (render.local(r), render.docker_run(r), render.pyxis(r), render.apptainer(r)):
        assert not any("TORCH_FR" in a or "TORCH_NCCL" in a for a in argv)
    assert "TORCH_FR" not in render.sbatch_script(r)


def test_containers_set_them_inside_where_the_run_directory_is_mounted():
    for argv in (render.docker_run(req(gpus=4)), render.apptainer(req(gpus=4))):
        i = argv.index("env")
        assert argv[i : i + 5] == ["env", *ITEMS, "python"], argv
    pyxis = render.pyxis(req(gpus=4, nodes=2))
    export = next(a for a in pyxis if a.startswith("--export="))
    assert export == "--export=ALL,RECIPES_DATA=/data," + ",".join(ITEMS)


def test_sbatch_and_submit_export_them_before_srun(tmp_path):
    r = req(gpus=8, nodes=2)
    for script in (render.sbatch_script(r), slurm.dry_run([r], tmp_path, "RUN")):
        lines = script.splitlines()
        srun = next(i for i, line in enumerate(lines) if line.startswith("srun"))
        assert [lines.index(e) < srun for e in EXPORTS] == [True] * 3, script


def test_a_run_root_outside_the_checkout_keeps_its_path_and_a_comma_is_refused_for_srun():
    assert "TORCH_FR_DUMP_TEMP_FILE=/scratch/runs/digits/RUN/hang/nccl_trace_rank_" in (
        render.local(req(gpus=2, run_root="/scratch/runs"))
    )
    with pytest.raises(ValueError, match="comma"):
        render.pyxis(req(gpus=2, run_root="/scratch/a,b"))


@pytest.mark.parametrize("target", ["local", "sbatch"])
def test_the_dry_runs_of_torchrun_and_sbatch_show_them(target):
    done = launch("render", "--target", target, GPUS="2", RECIPES_DIR=str(ROOT / "recipes"))
    assert done.returncode == 0, done.stderr
    shown = shlex.split(done.stdout) if target == "local" else done.stdout.splitlines()
    expected = ITEMS if target == "local" else EXPORTS
    for item in expected[:2]:
        assert item in shown, done.stdout
    dump = [s for s in shown if "TORCH_FR_DUMP_TEMP_FILE=" in s]
    assert len(dump) == 1 and dump[0].endswith("/hang/nccl_trace_rank_"), done.stdout
