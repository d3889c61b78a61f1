from torch import nn

from engine.recipe import Recipe, flip_width
from recipes.cifar10.data import DataConfig, build_datasets, check_data, normalised
from recipes.cifar10.example import write_example
from recipes.cifar10.model import ModelConfig, Whiten, build_model, whiten_init

WHITEN_IMAGES = 5000  # as airbench: enough for a stable 12x12 patch covariance


def prepare(model, train_data) -> None:
    if isinstance(model, nn.Sequential) and isinstance(model[0], Whiten):
        whiten_init(model, normalised(train_data, WHITEN_IMAGES))


RECIPE = Recipe(
    model_config=ModelConfig,
    build_model=build_model,
    data_config=DataConfig,
    build_datasets=build_datasets,
    sample_shape=lambda data: (3, 32, 32),
    prepare=prepare,
    mirror=flip_width,
    resume_safe=("data.download",),
    example_data=write_example,
    check_data=check_data,
)
