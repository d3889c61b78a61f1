from engine.recipe import Recipe
from recipes.digits.data import DataConfig, build_datasets
from recipes.digits.model import ModelConfig, build_model

RECIPE = Recipe(
    model_config=ModelConfig,
    build_model=build_model,
    data_config=DataConfig,
    build_datasets=build_datasets,
    sample_shape=lambda data: (1, 8, 8),
)
