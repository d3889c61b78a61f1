"""`python -m engine.train RECIPE --check N`: the recipe's look at its data, where this
machine can see it (a login node may not mount the compute nodes' data), and always with
--data-here (a local launch)."""

from dataclasses import dataclass

import pytest

from engine import catalog, cli
from engine.data.errors import DataError


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def check(capsys):
    """engine.cli.main(RECIPE device=cpu ARGS --check 2) in this process (the same code as
    `python -m engine.train`, without a torch import per test)."""

    def run(recipe: str, *args: str) -> Done:
        rc = cli.main([recipe, "device=cpu", *args, "--check", "2"])
        out = capsys.readouterr()
        return Done(rc, out.out, out.err)

    return run


def test_data_this_machine_cannot_see_may_be_the_compute_nodes(check, tmp_path):
    done = check("imagenet", f"data.root={tmp_path}/elsewhere")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "config ok for 2 processes\n"


def test_data_that_must_be_here_and_is_not_is_one_line(check, tmp_path):
    done = check("imagenet", f"data.root={tmp_path}/elsewhere", "--data-here")
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: data root {tmp_path}/elsewhere not found")
    assert len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    ("recipe", "make", "said"),
    [
        ("imagenet", lambda root: (root / "train" / "n01").mkdir(parents=True), "val not found"),
        ("cifar10", lambda root: None, "CIFAR-10 not found in"),
        ("gpt", lambda root: None, "is not a readable file"),
    ],
)
def test_visible_data_in_the_wrong_shape_is_one_line(check, tmp_path, recipe, make, said):
    root = tmp_path / "data"
    root.mkdir()
    make(root)
    key = "data.path" if recipe == "gpt" else "data.root"  # gpt: a directory is no text file
    done = check(recipe, f"{key}={root}")
    assert done.returncode == 2, done.stdout
    assert done.stderr.startswith("error: ") and said in done.stderr
    assert len(done.stderr.splitlines()) == 1
    assert sorted(p.name for p in root.iterdir()) == (["train"] if recipe == "imagenet" else [])


def test_synthetic_images_need_no_data_here(check):
    done = check("imagenet", "data.synthetic=true", "data.root=/nonexistent", "--data-here")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", catalog.available())
def test_a_recipe_that_reads_files_checks_them_and_passes_on_its_example(name, tmp_path):
    recipe = catalog.load(name)
    if recipe.example_data is None:  # its data ships with a package or is generated
        return
    cfg, _ = catalog.load_config(name, [f"data.root={tmp_path}"])
    assert recipe.check_data is not None, f"{name} reads files but declares no check_data"
    with pytest.raises(DataError):
        recipe.check_data(cfg.data)  # nothing there yet
    recipe.example_data(tmp_path)
    recipe.check_data(cfg.data)


def test_a_batch_larger_than_the_training_set_is_refused_by_the_check_before_the_queue(check):
    """gpt 124m on the built-in corpus: the check says what the sampler would say only on
    the node (the count from the text's size, no read)."""
    done = check("gpt", "--config", "124m")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "error: the training set has 409 samples, fewer than train.batch_size=512: lower "
        "train.batch_size, or train on more data"
    ]
    assert check("gpt", "--config", "124m", "train.batch_size=384").returncode == 0


@pytest.mark.parametrize("args", [[], ["data.block_size=100", "data.eval_fraction=0.3"]])
def test_a_recipe_s_sample_count_is_its_training_set_s_length(args, tmp_path):
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(256)) * 40)
    for data in ([], [f"data.path={text}"]):
        cfg, recipe = catalog.load_config("gpt", [*args, *data])
        train, _ = recipe.build_datasets(cfg.data)
        assert recipe.count_samples(cfg.data) == len(train)
