from engine.recipe import Recipe
from engine.tasks import NextToken
from recipes.gpt import parallel
from recipes.gpt.data import DataConfig, build_datasets, check_data, count_samples
from recipes.gpt.model import ModelConfig, blocks, build_model, flops_per_token, init_weights

RECIPE = Recipe(
    model_config=ModelConfig,
    build_model=build_model,
    data_config=DataConfig,
    build_datasets=build_datasets,
    task=NextToken(),
    blocks=blocks,
    init_weights=init_weights,
    # One sample is one block of data.block_size tokens.
    flops_per_sample=lambda model, data: flops_per_token(model, data.block_size) * data.block_size,
    units_per_sample=lambda data: data.block_size,
    check_data=check_data,
    count_samples=count_samples,
    parallelize=parallel.parallelize,
    check_tp=parallel.check,
)
