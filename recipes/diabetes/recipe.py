from engine.recipe import Recipe
from recipes.diabetes.data import FEATURES, DataConfig, build_datasets
from recipes.diabetes.model import ModelConfig, build_model
from recipes.diabetes.task import Regression

RECIPE = Recipe(
    model_config=ModelConfig,
    build_model=build_model,
    data_config=DataConfig,
    build_datasets=build_datasets,
    sample_shape=lambda data: (FEATURES,),
    task=Regression(),
)
